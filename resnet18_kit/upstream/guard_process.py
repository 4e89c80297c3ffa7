"""`GrpcGuard`: the gRPC guard (upstream.grpc_guard) as a process of its own, `resnet18-kit grpc-guard`,
started, waited for until it listens, read (its counts) and stopped by the program that serves."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from resnet18_kit.server.config import PortBusyError
from resnet18_kit.upstream.grpc_guard import GuardCounts


class GrpcGuard:
    """`resnet18-kit grpc-guard` in a process of its own, listening on `listen_host`:`listen_port` and
    forwarding to `upstream`. log_path: its output (None: this process's). It gets SIGTERM when the thread
    that started it dies (setpriv --pdeathsig, as tritonserver). Its folder (counts, `marks_folder`) is
    made here, so that tritonserver can be started with the marks folder first; stop() removes it."""

    def __init__(self, listen_host: str, listen_port: int, upstream: str, log_path: Path | None = None,
                 grace_s: float = 5.0):
        self.listen_host, self.listen_port, self.upstream = listen_host, listen_port, upstream
        self.grace_s = grace_s  # what calls in flight get once it is asked to stop (--grace-s)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self._folder = tempfile.mkdtemp(prefix="grpc-guard-")
        self.marks_folder = Path(self._folder) / "marks"  # upstream.cancel_marks
        self.marks_folder.mkdir()

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until it listens. Raises PortBusyError (its one line) when it exits 2,
        RuntimeError when it exits otherwise or does not listen within `timeout_s` seconds."""
        from resnet18_kit.observe.processes import port_listeners

        listen = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        command = [sys.executable, "-m", "resnet18_kit", "grpc-guard", "--listen", f"{listen}:{self.listen_port}",
                   "--upstream", self.upstream, "--counts-file", str(self.counts_path), "--port-flag=--grpc-port",
                   "--grace-s", str(self.grace_s), "--cancel-marks", str(self.marks_folder)]
        if shutil.which("setpriv"):
            command = ["setpriv", "--pdeathsig", "TERM", "--", *command]
        output = open(self.log_path, "ab") if self.log_path else None
        self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT if output else None,
                                        start_new_session=True)
        if output:
            output.close()
        deadline = time.monotonic() + timeout_s
        while not any(pid == self.process.pid for pid, _ in port_listeners(self.listen_port)):
            status = self.process.poll()
            if status is not None:
                self._cleanup()
                if status == 2:
                    raise PortBusyError(self._last_line() or f"gRPC port {self.listen_port} cannot be bound")
                raise RuntimeError(f"the gRPC guard exited with status {status} before listening")
            if time.monotonic() > deadline:
                self.stop(grace_s=0)
                raise RuntimeError(f"the gRPC guard did not listen on port {self.listen_port} within {timeout_s:.0f} s")
            time.sleep(0.05)

    @property
    def counts_path(self) -> Path:
        return Path(self._folder) / "counts.json"

    @property
    def counts(self) -> GuardCounts:
        """What the guard did so far (written by it every COUNTS_INTERVAL_S)."""
        try:
            return GuardCounts(**json.loads(self.counts_path.read_text()))
        except (OSError, ValueError, TypeError):
            return GuardCounts()

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM (it refuses new calls, gives those in flight up to its own grace), `grace_s` + 5 s for it
        to exit, then SIGKILL; grace_s 0: SIGKILL at once. Its exit status (idempotent; None: never started)."""
        if self.process is None:
            self._cleanup()
            return None
        if self.process.poll() is None and grace_s <= 0:
            self.process.kill()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s + 5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._cleanup()
        return self.process.returncode

    def _cleanup(self) -> None:
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _last_line(self) -> str:
        if not self.log_path or not Path(self.log_path).is_file():
            return ""
        lines = [line for line in Path(self.log_path).read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].removeprefix("grpc-guard: ") if lines else ""
