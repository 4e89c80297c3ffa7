"""Validation analysis: Triton's request trace, the simulation's predictions of each level, the tables.

resnet18_kit/tools/planner/validate.py measures the levels (perf_analyzer against the embedded tritonserver, Triton's
trace on); this module reads what they left and predicts each level with the model:
  * from the trace (`read_traces`, `split_levels`, `trace_summary`): every request's queue time, and for
    each the part of it spent while no execution was running (the instance idle with requests waiting:
    the documented batcher never does that longer than max_queue_delay), and the missed wake-ups;
  * predicted (`add_predictions`): `simulate` with Poisson arrivals at the level's rate (20,000
    requests), the config's batcher, the profile; and again on the exact send times perf_analyzer used
    (replayed trace);
  * `format_table`: the Markdown tables of docs/records/capacity.md (measured vs predicted, what the trace shows).
It starts no server: `resnet18-kit plan validate --predict-only` runs it on a saved
validation.json.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from resnet18_kit.tools.load.perf_analyzer import error_summary, load_profile_export
from resnet18_kit.tools.planner.arrivals import Poisson, send_times_s
from resnet18_kit.tools.planner.batcher import BatcherConfig, QueuePolicy
from resnet18_kit.tools.planner.profile import Profile
from resnet18_kit.tools.planner.search import speed_for
from resnet18_kit.tools.planner.simulator import LostWakeup, simulate

#: Queue-time histogram bins of the trace summary, milliseconds.
QUEUE_BINS_MS = [0, 5, 10, 25, 50, 100, 200, 400, 600, 1000, 1e9]


def read_traces(trace_file: Path, model: str, required: tuple[str, ...] = ("QUEUE_START", "COMPUTE_START")
                ) -> list[dict[str, int]]:
    """Every traced request of `model` that has the `required` timestamps: {timestamp name: ns}, merged by
    trace id, sorted by QUEUE_START. Triton's trace timestamps are CLOCK_MONOTONIC ns (time.monotonic_ns()
    in this process). An ensemble's own record has no COMPUTE_*: ask it for ("REQUEST_START", "QUEUE_START", "REQUEST_END")."""
    merged: dict[int, dict] = {}
    for path in sorted(trace_file.parent.glob(trace_file.name + "*")):
        text = path.read_text().strip()
        if not text:
            continue
        for entry in json.loads(text):
            record = merged.setdefault(entry["id"], {})
            if "model_name" in entry:
                record["model"] = entry["model_name"]
            for stamp in entry.get("timestamps", []):
                record[stamp["name"]] = int(stamp["ns"])
    requests = [r for r in merged.values() if r.get("model") == model and all(k in r for k in required)]
    return sorted(requests, key=lambda r: r["QUEUE_START"])


def split_levels(requests: list[dict], counts: list[int]) -> list[list[dict]]:
    """Cut the time-sorted traced requests into levels of `counts` requests: at the largest gaps between
    arrivals (validate.LEVEL_GAP_S pauses) when that gives the expected sizes, else by count from the end
    (anything before the first level, e.g. traced warmup, is left out)."""
    levels = len(counts)
    if len(requests) < sum(counts):
        return [[] for _ in counts]
    starts = np.array([r["QUEUE_START"] for r in requests])
    cuts = sorted(np.argsort(np.diff(starts))[-(levels - 1):] + 1) if levels > 1 else []
    parts = [requests[a:b] for a, b in zip([0, *cuts], [*cuts, len(requests)])]
    if [len(p) for p in parts] == list(counts):
        return parts
    tail = requests[len(requests) - sum(counts):]
    bounds = np.cumsum([0, *counts])
    return [tail[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def missed_wakeups(requests: list[dict], batcher: BatcherConfig, tolerance_s: float = 0.003) -> dict:
    """How often the batcher did not start the next batch when the documented rules say it must: at
    each execution end (an instance becomes free) with requests waiting, the rules start a batch at once if
    a preferred size is queued or the oldest waiting request is max_queue_delay old, else when it gets
    that old. A start more than `tolerance_s` later is a missed wake-up; each is classed by what ended it.

    Returns {"busy_completions", "missed", "probability", "rescued_by_arrival", "extra_wait_ms_p50",
    "extra_wait_ms_max"}."""
    executions = sorted({(r["COMPUTE_START"], r.get("COMPUTE_END", r["COMPUTE_START"])) for r in requests})
    queue_starts = np.array(sorted(r["QUEUE_START"] for r in requests)) / 1e9
    by_request = sorted(((r["QUEUE_START"] / 1e9, r["COMPUTE_START"] / 1e9) for r in requests))
    delay_s = batcher.max_queue_delay_us / 1e6
    starts = np.array([s for s, _ in executions]) / 1e9
    busy = missed = rescued = 0
    extra = []
    for _, end_ns in executions:
        end = end_ns / 1e9
        later = starts[starts >= end]
        if not later.size:
            continue
        next_start = later[0]  # the first batch started anywhere after this instance became free
        waiting = [q for q, c in by_request if q < end and c >= end]
        if not waiting:
            continue
        busy += 1
        due = end if (len(waiting) >= min(batcher.preferred) or min(waiting) + delay_s <= end) \
            else min(waiting) + delay_s
        if next_start - due > tolerance_s:
            missed += 1
            extra.append(next_start - due)
            arrivals = queue_starts[(queue_starts > due) & (queue_starts <= next_start)]
            rescued += int(arrivals.size > 0 and next_start - arrivals[-1] <= tolerance_s)
    return {"busy_completions": busy, "missed": missed, "probability": missed / busy if busy else 0.0,
            "rescued_by_arrival": rescued,
            "extra_wait_ms_p50": float(np.median(extra) * 1e3) if extra else 0.0,
            "extra_wait_ms_max": float(max(extra) * 1e3) if extra else 0.0}


def trace_summary(requests: list[dict], batcher: BatcherConfig, stall_threshold_s: float = 0.4) -> dict:
    """Queue-time distribution of one level's traced requests, the idle-instance part of each wait,
    the missed wake-ups (`missed_wakeups`), and the executions per batch size ("execution_ms":
    {batch: [executions, mean COMPUTE_START..COMPUTE_END ms]}).

    idle wait: the part of a request's queue time during which no execution was running (computed from
    the executions' COMPUTE_START..COMPUTE_END intervals; exact with one instance).
    """
    if not requests:
        return {}
    queue_s = np.array([(r["COMPUTE_START"] - r["QUEUE_START"]) / 1e9 for r in requests])
    executions = sorted({(r["COMPUTE_START"], r.get("COMPUTE_END", r["COMPUTE_START"])) for r in requests})
    starts = np.array([e[0] for e in executions]) / 1e9
    ends = np.array([e[1] for e in executions]) / 1e9
    idle_s = []
    for r in requests:
        a, b = r["QUEUE_START"] / 1e9, r["COMPUTE_START"] / 1e9
        busy = np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0, None).sum()
        idle_s.append(max(0.0, (b - a) - busy))
    idle_s = np.array(idle_s)
    size_of = Counter(r["COMPUTE_START"] for r in requests)  # an execution's requests share its start
    by_batch: dict[int, list[float]] = {}
    for start, end in executions:
        by_batch.setdefault(size_of[start], []).append((end - start) / 1e6)
    return {
        "requests": len(requests), "executions": len(executions),
        "average_batch": len(requests) / len(size_of),
        "queue_p50_ms": float(np.percentile(queue_s, 50) * 1e3),
        "queue_p99_ms": float(np.percentile(queue_s, 99) * 1e3),
        "queue_max_ms": float(queue_s.max() * 1e3),
        "stalled": int((queue_s > stall_threshold_s).sum()),
        "stalled_idle": int((idle_s > stall_threshold_s).sum()),
        "idle_wait_p99_ms": float(np.percentile(idle_s, 99) * 1e3),
        "queue_hist_ms": np.histogram(queue_s * 1e3, bins=QUEUE_BINS_MS)[0].tolist(),
        "missed_wakeups": missed_wakeups(requests, batcher),
        "execution_ms": {str(b): [len(d), float(np.mean(d))] for b, d in sorted(by_batch.items())},
    }


def timestamps_throughput(export: dict) -> float | None:
    """Requests / (last response - first send), seconds from perf_analyzer's own per-request timestamps
    (profile export, `load_profile_export`); None with fewer than 2 answered requests. perf_analyzer
    2.51's summary throughput for a --request-count run divides by a longer span (it came out 3-9% lower
    than this on every level of the validation), so both sides of the comparison use this definition
    (see `predict`)."""
    requests = [r for e in export["experiments"] for r in e["requests"] if r.get("response_timestamps")]
    if len(requests) < 2:
        return None
    first = min(r["timestamp"] for r in requests)
    last = max(r["response_timestamps"][-1] for r in requests)
    return len(requests) / ((last - first) / 1e9)


def predict(rate_rps: float, batcher, profile: Profile, instances: int, requests: int = 20000, seed: int = 1,
            arrivals_s: np.ndarray | None = None, lost_wakeup: LostWakeup | None = None,
            speed_under_load: bool = True, concurrent: int | None = None) -> dict:
    """The simulation's figures for one level: Poisson at rate_rps, or the given arrival times; with the
    profile's speed trace nearest to the level's load (rate / capacity) unless speed_under_load is False;
    `concurrent`: instances that execute at once (the rate limiter; None = all)."""
    if arrivals_s is None:
        arrivals_s = Poisson(rate_rps).arrivals(requests, 1, "random", np.random.default_rng(seed))
        warmup = 0.1
    else:
        warmup = 0.0  # perf_analyzer's figures cover every request of the level
    speed = speed_for(profile, batcher, concurrent or instances, rate_rps) if speed_under_load else None
    result = simulate(arrivals_s, batcher, profile, instances, seed=seed, warmup_fraction=warmup,
                      lost_wakeup=lost_wakeup, speed=speed, concurrent=concurrent)
    summary = {**result.summary(), "speed_utilization": speed.utilization if speed else None,
               "speed_factor": speed.mean if speed else None,
               "queue_p99_ms": float(np.percentile(result.queue_s, 99) * 1e3)
               if result.queue_s.size else 0.0}
    if warmup == 0.0 and result.completed == len(arrivals_s) > 1:
        # the replayed level, measured like `timestamps_throughput`: requests / (last answer - first send)
        span_s = float(np.max(arrivals_s + result.latencies_s) - arrivals_s[0])
        summary["throughput_rps"] = len(arrivals_s) / span_s
    return summary


def row_batcher(row: dict) -> BatcherConfig:
    """The BatcherConfig a validation row was measured with (stored as a dict in validation.json)."""
    fields = dict(row["batcher_config"])
    fields["queue"] = QueuePolicy(**fields["queue"])
    fields["preferred_batch_sizes"] = tuple(fields["preferred_batch_sizes"])
    return BatcherConfig(**fields)


def speed_factor(trace: dict, profile: Profile, instances: int) -> float | None:
    """The level's executions (Triton's trace) against the profile: mean over executions of the traced
    duration over the profile's time for that batch size (None without a trace)."""
    ratios = [(count, mean_ms / (profile.exec_s(int(b), instances) * 1e3))
              for b, (count, mean_ms) in (trace.get("execution_ms") or {}).items()
              if int(b) <= profile.max_batch_size(instances)]
    total = sum(c for c, _ in ratios)
    return sum(c * r for c, r in ratios) / total if total else None


def add_predictions(rows: list[dict], profile: Profile) -> list[dict]:
    """Predict every measured level (module doc) with the model: the documented batcher rules, the
    profile's speed under load (resnet18_kit/tools/planner/speed.py) and, for a config with a queue policy (no payload
    prefetching), Triton 2.51's lost wake-up at the probability measured on the traces of the config's
    OTHER levels (leave-one-out: a level's own trace never feeds its prediction; other configs' traces
    only when it has no other level). "predicted": Poisson at the level's rate, steady state;
    "predicted_replay": perf_analyzer's own send times, from an empty server, as measured. The same two
    with the documented rules alone (closed-loop table, no speed under load, no lost wake-up):
    "..._static"."""
    for i, row in enumerate(rows):
        if "error" in row:
            continue
        batcher, instances = row_batcher(row), row["instances"]
        concurrent = row.get("concurrent")  # absent in runs before it was recorded: every instance at once
        traced = [(j, r) for j, r in enumerate(rows) if j != i and (r.get("trace") or {}).get("missed_wakeups")]
        same = [r for j, r in traced if r["config"] == row["config"]]
        others = [r["trace"]["missed_wakeups"] for r in (same or [r for _, r in traced])]
        busy = sum(o["busy_completions"] for o in others)
        probability = sum(o["missed"] for o in others) / busy if busy else 0.0
        export = load_profile_export(Path(row["level_dir"]) / "profile.json")
        row["measured"].setdefault("throughput_perf_analyzer", row["measured"]["throughput"])
        row["export_truncated"] = bool(export.get("truncated"))
        if row["export_truncated"]:
            # perf_analyzer cut the export: the requests kept are not the first N, so neither their span
            # nor their send times stand for the level; its summary throughput stands in, no replay
            export = {"experiments": []}
        sends, measured_rps = send_times_s(export), timestamps_throughput(export)
        row["measured"]["throughput"] = measured_rps or row["measured"]["throughput_perf_analyzer"]
        row["speed_factor_measured"] = speed_factor(row.get("trace") or {}, profile, concurrent or instances)
        # Triton loses wake-ups only without payload prefetching, i.e. with a queue policy (docs/capacity.md)
        stalls = batcher.dynamic_batching and batcher.queue.disables_prefetching
        row["lost_wakeup_probability"] = probability if stalls else None
        for suffix, lost_wakeup, speed in (("", LostWakeup(probability) if stalls else None, True),
                                           ("_static", None, False)):
            row["predicted" + suffix] = predict(row["rate_rps"], batcher, profile, instances,
                                                lost_wakeup=lost_wakeup, speed_under_load=speed,
                                                concurrent=concurrent)
            row["predicted_replay" + suffix] = predict(row["rate_rps"], batcher, profile, instances,
                                                       arrivals_s=sends, lost_wakeup=lost_wakeup,
                                                       speed_under_load=speed,
                                                       concurrent=concurrent) if sends.size > 10 else {}
        row["speed_factor_model"] = row["predicted"].get("speed_factor")
    return rows


def errors(row: dict, key: str = "predicted") -> dict:
    """Relative error of a prediction vs the measurement: throughput, p50, p99 (fractions, signed)."""
    m, p = row["measured"], row.get(key) or {}
    if not p:
        return {}
    return {"throughput": p["throughput_rps"] / m["throughput"] - 1,
            "p50": p["p50_ms"] / (m["p50_us"] / 1e3) - 1, "p99": p["p99_ms"] / (m["p99_us"] / 1e3) - 1}


def within_target(row: dict, key: str) -> bool:
    """The issue's target: throughput within 10% and p99 within 25% of the measurement."""
    e = errors(row, key)
    return bool(e) and abs(e["throughput"]) <= 0.10 and abs(e["p99"]) <= 0.25


def _prediction_table(rows: list[dict], suffix: str) -> list[str]:
    """One Markdown table of measured vs predicted[suffix] (steady state and replayed sends)."""
    def cell(m: float, p: float) -> str:
        return f"{m:.1f} / {p:.1f} ({p / m - 1:+.0%})"

    steady, replay = "predicted" + suffix, "predicted_replay" + suffix
    lines = ["| config | load | rate req/s | speed trace | P(missed) | throughput meas / pred | p50 ms meas / pred "
             "| p99 ms meas / pred | measured sends: throughput, p99 pred | target met (steady / sends) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | {row['fraction']:.0%} | {row['rate_rps']:.1f} | | | perf_analyzer "
                         f"failed: {error_summary(row['error'])[:80]} | | | | |")
            continue
        m, p = row["measured"], row.get(steady) or {}
        if not p:
            continue
        trace = p.get("speed_utilization")
        lines.append(
            f"| {row['config']} | {row['fraction']:.0%} | {row['rate_rps']:.1f} "
            f"| {f'{trace:.0%}' if trace is not None else 'none'} "
            f"| {_probability(row.get('lost_wakeup_probability') if suffix == '' else None)} "
            f"| {cell(m['throughput'], p['throughput_rps'])} | {cell(m['p50_us'] / 1e3, p['p50_ms'])} "
            f"| {cell(m['p99_us'] / 1e3, p['p99_ms'])} "
            f"| {_replayed(row, replay)} "
            f"| {'yes' if within_target(row, steady) else 'NO'} / {'yes' if within_target(row, replay) else 'NO'} |")
    return lines


def _replayed(row: dict, key: str) -> str:
    """The replayed-sends cell: predicted throughput and p99 with their errors, or why there is none."""
    r, e = row.get(key) or {}, errors(row, key)
    if not e:
        return "export cut short: no replay" if row.get("export_truncated") else "-"
    return f"{r['throughput_rps']:.1f} ({e['throughput']:+.0%}), {r['p99_ms']:.1f} ({e['p99']:+.0%})"


def _probability(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _factor(value: float | None) -> str:
    return f"x{value:.2f}" if value else "-"


def format_table(rows: list[dict]) -> str:
    """The validation tables (Markdown): predicted vs measured (the model; the documented rules alone),
    and what the trace shows."""
    lines = ["The model (speed under load; lost wake-up where the config has a queue policy, P measured on "
             "the config's other levels):", "", *_prediction_table(rows, "")]
    lines += ["", "The documented batcher rules alone (closed-loop profile table, no speed under load, no lost "
              "wake-up):", "", *_prediction_table(rows, "_static")]
    lines += ["", "What Triton's trace shows (every request of the level):", "",
              "| config | load | batch meas / pred | queue p50 / p99 ms (trace) | queued > 400 ms "
              "(with the instance idle) | missed wake-ups / busy completions (rescued by an arrival) "
              "| execution time / profile: trace, speed model | CPU other processes / steal | perf_analyzer |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            continue
        t, mw = row.get("trace") or {}, (row.get("trace") or {}).get("missed_wakeups") or {}
        lines.append(
            f"| {row['config']} | {row['fraction']:.0%} | {row['server']['average_batch']:.2f} / "
            f"{row['predicted']['average_batch']:.2f} | {t.get('queue_p50_ms', float('nan')):.1f} / "
            f"{t.get('queue_p99_ms', float('nan')):.1f} | {t.get('stalled', '?')} ({t.get('stalled_idle', '?')}) "
            f"of {t.get('requests', '?')} | {mw.get('missed', '?')} / {mw.get('busy_completions', '?')} "
            f"({mw.get('rescued_by_arrival', '?')}) | {_factor(row.get('speed_factor_measured'))}, "
            f"{_factor(row.get('speed_factor_model'))} | {row['cpu']['foreign']:.0%} / {row['cpu']['steal']:.0%} "
            f"| {row['perf_analyzer_delayed'] or 'kept the rate'} |")
    return "\n".join(lines)
