"""Start, wait for and stop the `tritonserver` binary that ships in the nvidia-pytriton wheel.

The one place that knows how that server is put together (the same steps PyTriton takes):
  * a backend directory of our own holding the Python backend (`libtriton_python.so`) and the stub
    built for this interpreter's Python version (`triton_python_backend_stub`);
  * LD_LIBRARY_PATH with the wheel's bundled libraries (the stub needs its libcudart even on a CPU);
  * the venv's bin/ first on PATH, so each stub's embedded interpreter imports the venv's packages.

What a start guarantees (docs/reliability.md "Faults"):
  * the three ports are checked before anything starts (PortBusyError names the port and its holder);
  * readiness is believed only from this server: /v2/health/ready must answer 200 *and* the socket
    listening on the HTTP port must belong to the tritonserver process started here (another server
    on the port cannot satisfy the probe);
  * every start gets its own Python-backend shared-memory prefix (`shm_prefix`), and `stop()` removes
    whatever is left under it in /dev/shm once the process group is gone (server.resources).
"""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from resnet18_kit.contract import DEFAULT_HOST, STUB_EXECUTABLE
from resnet18_kit.observe.processes import child_processes, port_listeners, rss_bytes
from resnet18_kit.upstream.cancel_marks import ENVIRONMENT as CANCEL_MARKS_ENVIRONMENT
from resnet18_kit.server.config import (ADMIN_HEADER, RESTRICTED_APIS, ConfigurationError, ServerConfig,
                                        ServerStartError, StartCancelled, check_ports_free)
from resnet18_kit.server.resources import PYTHON_BACKEND_SHM_PREFIX, remove_regions
from resnet18_kit.server.server_log import first_error_line, log_tail


#: Numbers this process's servers, for their shared-memory prefixes.
_starts = itertools.count(1)
def _pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("nvidia-pytriton is not installed (the 'serve' extra)", name="pytriton")
    return Path(list(spec.submodule_search_locations)[0])


def tritonserver_binary() -> Path:
    """The `tritonserver` executable inside the installed nvidia-pytriton wheel."""
    return _pytriton_dir() / "tritonserver" / "bin" / "tritonserver"


def library_path() -> str:
    """LD_LIBRARY_PATH for tritonserver, its stubs and perf_analyzer: the wheels' bundled libraries."""
    site_packages = _pytriton_dir().parent
    dirs = [site_packages / "nvidia_pytriton.libs", site_packages / "nvidia" / "cuda_runtime" / "lib"]
    existing = os.environ.get("LD_LIBRARY_PATH")
    return os.pathsep.join([str(d) for d in dirs if d.is_dir()] + ([existing] if existing else []))


def backend_directory(target: Path | None = None) -> Path:
    """Build (once) `target`/python (default target: <venv>/triton-backends) with the backend library and
    this Python's stub, from the nvidia-pytriton found on sys.path; returns `target`. RuntimeError when
    that nvidia-pytriton has no stub for this Python."""
    source = _pytriton_dir() / "tritonserver"
    target = Path(sys.prefix) / "triton-backends" if target is None else Path(target)
    python_dir = target / "python"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = source / "python_backend_stubs" / version / STUB_EXECUTABLE
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton ships no Python-backend stub for Python {version}")
    python_dir.mkdir(parents=True, exist_ok=True)
    for item in (source / "backends" / "python").iterdir():
        link = python_dir / item.name
        if item.is_file() and not link.exists():
            link.symlink_to(item)
    if not (python_dir / stub.name).exists():
        shutil.copy2(stub, python_dir / stub.name)
    return target


def server_environment(stub_python: Path | None = None) -> dict[str, str]:
    """This process's environment with LD_LIBRARY_PATH and PATH set for tritonserver and its stubs: the
    folder of `stub_python` (default: this Python) first on PATH, where each stub's embedded interpreter
    finds the installation whose site-packages it imports from (it ignores PYTHONPATH)."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = library_path()
    env["PATH"] = os.pathsep.join([str(Path(stub_python or sys.executable).parent), env.get("PATH", "")])
    return env


def server_command(config: ServerConfig, shm_prefix: str = PYTHON_BACKEND_SHM_PREFIX,
                   control_key: str | None = None) -> list[str]:
    """The tritonserver command line for `config` (no shell quoting needed: a list of arguments);
    `shm_prefix`: the name prefix of its stubs' shared-memory regions in /dev/shm.

    Model control is always Triton's explicit mode, every model loaded at start, so that a stop can
    unload them first (upstream.admission). With config.model_control "explicit" the model-control API is
    the user's, behind config.admin_key with the other RESTRICTED_APIS; with "none" it is locked by
    `control_key` (required then: ValueError without it), which only the process that started the server
    holds, and the other restricted APIs keep config.admin_key when one is set."""
    if config.model_repository is None:
        raise ValueError("ServerConfig.model_repository is required to start a server")
    cmd = [
        str(tritonserver_binary()),
        *(f"--model-repository={repository}"
          for repository in (config.model_repository, *config.extra_model_repositories)),
        f"--backend-directory={backend_directory(config.backend_root)}",
        f"--http-address={config.host}", f"--http-port={config.http_port}",
        *((f"--grpc-address={config.host}", f"--grpc-port={config.grpc_port}") if config.triton_grpc_port is None
          else (f"--grpc-address={DEFAULT_HOST}", f"--grpc-port={config.triton_grpc_port}")),
        f"--metrics-address={config.host}", f"--metrics-port={config.metrics_port}",
        "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        # Triton's rate limiter: instances that declare rate_limiter resources (the CPU network configs'
        # "cores") run only while those resources are free; instances that declare none are not limited.
        "--rate-limit=execution_count",
        f"--backend-config=python,shm-default-byte-size={config.python_shm_default_bytes}",
        f"--backend-config=python,shm-growth-byte-size={config.python_shm_growth_bytes}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--log-verbose={config.log_verbose}",
    ]
    if config.response_cache_bytes:
        # Triton's local cache (libtritoncache_local.so, shipped in the wheel): LRU, held in this process.
        cmd += [f"--cache-directory={_pytriton_dir() / 'tritonserver' / 'caches'}",
                f"--cache-config=local,size={config.response_cache_bytes}"]
    cmd += ["--model-control-mode=explicit", "--load-model=*"]  # every model at start; unloaded before a stop
    if config.model_config_name:
        cmd.append(f"--model-config-name={config.model_config_name}")
    # Triton takes keys only on its command line, so local users can read them in `ps`; the restriction
    # is against callers from the network, not other accounts on this machine.
    restrictions = []  # (APIs, key)
    user_apis = RESTRICTED_APIS
    if config.model_control != "explicit":
        if not control_key:
            raise ValueError("server_command: model control 'none' needs a control_key to lock the model-control API")
        restrictions.append((["model-repository"], control_key))
        user_apis = [api for api in RESTRICTED_APIS if api != "model-repository"]
    if config.admin_key:
        restrictions.append((user_apis, config.admin_key))
    for apis, key in restrictions:
        restriction = f"{','.join(apis)}:{ADMIN_HEADER}={key}"
        cmd += [f"--http-restricted-api={restriction}", f"--grpc-restricted-protocol={restriction}"]
    return cmd + list(config.extra_args)


def answers_ready(http_url: str, timeout_s: float = 2.0) -> bool:
    """True when GET http://`http_url`/v2/health/ready answers 200 within `timeout_s` seconds (the standard
    library's HTTP client: no tritonclient needed to start a server); False for any other answer or none."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):  # not listening yet, 400 while not ready (HTTPError), a reset
        return False


def reported_version(http_url: str, timeout_s: float = 2.0) -> str | None:
    """The release the server at `http_url` reports in its KServe v2 server metadata (GET /v2: {"name":
    "triton", "version": "2.51.0", ...}); None when it does not answer with one within `timeout_s` s."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2", timeout=timeout_s) as response:
            version = json.load(response).get("version")
    except (OSError, ValueError, AttributeError):  # no answer, not JSON, not an object
        return None
    return version if isinstance(version, str) else None


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
        #: The gRPC guard in front of tritonserver (upstream.grpc_guard), when config.triton_grpc_port is set:
        #: listening before the server is ready, stopped after it.
        self.guard = None
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
        env = server_environment(self.config.stub_python)
        env.pop(CANCEL_MARKS_ENVIRONMENT, None)
        if self.config.triton_grpc_port is not None:  # its marks reach the models (upstream.cancel_marks)
            from resnet18_kit.upstream.guard_process import GrpcGuard

            self.guard = GrpcGuard(self.config.host, self.config.grpc_port, self.config.triton_grpc_url,
                                   self.log_path, grace_s=self.config.exit_timeout_s)
            env[CANCEL_MARKS_ENVIRONMENT] = str(self.guard.marks_folder)
        try:
            self.process = subprocess.Popen(
                command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
                start_new_session=True)  # Ctrl-C reaches us, not the server; we stop it gracefully
        except BaseException:
            if self.guard is not None:
                self.guard.stop()
            raise
        finally:
            if output:
                output.close()
        try:
            if self.guard is not None:  # listening before tritonserver is ready, as its own gRPC would
                self.guard.start()
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
    def running(self) -> bool:
        """True while the tritonserver process is alive."""
        return self.process is not None and self.process.poll() is None

    def server_processes(self) -> dict[str, int]:
        """The processes this server runs on, by role: {"tritonserver": pid, "grpc guard": pid (when it has
        one)}; the stubs are tritonserver's children (observe.process_cpu follows them). Empty when stopped."""
        roles = {"tritonserver": self.process.pid} if self.running else {}
        if self.guard is not None and self.guard.process is not None and self.guard.process.poll() is None:
            roles["grpc guard"] = self.guard.process.pid
        return roles

    def stub_processes(self) -> dict[str, int]:
        """The Python backend's stub processes of this server: {instance name: pid}, e.g.
        {"resnet18_onnx_0_0": 4242}. One per model instance; Triton 2.51 does not restart a stub that
        died (its model stays READY and every request fails), so the supervisor watches these. While a
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
        (upstream.admission.stop_admitting: new requests refused, those held answered), for up to
        exit_timeout_s, so tritonserver holds nothing when its exit timeout ends (Triton 2.51 abandons
        what it holds then). False skips it (a restart after a fault, a wedged server).
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
            if refuse_first and self.config.refuse_first and drain_s > 0 and not (hurry is not None and hurry()):
                from resnet18_kit.upstream.admission import stop_admitting

                self.refused_first = stop_admitting(self.config.http_url, self.control_key,
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
        if self.guard is not None:  # after the drain, during which it forwarded what clients still sent
            self.guard.stop(grace_s=0.0)
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
