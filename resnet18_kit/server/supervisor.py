"""Keep an embedded tritonserver serving without a human: restart it when it dies, when a Python-backend
stub dies, or when it stops answering.

Triton does not restart a Python-backend stub that died (upstream defect `dead-stub`, upstream.dead_stub),
so the supervisor restarts the whole server, which needs no model-control call from a client.

Checks, every `poll_interval_s`:
  * the tritonserver process exited;
  * a stub process is gone (one per model instance), unless a swap replaced it (StubWatch.dead);
  * `/v2/health/live` has not answered for `unresponsive_after_s`;
  * wedged: no inference answered or executed for `wedged_after_s`, while the health endpoints may still
    answer 200 (a corrupt heap or stuck threads: upstream defect `grpc-cancellation`). A thread probes
    every `probe_interval_s` (observe.probe: the execution count, and an inference to each step of the ensemble
    when the count did not grow). A stop of a server found wedged does not wait for its exit timeout.
A restart stops the server (SIGTERM, `restart_drain_s` for the requests other models are serving, then
SIGKILL) and starts it again on the same ports; with model control it then loads back the configs a swap
had put in place (read from the server whenever its stubs changed). More than `max_restarts` restarts within
`restart_window_s` is a crash loop: the supervisor gives up and `run` returns 1.

A start that fails is not a fault to restart from: a taken port, a model that does not load or a
restart that comes up without a model instance the first start had (the repository changed under the
server) are ConfigurationError and end `run` with status 2 at once; a
start that times out ends it with 1. A stop requested during a start (StopRequest) stops the starting
server and `run` returns 0.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from resnet18_kit.server.config import ConfigurationError, ServerConfig, ServerStartError, StartCancelled
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.model_control import ModelControl, SwapError, SwapTarget, same_config, swap
from resnet18_kit.upstream.seam import QueueWatch, StubWatch
from resnet18_kit.observe.probe import ProgressWatch, live
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.stop import StopRequest


@dataclass(frozen=True)
class SupervisorPolicy:
    """poll_interval_s: seconds between health checks; unresponsive_after_s: seconds without an answer
    from /v2/health/live before a restart; restart_drain_s: seconds a restart waits after SIGTERM before
    SIGKILL; max_restarts / restart_window_s: crash-loop bound (0 restarts = never restart);
    ready_timeout_s: start-up budget of each start; queue_warnings: log an "overload" event when a
    model's pending requests reach max_queue_size - max_batch_size (upstream.overload)."""

    poll_interval_s: float = 0.5
    unresponsive_after_s: float = 30.0
    #: 2 s: requests other models are running finish (an execution takes under 1 s here); a server with a
    #: dead stub never exits on its own (the dead instance does not unload), so every second here is downtime.
    restart_drain_s: float = 2.0
    max_restarts: int = 5
    restart_window_s: float = 600.0
    ready_timeout_s: float = 300.0
    queue_warnings: bool = True
    #: Wedge detection (observe.probe), for repositories with the ensemble and its warmup image: a round
    #: every probe_interval_s; the probe inference's queue timeout probe_timeout_s; a restart after
    #: wedged_after_s without progress (0: no wedge detection). 5 s: over twice the longest execution
    #: here (a batch of 16 on 2 cores, under 2 s), so a long batch is never taken for a wedge.
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    wedged_after_s: float = 5.0


@dataclass
class SupervisorEvent:
    at_s: float    # seconds since the supervisor started (monotonic clock)
    kind: str      # "ready", "fault", "restart", "gave-up", "overload", "stopped", "start-failed"
    detail: str


class Supervisor:
    """Runs `EmbeddedTritonServer(config)` and restarts it per `policy`.

    log_path: tritonserver's output (None: this process's stdout/stderr); on_event: called with each
    SupervisorEvent (default: a line on stderr). Use `run(stop)` in the foreground, or `start()` /
    `stop()` around a background thread (tests, benchmarks).
    """

    def __init__(self, config: ServerConfig, policy: SupervisorPolicy = SupervisorPolicy(),
                 log_path: Path | None = None, on_event: Callable[[SupervisorEvent], None] | None = None):
        self.config = config
        self.policy = policy
        self.log_path = log_path
        self._on_event = on_event or (lambda e: print(f"supervisor: [{e.at_s:9.3f} s] {e.kind}: {e.detail}",
                                                      file=sys.stderr, flush=True))
        self.server: EmbeddedTritonServer | None = None
        self.events: list[SupervisorEvent] = []
        self.restarts = 0
        self._restart_times: list[float] = []
        #: The stubs of the server now running (made by start_server).
        self._stubs: StubWatch | None = None
        #: The stub instances serving before a restart: the restarted server must run the same ones.
        self._instances: set[str] | None = None
        #: With model control: model -> the config each model served when last looked at (after the start
        #: and whenever its stubs changed); a restart loads back those a swap had changed.
        self._serving: dict[str, object] = {}
        self._last_live = 0.0
        self._origin = time.monotonic()
        self._queues = QueueWatch.for_config(config) if policy.queue_warnings else None
        self._thread: threading.Thread | None = None
        self._stop = StopRequest()
        self._stop_request: StopRequest | None = None
        self.exit_status: int | None = None
        #: The wedge check of the server now running (None: off, or no ensemble to probe).
        self._progress: ProgressWatch | None = None

    # -- events ---------------------------------------------------------------------------------------

    def _event(self, kind: str, detail: str) -> None:
        event = SupervisorEvent(round(time.monotonic() - self._origin, 3), kind, detail)
        self.events.append(event)
        self._on_event(event)

    # -- start, check, restart ------------------------------------------------------------------------

    def _hurried(self) -> bool:
        """True once the stop request of `run` asks to cut the drain short (read without blocking)."""
        stop = self._stop_request
        return stop is not None and stop.wait(0) and stop.hurried

    def start_server(self) -> float:
        """Start tritonserver and wait until ready; return seconds to ready. Raises ServerStartError
        (StartCancelled when the stop request of `run` came first)."""
        # die_with_parent: if this process is killed outright, the server does not outlive it
        self.server = EmbeddedTritonServer(self.config, log_path=self.log_path, die_with_parent=True)
        stop = self._stop_request
        seconds = self.server.start(self.policy.ready_timeout_s,
                                    cancelled=None if stop is None else (lambda: stop.wait(0)))
        put_back = self._put_back_swapped()
        expected = self._instances
        explicit = self.config.model_control == "explicit"  # swaps replace stubs: the configs serving say which
        self._stubs = StubWatch(self.server.stub_pids, (lambda model: self._serving.get(model)) if explicit else None,
                                on_change=self._note_serving)
        self._stubs.follow()
        names = self._stubs.instances
        if expected is not None and not expected <= names:
            missing = ", ".join(sorted(expected - names))
            self.server.stop(drain_s=0)
            raise ConfigurationError(f"the restarted server lacks model instances {missing}: the model "
                                     f"repository changed under the running server ({self.config.model_repository})")
        self._instances = names
        self._last_live = time.monotonic()
        self._start_probing()
        self._event("ready", f"tritonserver pid {self.server.process.pid} ready in {seconds:.1f} s, "
                             f"{len(names)} model instances{put_back}")
        return seconds

    def check(self) -> str | None:
        """One round of health checks; returns why the server must restart, or None when healthy."""
        server = self.server
        if server.process.poll() is not None:
            return f"tritonserver exited with status {server.process.returncode}"
        dead = self._stubs.dead()
        if dead is not None:
            return dead
        self._instances = self._stubs.instances  # a swap's changes too: a restart must bring these back
        if self._is_live():
            self._last_live = time.monotonic()
        elif time.monotonic() - self._last_live > self.policy.unresponsive_after_s:
            return f"/v2/health/live unanswered for {self.policy.unresponsive_after_s:.0f} s"
        if self.wedged():
            return (f"wedged: no inference answered or executed for {self._progress.stalled_s():.1f} s "
                    f"(last probe: {self._progress.last_detail})")
        if self._queues is not None:
            for warning in self._queues.warnings(self.config.metrics_url):
                self._event("overload", warning)
        return None

    # -- stubs and swaps --------------------------------------------------------------------------------

    def _note_serving(self) -> None:
        """With model control: read every model's config from the server into _serving."""
        if self.config.model_control != "explicit":
            return
        try:
            with ModelControl(self.config.triton_grpc_url, self.config.admin_key, timeout_s=5.0) as control:
                self._serving = control.served_configs()
        except SwapError as exc:
            self._event("swap", f"could not read the configs serving: {exc}")

    def _put_back_swapped(self) -> str:
        """After a restart with model control: load the configs a swap had changed before the fault
        (model_control.swap); what the ready event adds about it."""
        if self.config.model_control != "explicit" or not self._serving:
            return ""
        try:
            with ModelControl(self.config.triton_grpc_url, self.config.admin_key) as control:
                now = control.served_configs()
                targets = [SwapTarget(model, config, "the config serving before the restart")
                           for model, config in self._serving.items() if model in now and not same_config(config, now[model])]
                if targets:
                    swap(control, targets, served=now)
        except SwapError as exc:
            return f"; could not put back the swapped configs ({exc}): the repository's configs serve"
        return f"; swapped configs put back: {', '.join(t.model for t in targets)}" if targets else ""

    def _start_probing(self) -> None:
        """A ProgressWatch for the server just started, and a thread that runs its rounds while that
        server runs (module doc); nothing when wedged_after_s is 0 or the repository has no ensemble."""
        self._progress = None
        if not self.policy.wedged_after_s or self.config.model_repository is None:
            return
        image = ModelRepository(self.config.model_repository).warmup_image_path
        if not image.is_file():
            return
        watch = ProgressWatch(self.config.http_url, image.read_bytes(), self.policy.probe_timeout_s)
        server = self.server

        def probe() -> None:
            while server.running:
                time.sleep(self.policy.probe_interval_s)
                watch.round()
        self._progress = watch
        threading.Thread(target=probe, name="triton-probe", daemon=True).start()

    def wedged(self) -> bool:
        """True when the running server has shown no progress for wedged_after_s (module doc)."""
        return self._progress is not None and self._progress.stalled_s() > self.policy.wedged_after_s

    def _is_live(self) -> bool:
        return live(self.config.http_url, 2.0)

    def restart(self, reason: str) -> int | None:
        """Stop the server and start it again; None when it is serving again, else the status `run`
        returns: 1 when the crash-loop bound forbids a restart or the new server timed out, 2 when it
        cannot start (ConfigurationError), 0 when a stop was requested during the start."""
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < self.policy.restart_window_s]
        if len(self._restart_times) >= self.policy.max_restarts:
            self._event("gave-up", f"{reason}; {len(self._restart_times)} restarts in the last "
                                   f"{self.policy.restart_window_s:.0f} s already")
            self.server.stop(drain_s=self.policy.restart_drain_s, refuse_first=False)
            return 1
        self._restart_times.append(now)
        self.restarts += 1
        self._event("fault", reason)
        status = self.server.stop(drain_s=self.policy.restart_drain_s, refuse_first=False)
        self._event("restart", f"old server stopped (status {status}) in {time.monotonic() - now:.1f} s; "
                               f"starting again (restart {self.restarts})")
        try:
            self.start_server()
        except StartCancelled:
            status = self.server.stop(hurry=self._hurried)
            self._event("stopped", f"stop requested while restarting; the new server stopped (status {status})")
            return 0
        except ServerStartError as exc:
            self._event("gave-up", f"restart failed: {exc}")
            return exc.exit_status
        return None

    # -- loops ------------------------------------------------------------------------------------------

    def run(self, stop: StopRequest) -> int:
        """Start the server, supervise it until `stop` asks for a stop, then stop it gracefully (SIGTERM,
        up to exit_timeout_s; `stop.hurried` cuts that short). Returns 0 on a clean stop (or a stop before
        ready), 1 when the server could not be kept running, did not exit cleanly or was cut short, 2
        when it cannot start (ConfigurationError: a port taken, a model that does not load)."""
        self._stop_request = stop
        try:
            self.start_server()
        except StartCancelled:
            status = self.server.stop(hurry=self._hurried)
            self._event("stopped", f"stop requested before the server was ready; it stopped (status {status})")
            return 0
        except ServerStartError as exc:
            self._event("start-failed", str(exc))
            return exc.exit_status
        while not stop.wait(self.policy.poll_interval_s):
            reason = self.check()
            if reason is not None:
                status = self.restart(reason)
                if status is not None:
                    return status
        wedged = self.wedged()  # its drain would only wait out the exit timeout: SIGKILL after restart_drain_s
        status = self.server.stop(drain_s=self.policy.restart_drain_s if wedged else None, hurry=self._hurried,
                                  refuse_first=not wedged)
        if wedged:
            self._event("stopped", f"the server was wedged: killed after {self.policy.restart_drain_s:.0f} s "
                                   f"(status {status})")
            return 1
        if stop.hurried:
            self._event("stopped", f"drain cut short: tritonserver and its stubs killed (status {status})")
            return 1
        self._event("stopped", f"tritonserver exited with status {status}")
        return 0 if status == 0 else 1

    def start(self, ready_timeout_s: float | None = None) -> None:
        """Run the supervisor in a background thread; return once the first server is ready."""
        self._thread = threading.Thread(target=self._run_in_thread, name="triton-supervisor", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + (ready_timeout_s or self.policy.ready_timeout_s)
        while not any(e.kind == "ready" for e in self.events):
            if self.exit_status is not None or time.monotonic() > deadline:
                raise ServerStartError("supervised tritonserver did not become ready")
            time.sleep(0.1)

    def wait_serving(self, timeout_s: float) -> bool:
        """Block until the server is running and ready after the last fault (True), or `timeout_s`
        seconds pass or the supervisor ends (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.exit_status is None:
            last = next((e.kind for e in reversed(self.events) if e.kind in ("ready", "fault", "restart")), None)
            if last == "ready" and self.server is not None and self.server.running:
                return True
            time.sleep(0.1)
        return False

    def _run_in_thread(self) -> None:
        self.exit_status = self.run(self._stop)

    def stop(self, timeout_s: float | None = None, hurry: bool = False) -> int | None:
        """Stop the background supervisor and its server, waiting up to `timeout_s` seconds (None: until it
        has stopped); returns run()'s status. hurry: no drain (what the server holds fails; its processes
        are killed at once, their shared memory removed), for a server whose requests no longer matter."""
        if hurry:
            self._stop.hurry()
        self._stop.request()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.exit_status

    def __enter__(self) -> "Supervisor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
