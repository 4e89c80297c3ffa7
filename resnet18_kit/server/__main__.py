"""resnet18-kit serve: serve the model repository with Triton (the PyPI wheel's `tritonserver`, or --tritonserver).

Runs the export first when model files are missing, checks that the three ports are free (a taken one:
one line naming it and its holder, exit 2), starts tritonserver, waits until every model is ready on the
server it started, prints where it listens, then serves until Ctrl-C or SIGTERM.

Stopping (tritonserver's --exit-timeout-secs, given by --exit-timeout-s; docs/reliability.md "Stopping"):
  1. the first SIGTERM or SIGINT unloads every model (ensembles first) through the model-control API,
     which tritonserver always runs (with --model-control none it is locked by a key only serve holds):
     new requests are refused at once (HTTP 404 / gRPC NOT_FOUND "has no available versions": not run),
     the requests the models hold are answered, for up to the exit timeout;
  2. then tritonserver gets SIGTERM: it refuses new HTTP connections and exits once the open ones have
     closed or the exit timeout has passed, holding nothing (without step 1 it would serve open keep-alive
     connections until then and abandon what it held: upstream defect keep-alive-stop);
  3. serve removes the stubs' shared memory and exits 0.
More SIGTERMs change nothing (make and Kubernetes may send several). A second Ctrl-C (SIGINT) cuts the
drain short: tritonserver and its stubs are killed, in-flight requests fail, serve exits 1.
If serve itself is killed (SIGKILL), tritonserver gets SIGTERM from the kernel and stops the same way.

A supervisor restarts tritonserver when it exits, when a Python-backend stub process dies (Triton
does not restart it: upstream defect dead-stub) or when it stops answering; after --max-restarts restarts
within 10 minutes it gives up and exits 1.

Swapping configs: with --model-control explicit (and $TRITON_ADMIN_KEY set), `resnet18-kit swap` loads
another config into the running server while it serves (docs/model-repository.md "Swapping configs"). The
supervisor follows: the stubs of a swapped model are replaced without a fault, and a restart after a
fault puts back the configs that were serving.

tritonserver's log goes to --server-log (default <results>/serve-tritonserver.log, emptied at each start of
`serve`) and is shown here as it grows, except its CUDA messages on a machine without a usable GPU: one
line says they are expected (the models run on the CPU) and where the full log is.

Security: the server listens on 127.0.0.1 unless --host says otherwise. Listening on any other address
needs an admin key in the environment variable TRITON_ADMIN_KEY: model control, shared memory, trace
and logging then need the header `admin-key: <key>` (gRPC metadata `triton-grpc-protocol-admin-key`);
inference, health, metadata and statistics stay open. A key set on 127.0.0.1 restricts the same APIs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT, TRITON_VERSION, parse_version
from resnet18_kit.export import ensure_exported, export_needed
from resnet18_kit.progress import stderr_line
from resnet18_kit.repository import ModelRepository
from resnet18_kit.settings import TRITON_VERSION_ENV, Settings, shipped_variants, shown
from resnet18_kit.server.config import (ADMIN_HEADER, ADMIN_KEY_ENV, DEFAULT_CACHE_BYTES, MAX_CACHE_BYTES,
                                        RESTRICTED_APIS, ConfigurationError, ServerConfig, ServerStartError,
                                        check_ports_free,
                                        free_port_besides)
from resnet18_kit.server.tritonserver import release_of, reported_version, tritonserver_binary
from resnet18_kit.model_control import MODEL_CONTROL_MODES
from resnet18_kit.observe.server_log import CudaNoticeFilter, LogFollower
from resnet18_kit.server.stop import SignalStop
from resnet18_kit.server.supervisor import Supervisor, SupervisorEvent, SupervisorPolicy
from resnet18_kit.upstream.seam import banner, switches

#: The file under the results folder where `serve` writes tritonserver's full log (restarts append to it).
SERVER_LOG_NAME = "serve-tritonserver.log"
#: What the supervisor appends to a start failure; the lines were shown as they came (LogFollower).
LOG_TAIL_MARK = "; server log tail:"


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the server itself (addresses, ports, config, shutdown), shared with the demo (resnet18_kit.demo)."""
    defaults = ServerConfig()
    parser.add_argument("--host", default=defaults.host,
                        help="address to listen on (default 127.0.0.1: this machine only; any other "
                             f"address needs the admin key in ${ADMIN_KEY_ENV})")
    parser.add_argument("--http-port", type=int, default=defaults.http_port, help="HTTP port (default 8000)")
    parser.add_argument("--grpc-port", type=int, default=defaults.grpc_port, help="gRPC port (default 8001)")
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                        help="Prometheus metrics port (default 8002)")
    parser.add_argument("--model-config-name", metavar="NAME",
                        help="use <model>/configs/<NAME>.pbtxt where present (empty: every model's config.pbtxt); "
                             f"the shipped names: {', '.join(shipped_variants())} (docs/model-repository.md)")
    parser.add_argument("--exit-timeout-s", type=int, default=defaults.exit_timeout_s,
                        help="seconds in-flight requests get to finish on shutdown (default 30)")
    parser.add_argument("--log-verbose", type=int, default=0,
                        help="tritonserver's --log-verbose level (default 0; 1 and up: detail per request)")
    add_cache_argument(parser)
    add_model_control_argument(parser)
    parser.add_argument("--tritonserver", type=Path, metavar="PATH",
                        help="the tritonserver executable to run, installed as in NVIDIA's Triton images "
                             "(PATH's folder's parent holds backends/ and caches/: /opt/tritonserver/bin/tritonserver "
                             f"there); its release, read from its server metadata, switches the workarounds "
                             f"(default: the nvidia-pytriton wheel's, Triton {TRITON_VERSION})")
    parser.add_argument("--grpc-guard", action=argparse.BooleanOptionalAction, default=None,
                        help="gRPC clients connect to the kit's guard, which never passes their deadlines or "
                             "cancellations on to tritonserver (Triton before 2.59.0 crashes on them under load; "
                             "docs/reliability.md 'Deadlines and cancellation'); tritonserver's own gRPC then "
                             "listens on a free port of 127.0.0.1 (default: on where the release lacks the fix, "
                             "as 2.51; --no-grpc-guard exposes tritonserver's gRPC on --grpc-port)")
    parser.add_argument("--refuse-first", action=argparse.BooleanOptionalAction, default=None,
                        help="on a stop, unload the models before tritonserver gets SIGTERM: new requests are "
                             "refused at once (404 / NOT_FOUND 'has no available versions'), those held are "
                             "answered, none is abandoned (default: on where the release has upstream defect "
                             "keep-alive-stop, which no release has fixed yet). --no-refuse-first behind a load "
                             "balancer whose health check takes the server out: it serves on while the "
                             "balancer moves traffic away (tritonserver then abandons what it holds if clients "
                             "keep sending on open HTTP connections past --exit-timeout-s)")


def add_cache_argument(parser: argparse.ArgumentParser, whose: str = "Triton's") -> None:
    """--response-cache-bytes (serve, demo, fleet: `whose` says whose cache, e.g. "each replica's")."""
    parser.add_argument("--response-cache-bytes", type=cache_bytes, default=DEFAULT_CACHE_BYTES, metavar="BYTES",
                        help=f"size of {whose} local response cache, bytes (e.g. 67108864 or 64MiB; "
                             f"default {DEFAULT_CACHE_BYTES >> 20} MiB; 0 = no cache): an image sent again is "
                             "answered from it without running the models (docs/usage.md 'Traffic controls')")


def add_model_control_argument(parser: argparse.ArgumentParser) -> None:
    """--model-control (serve, demo, fleet)."""
    parser.add_argument("--model-control", choices=MODEL_CONTROL_MODES, default="none",
                        help="none (default): the configs loaded at start serve until the server stops; explicit: "
                             "`resnet18-kit swap` can load another config into the running server (Triton's "
                             f"model-control API, which then needs the admin key: ${ADMIN_KEY_ENV} must be set)")


#: Size suffixes --response-cache-bytes accepts (powers of 1024).
SIZE_SUFFIXES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def cache_bytes(text: str) -> int:
    """--response-cache-bytes: a whole number of bytes, optionally with KiB / MiB / GiB, 0..MAX_CACHE_BYTES
    (16 GiB); argparse.ArgumentTypeError (one line) otherwise."""
    number, scale = text.strip(), 1
    for suffix, factor in SIZE_SUFFIXES.items():
        if number.endswith(suffix):
            number, scale = number[:-len(suffix)].strip(), factor
    try:
        value = int(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, e.g. 67108864 or 64MiB (0 = no cache)")
    if not 0 <= value <= MAX_CACHE_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 (no cache) to {MAX_CACHE_BYTES >> 30} GiB")
    return value


class InsecureBindError(ValueError):
    """--host names a non-loopback address, or --model-control opens model control, and no admin key is
    set: refused (exit status 2)."""


def config_from_args(settings: Settings, args: argparse.Namespace, environ: dict[str, str] | None = None,
                     triton_version: str | None = None) -> ServerConfig:
    """The ServerConfig for the parsed arguments and the settings' model repository; the admin key comes
    from $TRITON_ADMIN_KEY. The workarounds (upstream.seam.switches) are those of `triton_version`, else
    settings.triton_version ($TRITON_SERVER_VERSION), else the release --tritonserver reports
    (tritonserver.release_of: ServerStartError when it does not), else the wheel's (contract.TRITON_VERSION);
    --grpc-guard and --refuse-first override them.

    Warns on stderr when the server will be reachable from other machines; raises InsecureBindError
    when it would be reachable without the restricted APIs being locked.
    """
    environ = os.environ if environ is None else environ
    tritonserver = getattr(args, "tritonserver", None)
    triton_version = (triton_version or settings.triton_version
                      or (release_of(tritonserver) if tritonserver else TRITON_VERSION))
    on = switches(triton_version, getattr(args, "grpc_guard", None), getattr(args, "refuse_first", None))
    admin_key = environ.get(ADMIN_KEY_ENV) or None
    config = ServerConfig(model_repository=settings.model_repository, host=args.host,
                          http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          model_config_name=args.model_config_name or None, exit_timeout_s=args.exit_timeout_s,
                          log_verbose=args.log_verbose, admin_key=admin_key,
                          response_cache_bytes=args.response_cache_bytes,
                          model_control=getattr(args, "model_control", "none"),
                          refuse_first=on.refuse_first, tritonserver=tritonserver, release=triton_version,
                          triton_grpc_port=(free_port_besides(args.http_port, args.grpc_port, args.metrics_port)
                                            if on.grpc_guard else None))
    if config.model_control != "none" and admin_key is None:
        raise InsecureBindError(
            f"serve: --model-control {config.model_control} needs an admin key, or anyone who can reach the server "
            f"could load and unload models: set {ADMIN_KEY_ENV} (e.g. `export {ADMIN_KEY_ENV}=$(openssl rand -hex 16)`) "
            f"and run again; `resnet18-kit swap` sends it")
    if not config.loopback_only:
        if admin_key is None:
            raise InsecureBindError(
                f"serve: refusing to listen on {args.host} without an admin key: anyone on the network could "
                f"load and unload models and register shared memory. Set {ADMIN_KEY_ENV} (e.g. "
                f"`export {ADMIN_KEY_ENV}=$(openssl rand -hex 16)`) and run again.")
        if not getattr(args, "check", False):  # --check says only what is wrong, or that all is well
            print(f"serve: WARNING: listening on {args.host}: the server is reachable from other machines; "
                  f"{', '.join(RESTRICTED_APIS)} need the header '{ADMIN_HEADER}' (key from ${ADMIN_KEY_ENV}). "
                  f"Inference is open and unencrypted: put a TLS proxy in front.", file=sys.stderr)
    elif admin_key:
        print(f"serve: {', '.join(RESTRICTED_APIS)} need the header '{ADMIN_HEADER}' "
              f"(key from ${ADMIN_KEY_ENV})", file=sys.stderr)
    return config


def version_lines(config: ServerConfig) -> tuple[str, str | None]:
    """What the ready banner says after "Triton" (upstream.seam.banner for the release the workarounds
    were switched by, config.release) and a warning line, or None, when the server reports
    another release in its metadata (GET /v2): then the workarounds are those of the wrong release, and
    the warning names the variable to set."""
    assumed, running = config.release or TRITON_VERSION, reported_version(config.http_url)
    line = banner(assumed, config.triton_grpc_port is not None)
    if running is None:
        return line + " (the server did not report its version)", None
    try:
        same = parse_version(running) == parse_version(assumed)
    except ValueError:
        same = False
    if same:
        return line, None
    return line, (f"serve: WARNING: tritonserver reports release {running}, but the workarounds are those of "
                  f"{assumed} (${TRITON_VERSION_ENV}, else the PyPI wheel's {TRITON_VERSION}): set "
                  f"{TRITON_VERSION_ENV}={running} and start again")


def guard_note(config: ServerConfig) -> str:
    """What the ready banner says after the gRPC address: whether the guard is in front."""
    if config.triton_grpc_port is None:
        return "   (tritonserver's own: no guard against client cancellations)"
    return f"   (the kit's gRPC guard; tritonserver's own gRPC on {config.triton_grpc_url})"


def control_note(config: ServerConfig) -> str:
    """What the ready banner says after the config variant: whether `resnet18-kit swap` can change it."""
    if config.model_control == "explicit":
        return "   (model control on: `resnet18-kit swap --url " + config.grpc_url + " --model-config-name <name>`)"
    return "   (fixed until the server stops; --model-control explicit allows `resnet18-kit swap`)"


def check_variant(config: ServerConfig) -> None:
    """ConfigurationError when --model-config-name names a config no model of the repository has
    (tritonserver would silently load every config.pbtxt instead); the message lists the known names."""
    name = config.model_config_name
    if name is None:
        return
    known = ModelRepository(config.model_repository).variant_names()
    if name not in known:
        raise ConfigurationError(f"--model-config-name {name}: no model in {shown(Path(config.model_repository))} "
                                 f"has configs/{name}.pbtxt; known names: {', '.join(known)}")


def checked_server_config(settings: Settings, args: argparse.Namespace, command: str = "serve") -> ServerConfig | None:
    """The ServerConfig of parsed add_server_arguments options, checked before anything starts; None
    after printing one line naming the problem (a refused --host, an unknown --model-config-name, a
    port taken or impossible): the command then exits 2."""
    binary = getattr(args, "tritonserver", None)
    if binary is None:
        tritonserver_binary()  # ModuleNotFoundError without the 'serve' extra: the command names the extra
    elif not (binary.is_file() and os.access(binary, os.X_OK)):
        print(f"{command}: --tritonserver {binary}: not an executable file", file=sys.stderr)
        return None
    try:
        config = config_from_args(settings, args)
        check_variant(config)
        check_ports_free(config)
    except (InsecureBindError, ServerStartError) as exc:
        message = str(exc).removeprefix("serve: ")
        print(f"{command}: {message}", file=sys.stderr)
        return None
    return config


def prepared_server_config(settings: Settings, args: argparse.Namespace, command: str = "serve"
                           ) -> ServerConfig | None:
    """checked_server_config, then the export into the settings' repository when its files are missing
    (export.ensure_exported); None after one line on stderr when either fails (the command exits 2)."""
    config = checked_server_config(settings, args, command)
    if config is None:
        return None
    if not getattr(args, "export", True):
        reason = export_needed(settings.repository)
        if reason:
            root = settings.repository.root
            missing = ", ".join(str(path.relative_to(root)) for path in settings.repository.missing_artifacts()[:3])
            print(f"{command}: {reason} in {settings.repository.root} ({missing or 'outdated'}); run "
                  "`make export` (resnet18-kit export) on the model repository first; nothing was started",
                  file=sys.stderr)
            return None
        return config
    try:
        ensure_exported(settings.repository)
    except subprocess.CalledProcessError as exc:
        print(f"{command}: the export failed (exit status {exc.returncode}); nothing was started", file=sys.stderr)
        return None
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve command's options: the server's own (add_server_arguments) and the supervisor's."""
    add_server_arguments(parser)
    parser.add_argument("--max-restarts", type=int, default=SupervisorPolicy.max_restarts,
                        help="restarts allowed within 10 minutes before giving up (default 5; 0: never "
                             "restart, exit 1 on the first fault)")
    parser.add_argument("--export", action=argparse.BooleanOptionalAction, default=True,
                        help="run the export first when model files are missing (default: on; --no-export: "
                             "exit 2 naming the missing file instead, as the container image does with its "
                             "model repository mounted read-only)")
    parser.add_argument("--check", action="store_true",
                        help="check the settings (address and admin key, config name, ports) and the model "
                             "files, say so and exit 0 without serving (exit 2 and one line otherwise)")
    parser.add_argument("--server-log", type=Path,
                        help=f"tritonserver's full log, emptied at start (default <results>/{SERVER_LOG_NAME})")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM (module doc); exit status 0 on a clean stop, 1 when the server could
    not be kept running or the stop was cut short, 2 for a bad environment: a refused --host, an unknown
    --model-config-name, a taken port, a model that does not load, a failed export."""
    config = prepared_server_config(settings, args)
    if config is None:
        return 2
    if args.check:
        print(f"serve: settings and model files of {settings.repository.root} checked; not serving (--check)",
              file=sys.stderr)
        return 0

    def on_signal(signum, effect: str) -> None:  # called from the main loop (SignalStop.poll), not a handler
        if effect == "stop":
            stderr_line(f"serve: {signum.name}: stopping; requests already accepted finish first (up to "
                        f"{config.exit_timeout_s} s; Ctrl-C again to stop at once)")
        elif effect == "hurry":
            stderr_line(f"serve: {signum.name} again: not waiting for in-flight requests; killing tritonserver")
        else:
            stderr_line(f"serve: {signum.name} again: already stopping")

    announced = threading.Event()

    def on_event(event: SupervisorEvent) -> None:
        detail = event.detail.split(LOG_TAIL_MARK)[0]  # those lines were shown as they came
        stderr_line(f"serve: {event.kind}: {detail}")
        if event.kind == "ready" and not announced.is_set():
            announced.set()
            triton, mismatch = version_lines(config)
            if mismatch:
                stderr_line(mismatch)
            print(f"\nserve: ready\n"
                  f"  HTTP    http://{config.http_url}   (KServe v2: /v2/health/ready, /v2/models/resnet18/infer)\n"
                  f"  gRPC    {config.grpc_url}{guard_note(config)}\n"
                  f"  metrics {config.metrics_url}\n"
                  f"  config  {config.model_config_name or DEFAULT_VARIANT}{control_note(config)}\n"
                  f"  Triton  {triton}\n"
                  f"  try:    resnet18-kit classify --url {config.http_url} <images>\n"
                  f"serve: Ctrl-C or SIGTERM to stop", flush=True)

    server_log = (args.server_log or settings.results_dir(SERVER_LOG_NAME)).resolve()
    server_log.parent.mkdir(parents=True, exist_ok=True)
    server_log.write_bytes(b"")
    stderr_line(f"serve: tritonserver log: {shown(server_log)}")
    supervisor = Supervisor(config, SupervisorPolicy(max_restarts=args.max_restarts), log_path=server_log,
                            on_event=on_event)
    with SignalStop(on_signal) as stop, \
            LogFollower(server_log, stderr_line, CudaNoticeFilter(shown(server_log), prefix="serve: ")):
        status = supervisor.run(stop)
    stderr_line(f"serve: exiting with status {status}")
    return status

