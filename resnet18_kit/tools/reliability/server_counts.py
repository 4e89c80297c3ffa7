"""What the server counted of a scenario's requests: the metrics endpoint and the statistics extension,
read before and after, to compare with what the clients saw."""
from __future__ import annotations

import time
import urllib.request

from resnet18_kit.observe.metrics import model_counters
from resnet18_kit.observe.statistics import model_statistics
from resnet18_kit.server.config import ServerConfig


def server_counts(config: ServerConfig, model: str) -> dict[str, float]:
    """The server's own cumulative counts for `model`: metrics endpoint (metrics_success, metrics_failure
    (every reason), metrics_inferences) and statistics extension (stats_success, stats_fail)."""
    metrics = model_counters(config.metrics_url, model)
    stats = model_statistics(config.http_url, model)["inference_stats"]
    return {"metrics_success": metrics.get("nv_inference_request_success", 0.0),
            "metrics_failure": metrics.get("nv_inference_request_failure", 0.0),
            "metrics_inferences": metrics.get("nv_inference_count", 0.0),
            "stats_success": float(stats["success"].get("count", 0)),
            "stats_fail": float(stats["fail"].get("count", 0))}


def failure_reasons(config: ServerConfig, model: str) -> dict[str, float]:
    """nv_inference_request_failure of `model` per `reason` label (REJECTED, CANCELED, BACKEND, OTHER)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(config.metrics_url, timeout=5) as response:
        text = response.read().decode()
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "nv_inference_request_failure" and sample.labels.get("model") == model:
                reason = sample.labels.get("reason", "")
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return reasons


def settled_counts(config: ServerConfig, model: str, timeout_s: float = 10.0) -> dict[str, float]:
    """server_counts once they stop changing (two reads 0.5 s apart agree) or `timeout_s` passed:
    the server updates its counters as each request completes, a moment after the client's outcome."""
    deadline = time.monotonic() + timeout_s
    counts = server_counts(config, model)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = server_counts(config, model)
        if again == counts:
            break
        counts = again
    return counts


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """after - before per key of `after`, rounded to whole requests."""
    return {key: int(round(after[key] - before[key])) for key in after}
