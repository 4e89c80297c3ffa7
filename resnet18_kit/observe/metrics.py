"""Read Triton's Prometheus metrics endpoint (default http://127.0.0.1:8002/metrics)."""
from __future__ import annotations

import urllib.request


def _families(metrics_url: str, timeout_s: float, names: tuple[str, ...] = ()):
    """The metric families the endpoint serves, parsed by prometheus_client. With `names` (gauges or
    counters), only those families' lines go to the parser ("# HELP/# TYPE <name>", samples <name>{...}
    and <name>_total{...}): a read for one gauge then costs 0.4 ms of CPU against 1.4-3.2 for the whole
    text (8 kB from Triton 2.51 serving four models, AMD EPYC Zen 4)."""
    from prometheus_client.parser import text_string_to_metric_families  # only where metrics are read

    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    if names:
        text = "".join(line for line in text.splitlines(keepends=True) if _family_of(line) in names)
    return list(text_string_to_metric_families(text))


def _family_of(line: str) -> str:
    """The family a line of the text format belongs to: <name> of "# HELP <name> ...", "# TYPE <name> ...",
    "<name>{labels} value" and of a counter's "<name>_total{labels} value"."""
    if line.startswith("# "):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 else ""
    name = line.split("{", 1)[0].split(" ", 1)[0]
    return name[:-len("_total")] if name.endswith("_total") else name


def server_gauge(metrics_url: str, name: str, timeout_s: float = 5.0) -> float | None:
    """The value of an unlabelled server-wide gauge, e.g. `nv_cpu_utilization` (fraction of all cores
    busy, 0..1, sampled by Triton every --metrics-interval-ms), or None when the server has none."""
    for family in _families(metrics_url, timeout_s):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    return None


def model_counters(metrics_url: str, model: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Return every sample of `model` (label model=<name>, summed over versions) by metric name.

    Counters are keyed by Triton's name (`nv_inference_count`, not the parser's `..._total`).

    E.g. {"nv_inference_count": 120.0, "nv_inference_exec_count": 15.0, ...}.
    Raises urllib.error.URLError when the endpoint cannot be reached.
    """
    return counters_by_model(metrics_url, timeout_s).get(model, {})


def counters_by_model(metrics_url: str, timeout_s: float = 5.0,
                      names: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """model_counters of every model from one read of the endpoint: {model: {metric name: value}}.
    One read and parse costs 1.4-3.2 ms of CPU on the reading side (8 kB of text, prometheus_client's
    parser): read once for several models; `names`, when given, the only metrics wanted (much cheaper:
    `_families`). Raises urllib.error.URLError when it cannot be reached."""
    by_model: dict[str, dict[str, float]] = {}
    for family in _families(metrics_url, timeout_s, names):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is not None:
                name = family.name if sample.name == f"{family.name}_total" else sample.name
                counters = by_model.setdefault(model, {})
                counters[name] = counters.get(name, 0.0) + sample.value
    return by_model


def average_batch_size(counters: dict[str, float]) -> float:
    """Average batch the dynamic batcher formed: nv_inference_count / nv_inference_exec_count
    (inferences = batch elements, executions = model runs; Triton's metrics documentation)."""
    executions = counters.get("nv_inference_exec_count", 0.0)
    return counters.get("nv_inference_count", 0.0) / executions if executions else 0.0


#: The local response cache's server-wide metrics (Triton 2.51, --cache-config local,...): hits, misses,
#: lookups, entries, evictions (counts) and util (fraction of the cache's bytes in use, 0..1). Triton
#: refreshes them every --metrics-interval-ms (2 s); a cached model's own `nv_cache_num_hits_per_model` and
#: `nv_cache_num_misses_per_model` (model_counters) count at once.
CACHE_METRICS = ("nv_cache_num_hits", "nv_cache_num_misses", "nv_cache_num_lookups", "nv_cache_num_entries",
                 "nv_cache_num_evictions", "nv_cache_util")


def cache_counters(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """{metric: value} of CACHE_METRICS without their `nv_cache_` prefix ({"num_hits": 3.0, ...,
    "util": 0.0002}); empty when the server runs without a response cache. Raises urllib.error.URLError
    when the endpoint cannot be reached."""
    wanted = set(CACHE_METRICS)
    values = {}
    for family in _families(metrics_url, timeout_s):
        for sample in family.samples:
            name = family.name if sample.name == f"{family.name}_total" else sample.name
            if name in wanted and not sample.labels:
                values[name.removeprefix("nv_cache_")] = sample.value
    return values
