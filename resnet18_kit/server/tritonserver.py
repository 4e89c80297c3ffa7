"""The tritonserver program: which executable runs, its environment, its one command line, its release.

Two installations are known:
  * the nvidia-pytriton wheel's (the default): the same steps PyTriton takes, a backend directory of our
    own holding the Python backend (`libtriton_python.so`) and the stub built for this interpreter's Python
    version (`triton_python_backend_stub`); LD_LIBRARY_PATH with the wheel's bundled libraries (the stub
    needs its libcudart even on a CPU);
  * one laid out as NVIDIA's Triton images lay it out (ServerConfig.tritonserver, `serve --tritonserver
    /opt/tritonserver/bin/tritonserver`): <root>/backends and <root>/caches beside <root>/bin, its own
    libraries.
Either way the venv's bin/ goes first on PATH, so each stub's embedded interpreter imports the venv's
packages. `server_command` is the only place the flags are written: the CPU image and every command that
starts a server run it through `resnet18-kit serve`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from resnet18_kit.contract import DEFAULT_HOST, STUB_EXECUTABLE
from resnet18_kit.server.config import ADMIN_HEADER, RESTRICTED_APIS, ServerConfig, ServerStartError, free_ports
from resnet18_kit.server.resources import PYTHON_BACKEND_SHM_PREFIX


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


def server_environment(stub_python: Path | None = None, wheel_libraries: bool = True) -> dict[str, str]:
    """This process's environment with PATH (and, with `wheel_libraries`, LD_LIBRARY_PATH: the wheel's
    tritonserver) set for tritonserver and its stubs: the folder of `stub_python` (default: this Python)
    first on PATH, where each stub's embedded interpreter finds the installation whose site-packages it
    imports from (it ignores PYTHONPATH). A tritonserver installed as NVIDIA's images install it finds its
    own libraries: wheel_libraries=False."""
    env = dict(os.environ)
    if wheel_libraries:
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
    if config.tritonserver is None:
        binary, backends, caches = tritonserver_binary(), backend_directory(config.backend_root), None
    else:
        root = Path(config.tritonserver).resolve().parent.parent
        binary, backends, caches = Path(config.tritonserver), root / "backends", root / "caches"
    cmd = [
        str(binary),
        *(f"--model-repository={repository}"
          for repository in (config.model_repository, *config.extra_model_repositories)),
        f"--backend-directory={backends}",
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
        cmd += [f"--cache-directory={caches or _pytriton_dir() / 'tritonserver' / 'caches'}",
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


def reported_version(http_url: str, timeout_s: float = 2.0) -> str | None:
    """The release the server at `http_url` reports in its KServe v2 server metadata (GET /v2: {"name":
    "triton", "version": "2.51.0", ...}); None when it does not answer with one within `timeout_s` s."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2", timeout=timeout_s) as response:
            version = json.load(response).get("version")
    except (OSError, ValueError, AttributeError):  # no answer, not JSON, not an object
        return None
    return version if isinstance(version, str) else None


def release_of(binary: Path, timeout_s: float = 30.0) -> str:
    """The Triton release the tritonserver executable `binary` (laid out as in ServerConfig.tritonserver)
    reports in its server metadata (GET /v2 "version", e.g. "2.51.0"): read from a start of it with no
    model on free ports of 127.0.0.1, killed once it has answered.
    Raises ServerStartError when it exits or does not answer within `timeout_s` seconds."""
    http_port, grpc_port, metrics_port = free_ports(3)
    with tempfile.TemporaryDirectory(prefix="triton-release-") as empty:
        command = [str(binary), f"--model-repository={empty}", "--model-control-mode=explicit",
                   f"--http-address={DEFAULT_HOST}", f"--http-port={http_port}", f"--grpc-address={DEFAULT_HOST}",
                   f"--grpc-port={grpc_port}", f"--metrics-address={DEFAULT_HOST}", f"--metrics-port={metrics_port}"]
        log_path = Path(empty) / "tritonserver.log"  # a file, not a pipe: a full pipe would stall the server
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, env=server_environment(wheel_libraries=False), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while process.poll() is None and time.monotonic() < deadline:
                version = reported_version(f"{DEFAULT_HOST}:{http_port}", timeout_s=1.0)
                if version is not None:
                    return version
                time.sleep(0.05)
            last = (log_path.read_text(errors="replace").strip().splitlines() or [""])[-1] \
                if process.poll() is not None else f"no answer in {timeout_s:.0f} s"
            raise ServerStartError(f"{binary} did not report its release: {last}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
