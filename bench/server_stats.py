"""What the server itself reports during a benchmark: the statistics extension and the metrics endpoint.

* Statistics extension (`GET /v2/models/<model>/stats`): cumulative request counts and nanoseconds per
  stage (queue, compute input, compute infer, compute output) and execution counts per batch size.
  The difference of two snapshots covers exactly the requests in between.
* Metrics endpoint: `nv_cpu_utilization`, sampled by `CpuSampler` while a load level runs.
"""
from __future__ import annotations

import threading

import tritonclient.http as httpclient

from client.metrics import server_gauge

STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


def model_statistics(http_url: str, model: str) -> dict:
    """The statistics extension's record of `model` (all versions summed by Triton's version field)."""
    client = httpclient.InferenceServerClient(http_url)
    try:
        return client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()


def statistics_delta(before: dict, after: dict) -> dict:
    """What happened between two snapshots of `model_statistics`.

    Returns {"inference_count", "execution_count", "average_batch" (inferences per execution),
    "<stage>_us" (mean per request, microseconds, for each of STAGES), "batch_executions"
    ({batch size: executions})}.
    """
    def stage(record: dict, name: str) -> tuple[int, int]:
        entry = record["inference_stats"][name]
        return int(entry["count"]), int(entry["ns"])

    inferences = int(after["inference_count"]) - int(before["inference_count"])
    executions = int(after["execution_count"]) - int(before["execution_count"])
    result = {"inference_count": inferences, "execution_count": executions,
              "average_batch": inferences / executions if executions else 0.0}
    for name in STAGES:
        (count_a, ns_a), (count_b, ns_b) = stage(after, name), stage(before, name)
        result[f"{name}_us"] = (ns_a - ns_b) / 1000.0 / (count_a - count_b) if count_a > count_b else 0.0
    executions_before = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in before["batch_stats"]}
    histogram = {}
    for entry in after["batch_stats"]:
        size = int(entry["batch_size"])
        count = int(entry["compute_infer"]["count"]) - executions_before.get(size, 0)
        if count:
            histogram[size] = count
    result["batch_executions"] = dict(sorted(histogram.items()))
    return result


class CpuSampler:
    """Samples the server's `nv_cpu_utilization` (0..1 of all cores) every `interval_s` on a thread,
    between `with` entry and exit; `mean` and `peak` hold the result (None without samples)."""

    def __init__(self, metrics_url: str, interval_s: float = 1.0):
        self.metrics_url, self.interval_s = metrics_url, interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                value = server_gauge(self.metrics_url, "nv_cpu_utilization")
            except OSError:
                continue
            if value is not None:
                self.samples.append(value)

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    @property
    def peak(self) -> float | None:
        return max(self.samples) if self.samples else None

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
