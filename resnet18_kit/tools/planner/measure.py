"""Measure a profile through the real server: perf_analyzer at fixed batch sizes (`-b`).

How, and why this way rather than from the per-batch-size statistics of a loaded run:
  * the model is served from a scratch repository (`<out>/repository`, the version folder linked, the
    config derived from the model's config.pbtxt) with NO dynamic batcher and max_batch_size = the
    largest size to measure: every request of `-b B` is then exactly one execution of batch B, whereas
    a batcher would merge requests into sizes the profile did not ask for, and a loaded run only yields
    the sizes the batcher happened to form;
  * `perf_analyzer -b B --concurrency-range 2n` keeps every one of the n instances busy with one
    request waiting behind it, so an execution starts as soon as the previous one ends, as under load.
    The execution time per batch is then the instance's cycle time n x B / throughput: it includes what
    the server spends per execution outside the model (stub round trip, response sending), which the
    statistics extension's compute times leave out (both are recorded);
  * the standard deviation of a batch's time is that of the gaps between consecutive responses
    (profile export) with one instance; with n > 1 it is the one-instance coefficient of variation
    times the mean (stated in the profile's source);
  * each measurement waits for other processes to leave the cores (resnet18_kit/tools/planner/cpu.py) and is done again,
    up to 3 times, when they took more than 15% of them meanwhile (the shares are kept in the profile);
  * the fixed per-request overhead is the median latency of lone batch-1 requests (concurrency 1)
    minus the batch-1 execution time: client, protocol and server front end;
  * the speed under load (resnet18_kit/tools/planner/speed.py): batch-1 requests open loop (Poisson) for SPEED_SECONDS
    at each of SPEED_UTILIZATIONS of the batch-1 capacity, between closed-loop runs (every instance
    busy) of SPEED_CLOSED_SECONDS, the statistics extension polled every SPEED_WINDOW_S; each window's
    mean compute_infer per execution over the closed-loop runs' mean is one factor (`measure_speed`).
The server ceiling (requests/s through protocol and batcher whatever the model) is not measured here:
it comes from the trivial-model run of `resnet18-kit bench run` (<results>/bench-*/summary.json), see
`server_ceiling_from_bench`.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from resnet18_kit.observe.machine import machine_info
from resnet18_kit.observe.model_config import ModelConfigView, output_row_bytes
from resnet18_kit.tools.load.perf_analyzer import (EMPTY_EXPORT_ATTEMPTS, LoadSpec, PerfAnalyzerError, command, load_profile_export,
                                 parse_csv, run_level, run_perf_analyzer)
from resnet18_kit.progress import log_status
from resnet18_kit.observe.statistics import ExecutionSampler, model_statistics, statistics_delta
from resnet18_kit.contract import DEFAULT_VARIANT, TRITON_VERSION
from resnet18_kit.tools.planner.batcher import BatcherConfig
from resnet18_kit.tools.planner.cpu import MAX_ATTEMPTS, MAX_FOREIGN_SHARE, CpuAccount, wait_until_quiet
from resnet18_kit.tools.planner.pbtxt import planned_config, write_config
from resnet18_kit.tools.planner.profile import BatchTiming, Profile
from resnet18_kit.tools.planner.speed import SpeedTrace, mean_execution_ms, window_factors
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.tools.load.results import bench_summaries

#: Responses per instance left out of the profile at the start of each batch size's run.
WARMUP_RESPONSES = 2
#: Speed under load: open-loop loads measured (fractions of capacity; 1.0, closed loop, always), the
#: length of each run and of each window.
SPEED_UTILIZATIONS = (0.25, 0.5, 0.75)
SPEED_SECONDS = 20.0
SPEED_CLOSED_SECONDS = 10.0
SPEED_WINDOW_S = 1.0

def instance_parameters(base_parameters: dict[str, str], instances: int) -> dict[str, str]:
    """Per-instance-count parameters: with an `intra_op_threads` parameter (ONNX Runtime in this
    repository), n instances get cores // n threads each, so they do not oversubscribe the cores
    (onnxruntime_backend issue 34); one instance keeps the config's value."""
    if "intra_op_threads" in base_parameters and instances > 1:
        return {"intra_op_threads": str(max(1, (os.cpu_count() or 1) // instances))}
    return {}


def scratch_repository(model: str, out_dir: Path, max_batch: int, instances: int,
                       source_repository: ModelRepository, variant: str = DEFAULT_VARIANT
                       ) -> tuple[Path, dict[str, str]]:
    """A model repository holding only `model` of `source_repository` (its config `variant`), without
    dynamic batching, with `instances` instances and max_batch_size `max_batch`; the version folder is a
    link to the real one. Returns (repository path, the per-instance parameters used)."""
    base = ModelConfigView.for_variant(source_repository, model, variant)
    params = instance_parameters(base.parameters, instances)
    config = planned_config(base.proto, BatcherConfig(max_batch_size=max_batch, dynamic_batching=False), instances,
                            params)
    del config.model_warmup[:]  # measured runs warm it up; keeps start-up short
    repository = out_dir / "repository"
    model_dir = repository / model
    model_dir.mkdir(parents=True, exist_ok=True)
    for version in (source_repository.root / model).iterdir():
        if version.is_dir() and version.name.isdigit() and not (model_dir / version.name).exists():
            (model_dir / version.name).symlink_to(version.resolve())
    write_config(config, ModelRepository(repository).config_path(model),
                 header=f"{model}: profile-measurement copy (resnet18-kit plan profile), no dynamic batcher")
    return repository, params


def run_fixed_batch(url: str, model: str, batch: int, concurrency: int, requests: int, out_dir: Path,
                    row_bytes: int, timeout_s: float = 600.0) -> dict:
    """One perf_analyzer run: `requests` requests of batch `batch` at `concurrency`, over gRPC with
    system shared memory. Returns the PerfRow fields plus the response times (s) of the profile export."""
    out_dir.mkdir(parents=True, exist_ok=True)
    load = LoadSpec("concurrency", (concurrency,), shared_memory="system",
                    output_shm_bytes=row_bytes * batch, request_count=requests)
    cmd = command(model, url, "grpc", load, concurrency, out_dir, count=requests) + ["-b", str(batch)]
    (out_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    result = run_perf_analyzer(cmd, out_dir, timeout_s, export_attempts=EMPTY_EXPORT_ATTEMPTS)
    if result.returncode != 0:
        tail = "\n".join((out_dir / "perf_analyzer.log").read_text().splitlines()[-8:])
        raise PerfAnalyzerError(f"perf_analyzer -b {batch} exited {result.returncode}:\n{tail}")
    answered = [r for e in load_profile_export(out_dir / "profile.json")["experiments"] for r in e["requests"]
                if r.get("response_timestamps")]
    if not answered:
        raise PerfAnalyzerError(f"perf_analyzer -b {batch} left its profile export empty ({out_dir / 'profile.json'})")
    (row,) = parse_csv(out_dir / "perf.csv")
    record = asdict(row)
    sends = [r["timestamp"] / 1e9 for r in answered]
    responses = [r["response_timestamps"][0] / 1e9 for r in answered]
    record["latencies_s"] = sorted(np.subtract(responses, sends).tolist())
    record["responses_s"] = sorted(responses)
    return record


def measure_speed(grpc_url: str, http_url: str, model: str, instances: int, exec1_ms: float, out_dir: Path,
                  row_bytes: int, session_id: int | None = None,
                  progress=log_status) -> tuple[tuple[SpeedTrace, ...], dict]:
    """The speed traces of one instance count (module doc). Closed-loop runs (SPEED_CLOSED_SECONDS)
    alternate with open-loop runs at each SPEED_UTILIZATIONS fraction of the batch-1 capacity
    (instances / exec1_ms): closed, 25%, closed, 50%, closed, 75%, closed. An open run's factors are
    relative to the mean of the closed runs just before and after it, so the machine's drift over the
    minutes of the measurement (this VM: +-20%) is not taken for an effect of the load; the closed
    runs' windows, relative to all closed runs' mean, are the 100% trace. Needs a server without dynamic
    batching (every request one execution of batch 1); session_id: the server's, for the CPU accounting.
    Returns (traces ascending by utilization, details)."""
    capacity_rps = instances / (exec1_ms / 1e3)
    runs: list[tuple[float, list[tuple[int, int]], float]] = []  # (utilization, snapshots, mean ms)
    details: dict = {"runs": []}
    for utilization in (1.0, *[u for open_u in SPEED_UTILIZATIONS for u in (open_u, 1.0)]):
        wait_until_quiet(session_id=session_id)
        cpu = CpuAccount(session_id).start()
        with ExecutionSampler(http_url, model, SPEED_WINDOW_S) as poller:
            if utilization == 1.0:
                run_fixed_batch(grpc_url, model, 1, 2 * instances, int(SPEED_CLOSED_SECONDS * capacity_rps),
                                out_dir / "closed", row_bytes)
            else:
                rate = round(utilization * capacity_rps, 2)
                load = LoadSpec("request_rate", (rate,), shared_memory="system", output_shm_bytes=row_bytes,
                                request_count=int(SPEED_SECONDS * rate), async_mode=True)
                run_level(model, grpc_url, "grpc", load, rate, out_dir / f"open-{utilization:g}")
        mean_ms = mean_execution_ms(poller.samples[0], poller.samples[-1])
        runs.append((utilization, poller.samples, mean_ms))
        details["runs"].append({"utilization": utilization, "mean_compute_ms": mean_ms, "cpu": cpu.stop()})
    means = [mean_ms for _, _, mean_ms in runs]
    closed_ms = float(np.mean([mean_ms for u, _, mean_ms in runs if u == 1.0]))
    closed = [f for u, samples, _ in runs if u == 1.0 for f in window_factors(samples, closed_ms)]
    traces = [SpeedTrace(1.0, SPEED_WINDOW_S, tuple(closed))] if closed else []
    for k, (utilization, samples, _) in enumerate(runs):
        if utilization == 1.0:
            continue
        baseline_ms = (means[k - 1] + means[k + 1]) / 2
        factors = window_factors(samples, baseline_ms)
        if factors:
            traces.append(SpeedTrace(utilization, SPEED_WINDOW_S, tuple(factors)))
        progress(f"profile: {instances} instance(s), speed at {utilization:.0%} load: mean execution "
                 f"{means[k]:.1f} ms = x{means[k] / baseline_ms:.2f} the closed-loop runs around it "
                 f"({means[k - 1]:.1f}, {means[k + 1]:.1f} ms); windows x{min(factors, default=0):.2f}"
                 f"..x{max(factors, default=0):.2f}", step=True)
    progress(f"profile: {instances} instance(s), closed loop: mean execution {closed_ms:.1f} ms, windows "
             f"x{min(closed, default=0):.2f}..x{max(closed, default=0):.2f}", step=True)
    return tuple(sorted(traces, key=lambda t: t.utilization)), details


def measure_profile(model: str, batch_sizes: tuple[int, ...], instance_counts: tuple[int, ...], out_dir: Path,
                    source_repository: ModelRepository, executions: int = 12, server_ceiling_rps: float = 0.0,
                    speed_under_load: bool = True, progress=log_status, variant: str = DEFAULT_VARIANT) -> Profile:
    """Measure `model` of `source_repository` (its config `variant`, e.g. "int8"): its profile for each
    instance count (one server start each) and batch size, and (speed_under_load, with batch 1 among the
    sizes) its speed traces (`measure_speed`).

    executions: back-to-back executions measured per instance and batch size (after 2 discarded).
    Writes perf_analyzer's files under out_dir/<instances>x/b<B>/ and returns the Profile. Status lines go
    to progress(message, warning=, step=) (resnet18_kit.progress): step for each finished measurement (what
    planner.__main__.profile_runs counts), warning for a measurement repeated because of other load.
    """
    started = datetime.datetime.now(datetime.timezone.utc)
    row_bytes = output_row_bytes(ModelConfigView.for_variant(source_repository, model, variant).proto)
    timings: dict[int, dict[int, BatchTiming]] = {}
    details: dict = {"runs": {}, "instance_parameters": {}}
    overhead_us = 0.0
    speed: dict[int, tuple[SpeedTrace, ...]] = {}
    for instances in instance_counts:
        level_dir = out_dir / f"{instances}x"
        repository, params = scratch_repository(model, level_dir, max(batch_sizes), instances, source_repository,
                                                variant)
        details["instance_parameters"][str(instances)] = params
        server_config = config_on_free_ports(model_repository=repository)
        progress(f"profile: {instances} instance(s): starting tritonserver")
        with EmbeddedTritonServer(server_config, log_path=level_dir / "tritonserver.log") as server:
            url, http = server.config.grpc_url, server.config.http_url
            timings[instances] = {}
            for batch in batch_sizes:
                concurrency = 2 * instances
                requests = instances * (executions + WARMUP_RESPONSES + 1)
                for attempt in range(1, MAX_ATTEMPTS + 1):
                    wait_until_quiet(session_id=server.process.pid)
                    before = model_statistics(http, model)
                    began, cpu = time.monotonic(), CpuAccount(server.process.pid).start()
                    record = run_fixed_batch(url, model, batch, concurrency, requests, level_dir / f"b{batch}",
                                             row_bytes)
                    cpu_share = cpu.stop()
                    stats = statistics_delta(before, model_statistics(http, model))
                    if cpu_share["foreign"] <= MAX_FOREIGN_SHARE or attempt == MAX_ATTEMPTS:
                        break
                    progress(f"profile: batch {batch}: other processes took {cpu_share['foreign']:.0%} of the "
                             f"cores; measuring again (attempt {attempt + 1})", warning=True)
                # Steady state: the gaps between consecutive responses after the first WARMUP_RESPONSES
                # (first executions of a shape are slower: allocations). n instances complete one request
                # every cycle / n on average.
                gaps = np.diff(record["responses_s"])[WARMUP_RESPONSES * instances:]
                cycle_s = instances * float(gaps.mean()) if gaps.size else instances * batch / record["throughput"]
                std_s = float(np.std(gaps)) if instances == 1 and gaps.size > 2 else float("nan")
                timings[instances][batch] = BatchTiming(cycle_s * 1e3, std_s * 1e3, stats["execution_count"])
                server_exec_ms = (stats["compute_input_us"] + stats["compute_infer_us"]
                                  + stats["compute_output_us"]) / 1e3
                details["runs"][f"{instances}x/b{batch}"] = {
                    "throughput": record["throughput"], "cycle_ms": cycle_s * 1e3, "std_ms": std_s * 1e3,
                    "server_compute_ms": server_exec_ms, "batch_executions": stats["batch_executions"],
                    "p50_ms": record["p50_us"] / 1e3, "wall_s": time.monotonic() - began, "cpu": cpu_share,
                    "attempts": attempt}
                progress(f"profile: {instances} instance(s), batch {batch}: cycle {cycle_s * 1e3:.1f} ms "
                         f"(server compute {server_exec_ms:.1f} ms); CPU ours {cpu_share['ours']:.0%}, "
                         f"others {cpu_share['foreign']:.0%}, steal {cpu_share['steal']:.0%}", step=True)
            if instances == min(instance_counts):
                for attempt in range(1, MAX_ATTEMPTS + 1):
                    wait_until_quiet(session_id=server.process.pid)
                    cpu = CpuAccount(server.process.pid).start()
                    record = run_fixed_batch(url, model, 1, 1, max(40, executions), level_dir / "lone", row_bytes)
                    if cpu.stop()["foreign"] <= MAX_FOREIGN_SHARE:
                        break
                lone_ms = float(np.median(record["latencies_s"])) * 1e3
                overhead_us = max(0.0, (lone_ms - timings[instances][1].mean_ms) * 1e3) if 1 in timings[
                    instances] else 0.0
                details["lone_request_p50_ms"] = lone_ms
                progress(f"profile: lone batch-1 request p50 {lone_ms:.1f} ms -> overhead {overhead_us:.0f} us",
                         step=True)
            if speed_under_load and 1 in timings[instances]:
                speed[instances], details.setdefault("speed_under_load", {})[str(instances)] = measure_speed(
                    url, http, model, instances, timings[instances][1].mean_ms, level_dir / "speed", row_bytes,
                    server.process.pid, progress)
    # Standard deviation where it could not be measured: the one-instance coefficient of variation.
    one = timings.get(1, {})
    cvs = [t.std_ms / t.mean_ms for t in one.values() if t.std_ms == t.std_ms and t.mean_ms > 0]
    cv = float(np.median(cvs)) if cvs else 0.0
    for instances, by_batch in timings.items():
        for batch, t in by_batch.items():
            if t.std_ms != t.std_ms:
                by_batch[batch] = BatchTiming(t.mean_ms, cv * t.mean_ms, t.executions)
    machine = machine_info(TRITON_VERSION)
    if variant != DEFAULT_VARIANT:
        details["variant"] = variant
    profile = Profile(
        model=model, timings=timings, overhead_us=overhead_us, server_ceiling_rps=server_ceiling_rps,
        device=f"{machine['cpu']} ({machine['cores']} cores), {machine['gpu'] or 'no GPU'}",
        source=("perf_analyzer -b B at concurrency 2 x instances against a no-batcher copy of the config "
                "(resnet18_kit/tools/planner/measure.py); exec = instances x B / throughput; std from response gaps "
                f"(1 instance; others: CV {cv:.3f} x mean); overhead = lone batch-1 p50 - exec(1)"),
        measured_utc=started.isoformat(timespec="seconds"), extra=details, speed=speed)
    return profile


def server_ceiling_from_bench(results: Path) -> tuple[float, str]:
    """The trivial-model ceiling (infer/s) of the newest bench summary that has one (load.results.bench_summaries
    of the results folder `results`), and the file it came from; (0.0, "") when there is none."""
    for path, summary in bench_summaries(results):
        rows = (summary.get("identity") or {}).get("concurrency") or []
        if rows:
            return max(r["throughput"] for r in rows), str(path.relative_to(path.parents[2]))
    return 0.0, ""
