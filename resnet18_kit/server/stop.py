"""Requests to stop the server: from SIGTERM / SIGINT (the serve command) or from code (tests, the
supervisor's background thread), read by the main loop and never acted on inside a signal handler.

The signal handlers installed by `SignalStop` do nothing: the interpreter's C-level handler writes the
signal's number to a self-pipe (`signal.set_wakeup_fd`), and the main loop reads that pipe in
`StopRequest.wait` / `StopRequest.poll`. A handler that takes no lock cannot deadlock against itself when
a second signal arrives while the first is being handled (the hang this design replaces: a handler
re-entered `threading.Event.set` while holding the Event's lock).

What each signal means (the same words are in docs/reliability.md "Stopping"):
  * the first SIGTERM or SIGINT: a graceful stop (tritonserver gets SIGTERM and drains for up to its
    exit timeout);
  * more SIGTERMs: the same request again, ignored. `make` forwards SIGTERM to its child, so
    `kill -TERM -- -<pgid>` on `make serve` delivers two; Kubernetes may deliver several;
  * a SIGINT after the first stop signal (Ctrl-C twice): hurry. In-flight requests are cut off,
    tritonserver and its stubs get SIGKILL, serve exits 1.
"""
from __future__ import annotations

import os
import select
import signal
import threading
from typing import Callable

#: Signals that ask for a stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """A stop asked for by code: `request()` (graceful) and `hurry()` (cut the drain short), from any
    thread. `wait(timeout_s)` blocks until a stop is requested or `timeout_s` seconds pass."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._hurried = threading.Event()

    def request(self) -> None:
        """Ask for a graceful stop (in-flight requests finish within the server's exit timeout)."""
        self._requested.set()

    def hurry(self) -> None:
        """Ask to stop now: the drain is cut short (implies request())."""
        self._requested.set()
        self._hurried.set()

    def poll(self) -> None:
        """Take in whatever asked for a stop since the last call (no-op here; SignalStop reads its pipe)."""

    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` seconds for a stop request; True once one was made."""
        self.poll()
        return self._requested.wait(timeout_s)

    @property
    def requested(self) -> bool:
        """True once a stop was asked for (call poll() first to take in signals)."""
        return self._requested.is_set()

    @property
    def hurried(self) -> bool:
        """True once the drain was asked to be cut short."""
        return self._hurried.is_set()


class SignalStop(StopRequest):
    """StopRequest fed by SIGTERM and SIGINT through a self-pipe. Use as a context manager in the main
    thread: the previous handlers and wake-up fd are restored on exit.

    on_signal(signum, effect): called from the main loop (poll / wait), never from a handler, with effect
    "stop", "hurry" or "repeat" (a signal that changes nothing), to tell the user what happens, or
    "other" for a signal of `also` (e.g. SIGHUP: the fleet's rolling restart), which the caller acts on.
    """

    def __init__(self, on_signal: Callable[[signal.Signals, str], None] | None = None,
                 also: tuple[signal.Signals, ...] = ()) -> None:
        super().__init__()
        self._on_signal = on_signal or (lambda signum, effect: None)
        self._also = tuple(also)
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd = -1

    def __enter__(self) -> "SignalStop":
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in STOP_SIGNALS + self._also:
            # Only the wake-up byte matters; a Python handler is needed so the default one does not run.
            self._previous[signum] = signal.signal(signum, _record_only)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def poll(self) -> None:
        """Read the signals delivered since the last call and apply them in order (module doc)."""
        while True:
            try:
                data = os.read(self._read_fd, 512)
            except BlockingIOError:
                return
            for signum in data:
                if signum in self._also:
                    self._on_signal(signal.Signals(signum), "other")
                    continue
                if signum not in STOP_SIGNALS:
                    continue
                if not self.requested:
                    self.request()
                    effect = "stop"
                elif signum == signal.SIGINT and not self.hurried:
                    self.hurry()
                    effect = "hurry"
                else:
                    effect = "repeat"
                self._on_signal(signal.Signals(signum), effect)

    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` seconds for a stop signal (or request()); True once a stop was asked for."""
        self.poll()
        if not self.requested and timeout_s > 0:
            select.select([self._read_fd], [], [], timeout_s)
            self.poll()
        return self.requested


def _record_only(signum, frame) -> None:
    """The Python-level handler: nothing. The signal number already went to the wake-up pipe."""
