"""perf_analyzer sweeps of ResNet-18 over swapped model configs, against the ceilings (resnet18-kit bench run).

For each named config of the model (config.pbtxt as "default", and configs/<name>.pbtxt, GPU-only ones
left out), the embedded tritonserver is restarted with `--model-config-name=<name>`: a restart, not the
model-control API, because the process start -> ready time is one of the figures (cold start), and
because a restart with `--model-config-name` is exactly how docker compose and Kubernetes switch
configs; the config the server really loaded is read back and recorded. Per config:
  * cold start: process start to every model ready (s), then the first inference's latency (ms);
  * the in-process bar (no server): the config's own network file and runtime in its strongest
    arrangement (OpenVINO streams, one single-threaded runner per core, or one runner on every core; malloc
    as served: bench/inprocess.py) at the fastest batch up to max_batch_size, and at batch 1 as served;
    measured again right before and after each saturating level, whose ratios it divides (inprocess.paired);
  * a perf_analyzer concurrency sweep and a Poisson request-rate sweep, one perf_analyzer run per level,
    with the statistics extension read before and after each (stage times, batch sizes formed), the
    server's CPU utilization sampled from the metrics endpoint, and the stubs' thread placement (the
    cores each thread may run on, read from /proc) sampled under load.
Then the batching-layer ceiling: the trivial `identity` model through the same server and batcher.

Then the main job end to end (resnet18_kit/tools/bench/pipeline.py; --skip-pipeline leaves it out,
--skip-tensor-sweeps runs only it): encoded photos (the sample photos, and the same as 12-megapixel JPEGs) as real BYTES requests
through the `resnet18` ensemble (preprocess -> resnet18_onnx), per config variant (--pipeline-variants;
default: "default" and "int8" when configs/int8.pbtxt exists), photo set, protocol and concurrency, with
the server's split per step (queue, compute, average batch), against the strongest pipeline in-process
(bench/pipeline_inprocess.py: decode in threads feeding the network's strongest arrangement).

Writes <results>/bench-<UTC time>[-quick]/ (--out to choose the folder): perf_analyzer's files per level,
machine.json, summary.json, report.md and PNG plots (three for the tensor sweeps, two end to end), and
ends on stdout with one line per config and per main-job photo set: served / in-process, e.g.
"int8 tensors: 0.93 of in-process (...)".
--quick takes about 7 minutes on 2 cores.

Progress: a log line on stderr per perf_analyzer run with the count done, the elapsed time and the ETA
(INFO; so `resnet18-kit bench run --quick > log 2>&1` shows it), and a bar on a terminal; the report's
path and the targets go to stdout.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import numpy as np

from resnet18_kit.tools.bench import inprocess
from resnet18_kit.observe.machine import cpu_share, cpu_ticks, machine_info, processor_line
from resnet18_kit.observe.process_cpu import ProcessCpu, per_inference_ms
from resnet18_kit.tools.load.perf_analyzer import RESNET18_LOGITS_BYTES, LoadSpec, PerfAnalyzerError, run_level
from resnet18_kit.tools.bench.pipeline import (PIPELINE_TRANSPORTS, fixed_request_count, level_counts,
                                              pipeline_options, print_targets, run_pipeline)
from resnet18_kit.tools.bench.pipeline import ratio_lines as pipeline_ratio_lines
from resnet18_kit.observe.model_config import ModelConfigView, served_config
from resnet18_kit.observe.placement import PlacementSampler, shared_pinned_cores
from resnet18_kit.progress import Progress
from resnet18_kit.tools.bench.report import evaluate_targets, placement_phrase, ratio_lines, saturation_row, write_report
from resnet18_kit.observe.statistics import CpuSampler, model_statistics, statistics_delta
from resnet18_kit.client.sync_client import TritonClassifierClient
from resnet18_kit.client.errors import QUEUE_FULL_MESSAGE
from resnet18_kit.contract import DEFAULT_VARIANT, ONNX_MODEL
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.settings import Settings, shown

#: The bench's own model repository (the trivial `identity` model), shipped inside the package.
BENCH_REPOSITORY = Path(__file__).parent / "model_repository"
IDENTITY_MODEL = "identity"
#: Variants that need a GPU: left out of the sweeps on this CPU-only bench.
GPU_VARIANTS = ("gpu",)
log = logging.getLogger(__name__)


def config_names(repository: ModelRepository, model: str) -> list[str]:
    """"default" (config.pbtxt) and every configs/<name>.pbtxt of `model` (ModelRepository.variant_names),
    GPU-only variants left out."""
    return [DEFAULT_VARIANT] + [n for n in repository.variant_names(model)
                                if n != DEFAULT_VARIANT and n not in GPU_VARIANTS]


def local_batching(repository: ModelRepository, model: str, name: str) -> ModelConfigView:
    """Config `name` of `model` as written in the model repository (max_batch_size, max_queue_size,
    instance_count(): Triton's defaults filled in, e.g. for an instance group of count 0)."""
    return ModelConfigView.for_variant(repository, model, name)


def measure_level(server: EmbeddedTritonServer, model: str, load: LoadSpec, level: float, out_dir: Path,
                  protocol: str) -> dict:
    """One perf_analyzer level with the server-side statistics of exactly that run, and the CPU time the
    server's processes spent over it per inference (observe.process_cpu)."""
    config = server.config
    url = config.url(protocol)
    before = model_statistics(config.http_url, model)
    with CpuSampler(config.metrics_url) as cpu, ProcessCpu(server.server_processes()) as processes:
        row = run_level(model, url, protocol, load, level, out_dir, metrics_url=config.metrics_url)
    after = model_statistics(config.http_url, model)
    served = statistics_delta(before, after)
    return {**asdict(row), "server": served, "cpu_utilization": cpu.mean,
            "server_cpu_ms_per_inference": per_inference_ms(processes.seconds, served["inference_count"])}


def levels_for(max_batch_size: int, max_queue_size: int, quick: bool, instances: int = 1) -> tuple[int, ...]:
    """Concurrency levels: powers of two up to 2 x max_batch_size x instances (the saturation rule of
    thumb of Triton's guide), but no more than the queue holds (max_queue_size, 0 = unbounded): beyond
    it the server refuses requests, which perf_analyzer treats as a failed run.
    --quick keeps 1 and the top level (see QUICK_LEVELS)."""
    top = 2 * max_batch_size * instances
    top = min(top, max_queue_size or top)
    levels = tuple(sorted({1, *[2 ** k for k in range(1, 10) if 2 ** k <= top], top}))
    return (1, top) if quick else levels


#: --quick: concurrency 1 for every config (its latency at low load: the docs' "Choosing a config" table),
#: the levels the targets are about (the throughput config at 2 x max_batch_size) and one saturating level
#: per config (its served infer/s against the in-process bar). Concurrency 1 is a fixed request count;
#: the saturating level is measured in stabilized windows, since a fixed count there also times the ramp
#: up and the drain of its requests in flight (pipeline.PipelineOptions).
QUICK_LEVELS = {"latency": (1, 32), "throughput": (1, 64), "no_batching": (1, 16), "default": (1, 32)}


def concurrency_levels(name: str, max_batch_size: int, max_queue_size: int, instances: int,
                       quick: bool) -> tuple[int, ...]:
    """The concurrency levels (requests in flight) swept for config `name` (QUICK_LEVELS with --quick)."""
    if quick and name in QUICK_LEVELS:
        return QUICK_LEVELS[name]
    return levels_for(max_batch_size, max_queue_size, quick, instances)


def run_config(repository: ModelRepository, name: str, model: str, run_dir: Path, args,
               progress: Progress) -> dict:
    """Restart the server with config `name`, measure cold start, in-process ceiling and both sweeps."""
    out = run_dir / name
    out.mkdir(parents=True)
    server_config = config_on_free_ports(model_config_name=None if name == DEFAULT_VARIANT else name,
                                         model_repository=args.served_repository or repository.root,
                                         grpc_guard=args.grpc_guard)
    server = EmbeddedTritonServer(server_config, log_path=out / "tritonserver.log")
    progress.set_description(f"{name}: starting tritonserver")
    log.info("%s: starting tritonserver (--model-config-name %s)", name, name)
    ready_s = server.start()
    log.info("%s: tritonserver ready in %.1f s (log: %s)", name, ready_s, shown(out / "tritonserver.log"))
    try:
        with TritonClassifierClient(server_config.http_url, "http") as client:
            probe = np.zeros((1, 3, 224, 224), np.uint8)
            started = time.perf_counter()
            client.infer_tensor(probe, model=model)
            first_ms = (time.perf_counter() - started) * 1e3
            record = {"name": name, **served_config(client, model),
                  "served_repository": str(args.served_repository or ""),
                      "triton_version": client.raw.get_server_metadata()["version"],
                      "cold_start": {"process_to_ready_s": ready_s, "first_inference_ms": first_ms}}
        log.debug("%s: first inference %.1f ms; served config %s", name, first_ms,
                  {k: v for k, v in record.items() if k not in ("name", "cold_start")})
        progress.set_description(f"{name}: in-process bar")
        view = local_batching(repository, model, name)
        loaders = repository.runtimes()
        record["allocator_as_served"] = inprocess.allocate_as_served(repository)
        spec = loaders.RuntimeSpec.from_parameters(view.parameters, repository.root / model / "1")
        bar = inprocess.strongest(loaders, spec, inprocess.bar_batch_sizes(view.max_batch_size, view.dynamic_batching,
                                                                           args.quick), args.inprocess_s)
        # Batch 1 on one runner loaded as the served config loads it: what a lone request costs in-process.
        (lone,) = inprocess.measure(None, f"{spec.runtime} {spec.path.name}, as served, 1 runner", [1],
                                    duration_s=args.inprocess_s, runner=loaders.load(spec))
        record["inprocess"] = bar.tried + [asdict(lone)]
        record["inprocess_batch1"] = asdict(lone)
        capacity = bar.best["img_per_s"]
        log.info("%s: in-process bar %.1f infer/s (%s)", name, capacity, bar.label())
        fallback = int(capacity * 2 * args.measurement_ms / 1000)  # about 2 windows' worth of requests
        levels = concurrency_levels(name, record["max_batch_size"], record["max_queue_size"], record["instances"],
                                    args.quick)
        load = LoadSpec("concurrency", levels, shared_memory=args.shared_memory,
                        output_shm_bytes=RESNET18_LOGITS_BYTES,
                        measurement_ms=args.measurement_ms, fallback_request_count=fallback)
        record["concurrency"] = []
        remeasure = inprocess.again(loaders, spec, bar, args.inprocess_s)
        stubs = {n: pid for n, pid in server.stub_processes().items() if n.startswith(model + "_")}
        with PlacementSampler(stubs, os.sched_getaffinity(server.process.pid), interval_s=0.5) as placement:
            for level in load.levels:
                # --quick, concurrency 1: ~2.5 s of capacity, and at least 6 rounds (QUICK_LEVELS).
                count_at_1 = fixed_request_count(capacity, 2.5, 1) if args.quick else 0
                load = replace(load, **level_counts(level, count_at_1, fallback))
                progress.set_description(f"{name}: concurrency {level:g}")
                measure = partial(measure_level, server, model, load, level, out / f"concurrency-{level:g}",
                                  args.sweep_protocol)
                # Above concurrency 1, between two in-process measurements (inprocess.paired).
                record["concurrency"].append(inprocess.paired(remeasure, measure, inprocess.tensor_figures)
                                             if level > 1 else measure())
                progress.update()
        served_view = (local_batching(ModelRepository(args.served_repository), model, name)
                       if args.served_repository else view)
        served_spec = loaders.RuntimeSpec.from_parameters(served_view.parameters, spec.path.parent)
        record["placement"] = placement_phrase(served_view, served_spec, placement.pinned, loaders.usable_cores())
        record["shared_pinned_cores"] = {str(c): names for c, names in shared_pinned_cores(placement.pinned).items()}
        # The efficiency and the CPU ratio divide by the bar measured right around the saturating level.
        around = saturation_row(record).get("inprocess_paired") or {
            "before": bar.best, "after": inprocess.tensor_figures(remeasure()),
            "cpu_ms_per_image": bar.best["cpu_ms_per_image"]}
        before_after = [around["before"]["img_per_s"], around["after"]["img_per_s"]]
        record["inprocess_bar"] = {**bar.best, "label": bar.label(), "before_after": before_after,
                                   "cpu_ms_per_image": around["cpu_ms_per_image"]}
        record["inprocess_bar_img_per_s"] = capacity = sum(before_after) / 2
        rates = tuple(round(f * capacity, 1) for f in args.rate_fractions) if name in args.rate_configs else ()
        # --async: with blocking calls perf_analyzer's rate mode can keep only as many requests in flight as
        # it has threads, and then sends below the asked rate once latency grows.
        rate_load = LoadSpec("request_rate", rates, shared_memory=args.shared_memory, async_mode=True,
                             output_shm_bytes=RESNET18_LOGITS_BYTES, measurement_ms=args.measurement_ms,
                             fallback_request_count=fallback,
                             request_count=int(capacity * 2.5) if args.quick else 0)
        record["request_rate"], record["request_rate_refused"] = [], []
        for rate in rates:
            progress.set_description(f"{name}: {rate:g} requests/s")
            try:
                record["request_rate"].append(measure_level(server, model, rate_load, rate,
                                                            out / f"rate-{rate:g}", args.sweep_protocol))
            except PerfAnalyzerError as exc:
                # An open-loop rate above what the server sustains fills a bounded queue, and Triton refuses
                # the excess (back-pressure working, not a fault): recorded, and the higher rates skipped.
                if QUEUE_FULL_MESSAGE not in str(exc):
                    raise
                log.warning("%s: %g requests/s refused by the full queue; higher rates skipped", name, rate)
                record["request_rate_refused"].append({"level": rate, "error": exc.summary})
                progress.update(len(rates) - len(record["request_rate"]))
                break
            progress.update()
        record["efficiency"] = saturation_row(record)["throughput"] / capacity
        return record
    finally:
        server.stop()


def run_identity(run_dir: Path, args, progress: Progress) -> dict:
    """The batching-layer ceiling: `identity` through the same server, batcher and protocol stack."""
    out = run_dir / IDENTITY_MODEL
    out.mkdir()
    server_config = config_on_free_ports(model_repository=BENCH_REPOSITORY)
    with EmbeddedTritonServer(server_config, log_path=out / "tritonserver.log") as server:
        with TritonClassifierClient(server_config.http_url, "http") as client:
            instances = served_config(client, IDENTITY_MODEL)["instances"]
        load = LoadSpec("concurrency", (128,) if args.quick else (1, 4, 16, 64, 128, 256),
                        measurement_ms=args.measurement_ms, async_mode=True,
                        fallback_request_count=int(7000 * 3 * args.measurement_ms / 1000))
        # Time windows even in --quick: perf_analyzer 2.51 --async with a fixed --request-count at
        # concurrency 128+ sometimes never exits (resnet18_kit/tools/load/perf_analyzer.py, HANG_S).
        rows, failed = [], []
        for level in load.levels:
            progress.set_description(f"identity: concurrency {level:g}")
            try:
                rows.append(measure_level(server, IDENTITY_MODEL, load, level, out / f"concurrency-{level:g}",
                                          "grpc"))
            except PerfAnalyzerError as exc:  # e.g. perf_analyzer 2.51 hung twice: the other levels stand
                log.warning("identity: concurrency %g not measured: %s", level, exc.summary)
                failed.append({"level": level, "error": exc.summary})
            progress.update()
    return {"instances": instances, "protocol": "grpc", "mode": "async", "concurrency": rows,
            "failed_levels": failed}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench run`'s options."""
    parser.add_argument("--quick", action="store_true",
                        help="fewer levels, shorter windows: about 7 minutes on 2 cores "
                             "(about 3 with --skip-pipeline)")
    parser.add_argument("--model", default=ONNX_MODEL, help=f"the network model swept (default {ONNX_MODEL})")
    parser.add_argument("--configs", nargs="*", metavar="NAME",
                        help="config variants to sweep (default: every CPU variant of the model)")
    parser.add_argument("--perf-protocol", dest="sweep_protocol", choices=("grpc", "http"), default="http",
                        help="perf_analyzer's protocol against the bench's own server (default http: with "
                             "--shared-memory system, the kit's transport for a client on the server's host)")
    parser.add_argument("--shared-memory", choices=("none", "system"), default="system",
                        help="perf_analyzer's tensor transport (default system: same host)")
    parser.add_argument("--measurement-ms", type=int,
                        help="perf_analyzer measurement window, ms (default 2500, quick 1500)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="results folder, a new one (default <results>/bench-<time>[-quick])")
    parser.add_argument("--pipeline-variants", nargs="+", metavar="NAME",
                        help="config variants for the end-to-end part (server-wide --model-config-name; "
                             "default: default, and int8 when configs/int8.pbtxt exists)")
    parser.add_argument("--pipeline-transports", nargs="+", choices=PIPELINE_TRANSPORTS, metavar="NAME",
                        help="the end-to-end part's transports, of " + ", ".join(PIPELINE_TRANSPORTS) + " (-shm: each "
                             "photo in system shared memory; default grpc, http-shm with --quick, and http too without)")
    parser.add_argument("--skip-tensor-sweeps", action="store_true",
                        help="run only the end-to-end part (no per-config tensor sweeps, no identity ceiling)")
    parser.add_argument("--skip-pipeline", action="store_true", help="leave the end-to-end part out")
    parser.add_argument("--served-repository", type=Path, metavar="DIR",
                        help="serve from this model repository (e.g. an older checkout's model_repository/, for a "
                             "before/after); the configs' in-process bars are --model-repository's")
    parser.add_argument("--grpc-guard", action="store_true",
                        help="measure gRPC through the kit's gRPC guard, as `resnet18-kit serve` runs (default: "
                             "tritonserver's own gRPC port); its CPU counts in the server's CPU per inference")


def usage_problem(repository: ModelRepository, args: argparse.Namespace) -> str | None:
    """What is wrong with the command line or the model repository (one line), None when nothing is."""
    if repository.missing_artifacts():
        return "model files missing: run `resnet18-kit export` first"
    if args.skip_tensor_sweeps and args.skip_pipeline:
        return "--skip-tensor-sweeps and --skip-pipeline together leave nothing to run"
    known = config_names(repository, args.model)
    unknown = sorted(set(args.configs or ()) - set(known))
    if unknown and not args.skip_tensor_sweeps:
        return f"--configs: no such config of {args.model}: {', '.join(unknown)} (one of {', '.join(known)})"
    served = args.served_repository
    if served is not None and not (served / args.model).is_dir():
        return f"--served-repository: no model repository with {args.model} at {served}"
    if args.out is not None and args.out.exists():
        return f"--out {args.out}: exists already; name a new folder (a run never writes into another's)"
    return None


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Run the sweeps (module doc); exit status 0, 2 for a bad command line or missing model files."""
    repository = settings.repository
    problem = usage_problem(repository, args)
    if problem:
        print(f"resnet18-kit bench run: {problem}", file=sys.stderr)
        return 2
    args.measurement_ms = args.measurement_ms or (1500 if args.quick else 2500)
    args.inprocess_s = 1.5 if args.quick else 8.0
    #: Request rates as fractions of the in-process bar (the network's capacity on this machine).
    args.rate_fractions = (0.7,) if args.quick else (0.3, 0.7, 0.9)
    args.rate_configs = ("default",) if args.quick else ("default", "throughput")
    names = [] if args.skip_tensor_sweeps else args.configs or config_names(repository, args.model)
    try:
        pipeline = None if args.skip_pipeline else replace(pipeline_options(
            repository, settings.results_dir(), args.quick, args.pipeline_variants,
            None if args.quick else args.measurement_ms), served_repository=args.served_repository,
            grpc_guard=args.grpc_guard)
        if pipeline is not None and args.pipeline_transports:
            pipeline = replace(pipeline, protocols=tuple(args.pipeline_transports))
    except ValueError as exc:
        print(f"resnet18-kit bench run: --pipeline-variants: {exc}", file=sys.stderr)
        return 2

    started, ticks = time.time(), cpu_ticks()
    stamp = datetime.datetime.now(datetime.timezone.utc)
    run_dir = (args.out.resolve() if args.out else
               settings.results_dir(f"bench-{stamp:%Y%m%d-%H%M%S}{'-quick' if args.quick else ''}"))
    run_dir.mkdir(parents=True, exist_ok=False)
    views = {n: local_batching(repository, args.model, n) for n in names}
    steps = sum(len(concurrency_levels(n, v.max_batch_size, v.max_queue_size, v.instance_count(), args.quick))
                for n, v in views.items())
    if names:
        steps += len(args.rate_fractions) * sum(n in args.rate_configs for n in names) + (1 if args.quick else 6)
    steps += pipeline.perf_runs if pipeline else 0
    configs, parts, identity = {}, {}, None  # parts: the measured sections of summary.json
    log.info("%d perf_analyzer runs planned: %s%s%s; results in %s", steps,
             f"{len(names)} config(s) ({' '.join(names)}) and the identity ceiling" if names else "",
             " and " if names and pipeline else "",
             f"{pipeline.perf_runs} end-to-end runs ({' '.join(pipeline.variants)})" if pipeline else "",
             shown(run_dir))
    with Progress(steps, "run", "bench", log) as progress:
        for name in names:
            configs[name] = run_config(repository, name, args.model, run_dir, args, progress)
        if names:
            identity = run_identity(run_dir, args, progress)
        if pipeline:
            parts["pipeline"] = run_pipeline(run_dir, pipeline, progress)
    if names:
        log.info("in-process TorchScript reference (batch 1, 16, 32)")
        torchscript = [asdict(r) for r in inprocess.measure(repository, "torchscript", [1, 16, 32],
                                                            duration_s=args.inprocess_s)]
        parts.update({
            "configs": list(configs.values()),
            "inprocess": [r for c in configs.values() for r in c["inprocess"] if c["name"] == names[0]] + torchscript,
            "identity": identity})
    versions = [c["triton_version"] for c in configs.values()] + [
        v["triton_version"] for v in parts.get("pipeline", {}).get("variants", [])]
    machine = machine_info(versions[0])
    machine["cpu_during_run"] = cpu_share(ticks, cpu_ticks())  # steal > a few % means a noisy neighbour
    summary = {
        "command": "resnet18-kit " + shlex.join(sys.argv[1:]),
        "started_utc": stamp.isoformat(timespec="seconds"), "elapsed_s": time.time() - started,
        "model": args.model, "model_repository": str(repository.root), "machine": machine,
        "perf_analyzer": {"protocol": args.sweep_protocol, "shared_memory": args.shared_memory,
                          "measurement_ms": args.measurement_ms},
        "configs": [], "inprocess": [],  # "identity" only when measured (resnet18_kit/tools/planner/measure.py reads it)
        **parts,
        "targets": evaluate_targets(configs, identity, machine["cores"]) if names else [],
    }
    (run_dir / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = write_report(run_dir)
    print(f"\nbench: {shown(report)} ({time.time() - started:.0f} s); on {processor_line(machine)}")
    for line in ratio_lines(configs):
        print(line)
    if summary["targets"]:
        print(f"tensor sweeps ({args.model}):")
        print_targets(summary["targets"])
    if "pipeline" in summary:
        for line in pipeline_ratio_lines(summary["pipeline"]):
            print(line)
        print("end to end (resnet18 ensemble, encoded photos):")
        print_targets(summary["pipeline"]["targets"])
    return 0
