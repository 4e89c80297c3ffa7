"""What a user sets when starting the server, and its ports: `ServerConfig` (ports, addresses, URLs of
HTTP, gRPC, metrics and the gRPC guard), free ports for tests and benchmarks, the check that the ports are
free, and the errors a start that cannot succeed raises. server.embedded starts a server from a ServerConfig.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from resnet18_kit.contract import DEFAULT_HOST, DEFAULT_PORTS, PROTOCOLS
from resnet18_kit.server.resources import busy_port

#: APIs that change the server or read its memory: model control (load/unload, repository index),
#: shared-memory registration, trace and log settings. With an admin key they need the key's header;
#: inference, health, metadata, model config and statistics stay open (the same set as deploy/).
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
#: HTTP header that carries the admin key. Over gRPC Triton expects the metadata key
#: "triton-grpc-protocol-<header>" (grpcclient: headers={ADMIN_GRPC_HEADER: key}).
ADMIN_HEADER = "admin-key"
ADMIN_GRPC_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
#: Environment variable the `serve` command reads the admin key from (never a flag or a file).
ADMIN_KEY_ENV = "TRITON_ADMIN_KEY"

MiB = 1 << 20
#: `serve`'s response cache: 64 MiB holds about 8,000 answers of the `resnet18` ensemble (a cached answer is
#: its two FP32 [1, 1000] outputs, 8 KB per image: `resnet18-kit bench traffic --only cache`, 60 entries
#: filled 0.73 % of 64 MiB by nv_cache_util). The local cache evicts the least recently used.
DEFAULT_CACHE_BYTES = 64 * MiB
#: The largest cache `serve` accepts: the cache lives in tritonserver's own memory, beside the models.
MAX_CACHE_BYTES = 16 * (1 << 30)


@dataclass(frozen=True)
class ServerConfig:
    """What a user sets when starting the server (ports 0 are not allowed: pass real free ports);
    model_repository is required to start one (Settings.model_repository for the commands)."""

    model_repository: Path | None = None
    #: More repositories served beside it (Triton merges them; model names must not clash).
    extra_model_repositories: tuple[Path, ...] = ()
    #: Address HTTP, gRPC and metrics listen on. 127.0.0.1 keeps the server private to this machine.
    host: str = DEFAULT_HOST
    http_port: int = DEFAULT_PORTS["http"]
    grpc_port: int = DEFAULT_PORTS["grpc"]
    metrics_port: int = DEFAULT_PORTS["metrics"]
    #: Load <model>/configs/<name>.pbtxt instead of config.pbtxt where it exists (e.g. "gpu").
    model_config_name: str | None = None
    #: The tritonserver executable to run, from a Triton installation laid out as NVIDIA's images lay it out
    #: (<root>/bin/tritonserver beside <root>/backends and <root>/caches, e.g. /opt/tritonserver); None: the
    #: one in the nvidia-pytriton wheel, with the backend folder put together below.
    tritonserver: Path | None = None
    #: The Triton release this server runs ("2.51.0"), which switched its workarounds (upstream.seam);
    #: None when nobody said (a config made by hand).
    release: str | None = None
    #: Where the Python backend's folder (--backend-directory) is put together from the nvidia-pytriton
    #: found on sys.path (server.tritonserver.backend_directory); None: <sys.prefix>/triton-backends.
    backend_root: Path | None = None
    #: The python3 whose installation (its venv, its site-packages) the stubs' embedded interpreter uses:
    #: it finds its prefix from the first python3 on PATH and ignores PYTHONPATH. None: this Python.
    stub_python: Path | None = None
    #: On SIGTERM: seconds for open HTTP connections and in-flight requests (docs/reliability.md "Stopping").
    exit_timeout_s: int = 30
    #: Each stub's first shared-memory region: a batch of 16 images (2.4 MB of UINT8 pixels) and its logits fit in it.
    python_shm_default_bytes: int = 16 * MiB
    python_shm_growth_bytes: int = 16 * MiB
    log_verbose: int = 0
    #: tritonserver and its stubs run at this nice value (0 = as this process; higher = less CPU priority, the
    #: kernel's CFS weight), so the gRPC guard and the supervisor, whose work per request is small, get a
    #: core at once while the models keep every core busy. How the value was chosen: `resnet18-kit bench
    #: traffic` (docs/records/usage.md).
    nice: int = 10
    #: Triton's local response cache (--cache-config local,size=N), bytes; 0 = no cache. Only models whose
    #: config says `response_cache { enable: true }` use it (the `resnet18` ensemble); DEFAULT_CACHE_BYTES.
    response_cache_bytes: int = 0
    #: tritonserver's --model-control-mode: "none" (models load at start, nothing loads or unloads them) or
    #: "explicit" (they load at start and the model-control API swaps their configs: model_control;
    #: `serve` allows it only with an admin key, which that API then needs).
    model_control: str = "none"
    #: When set, RESTRICTED_APIS need the header `admin-key: <admin_key>` (HTTP 403 without it, gRPC
    #: UNAVAILABLE). Kept out of repr() so the key does not end up in logs.
    admin_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    #: gRPC behind the kit's guard (upstream.grpc_guard): when set, tritonserver's own gRPC listens on
    #: 127.0.0.1 at this port and the guard listens on `host`:`grpc_port`, where clients connect, so no
    #: client's deadline or cancellation reaches tritonserver (upstream defect grpc-cancellation). None:
    #: tritonserver listens on `grpc_port` itself. EmbeddedTritonServer runs the guard.
    triton_grpc_port: int | None = None
    #: On a stop, unload the models before tritonserver gets SIGTERM (upstream.admission): new requests
    #: refused, held ones answered, none abandoned. False behind a load balancer that takes the server out
    #: when its health check fails: tritonserver then serves on through its drain while the balancer moves
    #: traffic away (an unload would refuse what the balancer still sends in the ~0.5 s before it notices).
    refuse_first: bool = True

    @property
    def loopback_only(self) -> bool:
        """True when the server listens on this machine's loopback interface only."""
        return self.host in ("127.0.0.1", "localhost", "::1")

    @property
    def http_url(self) -> str:
        """host:port for HTTP clients (a wildcard listen address becomes loopback)."""
        return f"{_client_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port for gRPC clients (the guard's, when there is one)."""
        return f"{_client_host(self.host)}:{self.grpc_port}"

    @property
    def triton_grpc_url(self) -> str:
        """host:port where tritonserver's own gRPC listens: behind the guard 127.0.0.1:triton_grpc_port,
        else grpc_url."""
        return self.grpc_url if self.triton_grpc_port is None else f"{DEFAULT_HOST}:{self.triton_grpc_port}"

    def url(self, protocol: str) -> str:
        """host:port for clients of `protocol` ("http" or "grpc"); ValueError for another."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
        return self.http_url if protocol == "http" else self.grpc_url

    @property
    def metrics_url(self) -> str:
        """The Prometheus metrics endpoint (http://host:port/metrics)."""
        return f"http://{_client_host(self.host)}:{self.metrics_port}/metrics"


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now (held open together while chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_besides(*taken: int) -> int:
    """A TCP port free on 127.0.0.1 right now that is none of `taken` (ports chosen but not yet bound,
    which the kernel may hand out again)."""
    while True:
        port = free_ports(1)[0]
        if port not in taken:
            return port


def config_on_free_ports(grpc_guard: bool = False, **options) -> ServerConfig:
    """A ServerConfig with HTTP, gRPC and metrics on free ports (tests, benchmarks); other fields as given.
    grpc_guard: the kit's gRPC guard on the gRPC port, tritonserver's own gRPC on a fourth free port
    (triton_grpc_port), as `resnet18-kit serve` runs by default."""
    http_port, grpc_port, metrics_port, triton_grpc_port = free_ports(4)
    if grpc_guard:
        options["triton_grpc_port"] = triton_grpc_port
    return ServerConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, **options)


class ServerStartError(RuntimeError):
    """tritonserver did not become ready. `exit_status`: what a command should exit with (1: a fault,
    possibly passing; ConfigurationError: 2). The message carries the reason (and the log tail when
    the server said why)."""

    exit_status = 1


class ConfigurationError(ServerStartError):
    """A start that cannot succeed by retrying: a port taken, a model that does not load, a bad option.
    The message is one line naming the problem; exit status 2."""

    exit_status = 2


class PortBusyError(ConfigurationError):
    """One of the server's ports is taken by another process (named when /proc tells)."""


class StartCancelled(ServerStartError):
    """A stop was requested while the server was starting; it was stopped before it became ready."""

    exit_status = 0


def check_ports_free(config: ServerConfig) -> None:
    """Raise PortBusyError naming the first of `config`'s HTTP, gRPC and metrics ports (and tritonserver's
    own gRPC port behind the guard) that is taken right now, and its holder where /proc tells
    (server.resources.busy_port); ConfigurationError for a port outside 1..65535 or one port given for two
    services."""
    ports = (("HTTP", "--http-port", config.http_port), ("gRPC", "--grpc-port", config.grpc_port),
             ("metrics", "--metrics-port", config.metrics_port))
    internal = () if config.triton_grpc_port is None else (("tritonserver's gRPC", "--grpc-port",
                                                             config.triton_grpc_port),)
    for label, flag, port in ports + internal:
        if not 1 <= port <= 65535:
            raise ConfigurationError(f"{flag} {port}: a TCP port is 1 to 65535")
    all_ports = [p for _, _, p in ports + internal]
    shared = [flag for _, flag, port in ports if all_ports.count(port) > 1]
    if shared:
        raise ConfigurationError(f"{' and '.join(shared)} are the same port; HTTP, gRPC and metrics need one each")
    problem = busy_port(config.host, ports) or busy_port(DEFAULT_HOST, internal)
    if problem:
        raise PortBusyError(problem)
