"""Progress with an ETA and the one log set-up of `resnet18-kit` (cli calls `setup_logging` once, with the
global --log-level); progress for the long-running commands (bench run, reliability soak, plan validate /
plan profile).

`Progress` counts units of work done of a known total (perf_analyzer runs, load levels, seconds). On a
terminal it draws a tqdm bar on stderr; when stderr is not a terminal (CI, `2> file`) tqdm draws nothing
and each milestone is a log line instead, carrying the same count, elapsed time and ETA, so a captured
log stays one readable line per step. `setup_logging` sends log records through `tqdm.write`, so a log
line never tears the bar. Progress lines are log records (of the logger a Progress is given, under
`resnet18_kit`), so they reach whatever the log goes to (stderr, `2> file`), not only the bar.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable

from tqdm import tqdm

#: This project's packages: their loggers get the level asked for; other libraries stay at WARNING.
PACKAGES = ("resnet18_kit",)


#: One whole line at a time on stderr (stderr_line).
_STDERR_LOCK = threading.RLock()


def stderr_line(line: str) -> None:
    """Write `line` and its newline to stderr in one write, under a lock, and flush. serve's supervisor,
    its log follower and its signal notes write from different threads; print()'s two writes (text, then
    newline) let their lines run into each other. Re-entrant, so a signal note written while the main
    thread holds the lock does not deadlock."""
    with _STDERR_LOCK:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def log_status(message: str, warning: bool = False, step: bool = False) -> None:
    """The status callback of measuring code run without a Progress: `message` as a log line, WARNING
    when `warning`, else INFO (`step`, one unit of work done, has no total to count against)."""
    logging.getLogger(__name__).log(logging.WARNING if warning else logging.INFO, message)


class TqdmLogHandler(logging.Handler):
    """Writes each record to stderr with tqdm.write (above any bar being drawn)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(command: str, level: str | int = "INFO") -> None:
    """Log records of this project's packages at `level` and above, of other libraries at WARNING and
    above, to stderr as "HH:MM:SS <command> LEVEL message". Called once, by resnet18_kit.cli, for the
    command run; calling it again replaces the set-up."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, TqdmLogHandler)]:
        root.removeHandler(handler)
    handler = TqdmLogHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {command} %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for package in PACKAGES:
        logging.getLogger(package).setLevel(level)


class Progress:
    """`total` units of work (`unit`: "run", "level", "s"), a bar on stderr while on a terminal.

    update(n): n more units done (the tqdm call, so code written for a tqdm bar takes a Progress too);
    with log_updates, each update is also an INFO line "<description>: <status>". A Progress is also a
    status callback: progress(message, warning=False, step=False) logs the message (INFO, or WARNING),
    and with step counts one unit done and appends the status. advance_to(n): done becomes n (timed
    work). status(): "3/9 levels, 04:10 elapsed, ETA 08:20". The ETA is the mean time per unit so far
    times the units left (tqdm's smoothing=0), so it holds for steps of uneven length.
    """

    def __init__(self, total: float, unit: str, description: str = "", log: logging.Logger | None = None,
                 log_updates: bool = True, disable: bool | None = None):
        total = int(total) if float(total).is_integer() else total
        self.total, self.unit, self.description = total, unit, description
        self.log = log or logging.getLogger(__name__)
        self.log_updates = log_updates
        self.done: float = 0
        self.started = time.monotonic()
        # disable=None: tqdm draws only when stderr is a terminal. mininterval 1 s: light on 2 cores.
        # Timed work (seconds of seconds) has no rate worth showing.
        timed = "{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}{postfix}]" if unit == "s" else None
        self.bar = tqdm(total=total, unit=unit, desc=description, file=sys.stderr, disable=disable,
                        mininterval=1.0, smoothing=0, dynamic_ncols=True, bar_format=timed)

    def set_description(self, description: str) -> None:
        """What is running now (shown before the bar and in the milestone lines)."""
        self.description = description
        self.bar.set_description(description, refresh=False)

    def set_postfix(self, text: str) -> None:
        """A short note after the bar (e.g. the last minute's latency)."""
        self.bar.set_postfix_str(text, refresh=False)

    def update(self, n: float = 1) -> None:
        """`n` more units done; with log_updates an INFO line with the count and ETA."""
        self.done += n
        self.bar.update(n)
        if self.log_updates:
            self.log.info("%s: %s", self.description or "done", self.status())

    def __call__(self, message: str, warning: bool = False, step: bool = False) -> None:
        """Log `message` (WARNING when `warning`, else INFO); with `step`, one more unit done first and
        "; <status>" appended to the line."""
        if step:
            self.done += 1
            self.bar.update(1)
            message = f"{message}; {self.status()}"
        self.log.log(logging.WARNING if warning else logging.INFO, message)

    def advance_to(self, done: float) -> None:
        """Set the units done to `done` (clamped to the total); no log line."""
        done = min(done, self.total)
        if done > self.done:
            self.bar.update(done - self.done)
            self.done = done

    def elapsed_s(self) -> float:
        """Seconds since the Progress was made."""
        return time.monotonic() - self.started

    def eta_s(self) -> float | None:
        """Seconds left at the mean pace so far; None before the first unit."""
        if self.done <= 0:
            return None
        return self.elapsed_s() * max(0.0, self.total - self.done) / self.done

    def status(self) -> str:
        """e.g. "3/9 levels, 04:10 elapsed, ETA 08:20"."""
        eta = self.eta_s()
        unit = self.unit if self.unit == "s" or self.total == 1 else self.unit + "s"
        return (f"{self.done:.0f}/{self.total:.0f} {unit}, {tqdm.format_interval(self.elapsed_s())} elapsed, "
                f"ETA {'?' if eta is None else tqdm.format_interval(eta)}")

    def ticking(self, interval_s: float = 1.0, on_tick: Callable[[float], None] | None = None) -> "_Ticker":
        """Context manager for timed work (unit "s"): a thread advances the bar to the seconds elapsed
        since the block began every `interval_s` and then calls on_tick(elapsed seconds)."""
        return _Ticker(self, interval_s, on_tick)

    def close(self) -> None:
        """Finish the bar (left on screen)."""
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Ticker:
    def __init__(self, progress: Progress, interval_s: float, on_tick: Callable[[float], None] | None):
        self.progress, self.interval_s, self.on_tick = progress, interval_s, on_tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-ticker", daemon=True)
        self._origin = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            elapsed = time.monotonic() - self._origin
            self.progress.advance_to(int(elapsed))  # whole seconds on the bar
            if self.on_tick is not None:
                try:
                    self.on_tick(elapsed)
                except Exception:  # noqa: BLE001 - a progress note must never stop the measurement
                    self.progress.log.debug("progress callback failed", exc_info=True)

    def __enter__(self) -> "_Ticker":
        self._origin = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
