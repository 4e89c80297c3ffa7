"""Validation runs: the simulation's prediction against perf_analyzer on the embedded tritonserver.

For each config (config.pbtxt as "default", or configs/<name>.pbtxt) the server is started with
`--model-config-name` and Triton's request trace on (TIMESTAMPS, every request), and for each fraction
of the config's capacity (from the profile measured in the same run: max over b <= max_batch_size of
b / exec(b)) perf_analyzer sends a fixed count of requests with Poisson arrivals, open loop (--async,
so a slow response never holds the next request back). Recorded per level:
  * measured: perf_analyzer's throughput and p50/p99 (all requests of the level), its warning when it
    could not keep the rate, the statistics extension's delta (batches formed, mean queue time);
  * from the trace: every request's queue time, and for each the part of it spent while no execution
    was running (the instance idle with requests waiting: the documented batcher never does that
    longer than max_queue_delay); resnet18_kit/tools/planner/validate_analysis.py reads it.
The predictions (`simulate` with Poisson arrivals at the level's rate, and again on the exact send
times perf_analyzer used) and the tables are resnet18_kit/tools/planner/validate_analysis.py's.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT
from resnet18_kit.tools.load.perf_analyzer import (EMPTY_EXPORT_ATTEMPTS, RESNET18_LOGITS_BYTES, LoadSpec, PerfAnalyzerError,
                                             error_summary, run_level)
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.observe.statistics import model_statistics, statistics_delta
from resnet18_kit.tools.planner.batcher import batcher_from_config
from resnet18_kit.tools.planner.cpu import MAX_ATTEMPTS, MAX_FOREIGN_SHARE, CpuAccount, wait_until_quiet
from resnet18_kit.tools.planner.profile import Profile
from resnet18_kit.tools.planner.search import device_capacity_rps
from resnet18_kit.tools.planner.validate_analysis import read_traces, split_levels, trace_summary
from resnet18_kit.progress import log_status
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

#: Pause between levels, so the trace can be split into levels by the gaps in its queue times
#: (validate_analysis.split_levels).
LEVEL_GAP_S = 3.0


def trace_args(trace_file: Path) -> tuple[str, ...]:
    """tritonserver flags tracing every request's timestamps into trace_file.<n> (500 per file). Removes the
    pieces an earlier run left at that path first: validate_analysis.read_traces merges every trace_file.*."""
    for stale in trace_file.parent.glob(trace_file.name + ".*"):
        stale.unlink()
    return (f"--trace-config=triton,file={trace_file}", "--trace-config=triton,log-frequency=500",
            "--trace-config=rate=1", "--trace-config=level=TIMESTAMPS", "--trace-config=count=-1")


def validate_config(repository: ModelRepository, model: str, name: str, profile: Profile,
                    fractions: tuple[float, ...], out_dir: Path, requests_per_level: int, min_level_s: float,
                    progress=log_status, rates: tuple[float, ...] = ()) -> list[dict]:
    """Serve `repository` with config variant `name` and measure each level of `model`: fractions of the
    config's capacity (or `rates`, req/s), >= requests_per_level requests and >= min_level_s s each. One row
    per level; status to progress(message, warning=, step=) (resnet18_kit.progress)."""
    config = ModelConfigView.for_variant(repository, model, name)  # what the server loads under this name
    batcher, instances, concurrent = batcher_from_config(config), config.instance_count(), config.concurrent_executions()
    capacity = device_capacity_rps(profile, batcher, concurrent)  # the rate limiter's executions bound it
    out = out_dir / name
    out.mkdir(parents=True, exist_ok=True)
    trace_file = out / "trace.json"
    server_config = config_on_free_ports(model_repository=repository.root,
                                         model_config_name=None if name == DEFAULT_VARIANT else name,
                                         extra_args=trace_args(trace_file))
    rows, failed = [], []
    segments: list[tuple[int, int | None]] = []  # every attempt in order: (requests served, kept row or None)
    progress(f"{name}: capacity {capacity:.1f} infer/s ({batcher.describe()}, {instances} instance(s), "
             f"{concurrent} executing at once)")
    with EmbeddedTritonServer(server_config, log_path=out / "tritonserver.log") as server:
        http, grpc = server.config.http_url, server.config.grpc_url
        levels = [(rate / capacity, rate) for rate in rates] or [(f, round(f * capacity, 2)) for f in fractions]
        for fraction, rate in levels:
            count = max(requests_per_level, int(rate * min_level_s))
            load = LoadSpec("request_rate", (rate,), shared_memory="system",
                            output_shm_bytes=RESNET18_LOGITS_BYTES,
                            request_count=count, async_mode=True)
            level_dir = out / f"rate-{rate:g}"
            for attempt in range(1, MAX_ATTEMPTS + 1):
                foreign_before = wait_until_quiet(session_id=server.process.pid)
                before = model_statistics(http, model)
                began, cpu = time.monotonic(), CpuAccount(server.process.pid).start()
                error = None
                try:
                    row = run_level(model, grpc, "grpc", load, rate, level_dir,
                                    export_attempts=EMPTY_EXPORT_ATTEMPTS)
                except PerfAnalyzerError as exc:  # e.g. requests refused: queue full
                    error = str(exc)
                wall_s, cpu_share = time.monotonic() - began, cpu.stop()
                stats = statistics_delta(before, model_statistics(http, model))
                time.sleep(LEVEL_GAP_S)
                if cpu_share["foreign"] <= MAX_FOREIGN_SHARE or attempt == MAX_ATTEMPTS:
                    break  # the last attempt is kept whatever it shared: its CPU figures say so
                progress(f"{name} {fraction:.0%}: other processes took {cpu_share['foreign']:.0%} of the cores; "
                         f"measuring again (attempt {attempt + 1})", warning=True)
                segments.append((stats["inference_count"], None))
            segments.append((stats["inference_count"], None if error else len(rows)))
            if error:
                progress(f"{name} {fraction:.0%} = {rate:g} req/s FAILED: {error_summary(error)}", warning=True, step=True)
                failed.append({"config": name, "fraction": fraction, "rate_rps": rate, "error": error,
                               "cpu": cpu_share, "server": stats})
                continue
            log = (level_dir / "perf_analyzer.log").read_text()
            delayed = next((line.strip() for line in log.splitlines() if "not able to keep up" in line), "")
            rows.append({"config": name, "fraction": fraction, "rate_rps": rate, "capacity_rps": capacity,
                         "requests": count, "wall_s": wall_s, "measured": asdict(row), "server": stats,
                         "cpu": cpu_share, "foreign_cpu_before": foreign_before, "attempts": attempt,
                         "perf_analyzer_delayed": delayed, "batcher": batcher.describe(),
                         "batcher_config": asdict(batcher), "instances": instances, "concurrent": concurrent,
                         "level_dir": str(level_dir)})
            progress(f"{name} {fraction:.0%} = {rate:g} req/s: {row.throughput:.1f} infer/s, p50 "
                     f"{row.p50_us / 1e3:.1f} ms, p99 {row.p99_us / 1e3:.1f} ms, batch {stats['average_batch']:.2f}, "
                     f"CPU ours {cpu_share['ours']:.0%} foreign {cpu_share['foreign']:.0%} steal {cpu_share['steal']:.0%}"
                     f"{'  [' + delayed + ']' if delayed else ''}", step=True)
    traced = split_levels(read_traces(trace_file, model), [count for count, _ in segments])
    for (_, kept), level in zip(segments, traced):
        if kept is not None:
            # the last run's requests (load.perf_analyzer.run_perf_analyzer may have run the level again)
            rows[kept]["trace"] = trace_summary(level[-rows[kept]["requests"]:], batcher)
    return rows + failed


