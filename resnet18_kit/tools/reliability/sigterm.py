"""SIGTERM to the real serve command (`resnet18-kit serve`, run as a child process: its own
signal handling is what is measured) while requests are in flight: accepted requests are answered, new
ones refused, and the process exits within its exit timeout."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from resnet18_kit.contract import ONNX_MODEL, PROTOCOLS, REPO_ROOT
from resnet18_kit.tools.load.outcomes import ANSWERED, ERROR, LOST, REFUSED, Outcome, summarize
from resnet18_kit.observe.metrics import model_counters
from resnet18_kit.tools.reliability.loads import HANG_BOUND_S, TensorLoad, onnx_load, reference_answers
from resnet18_kit.tools.reliability.senders import send_all, send_fresh
from resnet18_kit.server.config import ADMIN_KEY_ENV, ServerConfig, config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer


def serve_arguments(config: ServerConfig, server_log: Path) -> list[str]:
    """The options of `resnet18-kit serve` for `config` (model repository, ports, exit timeout, response cache:
    none unless `config` has one, so every request of a scenario is computed), tritonserver's
    log in `server_log`; the global --model-repository given after the command name, as `make serve ARGS=`
    passes it."""
    return ["--model-repository", str(config.model_repository),
            "--http-port", str(config.http_port), "--grpc-port", str(config.grpc_port),
            "--metrics-port", str(config.metrics_port), "--exit-timeout-s", str(config.exit_timeout_s),
            "--response-cache-bytes", str(config.response_cache_bytes), "--server-log", str(server_log)]


def environment_without_admin_key() -> dict[str, str]:
    """This process's environment without $TRITON_ADMIN_KEY, for the serve commands the scenarios start
    (they listen on loopback and must not lock the APIs the scenarios call)."""
    return {k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV}


def serve_command(config: ServerConfig, server_log: Path, extra_serve_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of `resnet18-kit serve` for `config` (serve_arguments), then `extra_serve_args`."""
    return [sys.executable, "-m", "resnet18_kit", "serve", *serve_arguments(config, server_log), *extra_serve_args]


def start_serve(config: ServerConfig, log_path: Path, extra_serve_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """`resnet18-kit serve` on `config`'s model repository, ports and exit timeout, its output appended to
    `log_path` (tritonserver's log beside it, <stem>-tritonserver.log), without an admin key in its
    environment; the process (not yet ready: `wait_ready`)."""
    server_log = log_path.with_name(f"{log_path.stem}-tritonserver.log")
    with open(log_path, "ab") as log:
        return subprocess.Popen(serve_command(config, server_log, extra_serve_args), cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT,
                                env=environment_without_admin_key())


def wait_ready(config: ServerConfig, process: subprocess.Popen, timeout_s: float) -> None:
    """Block until the server of `config`, run by `process` (a serve command, which starts its own
    EmbeddedTritonServer), answers /v2/health/ready and its metrics endpoint (Triton starts that a few
    ms after HTTP), polling every 0.25 s; RuntimeError when `process` exits first or `timeout_s` seconds
    pass."""
    import urllib.request

    import tritonclient.http as httpclient

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} before ready")
        client = httpclient.InferenceServerClient(config.http_url, connection_timeout=2.0)
        try:
            if client.is_server_ready():
                with urllib.request.urlopen(config.metrics_url, timeout=2.0):
                    return
        except Exception:  # not listening yet
            pass
        finally:
            client.close()
        time.sleep(0.25)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def sigterm_in_flight(repository: Path, model: str, load: TensorLoad, in_flight: int, exit_timeout_s: int,
                      log_path: Path, extra_serve_args: tuple[str, ...] = ()) -> dict:
    """The serve command on `repository` (start_serve); `in_flight` requests of `load` sent at once over
    HTTP and gRPC (half each), SIGTERM to serve once the server holds them; then new requests on fresh
    connections, both protocols, every 100 ms until it exits.

    Returns {"model", "in_flight" (load.outcomes.summarize of the requests sent before SIGTERM),
    "exit_status", "last_in_flight_answered_after_sigterm_s", "exit_s", "exit_timeout_s",
    "after_sigterm" ([{"sent_s", "latency_s", "protocol", "kind", "status", "message"}])}; seconds.
    RuntimeError when serve is not ready in 300 s or the requests never reach the server.
    """
    config = config_on_free_ports(model_repository=repository, exit_timeout_s=exit_timeout_s)
    process = start_serve(config, log_path, extra_serve_args)
    try:
        wait_ready(config, process, 300)
        accepted: list[Outcome] = []
        done_at: list[float] = []

        async def in_flight_requests():
            half = in_flight // 2
            http = asyncio.ensure_future(send_all(config, "http", load, range(half)))
            grpc = asyncio.ensure_future(send_all(config, "grpc", load, range(half, in_flight)))
            return (await http) + (await grpc)

        # successes before the requests: a model's warmup (model_warmup in its config) counts as some
        succeeded_before = model_counters(config.metrics_url, model).get("nv_inference_request_success", 0)
        runner = threading.Thread(target=lambda: (accepted.extend(asyncio.run(in_flight_requests())),
                                                  done_at.append(time.monotonic())))
        runner.start()
        deadline = time.monotonic() + 30  # SIGTERM once the server holds the requests: some queued or done
        while True:
            counts = model_counters(config.metrics_url, model)
            if counts.get("nv_inference_pending_request_count", 0) >= 1 or \
                    counts.get("nv_inference_request_success", 0) > succeeded_before:
                break
            if time.monotonic() > deadline or not runner.is_alive():
                raise RuntimeError("the in-flight requests never reached the server")
            time.sleep(0.01)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        after: list[tuple[float, str, Outcome]] = []
        index = 10_000
        while process.poll() is None and time.monotonic() - signalled < exit_timeout_s + 30:
            for protocol in PROTOCOLS:
                sent_s = round(time.monotonic() - signalled, 3)  # when it was sent, after SIGTERM
                after.append((sent_s, protocol, send_fresh(config, protocol, load, index, grpc_timeout_s=10.0)))
                index += 1
            time.sleep(0.1)
        process.wait(exit_timeout_s + 30)
        exit_s = time.monotonic() - signalled
        runner.join(HANG_BOUND_S)
    finally:
        if process.poll() is None:  # an error above: stop serve (and so its server) before leaving
            process.terminate()
            try:
                process.wait(exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                process.kill()  # its tritonserver follows (die_with_parent)
                process.wait()
    return {"model": model, "in_flight": summarize(accepted, in_flight),
            "in_flight_failures": sorted({f"{o.status} {o.message[:120]}" for o in accepted
                                          if o.kind not in (ANSWERED, REFUSED)}),
            "exit_status": process.returncode,
            "last_in_flight_answered_after_sigterm_s": round(done_at[0] - signalled, 2) if done_at else None,
            "exit_s": round(exit_s, 2), "exit_timeout_s": exit_timeout_s,
            "after_sigterm": [{"sent_s": t, "latency_s": round(o.latency_s, 3), "protocol": p, "kind": o.kind,
                               "status": o.status, "message": o.message[:120]} for t, p, o in after]}


def reference_answers_from_new_server(repository: Path, out_dir: Path) -> TensorLoad:
    """Reference answers for onnx_load from a short-lived server of `repository` (log in `out_dir`): the
    SIGTERM scenario's own server is the one being stopped."""
    config = config_on_free_ports(model_repository=repository)
    with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver-reference.log"):
        return reference_answers(config, onnx_load())


def sigterm_shipped_models(repository: Path, out_dir: Path, in_flight: int, exit_timeout_s: int = 30) -> dict:
    """The command's run: sigterm_in_flight on the shipped model repository `repository` with `in_flight`
    resnet18_onnx requests (log serve-sigterm.log in `out_dir`)."""
    return sigterm_in_flight(repository, ONNX_MODEL, reference_answers_from_new_server(repository, out_dir),
                             in_flight=in_flight, exit_timeout_s=exit_timeout_s,
                             log_path=out_dir / "serve-sigterm.log")


def table_row(result: dict) -> list:
    """The table's row of one sigterm_in_flight run."""
    accepted, after = result["in_flight"], result["after_sigterm"]
    answered = {p: sum(r["kind"] == ANSWERED for r in after if r["protocol"] == p) for p in PROTOCOLS}
    sent = {p: sum(r["protocol"] == p for r in after) for p in PROTOCOLS}
    return [f"SIGTERM to `resnet18-kit serve` with {accepted['sent']} {result['model']} requests sent",
            "--scenario sigterm", accepted["sent"], accepted[ANSWERED], accepted[REFUSED],
            accepted[LOST] + accepted[ERROR],
            f"last accepted answered {result['last_in_flight_answered_after_sigterm_s']} s after SIGTERM; "
            f"exit {result['exit_s']} s (limit {result['exit_timeout_s']}), status {result['exit_status']}",
            f"after SIGTERM: HTTP answered {answered['http']} of {sent['http']}, "
            f"gRPC answered {answered['grpc']} of {sent['grpc']}"]
