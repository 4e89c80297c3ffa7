"""The two-stage prediction (resnet18_kit/tools/planner/ensemble.py) against the real ensemble on photos.

For each config name (served with --model-config-name; a model without configs/<name>.pbtxt serves its
config.pbtxt, as tritonserver does), from a scratch repository in <out> that links the model repository
and adds the planned configs of --configs-from (resnet18-kit plan ensemble --out DIR): the stages'
configs say the instance counts, how many of them execute at once under the rate limiter, and the
batchers; the ensemble profile gives the stage times and interference of the pair of instance counts
that execute at once, hence the capacity; each level is a fraction of it, sent by perf_analyzer open loop
(--async, Poisson) on the sample photos over gRPC, REQUESTS at least. Measured: perf_analyzer's p50/p99
for the level (its summary figures: the per-request export would hold every photo again), and the
throughput from Triton's trace of every request (TIMESTAMPS): the level's requests / (last REQUEST_END -
first REQUEST_START), the level's requests being those the server received while its perf_analyzer ran.
perf_analyzer's own throughput for a fixed request count is the count over the time rounded up to whole
seconds (400 requests answered in 11.0 to 12.0 s: 33.3 images/s; up to 9% low at a 95% level) and is kept
as "throughput_perf_analyzer". Predicted: simulate_ensemble at the same rate, Poisson, 10,000 requests.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from resnet18_kit.contract import DEFAULT_VARIANT, ENSEMBLE_MODEL, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.tools.load.perf_analyzer import LoadSpec, PerfAnalyzerError, run_level
from resnet18_kit.tools.load.photos import photo_set, write_input_data
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.tools.planner.arrivals import Poisson
from resnet18_kit.tools.planner.batcher import batcher_from_config
from resnet18_kit.tools.planner.cpu import CpuAccount, wait_until_quiet
from resnet18_kit.tools.planner.ensemble import EnsembleProfile, StageConfig, simulate_ensemble, stage_capacity_rps
from resnet18_kit.tools.planner.validate import trace_args
from resnet18_kit.tools.planner.validate_analysis import read_traces
from resnet18_kit.progress import log_status
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

#: Targets of the validation: throughput within 10 %, p99 within 25 % of the measured figure.
THROUGHPUT_TOLERANCE = 0.10
P99_TOLERANCE = 0.25
PREDICTED_REQUESTS = 10000


def scratch_repository(source: ModelRepository, planned: Path | None, target: Path) -> ModelRepository:
    """`target`: every model of `source` linked entry by entry, its configs/ folder rebuilt from the source's
    and the planned <planned>/<model>/configs/*.pbtxt (a planned name wins)."""
    shutil.rmtree(target, ignore_errors=True)
    for model_dir in sorted(p for p in source.root.iterdir() if (p / "config.pbtxt").is_file()):
        folder = target / model_dir.name
        folder.mkdir(parents=True)
        for entry in model_dir.iterdir():
            if entry.name != "configs":
                (folder / entry.name).symlink_to(entry.resolve())
        configs = [*(model_dir / "configs").glob("*.pbtxt"),
                   *((planned / model_dir.name / "configs").glob("*.pbtxt") if planned else [])]
        for config in configs:
            (folder / "configs").mkdir(exist_ok=True)
            (folder / "configs" / config.name).unlink(missing_ok=True)
            (folder / "configs" / config.name).symlink_to(config.resolve())
    return ModelRepository(target)


def served_stages(repository: ModelRepository, name: str) -> tuple[StageConfig, StageConfig]:
    """(preprocess, network) as tritonserver serves them under `name`."""
    pre = ModelConfigView.for_variant(repository, PREPROCESS_MODEL, name)
    net = ModelConfigView.for_variant(repository, ONNX_MODEL, name)
    return (StageConfig(batcher_from_config(pre), pre.instance_count(), pre.concurrent_executions()),
            StageConfig(batcher_from_config(net), net.instance_count(), net.concurrent_executions()))


def capacity_rps(profile: EnsembleProfile, pre: StageConfig, net: StageConfig) -> float:
    """Images/s the pair can serve: the slower stage's capacity with the pair's factors. KeyError naming
    a pair the profile lacks."""
    pair = profile.pair(pre.slots, net.slots)
    pre_profile, net_profile = profile.stage_profiles(pair, pre.batcher.max_batch_size)
    return min(stage_capacity_rps(pre_profile, pre), stage_capacity_rps(net_profile, net))


def predict(profile: EnsembleProfile, pre: StageConfig, net: StageConfig, rate_rps: float, seed: int = 1) -> dict:
    arrivals = Poisson(rate_rps).arrivals(PREDICTED_REQUESTS, 1, "round_robin", np.random.default_rng(seed))
    result = simulate_ensemble(arrivals, profile, pre, net, seed=seed, load=rate_rps / capacity_rps(profile, pre, net))
    return {"throughput": result.throughput_rps, "p50_ms": result.percentile_ms(50),
            "p99_ms": result.percentile_ms(99), "refused": result.refused}


def validate_ensemble(source: ModelRepository, profile: EnsembleProfile, names: list[str], fractions: tuple[float, ...],
                      out: Path, requests_per_level: int = 400, min_level_s: float = 10.0,
                      planned: Path | None = None, results: Path | None = None, progress=log_status,
                      rates: tuple[float, ...] = ()) -> list[dict]:
    """Every config name x level (module doc; `rates`, images/s, instead of fractions when given); one row per
    level with measured and predicted figures."""
    repository = scratch_repository(source, planned, out / "repository")
    photos = write_input_data(photo_set("sample", results or out), out / "photos.json")
    rows = []
    for name in names:
        pre, net = served_stages(repository, name)
        capacity = capacity_rps(profile, pre, net)
        trace_file = out / name / "trace.json"
        server_config = config_on_free_ports(model_repository=repository.root,
                                             model_config_name=None if name == DEFAULT_VARIANT else name,
                                             extra_args=trace_args(trace_file))
        progress(f"ensemble {name}: preprocess {pre.instances}, network {net.instances} instance(s) "
                 f"({net.slots} executing at once); capacity {capacity:.1f} images/s")
        config_rows = []
        with EmbeddedTritonServer(server_config, log_path=out / name / "tritonserver.log") as server:
            grpc = server.config.grpc_url
            run_level(ENSEMBLE_MODEL, grpc, "grpc", LoadSpec("concurrency", (4,), input_data=photos,
                                                              profile_export=False, request_count=40),
                      4, out / name / "warmup")
            levels = [(rate / capacity, rate) for rate in rates] or [(f, round(f * capacity, 2)) for f in fractions]
            for fraction, rate in levels:
                count = max(requests_per_level, int(rate * min_level_s))
                load = LoadSpec("request_rate", (rate,), input_data=photos, profile_export=False,
                                request_count=count, async_mode=True)
                wait_until_quiet(session_id=server.process.pid)
                cpu, began = CpuAccount(server.process.pid).start(), time.monotonic()
                row = {"config": name, "fraction": fraction, "rate_rps": rate, "capacity_rps": capacity,
                       "requests": count, "preprocess_instances": pre.instances, "network_instances": net.instances,
                       "network_concurrent": net.slots,
                       "network_batcher": net.batcher.describe()}
                began_ns = time.monotonic_ns()
                try:
                    measured = run_level(ENSEMBLE_MODEL, grpc, "grpc", load, rate, out / name / f"rate-{rate:g}")
                    row["measured"] = {"throughput": measured.throughput, "throughput_perf_analyzer": measured.throughput,
                                       "p50_ms": measured.p50_us / 1e3, "p99_ms": measured.p99_us / 1e3}
                except PerfAnalyzerError as exc:
                    row["error"] = exc.summary
                row["window_ns"] = [began_ns, time.monotonic_ns()]
                row["wall_s"], row["cpu"] = time.monotonic() - began, cpu.stop()
                row["predicted"] = predict(profile, pre, net, rate)
                config_rows.append(row)
        traced = read_traces(trace_file, ENSEMBLE_MODEL, ("REQUEST_START", "QUEUE_START", "REQUEST_END"))
        for row in config_rows:  # the server has stopped: Triton has written its whole trace
            if row.get("measured"):
                throughput, row["traced_requests"] = traced_throughput(traced, *row["window_ns"])
                if row["traced_requests"] == row["requests"]:
                    row["measured"]["throughput"] = throughput
            rows.append(row)
            progress(format_row(row), step=True)
    return rows


def traced_throughput(requests: list[dict], began_ns: int, ended_ns: int) -> tuple[float, int]:
    """(images/s, requests) of the traced ensemble requests (`read_traces`) that the server received in
    [began_ns, ended_ns] (one level's perf_analyzer run; CLOCK_MONOTONIC ns, the clock of Triton's trace):
    their count / (last REQUEST_END - first REQUEST_START); (0.0, count) for fewer than two."""
    level = [r for r in requests if began_ns <= r["REQUEST_START"] <= ended_ns]
    if len(level) < 2:
        return 0.0, len(level)
    span_ns = max(r["REQUEST_END"] for r in level) - min(r["REQUEST_START"] for r in level)
    return len(level) / (span_ns / 1e9), len(level)


def predict_again(rows: list[dict], profile: EnsembleProfile, out: Path) -> list[dict]:
    """The rows of an earlier `validate_ensemble` into `out`, each level predicted again from `profile`
    with the configs as served then (the copy of the repository it left in <out>/repository)."""
    repository = ModelRepository(out / "repository")
    for row in rows:
        pre, net = served_stages(repository, row["config"])
        row["predicted"] = predict(profile, pre, net, row["rate_rps"])
    return rows


def error(measured: float, predicted: float) -> float:
    return predicted / measured - 1 if measured else float("inf")


def met(row: dict) -> bool:
    m, p = row.get("measured"), row["predicted"]
    return bool(m) and abs(error(m["throughput"], p["throughput"])) <= THROUGHPUT_TOLERANCE and abs(
        error(m["p99_ms"], p["p99_ms"])) <= P99_TOLERANCE


def format_row(row: dict) -> str:
    m, p = row.get("measured"), row["predicted"]
    head = f"| {row['config']} | {row['fraction']:.0%} | {row['rate_rps']:.1f} "
    if not m:
        return head + f"| perf_analyzer failed: {row.get('error', '')} | | | |"
    return (head + f"| {m['throughput']:.1f} / {p['throughput']:.1f} ({error(m['throughput'], p['throughput']):+.0%}) "
            f"| {m['p50_ms']:.1f} / {p['p50_ms']:.1f} ({error(m['p50_ms'], p['p50_ms']):+.0%}) "
            f"| {m['p99_ms']:.1f} / {p['p99_ms']:.1f} ({error(m['p99_ms'], p['p99_ms']):+.0%}) "
            f"| {'yes' if met(row) else 'NO'} |")


def format_table(rows: list[dict]) -> str:
    """Measured / predicted per level, the error in brackets; 'target met': throughput within 10 % and p99
    within 25 %."""
    lines = ["| config | load | rate img/s | throughput meas / pred | p50 ms meas / pred | p99 ms meas / pred "
             "| target met |", "|---|---|---|---|---|---|---|"]
    lines += [format_row(r) for r in rows]
    lines.append(f"{sum(met(r) for r in rows)} of {len(rows)} levels within both targets")
    return "\n".join(lines)
