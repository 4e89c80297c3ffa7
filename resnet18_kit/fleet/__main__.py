"""resnet18-kit fleet: N replicas of the embedded Triton server behind HAProxy, on this machine.

Starts --replicas supervised tritonservers (each as `resnet18-kit serve` runs one: its own ports, log,
shared memory and restarts) and HAProxy 2.6 in front of them with deploy/haproxy/haproxy.cfg (Debian's
package; `make setup` installs it). Clients use the front ends as they would one server:

  HTTP  --http-port (default 8000)   KServe v2 REST, each request to the next replica in turn
  gRPC  --grpc-port (default 8001)   HTTP/2, each call to the next replica in turn, even on one channel

Replica i (1, 2, ...) listens on --replica-base-port + 10 (i - 1): HTTP, +1 gRPC, +2 metrics (each
replica's Prometheus endpoint; nv_inference_count there is its share of the traffic), +3 tritonserver's own
gRPC behind the replica's gRPC guard (127.0.0.1 only; upstream.grpc_guard: HAProxy passes a client's
cancellation on, the guard does not: upstream defect grpc-cancellation).

HAProxy checks every replica's /v2/health/ready every 500 ms; one failure takes it out of the pool, two
successes bring it back. A queue-full 503 is passed to the client and never counts against a replica. A
replica whose supervisor finds a fault (tritonserver died, a Python-backend stub died) is taken out at
once and put back when it serves again.

Signals: SIGHUP restarts the replicas one after another (drain in HAProxy, graceful stop, start, back in
the pool) with no request failing; the first SIGTERM or SIGINT stops HAProxy (requests under way finish)
and then every replica (each drains for up to --exit-timeout-s, default 10 s here); more signals change
nothing.

Files under <results>/fleet/: servers.cfg (the servers HAProxy reads after the policy file), haproxy.log,
replicaN-tritonserver.log, haproxy.sock (HAProxy's runtime API: `echo "show stat" | socat - haproxy.sock`;
under a results path too long for a UNIX socket, /tmp/resnet18-kit-haproxy-<hash>.sock instead).

Exit status: 0 after a clean stop; 1 when a replica cannot be kept running or a stop was cut short; 2
for a bad setting, a taken port, HAProxy missing or refusing its configuration (`haproxy -c`), a replica
whose models do not load. Nothing is left running in any case.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from resnet18_kit.progress import stderr_line
from resnet18_kit.settings import Settings, shown

#: The folder under the results folder for the fleet's files.
RESULTS_NAME = "fleet"
DEFAULT_REPLICAS = 3
DEFAULT_REPLICA_BASE_PORT = 8100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The fleet's options: the front ends, the replicas and their ports, the HAProxy policy file and
    executable, and the replicas' server options (as serve's)."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address HAProxy and the replicas listen on (default 127.0.0.1: this machine only; "
                             "any other address needs the admin key in $TRITON_ADMIN_KEY)")
    parser.add_argument("--http-port", type=int, default=8000, help="HAProxy's HTTP front end (default 8000)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="HAProxy's gRPC front end (default 8001)")
    parser.add_argument("--model-config-name", help="every replica loads <model>/configs/<NAME>.pbtxt where present")
    parser.add_argument("--exit-timeout-s", type=int, default=10,
                        help="seconds a stopping replica gives its in-flight requests (default 10)")
    parser.add_argument("--log-verbose", type=int, default=0, help="the replicas' tritonserver --log-verbose (default 0)")
    parser.add_argument("--grpc-guard", action=argparse.BooleanOptionalAction, default=None,
                        help="each replica's gRPC port is the kit's guard, which never passes a cancellation on to "
                             "tritonserver (HAProxy passes its clients' on: upstream defect grpc-cancellation); "
                             "tritonserver's own gRPC on the replica's port + 3 of 127.0.0.1 (default: on where "
                             "the release lacks the fix, as serve)")
    from resnet18_kit.server.__main__ import add_cache_argument, add_model_control_argument

    add_cache_argument(parser, "each replica's")
    add_model_control_argument(parser)
    parser.set_defaults(metrics_port=2)  # each replica's own: --replica-base-port + 2 + 10 (i - 1)
    parser.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS,
                        help=f"how many tritonservers (default {DEFAULT_REPLICAS})")
    parser.add_argument("--replica-base-port", type=int, default=DEFAULT_REPLICA_BASE_PORT,
                        help=f"replica 1's HTTP port; gRPC +1, metrics +2, replica i at +10 (i - 1) "
                             f"(default {DEFAULT_REPLICA_BASE_PORT})")
    parser.add_argument("--haproxy-config", type=Path,
                        help="HAProxy policy file (default: the checkout's deploy/haproxy/haproxy.cfg)")
    parser.add_argument("--haproxy", type=Path, help="the haproxy executable (default: haproxy on PATH, else "
                                                      "/usr/sbin/haproxy, Debian's package)")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0,
                        help="seconds each replica may take to load its models and become ready (default 300)")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts each replica's supervisor may make within 10 minutes (default 5)")


def fleet_config(settings: Settings, args: argparse.Namespace):
    """The FleetConfig of the parsed options (replicas from --replica-base-port, front ends on --host with
    --http-port and --grpc-port). ConfigurationError for impossible numbers."""
    from resnet18_kit.fleet.fleet import FleetConfig, replica_configs
    from resnet18_kit.fleet.haproxy import HAPROXY_CONFIG, FrontEnd, runtime_socket_in
    from resnet18_kit.server.__main__ import config_from_args, check_variant
    from resnet18_kit.server.config import ConfigurationError
    from resnet18_kit.server.supervisor import SupervisorPolicy

    template = config_from_args(settings, args)
    check_variant(template)
    workdir = settings.results_dir(RESULTS_NAME).resolve()
    front = FrontEnd(args.host, args.http_port, args.grpc_port, runtime_socket_in(workdir))
    if args.ready_timeout_s <= 0:
        raise ConfigurationError(f"--ready-timeout-s {args.ready_timeout_s:g}: give a positive number of seconds")
    return FleetConfig(replica_configs(template, args.replicas, args.replica_base_port), front, workdir,
                       policy=(args.haproxy_config or HAPROXY_CONFIG).resolve(),
                       supervisor=SupervisorPolicy(poll_interval_s=0.2, max_restarts=args.max_restarts,
                                                   ready_timeout_s=args.ready_timeout_s),
                       ready_timeout_s=args.ready_timeout_s, haproxy=args.haproxy)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Run the fleet until SIGTERM or Ctrl-C (module doc); the exit status of the module doc."""
    from resnet18_kit.export import ensure_exported
    from resnet18_kit.fleet.fleet import Fleet
    from resnet18_kit.fleet.haproxy import replica_name
    from resnet18_kit.server.__main__ import InsecureBindError
    from resnet18_kit.server.config import ServerStartError
    from resnet18_kit.server.tritonserver import tritonserver_binary
    from resnet18_kit.server.stop import SignalStop

    tritonserver_binary()  # without the 'serve' extra: the command names it
    try:
        config = fleet_config(settings, args)
        fleet = Fleet(config, on_event=lambda index, kind, detail: say(
            f"{'haproxy' if index is None else replica_name(index)}: {kind}: {detail}"))
        fleet.check()
    except (InsecureBindError, ServerStartError) as exc:
        print(f"fleet: {str(exc).removeprefix('serve: ')}", file=sys.stderr)
        return 2
    ensure_exported(settings.repository)
    roll_requested = threading.Event()

    def on_signal(signum, effect: str) -> None:  # from the main loop (SignalStop.poll), never a handler
        if effect == "other":
            roll_requested.set()
            say(f"{signum.name}: rolling restart of {len(config.replicas)} replicas")
        elif effect == "stop":
            say(f"{signum.name}: stopping HAProxy, then the replicas (requests under way finish, up to "
                f"{args.exit_timeout_s} s)")
        else:
            say(f"{signum.name} again: already stopping")

    with SignalStop(on_signal, also=(signal.SIGHUP,)) as stop:
        say(f"starting {len(config.replicas)} replicas and HAProxy (logs in {shown(config.workdir)})")
        try:
            seconds = fleet.start(cancelled=lambda: stop.wait(0))
        except ServerStartError as exc:
            print(f"fleet: {exc}", file=sys.stderr, flush=True)
            return 0 if stop.requested else exc.exit_status
        front = config.front.server_config()
        print(f"\nfleet: ready in {seconds:.1f} s: {len(config.replicas)} replicas behind HAProxy\n"
              f"  HTTP    http://{front.http_url}   (KServe v2, every request to the next replica)\n"
              f"  gRPC    {front.grpc_url}\n"
              + "".join(f"  {replica_name(i)}: HTTP {c.http_url}, gRPC {c.grpc_url}, metrics {c.metrics_url}\n"
                        for i, c in enumerate(config.replicas))
              + f"  try:    resnet18-kit classify --url {front.http_url} <images>\n"
                "  perf_analyzer through HAProxy: read its client-side figures only (its server-side statistics "
                "are one replica's)\n"
                f"fleet: SIGHUP for a rolling restart; Ctrl-C or SIGTERM to stop", flush=True)
        status = 0
        while not stop.wait(0.5):
            if roll_requested.is_set():
                roll_requested.clear()
                try:
                    fleet.roll()
                    say("rolling restart done")
                except ServerStartError as exc:
                    say(f"rolling restart stopped: {exc}")
            gave_up = fleet.gave_up()
            if len(gave_up) == len(config.replicas):
                say("every replica's supervisor gave up; stopping")
                status = 1
                break
        statuses: list[int] = []
        stopper = threading.Thread(target=lambda: statuses.append(fleet.stop()), name="fleet-stop")
        stopper.start()
        while stopper.is_alive():  # signals during the stop are still read (and told: "already stopping")
            stop.poll()
            stopper.join(0.2)
        status = max([status, *statuses]) if statuses else 1
    say(f"exiting with status {status}")
    return status


def say(line: str) -> None:
    stderr_line(f"fleet: {line}")
