"""The overload signal for operators: how full each model's queue is.

Triton's `/v2/health/ready` stays 200 while a model's queue is full and requests are being refused with
HTTP 503 / gRPC UNAVAILABLE (Triton 2.51; tests/test_reliability.py shows it), and in this release those
refusals are counted nowhere on the server: not in `nv_inference_request_failure`, not in the statistics
extension. What does show overload is the gauge `nv_inference_pending_request_count{model=...}` (requests waiting
for execution) against the model's `dynamic_batching.default_queue_policy.max_queue_size`. The gauge does
not count the requests the dynamic batcher has already gathered into the next batch while the instance
is busy, but the queue limit does: on 2.51 a model refuses requests while its gauge reads as
little as max_queue_size - max_batch_size. So the threshold is that value: "at most one more batch
fits". For the shipped models, 64 - 16 = 48 (75 %), as a Prometheus alert (no new endpoint, only
Triton's own metric):

    max by (model) (nv_inference_pending_request_count{model=~"preprocess|resnet18_onnx"}) >= 48

`QueueWatch` evaluates the same rule from the metrics endpoint; the `serve` supervisor logs a warning.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT
from resnet18_kit.observe.metrics import counters_by_model
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.repository import ModelRepository

PENDING_GAUGE = "nv_inference_pending_request_count"


def queue_limits(repositories: tuple[Path, ...], config_name: str | None = None) -> dict[str, ModelConfigView]:
    """{model: its ModelConfigView} for every model of `repositories` whose queue is bounded, as Triton
    would load it (configs/<config_name>.pbtxt where it exists, else config.pbtxt)."""
    limits = {}
    for root in repositories:
        repository = ModelRepository(root)
        for model in repository.model_names():
            view = ModelConfigView.for_variant(repository, model, config_name or DEFAULT_VARIANT)
            if view.max_queue_size > 0:
                limits[view.name] = view
    return limits


def queue_fill(metrics_url: str, sizes: dict[str, int], timeout_s: float = 2.0) -> dict[str, float]:
    """{model: pending requests / max_queue_size} now (0.0 .. 1.0). Raises OSError when the metrics
    endpoint cannot be reached."""
    counters = counters_by_model(metrics_url, timeout_s, names=(PENDING_GAUGE,))  # one read for every model
    return {model: counters.get(model, {}).get(PENDING_GAUGE, 0.0) / size for model, size in sizes.items()}


@dataclass
class QueueWatch:
    """Warns when a model's pending requests reach its overload threshold, at most once per `repeat_s`
    per model."""

    limits: dict[str, ModelConfigView]
    repeat_s: float = 10.0

    def __post_init__(self):
        self._last_warning: dict[str, float] = {}

    @classmethod
    def for_config(cls, config) -> "QueueWatch":
        return cls(queue_limits((Path(config.model_repository), *map(Path, config.extra_model_repositories)),
                                config.model_config_name))

    def warnings(self, metrics_url: str) -> list[str]:
        if not self.limits:
            return []
        sizes = {model: limit.max_queue_size for model, limit in self.limits.items()}
        try:
            fill = queue_fill(metrics_url, sizes)
        except OSError:  # metrics endpoint busy or restarting: the liveness check covers a dead server
            return []
        now, lines = time.monotonic(), []
        for model, value in fill.items():
            limit = self.limits[model]
            pending = round(value * limit.max_queue_size)
            if pending >= limit.overload_threshold and \
                    now - self._last_warning.get(model, -self.repeat_s) >= self.repeat_s:
                self._last_warning[model] = now
                lines.append(f"model '{model}' overloaded: {pending} requests pending, max_queue_size "
                             f"{limit.max_queue_size} (batch {limit.max_batch_size}): further requests get "
                             f"503 / UNAVAILABLE; add capacity or shed load")
        return lines
