"""python -m server: serve the model repository with Triton 2.51 (the PyPI `tritonserver`, CPU).

Runs the export first when model files are missing, starts tritonserver, waits until every model is
ready, prints where it listens, then serves until Ctrl-C or SIGTERM. On either signal the server stops
taking new requests, lets in-flight ones finish (up to --exit-timeout-s) and exits.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading

from export.artifacts import MODEL_REPOSITORY, missing_artifacts
from server.embedded import EmbeddedTritonServer, ServerConfig, ServerStartError


def ensure_exported() -> None:
    """Run `python -m export` when any generated model file is missing (exits on export failure)."""
    missing = missing_artifacts()
    if missing:
        print(f"serve: {len(missing)} model files missing, running the export first")
        subprocess.run([sys.executable, "-m", "export"], check=True)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    parser.add_argument("--host", default=defaults.host,
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--http-port", type=int, default=defaults.http_port)
    parser.add_argument("--grpc-port", type=int, default=defaults.grpc_port)
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port)
    parser.add_argument("--model-config-name", help="use <model>/configs/<NAME>.pbtxt where present")
    parser.add_argument("--model-repository", default=str(MODEL_REPOSITORY))
    parser.add_argument("--exit-timeout-s", type=int, default=defaults.exit_timeout_s,
                        help="seconds in-flight requests get to finish on shutdown (default 30)")
    parser.add_argument("--log-verbose", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"serve: WARNING: listening on {args.host}: the server is reachable from other machines",
              file=sys.stderr)
    return ServerConfig(model_repository=args.model_repository, host=args.host,
                        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                        model_config_name=args.model_config_name, exit_timeout_s=args.exit_timeout_s,
                        log_verbose=args.log_verbose)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    ensure_exported()

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server = EmbeddedTritonServer(config)
    try:
        seconds = server.start()
    except ServerStartError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    print(f"\nserve: ready in {seconds:.1f} s\n"
          f"  HTTP    http://{config.http_url}   (KServe v2: /v2/health/ready, /v2/models/resnet18/infer)\n"
          f"  gRPC    {config.grpc_url}\n"
          f"  metrics {config.metrics_url}\n"
          f"  try:    .venv/bin/python -m client.classify --url {config.http_url} <images>\n"
          f"serve: Ctrl-C or SIGTERM to stop", flush=True)
    while not stop.wait(0.5):
        if not server.running:
            print(f"serve: tritonserver exited unexpectedly (status {server.process.returncode})",
                  file=sys.stderr)
            return 1
    print("serve: stopping; in-flight requests finish first", flush=True)
    status = server.stop()
    print(f"serve: tritonserver exited with status {status}")
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
