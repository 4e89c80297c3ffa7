"""Readiness while the queue is full: what an operator or a load balancer sees while a model refuses
requests (readiness stays true; the queue gauge of upstream.overload shows the overload)."""
from __future__ import annotations

import asyncio
import threading
import time

from resnet18_kit.tools.load.outcomes import ANSWERED, REFUSED, summarize
from resnet18_kit.observe.metrics import model_counters
from resnet18_kit.tools.reliability import ECHO_MODEL, RELIABILITY_REPOSITORY
from resnet18_kit.tools.reliability.loads import echo_load
from resnet18_kit.tools.reliability.senders import send_all
from resnet18_kit.tools.reliability.table import ms_cell, unaccounted
from resnet18_kit.server.config import ServerConfig


def readiness_under_overload(config: ServerConfig, requests: int = 30) -> dict:
    """Overload reliability_echo (8 queued + 4 executing at most) with `requests` at once over gRPC and,
    while it refuses, read what an operator or a load balancer sees: /v2/health/ready (HTTP and gRPC),
    model readiness, and nv_inference_pending_request_count at its highest (upstream.overload).

    Returns the outcomes' summary (load.outcomes.summarize) with "model", "max_queue_size",
    "max_batch_size", "overload_threshold", "at_highest_pending" ({"pending", "server_ready_http",
    "server_ready_grpc", "model_ready"} at the gauge's highest reading) and "pending_after".
    """
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from resnet18_kit.upstream.overload import PENDING_GAUGE, queue_limits

    limit = queue_limits((RELIABILITY_REPOSITORY,))[ECHO_MODEL]
    seen: dict = {"pending": 0}
    done = threading.Event()

    def observe():
        """Poll the gauge until the burst is over; at each new high, read readiness at that moment."""
        http = httpclient.InferenceServerClient(config.http_url)
        grpc = grpcclient.InferenceServerClient(config.grpc_url)
        try:
            while not done.is_set():
                pending = model_counters(config.metrics_url, ECHO_MODEL).get(PENDING_GAUGE, 0)
                if pending > seen["pending"]:
                    seen.update(pending=pending, server_ready_http=http.is_server_ready(),
                                server_ready_grpc=grpc.is_server_ready(), model_ready=http.is_model_ready(ECHO_MODEL))
                time.sleep(0.005)
        finally:
            http.close()
            grpc.close()

    observer = threading.Thread(target=observe)
    observer.start()
    try:
        outcomes = asyncio.run(send_all(config, "grpc", echo_load(requests), range(requests)))
    finally:
        done.set()
        observer.join()
    after = model_counters(config.metrics_url, ECHO_MODEL).get(PENDING_GAUGE)
    return {"model": ECHO_MODEL, "max_queue_size": limit.max_queue_size, "max_batch_size": limit.max_batch_size,
            "overload_threshold": limit.overload_threshold, "at_highest_pending": seen, "pending_after": after,
            **summarize(outcomes, requests)}


def table_row(result: dict) -> list:
    """The table's row of one readiness_under_overload run."""
    seen = result["at_highest_pending"]
    return [f"readiness while refusing ({result['model']})", "--scenario readiness", result["sent"],
            result[ANSWERED], result[REFUSED], unaccounted(result), f"refusal p50 {ms_cell(result.get('refused_ms'))} ms",
            f"/v2/health/ready {'200' if seen.get('server_ready_http') else 'not ready'} at "
            f"{seen['pending']:.0f} pending (threshold {result['overload_threshold']})"]
