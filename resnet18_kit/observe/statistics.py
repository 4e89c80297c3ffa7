"""What the server itself reports during a benchmark: the statistics extension and the metrics endpoint.

* Statistics extension (`GET /v2/models/<model>/stats`): cumulative request counts and nanoseconds per
  stage (queue, compute input, compute infer, compute output) and execution counts per batch size.
  The difference of two snapshots covers exactly the requests in between.
* Metrics endpoint: `nv_cpu_utilization`, sampled by `CpuSampler` while a load level runs.
* `PeriodicSampler`: the thread that samples; `ExecutionSampler` polls the statistics extension.
"""
from __future__ import annotations

import json
import threading
import urllib.parse
import urllib.request

from resnet18_kit.observe.metrics import server_gauge

STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


def model_statistics(http_url: str, model: str, timeout_s: float = 60.0) -> dict:
    """The statistics extension's record of `model` at the server `http_url` (host:port): the JSON of
    GET /v2/models/<model>/stats, its first (only) entry of "model_stats", read with the standard library.
    Raises urllib.error.HTTPError for an unknown model (400), OSError when the server does not answer."""
    url = f"http://{http_url}/v2/models/{urllib.parse.quote(model)}/stats"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.load(response)["model_stats"][0]


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


class PeriodicSampler:
    """Takes `sample()` every `interval_s` seconds on a thread between `with` entry and exit (with
    `at_edges`, also at entry and once more after the thread stopped); results that are not None go to
    `samples`, in order. Subclasses define `sample()`."""

    def __init__(self, interval_s: float, at_edges: bool = False):
        self.interval_s, self.at_edges = interval_s, at_edges
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        raise NotImplementedError

    def _take(self) -> None:
        value = self.sample()
        if value is not None:
            self.samples.append(value)

    def _run(self) -> None:
        if self.at_edges:
            self._take()
        while not self._stop.wait(self.interval_s):
            self._take()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.at_edges:
            self._take()


class CpuSampler(PeriodicSampler):
    """The server's `nv_cpu_utilization` (0..1 of all cores) every `interval_s` while a level runs;
    `mean` and `peak` hold the result (None without samples)."""

    def __init__(self, metrics_url: str, interval_s: float = 1.0):
        super().__init__(interval_s)
        self.metrics_url = metrics_url

    def sample(self) -> float | None:
        try:
            return server_gauge(self.metrics_url, "nv_cpu_utilization")
        except OSError:
            return None

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    @property
    def peak(self) -> float | None:
        return max(self.samples) if self.samples else None


class ExecutionSampler(PeriodicSampler):
    """A model's cumulative (execution_count, compute_infer ns) from the statistics extension every
    `interval_s` seconds, at entry and at exit too (resnet18_kit/tools/planner/measure.py's speed under load)."""

    def __init__(self, http_url: str, model: str, interval_s: float):
        super().__init__(interval_s, at_edges=True)
        self.http_url, self.model = http_url, model

    def sample(self) -> tuple[int, int]:
        stats = model_statistics(self.http_url, self.model)
        return int(stats["execution_count"]), int(stats["inference_stats"]["compute_infer"]["ns"])
