"""Start, wait for and stop a tritonserver process (server.tritonserver says which executable and how).

What a start guarantees (docs/reliability.md "Faults"):
  * the three ports are checked before anything starts (PortBusyError names the port and its holder);
  * readiness is believed only from this server: /v2/health/ready must answer 200 *and* the socket
    listening on the HTTP port must belong to the tritonserver process started here (another server
    on the port cannot satisfy the probe);
  * every start gets its own Python-backend shared-memory prefix (`shm_prefix`), and `stop()` removes
    whatever is left under it in /dev/shm once the process group is gone (server.resources);
  * what its release's defects need runs beside it (upstream.seam.ServerHelpers), and nothing when none.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

from resnet18_kit.contract import STUB_EXECUTABLE
from resnet18_kit.observe.processes import child_processes, port_listeners, rss_bytes
from resnet18_kit.server.config import (ConfigurationError, ServerConfig, ServerStartError, StartCancelled,
                                        check_ports_free)
from resnet18_kit.server.resources import PYTHON_BACKEND_SHM_PREFIX, remove_regions
from resnet18_kit.observe.server_log import first_error_line, log_tail
from resnet18_kit.server.tritonserver import server_command, server_environment
from resnet18_kit.upstream.seam import ServerHelpers

#: Numbers this process's servers, for their shared-memory prefixes.
_starts = itertools.count(1)


def answers_ready(http_url: str, timeout_s: float = 2.0) -> bool:
    """True when GET http://`http_url`/v2/health/ready answers 200 within `timeout_s` seconds (the standard
    library's HTTP client: no tritonclient needed to start a server); False for any other answer or none."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):  # not listening yet, 400 while not ready (HTTPError), a reset
        return False


class EmbeddedTritonServer:
    """A tritonserver child process. Use as a context manager, or call start() and stop().

    log_path: where the server's stdout and stderr go (its folder is created); None = this process's stdout/stderr.
    die_with_parent: the server gets SIGTERM when the thread that started it dies, even by SIGKILL
        (Linux PR_SET_PDEATHSIG, through util-linux's `setpriv`), so a killed `serve` leaves no orphan
        server holding the ports: it drains, exits and removes its stubs' shared memory itself. Off by
        default: the server must then be started from a thread that outlives it.
    shm_prefix: the name prefix of this server's Python-backend regions in /dev/shm, new for each
        instance ("triton_python_backend_shm_region_<pid>x<n>_"); stop() removes what is left under it.
    drain_on_exit: leaving the `with` block stops gracefully (stop(): seconds, as the Python backend
        sleeps 1 s in the server before it finalizes each model instance); False kills it at once
        (stop(drain_s=0): what it still holds fails, its shared memory is removed all the same), for a
        server whose requests no longer matter then, such as a measurement's.
    """

    def __init__(self, config: ServerConfig = ServerConfig(), log_path: Path | None = None,
                 die_with_parent: bool = False, drain_on_exit: bool = True):
        self.config = config
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self.drain_on_exit = drain_on_exit
        self.shm_prefix = f"{PYTHON_BACKEND_SHM_PREFIX}{os.getpid()}x{next(_starts)}_"
        #: The key of the model-control API (server_command): the user's admin key with model control
        #: "explicit", else one made here that nobody else holds; stop() unloads the models with it.
        self.control_key = config.admin_key if config.model_control == "explicit" else secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self.started_at: float | None = None
        #: What runs beside tritonserver for the defects of its release (upstream.seam): made by start().
        self.helpers: ServerHelpers | None = None
        #: Set by stop(): True when every model was unloaded before SIGTERM (nothing was left in flight).
        self.refused_first: bool | None = None

    def start(self, ready_timeout_s: float = 300.0, cancelled: Callable[[], bool] | None = None) -> float:
        """Check the ports, start the server and block until it is ready; return seconds from start to
        ready.

        cancelled: polled while waiting; when it returns True, StartCancelled is raised with the server
        still running (it may be ready already and hold requests): stop() it. Raises PortBusyError before starting anything when a port is taken, ConfigurationError
        when tritonserver exits before ready (a model failed to load, a bad option: its first error line
        names it), ServerStartError when `ready_timeout_s` seconds pass.
        """
        check_ports_free(self.config)
        if self.log_path:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        output = open(self.log_path, "ab") if self.log_path else None
        self.started_at = time.monotonic()
        command = server_command(self.config, self.shm_prefix, self.control_key)
        if self.config.nice:
            command = ["nice", "-n", str(self.config.nice), *command]  # exec'd: the same pid, its threads inherit
        if self.die_with_parent and shutil.which("setpriv"):
            command = ["setpriv", "--pdeathsig", "TERM", "--", *command]  # kept across its exec
        self.helpers = ServerHelpers(self.config, self.log_path)
        env = self.helpers.environment(server_environment(self.config.stub_python,
                                                          wheel_libraries=self.config.tritonserver is None))
        try:
            self.process = subprocess.Popen(
                command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
                start_new_session=True)  # Ctrl-C reaches us, not the server; we stop it gracefully
        except BaseException:
            self.helpers.stop()
            raise
        finally:
            if output:
                output.close()
        try:
            self.helpers.start()
            self.wait_ready(ready_timeout_s, cancelled)
        except StartCancelled:
            raise  # still running: it may already hold requests, so the caller stops it gracefully
        except BaseException:
            self.stop(drain_s=0)
            raise
        return time.monotonic() - self.started_at

    def wait_ready(self, timeout_s: float, cancelled: Callable[[], bool] | None = None) -> None:
        """Poll every 0.25 s, up to `timeout_s` seconds, until /v2/health/ready answers 200 and the HTTP
        port's listening socket is this server's (serves_http_port); errors as in start()."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise StartCancelled("stop requested before the server was ready")
            if self.process.poll() is not None:
                raise ConfigurationError(
                    f"tritonserver exited with status {self.process.returncode} before ready: "
                    f"{first_error_line(self.log_path)}")
            if self.serves_http_port() and answers_ready(self.config.http_url):
                return
            time.sleep(0.25)
        raise ServerStartError(f"tritonserver not ready after {timeout_s:.0f} s{log_tail(self.log_path)}")

    def serves_http_port(self) -> bool:
        """True when the socket listening on the HTTP port belongs to this server's process (so a
        readiness answer on that port is its own, not another server's)."""
        return self.running and any(pid == self.process.pid for pid, _ in port_listeners(self.config.http_port))

    @property
    def guard(self):
        """The gRPC guard in front of tritonserver (upstream.guard_process.GrpcGuard), or None."""
        return None if self.helpers is None else self.helpers.guard

    @property
    def running(self) -> bool:
        """True while the tritonserver process is alive."""
        return self.process is not None and self.process.poll() is None

    def server_processes(self) -> dict[str, int]:
        """The processes this server runs on, by role: {"tritonserver": pid, "grpc guard": pid (when it has
        one)}; the stubs are tritonserver's children (observe.process_cpu follows them). Empty when stopped."""
        roles = {"tritonserver": self.process.pid} if self.running else {}
        return {**roles, **self.helpers.processes()} if self.helpers is not None else roles

    def stub_processes(self) -> dict[str, int]:
        """The Python backend's stub processes of this server: {instance name: pid}, e.g.
        {"resnet18_onnx_0_0": 4242}. One per model instance; Triton does not restart a stub that
        died (upstream defect dead-stub), so the supervisor watches these. While a
        swap replaces a model's instances, a name has two stubs: stub_pids() lists both."""
        return dict(self.stub_pids())

    def stub_pids(self) -> list[tuple[str, int]]:
        """Every model instance's stub process: (instance name, pid), sorted by pid; the short-lived stub
        Triton starts for a whole model while it loads it (named after the model) is left out."""
        if not self.running:
            return []
        models = {path.name for repository in (self.config.model_repository, *self.config.extra_model_repositories)
                  if repository is not None for path in Path(repository).iterdir()}
        stubs = []
        for pid, argv in child_processes(self.process.pid):
            # argv: stub, model.py, shm region, shm sizes (2), parent pid, backend dir, ipc size,
            # instance name, runtime ("DEFAULT")
            if argv and Path(argv[0]).name == STUB_EXECUTABLE and len(argv) >= 3 and argv[-2] not in models:
                stubs.append((argv[-2], pid))
        return sorted(stubs, key=lambda stub: stub[1])

    def resident_memory_bytes(self) -> dict[str, int]:
        """Resident memory (RSS) of tritonserver and of each stub: {"tritonserver": bytes,
        "<instance name>": bytes, ...} (a second stub of an instance, while a swap replaces it, as
        "<instance name> (pid N)"); empty when the server is not running."""
        if not self.running:
            return {}
        memory = {"tritonserver": rss_bytes(self.process.pid)}
        for name, pid in self.stub_pids():  # during a swap an instance has two stubs: both counted
            memory[name if name not in memory else f"{name} (pid {pid})"] = rss_bytes(pid)
        return {name: rss for name, rss in memory.items() if rss is not None}

    def stop(self, drain_s: float | None = None, hurry: Callable[[], bool] | None = None,
             refuse_first: bool = True) -> int | None:
        """Stop admitting requests (refuse_first), SIGTERM, wait for in-flight requests, then SIGKILL the
        process group (stubs included) and remove this server's shared-memory regions left in /dev/shm.

        refuse_first: when drain_s > 0 and config.refuse_first, first unload every model
        (upstream.seam.ServerHelpers.before_sigterm: new requests refused, those held answered), for up to
        exit_timeout_s, so tritonserver holds nothing when its exit timeout ends (upstream defect
        keep-alive-stop). False skips it (a restart after a fault, a wedged server).
        drain_s: how long to wait after SIGTERM before SIGKILL; default exit_timeout_s + 10 s (the
        server's own exit timeout plus a margin). A gRPC guard in front forwards until tritonserver has
        exited, then stops. hurry: polled every 0.1 s while waiting; True cuts the wait short (SIGKILL
        now, in-flight requests fail).
        Returns the server's exit status (None if it was never started; negative: killed by that signal).
        """
        if self.process is None:
            return None
        drain_s = self.config.exit_timeout_s + 10 if drain_s is None else drain_s
        if self.process.poll() is None:
            if refuse_first and drain_s > 0 and not (hurry is not None and hurry()):
                self.refused_first = self.helpers.before_sigterm(self.control_key,
                                                                 min(drain_s, self.config.exit_timeout_s), hurry)
            self.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + drain_s
            while self.process.poll() is None and time.monotonic() < deadline:
                if hurry is not None and hurry():
                    break
                try:
                    self.process.wait(0.1)
                except subprocess.TimeoutExpired:
                    pass
        with contextlib.suppress(ProcessLookupError):  # a server past its drain, or stubs of a killed one
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.remove_shared_memory()
        self.helpers.stop()  # after the drain, during which the guard forwarded what clients still sent
        return self.process.returncode

    def remove_shared_memory(self) -> list[Path]:
        """Remove this server's Python-backend regions from /dev/shm (call once its processes are gone);
        returns those removed. Regions of other servers (another prefix) are never touched."""
        return remove_regions(self.shm_prefix)

    def __enter__(self) -> "EmbeddedTritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(drain_s=None if self.drain_on_exit else 0)
