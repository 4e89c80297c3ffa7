"""The fault matrix of the serve command's lifecycle: signals, busy ports, killed processes and a deleted
model, each against the real `resnet18-kit serve` (a child process: its own signal handling and
supervisor are what is measured) on the echo model, under a load that retries refusals.

Each case reports what the retrying clients saw (sent / answered / refused / failed / lost: a logical
request is "refused" when it ended refused after its retries, "failed" on any other error, "lost" with no
outcome at all), serve's exit status and time to exit, its lines on stderr, the Python-backend regions in
/dev/shm before and after, and the processes it left (tritonserver and stubs alive afterwards: none).

Cases (`CASES`, the `--scenario lifecycle` rows of docs/records/reliability.md):
  sigterm            one SIGTERM under load
  sigterm-x3         three SIGTERMs within 100 ms (`kill -TERM -- -<pgid>` on `make serve`, Kubernetes)
  sigint             one SIGINT (Ctrl-C)
  sigint-x2          two SIGINTs (Ctrl-C twice: the drain is cut short, exit 1)
  sigterm-starting   SIGTERM while the server is starting, before it is ready
  http-busy, grpc-busy, metrics-busy
                     the port held by another program: one line, exit 2, nothing started
  stub-kill          a stub SIGKILLed: the supervisor restarts the server
  tritonserver-kill  tritonserver SIGKILLed: the supervisor restarts it
  serve-kill         serve SIGKILLed: tritonserver gets SIGTERM from the kernel and stops by itself
  model-deleted      the model's directory deleted under the running server, then its stub killed:
                     the restart cannot load it, serve says so in one line and exits 2
`repeated_stops` is the race check: `make serve` started and stopped with two SIGTERMs, N times in a row.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from resnet18_kit.contract import REPO_ROOT, STUB_EXECUTABLE
from resnet18_kit.tools.load.outcomes import ANSWERED, ERROR, LOST, REFUSED, TIMED_OUT, Outcome
from resnet18_kit.observe.processes import child_processes, process_alive
from resnet18_kit.tools.reliability import ECHO_MODEL, repository_with
from resnet18_kit.tools.reliability.loads import HANG_BOUND_S, TensorLoad, echo_load
from resnet18_kit.tools.reliability.senders import send_fresh
from resnet18_kit.tools.reliability.sigterm import environment_without_admin_key, serve_arguments, serve_command
from resnet18_kit.server.config import ServerConfig, config_on_free_ports
from resnet18_kit.server.resources import PYTHON_BACKEND_SHM_PREFIX, python_backend_regions, remove_regions

CASES = ("sigterm", "sigterm-x3", "sigint", "sigint-x2", "sigterm-starting", "http-busy", "grpc-busy",
         "metrics-busy", "stub-kill", "tritonserver-kill", "serve-kill", "model-deleted")
#: Seconds each case gives serve to start (the echo model: about 3 s here) and to exit after its fault.
START_BOUND_S = 120.0
EXIT_BOUND_S = 60.0
#: A logical request is retried on a refusal (503 / UNAVAILABLE, connection refused) for this long, this often.
RETRY_BUDGET_S, RETRY_PAUSE_S = 30.0, 0.05
#: Statuses a client retries: the server refused the request (queue full, timed out, not ready), or
#: cancelled a gRPC call it had not answered when its gRPC endpoint shut down.
RETRYABLE_STATUSES = ("503", "StatusCode.UNAVAILABLE", "StatusCode.CANCELLED")
#: Failures that mean the server did not take the request while it stopped or restarted: nothing
#: listening, a connection closed or reset before any response, and gRPC's NOT_FOUND "no available
#: versions" while Triton unloads the models on its way out. Inference is idempotent, so a client retries.
RETRYABLE_MESSAGES = ("Connection refused", "ConnectionRefused", "connection closed", "Connection reset",
                      "ConnectionReset", "RemoteDisconnected", "has no available versions", "failed to connect",
                      "Socket closed", "Broken pipe")


def retryable(outcome: Outcome) -> bool:
    """True for an outcome a client should retry (RETRYABLE_STATUSES, RETRYABLE_MESSAGES): the server
    refused the request or was stopping or restarting; it never answered it wrongly or failed it."""
    if outcome.kind in (REFUSED, TIMED_OUT) or outcome.status in RETRYABLE_STATUSES:
        return True
    return outcome.kind == ERROR and any(text in outcome.message for text in RETRYABLE_MESSAGES)


class RetryingLoad:
    """`clients` threads (alternating HTTP and gRPC), each sending one logical request at a time on a
    fresh connection and retrying it on a refusal (`retryable`) every RETRY_PAUSE_S for up to
    RETRY_BUDGET_S. After stop(), a request being retried ends at its next refusal.

    results: one final Outcome per logical request; `counts()` sums them."""

    def __init__(self, config: ServerConfig, load: TensorLoad, clients: int = 2):
        self.config, self.load = config, load
        self.results: list[Outcome] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = False
        self._threads = [threading.Thread(target=self._run, args=(("http", "grpc")[i % 2], i), daemon=True)
                         for i in range(clients)]

    def _run(self, protocol: str, worker: int) -> None:
        index = worker * 1_000_000
        while not self._stop.is_set():
            with self._lock:
                self.sent += 1
            deadline = time.monotonic() + RETRY_BUDGET_S
            while True:
                outcome = send_fresh(self.config, protocol, self.load, index, grpc_timeout_s=HANG_BOUND_S)
                if not retryable(outcome) or self._stop.is_set() or time.monotonic() > deadline:
                    break
                time.sleep(RETRY_PAUSE_S)
            with self._lock:
                self.results.append(outcome)
            index += 1
            if outcome.kind != ANSWERED:
                time.sleep(RETRY_PAUSE_S)  # a failing server is not hammered

    def __enter__(self) -> "RetryingLoad":
        self._started = True
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop sending; wait for the requests under way (at most HANG_BOUND_S)."""
        self._stop.set()
        for thread in self._threads if self._started else ():
            thread.join(HANG_BOUND_S + RETRY_BUDGET_S)

    def __exit__(self, *exc) -> None:
        self.stop()

    def counts(self) -> dict:
        """{"sent", "answered", "refused", "failed", "lost"} over the logical requests; "failed" holds
        every final outcome that is neither answered nor a refusal, "lost" the requests without one."""
        with self._lock:
            results, sent = list(self.results), self.sent
        answered = sum(o.kind == ANSWERED for o in results)
        refused = sum(o.kind != ANSWERED and retryable(o) for o in results)
        lost = sent - len(results) + sum(o.kind == LOST for o in results)
        failures = [o for o in results if o.kind not in (ANSWERED, LOST) and not retryable(o)]
        return {"sent": sent, "answered": answered, "refused": refused, "failed": len(failures), "lost": lost,
                "failures": sorted({f"{o.status or ''} {o.message[:80]}".strip() for o in failures})}


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, executable name) of every live descendant of `pid` (tritonserver and its stubs for serve)."""
    found, frontier = [], [pid]
    while frontier:
        for child, argv in child_processes(frontier.pop()):
            found.append((child, Path(argv[0]).name if argv else "?"))
            frontier.append(child)
    return found


def shm_regions(pid: int | None = None) -> list[str]:
    """Names of the Python-backend regions in /dev/shm: all of them, or those of servers started by the
    serve process `pid` (their prefix carries it: server.embedded.EmbeddedTritonServer.shm_prefix)."""
    prefix = PYTHON_BACKEND_SHM_PREFIX if pid is None else f"{PYTHON_BACKEND_SHM_PREFIX}{pid}x"
    return [region.name for region in python_backend_regions(prefix)]


class ServeRun:
    """One serve child process in its own session, stderr and stdout to `log_path` (tritonserver's log
    beside it). Records the processes it starts so that `leftovers()` can tell which outlived it."""

    def __init__(self, config: ServerConfig, work_dir: Path, command: list[str] | None = None,
                 environ: dict[str, str] | None = None):
        self.config = config
        self.log_path = work_dir / "serve.log"
        work_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # environ: variables added to environment_without_admin_key()
            self.process = subprocess.Popen(command or serve_command(config, work_dir / "tritonserver.log"),
                                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**environment_without_admin_key(), **(environ or {})})
        self.started = time.monotonic()
        self.seen: dict[int, str] = {}

    def watch(self) -> list[tuple[int, str]]:
        """The live descendants now, remembered for leftovers()."""
        now = descendants(self.process.pid)
        self.seen.update(now)
        return now

    def server_pid(self) -> int | None:
        """The tritonserver process's pid, None before it exists."""
        return next((pid for pid, name in self.watch() if name == "tritonserver"), None)

    def stub_pids(self) -> list[int]:
        """The Python-backend stubs' pids."""
        return [pid for pid, name in self.watch() if name == STUB_EXECUTABLE]

    def wait_ready(self, timeout_s: float = START_BOUND_S) -> float:
        """Seconds until serve printed its ready banner; RuntimeError when it exits first or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.watch()
            if "serve: ready\n" in self.log_path.read_text(errors="replace"):
                return time.monotonic() - self.started
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited with status {self.process.returncode} before ready: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"serve not ready after {timeout_s:.0f} s")

    def wait_exit(self, timeout_s: float = EXIT_BOUND_S) -> int | None:
        """serve's exit status, None when it is still running after `timeout_s` seconds (a hang)."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self) -> dict:
        """SIGTERM serve and wait for it (EXIT_BOUND_S); a serve that hangs is killed with what it started.
        {"exit_status" (None: it hung), "leftovers"}."""
        self.process.send_signal(signal.SIGTERM)
        status = self.wait_exit()
        if status is None:
            self.kill_everything()
        return {"exit_status": status, "leftovers": self.leftovers()}

    def leftovers(self) -> list[str]:
        """"<name> <pid>" of every process this serve started that is still alive (zombies excluded)."""
        return [f"{name} {pid}" for pid, name in sorted(self.seen.items()) if process_alive(pid)]

    def wait_gone(self, timeout_s: float) -> None:
        """Block until no process this serve started is alive (`leftovers` empty), or `timeout_s` seconds pass."""
        deadline = time.monotonic() + timeout_s
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)

    def kill_everything(self) -> list[str]:
        """SIGKILL serve and whatever it started, then unlink the shared-memory regions of its servers (the
        clean-up after a failed case); returns the names of the regions it unlinked."""
        self.watch()
        for pid in [self.process.pid, *self.seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self.wait_gone(10.0)
        return [region.name for pid in (self.process.pid, *self.seen)
                for region in remove_regions(f"{PYTHON_BACKEND_SHM_PREFIX}{pid}x")]

    def stderr_lines(self, prefix: str = "serve: ") -> list[str]:
        """serve's own lines (those starting with `prefix`), in order."""
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if line.startswith(prefix)]


def held_port(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` (another program holding the port); close it when done."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def run_case(case: str, work_dir: Path, load_s: float = 2.0, exit_timeout_s: int = 5) -> dict:
    """Run fault-matrix case `case` (CASES) in `work_dir` (its own echo repository, serve log and
    tritonserver log). Returns {"case", "counts" (RetryingLoad.counts), "exit_status" (None: still
    running after EXIT_BOUND_S, i.e. hung), "exit_s" (seconds from the fault to serve's exit),
    "shm_before", "shm_after" (regions in /dev/shm, all servers), "shm_left" (this serve's regions left,
    those the clean-up of a hung case unlinked included),
    "left_running" (processes it left), "lines" (serve's own stderr lines after the fault)}.
    """
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; one of {', '.join(CASES)}")
    repository = repository_with([ECHO_MODEL], work_dir / "repository")
    config = config_on_free_ports(model_repository=repository, exit_timeout_s=exit_timeout_s)
    shm_before = len(shm_regions())
    holder = None
    if case.endswith("-busy"):
        holder = held_port({"http-busy": config.http_port, "grpc-busy": config.grpc_port,
                            "metrics-busy": config.metrics_port}[case])
    run = ServeRun(config, work_dir)
    load = RetryingLoad(config, echo_load(), clients=2)
    lines_before, unlinked = 0, []
    try:
        if case == "sigterm-starting":
            while run.server_pid() is None and run.process.poll() is None:
                time.sleep(0.02)
            fault_at = time.monotonic()
            run.process.send_signal(signal.SIGTERM)
        elif holder is not None:
            fault_at = run.started
        else:
            run.wait_ready()
            lines_before = len(run.stderr_lines())
            load.__enter__()
            time.sleep(load_s)
            fault_at = time.monotonic()
            apply_fault(case, run, repository)
        if case in ("stub-kill", "tritonserver-kill"):  # the supervisor restarts it; then a plain stop
            wait_for_restart(run, lines_before)
            time.sleep(load_s)
            load.stop()
            run.process.send_signal(signal.SIGTERM)
        status = run.wait_exit()
        exit_s = time.monotonic() - fault_at
        if case == "serve-kill":  # serve is gone at once; time until its tritonserver stopped too
            run.wait_gone(EXIT_BOUND_S)
            exit_s = time.monotonic() - fault_at
    finally:
        load.stop()
        if holder is not None:
            holder.close()
        if run.process.poll() is None:
            unlinked = run.kill_everything()
    left = run.leftovers()
    return {"case": case, "counts": load.counts(), "exit_status": status, "exit_s": round(exit_s, 2),
            "shm_before": shm_before, "shm_after": len(shm_regions()),
            "shm_left": unlinked + shm_regions(run.process.pid),
            "left_running": left, "lines": run.stderr_lines()[lines_before:]}


def apply_fault(case: str, run: ServeRun, repository: Path) -> None:
    """Do what case `case` does to a ready serve process `run`."""
    if case == "sigterm":
        run.process.send_signal(signal.SIGTERM)
    elif case == "sigterm-x3":
        for _ in range(3):
            run.process.send_signal(signal.SIGTERM)
            time.sleep(0.04)
    elif case == "sigint":
        run.process.send_signal(signal.SIGINT)
    elif case == "sigint-x2":
        run.process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        run.process.send_signal(signal.SIGINT)
    elif case == "stub-kill":
        os.kill(run.stub_pids()[0], signal.SIGKILL)
    elif case == "tritonserver-kill":
        os.kill(run.server_pid(), signal.SIGKILL)
    elif case == "serve-kill":
        run.watch()
        run.process.kill()
    elif case == "model-deleted":
        stub = run.stub_pids()[0]
        target = (repository / ECHO_MODEL)
        target.unlink() if target.is_symlink() else shutil.rmtree(target)
        os.kill(stub, signal.SIGKILL)


def wait_for_restart(run: ServeRun, lines_before: int, timeout_s: float = START_BOUND_S) -> None:
    """Block until serve reports the server ready again after the fault; RuntimeError otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run.watch()
        if any(line.startswith("serve: ready: ") for line in run.stderr_lines()[lines_before:]):
            return
        if run.process.poll() is not None:
            raise RuntimeError(f"serve exited with status {run.process.returncode} instead of restarting")
        time.sleep(0.1)
    raise RuntimeError(f"no restart within {timeout_s:.0f} s")


def repeated_stops(work_dir: Path, repeat: int, exit_bound_s: float = EXIT_BOUND_S) -> dict:
    """`make serve` on the echo model, stopped `repeat` times in a row the way a terminal or a process
    manager stops a process group: `kill -TERM -- -<pgid>`, so make and serve both get SIGTERM and make
    forwards its own to serve (two each). Each round waits for ready, signals, and counts a hang when
    make is still running after `exit_bound_s` seconds.

    Returns {"rounds", "hangs", "exit_statuses" (make's, distinct: -15 as make re-raises SIGTERM),
    "serve_statuses" (distinct, from serve's last line), "exit_s" ({"min", "median", "max"}),
    "left_running" (processes left over all rounds), "shm_left" (regions of the serve processes left),
    "shm_before", "shm_after" (all regions in /dev/shm, other servers' included)}.
    """
    repository = repository_with([ECHO_MODEL], work_dir / "repository")
    shm_before = len(shm_regions())
    hangs, statuses, serve_statuses, exits, left, shm_left = 0, set(), set(), [], [], []
    for round_number in range(repeat):
        config = config_on_free_ports(model_repository=repository, exit_timeout_s=5)
        args = " ".join(serve_arguments(config, work_dir / "tritonserver.log"))
        run = ServeRun(config, work_dir / f"round-{round_number}", ["make", "--no-print-directory", "serve",
                                                                    f"ARGS={args}"])
        try:
            run.wait_ready()
            signalled = time.monotonic()
            os.killpg(run.process.pid, signal.SIGTERM)
            status = run.wait_exit(exit_bound_s)
            if status is None:
                hangs += 1
            else:
                statuses.add(status)
                exits.append(time.monotonic() - signalled)
                last = [line for line in run.stderr_lines() if line.startswith("serve: exiting with status")]
                serve_statuses.add(int(last[-1].rsplit(" ", 1)[1]) if last else None)
        finally:
            shm_left += run.kill_everything() if run.process.poll() is None else []
        left += run.leftovers()
        shm_left += [name for pid in (run.process.pid, *run.seen) for name in shm_regions(pid)]
    exits.sort()
    return {"rounds": repeat, "hangs": hangs, "exit_statuses": sorted(statuses),
            "serve_statuses": sorted(serve_statuses, key=str),
            "exit_s": {"min": round(exits[0], 2), "median": round(exits[len(exits) // 2], 2),
                       "max": round(exits[-1], 2)} if exits else None,
            "left_running": left, "shm_left": shm_left, "shm_before": shm_before, "shm_after": len(shm_regions())}


def table_row(result: dict) -> list:
    """The fault-matrix row (MATRIX_COLUMNS) of one run_case result."""
    counts = result["counts"]
    return [result["case"], counts["sent"], counts["answered"], counts["refused"], counts["failed"],
            counts["lost"], "hung" if result["exit_status"] is None else result["exit_status"],
            f"{result['exit_s']:.1f} s", f"{result['shm_before']} -> {result['shm_after']}",
            ", ".join(result["left_running"]) or "none"]


MATRIX_COLUMNS = ("case", "sent", "answered", "refused", "failed", "lost", "exit status", "time to exit",
                  "/dev/shm regions before -> after", "left running")
