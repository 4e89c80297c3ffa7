"""The main job end to end: encoded photos in, logits out, through the `resnet18` ensemble
(preprocess -> resnet18_onnx), served, against the same pipeline in-process.

For each config variant (a server-wide tritonserver `--model-config-name`; "default" = config.pbtxt
everywhere), the embedded tritonserver is restarted with it (as resnet18_kit/tools/bench/sweeps.py's run_config does), and
for each photo set (resnet18_kit/tools/load/photos.py: "sample", "12mp"):
  1. the in-process twin (resnet18_kit/tools/bench/pipeline_inprocess.py: the same decode/transform code and network
     runtime, batch size and decode threads as the variant's configs) is measured: saturation img/s and
     batch-1 latency;
  2. per transport (grpc, http; http-shm: HTTP with each photo in system shared memory, what a client on
     the server's host can do: `classify --protocol http --shared-memory`), a perf_analyzer concurrency sweep against
     `resnet18`, one run per level (bench.perf_analyzer.run_level), the photos sent as real BYTES input
     data (--input-data, one image per request, cycled; over the socket as a remote client's are), the
     statistics extension read before and after each level for the ensemble and BOTH step models
     (bench.server_stats.statistics_delta: per step queue and compute times per request, average batch);
     Each saturating level (above concurrency 1) is bracketed by the twin's saturation right before and
     right after it: the bar it is compared with (bench/inprocess.py `paired`). The machine's speed
     drifts by up to 15 % within a minute (shared cores: the twin alone measured 15.3-17.7 CPU ms per
     sample photo over six 2 s windows in a row), so a bar measured a sweep away can misjudge the ratio
     by as much;
  3. the twin is measured again (saturation and batch-1 latency: the photo set's figures).

Per (variant, photo set, protocol): efficiency = best served img/s over the levels / the in-process
saturation img/s paired with that level; the CPU ratio likewise (`bar`); c1_gap_ms = served p50 at
concurrency 1 - in-process batch-1 p50 (mean of before and after, ms). Targets: `pipeline_targets`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path

from resnet18_kit.tools.load.perf_analyzer import LoadSpec, run_level
from resnet18_kit.tools.load.photos import PHOTO_SETS, photo_set, write_input_data
from resnet18_kit.observe.model_config import served_config
from resnet18_kit.tools.bench.inprocess import mean_of, paired
from resnet18_kit.tools.bench.pipeline_inprocess import PipelineTwin
from resnet18_kit.observe.process_cpu import ProcessCpu, cpu_phrase, per_inference_ms
from resnet18_kit.observe.statistics import CpuSampler, model_statistics, statistics_delta
from resnet18_kit.client.sync_client import TritonClassifierClient
from resnet18_kit.contract import DEFAULT_VARIANT, ENSEMBLE_MODEL, LOGITS_BYTES, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

#: The ensemble's steps, in order: where a request's time goes on the server.
STEP_MODELS = (PREPROCESS_MODEL, ONNX_MODEL)
FULL_LEVELS = (1, 2, 4, 8, 16, 32)
QUICK_LEVELS = (1, 32)
#: HTTP with each photo in system shared memory (`transport`): the kit's same-host transport. It costs the
#: server less CPU per image than gRPC through serve, whose gRPC guard 2.51's HTTP does not need
#: (docs/records/benchmarks.md, "The main job's same-host transport").
SHARED_MEMORY_TRANSPORT = "http-shm"
#: Every transport a sweep can use (`transport`): the protocol, "-shm" with the photos in system shared memory.
PIPELINE_TRANSPORTS = ("grpc", "http", "grpc-shm", "http-shm")
#: How the figures draw each transport (the in-process line is dashed).
TRANSPORT_LINESTYLES = {"grpc": "-", "http": ":", "grpc-shm": "-.", "http-shm": (0, (5, 1, 1, 1))}
#: The variants measured unless --pipeline-variants says otherwise: the default configs, and the int8
#: network (configs/int8.pbtxt) when the model repository has it.
PREFERRED_VARIANTS = (DEFAULT_VARIANT, "int8")

#: Targets: sample photos through the fastest variant at saturation, img/s; on either photo set, the
#: fastest variant's fraction of the strongest in-process pipeline (bench/pipeline_inprocess.py);
#: 12-megapixel JPEGs, img/s; concurrency 1, served p50 - in-process batch-1 p50, ms.
TARGET_SAMPLE_IMG_PER_S = 110.0
TARGET_EFFICIENCY = 0.95
TARGET_12MP_IMG_PER_S = 60.0
TARGET_C1_GAP_MS = 5.0


@dataclass(frozen=True)
class PipelineOptions:
    """What the end-to-end run measures and for how long.

    measurement_ms: perf_analyzer's window per level (stabilized windows, the served rate at steady state);
    request_window_s > 0 (--quick): concurrency 1 is measured as a fixed request count instead, about this
    many seconds' worth at the in-process rate (`request_count`). Higher levels are always measured in
    windows: a fixed count at concurrency 32 also times the ramp up and the drain (about 0.3 s each of
    ~2.5 s), which measured the `int8` main job at 84.7 img/s against 104.1 in windows on the same server
    (docs/records/benchmarks.md). saturation_s / batch1_s: in-process timed seconds per
    figure; repository: the model repository served and run in-process; photos_root: the results folder
    under which generated photo sets are cached."""

    variants: tuple[str, ...]
    repository: ModelRepository
    photos_root: Path
    photo_sets: tuple[str, ...] = PHOTO_SETS
    protocols: tuple[str, ...] = ("grpc", "http", SHARED_MEMORY_TRANSPORT)
    levels: tuple[int, ...] = FULL_LEVELS
    measurement_ms: int = 2500
    request_window_s: float = 0.0
    saturation_s: float = 6.0
    batch1_s: float = 4.0
    #: Serve from this model repository instead (e.g. an older checkout's, for a before/after figure);
    #: the in-process twin still reads `repository`'s configs and runs its code.
    served_repository: Path | None = None
    #: gRPC through the kit's gRPC guard, as `resnet18-kit serve` runs (server.config.config_on_free_ports).
    grpc_guard: bool = False

    @property
    def perf_runs(self) -> int:
        """perf_analyzer runs in all (one per variant, photo set, protocol and level)."""
        return len(self.variants) * len(self.photo_sets) * len(self.protocols) * len(self.levels)


def default_variants(repository: ModelRepository) -> tuple[str, ...]:
    """PREFERRED_VARIANTS that exist in `repository` (ModelRepository.variant_names)."""
    return tuple(v for v in PREFERRED_VARIANTS if v in repository.variant_names())


def pipeline_options(repository: ModelRepository, photos_root: Path, quick: bool, variants: list[str] | None = None,
                     measurement_ms: int | None = None) -> PipelineOptions:
    """--quick: gRPC and http-shm, concurrency 1 (a fixed request count of ~2.5 s) and 32 (1.5 s windows),
    2 s + 1.5 s in-process; full: gRPC, HTTP and http-shm, concurrency 1 to 32, 2.5 s windows, 6 s + 4 s
    in-process. photos_root: the
    results folder (photo sets cached under it). ValueError naming variants `repository` lacks."""
    unknown = [v for v in variants or () if v not in repository.variant_names()]
    if unknown:
        raise ValueError(f"no configs/<name>.pbtxt in the model repository for variant(s) {', '.join(unknown)}")
    options = PipelineOptions(variants=tuple(variants or default_variants(repository)), repository=repository,
                              photos_root=photos_root)
    if quick:
        options = replace(options, protocols=("grpc", SHARED_MEMORY_TRANSPORT), levels=QUICK_LEVELS,
                          request_window_s=2.5, saturation_s=2.0, batch1_s=1.5, measurement_ms=1500)
    return replace(options, measurement_ms=measurement_ms or options.measurement_ms)


def fixed_request_count(rate_per_s: float, window_s: float, level: float) -> int:
    """A fixed request count (perf_analyzer --request-count): about window_s seconds of requests at
    rate_per_s (requests/s), and at least 6 rounds of `level` requests in flight."""
    return max(int(rate_per_s * window_s), 6 * int(level))


def level_counts(level: float, count_at_1: int, fallback: int) -> dict:
    """How one level is measured, as LoadSpec fields: exactly `count_at_1` requests at concurrency 1 (no
    ramp or drain to time there; 0 = windows there too), stabilized windows above it, with `fallback`
    requests as the windows' fallback (perf_analyzer.run_level). One rule for every sweep of `bench`."""
    if level == 1 and count_at_1:
        return {"request_count": count_at_1}
    return {"request_count": 0, "fallback_request_count": fallback}


def request_count(level: int, inprocess: dict, window_s: float) -> int:
    """A fixed request count for one level: window_s seconds at the in-process rate (batch-1 rate
    1000 / p50 ms at concurrency 1, the saturation img/s above it), and at least 6 rounds of the level."""
    rate_per_s = 1000.0 / inprocess["batch1_p50_ms"] if level == 1 else inprocess["saturation_img_per_s"]
    return fixed_request_count(rate_per_s, window_s, level)


def transport(label: str) -> tuple[str, bool]:
    """A sweep's transport label -> (protocol, photos in system shared memory): "http-shm" -> ("http", True)."""
    protocol, _, shm = label.partition("-")
    return protocol, shm == "shm"


def measure_pipeline_level(server: EmbeddedTritonServer, load: LoadSpec, level: float, out_dir: Path,
                           protocol: str) -> dict:
    """One perf_analyzer run against the ensemble with the server's statistics of exactly that run.
    protocol: a transport label (`transport`): one of PIPELINE_TRANSPORTS.

    Returns perf_analyzer's PerfRow fields (throughput = img/s, latencies in us), "steps": {model:
    statistics_delta} for the ensemble and each of STEP_MODELS (queue_us, compute_infer_us ... per
    request; average_batch; inference_count), "cpu_utilization" (server, 0..1, None if unsampled) and
    "server_cpu_ms_per_inference" (the server's processes' CPU per image, observe.process_cpu)."""
    config = server.config
    protocol, shared_memory = transport(protocol)
    if shared_memory:
        load = replace(load, shared_memory="system", output_shm_bytes=LOGITS_BYTES)
    url = config.url(protocol)
    models = (ENSEMBLE_MODEL, *STEP_MODELS)
    before = {model: model_statistics(config.http_url, model) for model in models}
    with CpuSampler(config.metrics_url) as cpu, ProcessCpu(server.server_processes()) as processes:
        row = run_level(ENSEMBLE_MODEL, url, protocol, load, level, out_dir, metrics_url=config.metrics_url)
    after = {model: model_statistics(config.http_url, model) for model in models}
    steps = {model: statistics_delta(before[model], after[model]) for model in models}
    return {**asdict(row), "steps": steps, "cpu_utilization": cpu.mean,
            "server_cpu_ms_per_inference": per_inference_ms(processes.seconds, steps[ENSEMBLE_MODEL]["inference_count"])}


def saturation_figures(result: tuple[float, int, float]) -> dict:
    """`inprocess.paired`'s figures of PipelineTwin.saturation's (img/s, batches, CPU ms per image):
    {"saturation_img_per_s", "saturation_cpu_ms_per_image"}."""
    img_per_s, _, cpu_ms = result
    return {"saturation_img_per_s": img_per_s, "saturation_cpu_ms_per_image": cpu_ms}


def sweep(server: EmbeddedTritonServer, input_data: Path, protocol: str, inprocess: dict, out: Path,
          options: PipelineOptions, progress=None, label: str = "", saturation=None) -> list[dict]:
    """The concurrency sweep of one photo set over one protocol: measure_pipeline_level per level, each
    into out/concurrency-<level>/. inprocess: the twin's figures, which size fixed request counts.
    saturation: the twin's saturation on the same photos (PipelineTwin.saturation); when given, every
    level above concurrency 1 is measured between two of them (bench/inprocess.py `paired`:
    "inprocess_paired")."""
    load = LoadSpec("concurrency", options.levels, input_data=input_data, profile_export=False,
                    measurement_ms=options.measurement_ms)
    rows = []
    for level in options.levels:
        count_at_1 = request_count(1, inprocess, options.request_window_s) if options.request_window_s else 0
        fallback = request_count(level, inprocess, 2 * options.measurement_ms / 1000)  # ~2 windows' worth
        load = replace(load, **level_counts(level, count_at_1, fallback))
        if progress is not None:
            progress.set_description(f"pipeline {label} {protocol} c={level}")
        measure = partial(measure_pipeline_level, server, load, level, out / f"concurrency-{level}", protocol)
        rows.append(paired(saturation, measure, saturation_figures)
                    if saturation is not None and level > 1 else measure())
        if progress is not None:
            progress.update()
    return rows


def summarize_protocol(rows: list[dict], inprocess: dict) -> dict:
    """best (the level with the most img/s), its in-process `bar` (the one paired with that level, else the
    photo set's), efficiency against it, and the concurrency-1 gap (None without c=1)."""
    best = max(rows, key=lambda r: r["throughput"])
    one = next((r for r in rows if r["level"] == 1), None)
    paired = best.get("inprocess_paired")
    bar = {"saturation_img_per_s": (paired or inprocess)["saturation_img_per_s"],
           "saturation_cpu_ms_per_image": (paired or inprocess).get("saturation_cpu_ms_per_image"),
           "paired": paired is not None}
    return {"best_level": best["level"], "best_img_per_s": best["throughput"],
            "best_server_cpu_ms_per_inference": best.get("server_cpu_ms_per_inference"), "bar": bar,
            "efficiency": best["throughput"] / bar["saturation_img_per_s"],
            "c1_p50_ms": None if one is None else one["p50_us"] / 1000,
            "c1_gap_ms": None if one is None else one["p50_us"] / 1000 - inprocess["batch1_p50_ms"]}


def run_variant(variant: str, photos: dict[str, list[Path]], run_dir: Path, options: PipelineOptions,
                progress=None) -> dict:
    """Restart the server with `variant`; per photo set: in-process, the sweeps per protocol, in-process."""
    out = run_dir / "pipeline" / variant
    out.mkdir(parents=True)
    server_config = config_on_free_ports(model_config_name=None if variant == DEFAULT_VARIANT else variant,
                                         model_repository=options.served_repository or options.repository.root,
                                         grpc_guard=options.grpc_guard)
    server = EmbeddedTritonServer(server_config, log_path=out / "tritonserver.log")
    if progress is not None:
        progress.set_description(f"pipeline {variant}: starting tritonserver")
    ready_s = server.start()
    try:
        with TritonClassifierClient(server_config.http_url, "http") as client:
            record = {"variant": variant, "served_repository": str(options.served_repository or ""),
                      "triton_version": client.raw.get_server_metadata()["version"],
                      "process_to_ready_s": ready_s,
                      "served": {model: served_config(client, model) for model in STEP_MODELS}}
        if progress is not None:
            progress.set_description(f"pipeline {variant}: choosing the in-process arrangement")
        twin = PipelineTwin(options.repository, variant)
        record["inprocess_twin"] = twin.describe()
        record["photo_sets"] = []
        for name, paths in photos.items():
            data = [p.read_bytes() for p in paths]
            input_data = write_input_data(paths, out / name / "input_data.json")
            if progress is not None:
                progress.set_description(f"pipeline {variant} {name}: in-process")
            before = twin.measure(data, options.saturation_s, options.batch1_s)
            runs = [{"protocol": protocol,
                     "concurrency": sweep(server, input_data, protocol, before, out / name / protocol, options,
                                          progress, f"{variant} {name}",
                                          partial(twin.saturation, data, options.saturation_s))}
                    for protocol in options.protocols]
            if progress is not None:
                progress.set_description(f"pipeline {variant} {name}: in-process again")
            after = twin.measure(data, options.saturation_s, options.batch1_s)
            inprocess = mean_of(before, after)
            for run in runs:
                run.update(summarize_protocol(run["concurrency"], inprocess))
            record["photo_sets"].append({"photos": name, "inprocess_before": before, "inprocess_after": after,
                                         "inprocess": inprocess, "protocols": runs})
        return record
    finally:
        server.stop()


def run_pipeline(run_dir: Path, options: PipelineOptions, progress=None) -> dict:
    """Every variant of `options` in turn (run_variant); the "pipeline" record of summary.json."""
    started = time.time()
    photos = {name: photo_set(name, options.photos_root) for name in options.photo_sets}
    variants = [run_variant(v, photos, run_dir, options, progress) for v in options.variants]
    pipeline = {"options": {**{f.name: getattr(options, f.name) for f in fields(options)},
                            "repository": str(options.repository.root), "photos_root": str(options.photos_root),
                            "served_repository": str(options.served_repository or "")},
                "photo_sets": {name: [{"file": p.name, "bytes": p.stat().st_size} for p in paths]
                               for name, paths in photos.items()},
                "variants": variants, "elapsed_s": time.time() - started}
    pipeline["targets"] = pipeline_targets(pipeline)
    return pipeline


def served_runs(pipeline: dict, photos: str | None = None):
    """(variant record, photo-set record, protocol run) for every served sweep of a "pipeline" record,
    in run order; only those of photo set `photos` when given."""
    for variant in pipeline["variants"]:
        for entry in variant["photo_sets"]:
            if photos is None or entry["photos"] == photos:
                for run in entry["protocols"]:
                    yield variant, entry, run


def run_bar(entry: dict, run: dict) -> dict:
    """The in-process figures a protocol run is compared with ({"saturation_img_per_s",
    "saturation_cpu_ms_per_image"}): the bar paired with its best level (`summarize_protocol`), or the
    photo set's before/after mean in a summary.json written before pairing."""
    return run.get("bar") or entry["inprocess"]


def pipeline_targets(pipeline: dict) -> list[dict]:
    """The end-to-end targets, each {name, wanted, measured, met}: on the sample photos, the fastest
    variant (most img/s at its best level, either protocol) reaches TARGET_SAMPLE_IMG_PER_S and
    TARGET_EFFICIENCY of its own in-process pipeline; the fastest variant on the 12 MP photos reaches
    TARGET_12MP_IMG_PER_S; for the fastest sample-photo variant, each photo set and protocol: served p50
    at concurrency 1 within TARGET_C1_GAP_MS of in-process batch-1 p50."""
    targets = []
    sample = list(served_runs(pipeline, "sample"))
    if sample:
        variant, entry, run = max(sample, key=lambda item: item[2]["best_img_per_s"])
        where = f"{variant['variant']}, {run['protocol']}, concurrency {run['best_level']:g}"
        targets.append({"name": "sample photos at saturation, fastest variant",
                        "wanted": f">= {TARGET_SAMPLE_IMG_PER_S:g} img/s",
                        "measured": f"{run['best_img_per_s']:.1f} img/s ({where})",
                        "met": run["best_img_per_s"] >= TARGET_SAMPLE_IMG_PER_S})
        targets.append({"name": "sample photos, served / in-process (same runtime), fastest variant",
                        "wanted": f">= {TARGET_EFFICIENCY:g}",
                        "measured": f"{run['efficiency']:.2f} ({run['best_img_per_s']:.1f} / "
                                    f"{run_bar(entry, run)['saturation_img_per_s']:.1f} img/s, {where})",
                        "met": run["efficiency"] >= TARGET_EFFICIENCY})
        for entry in variant["photo_sets"]:
            for run in entry["protocols"]:
                if run["c1_gap_ms"] is None:
                    continue
                targets.append({"name": f"concurrency 1: served p50 - in-process batch-1 p50, {variant['variant']}, "
                                        f"{entry['photos']} photos, {run['protocol']}",
                                "wanted": f"<= {TARGET_C1_GAP_MS:g} ms",
                                "measured": f"{run['c1_p50_ms']:.1f} - {entry['inprocess']['batch1_p50_ms']:.1f} = "
                                            f"{run['c1_gap_ms']:+.1f} ms",
                                "met": run["c1_gap_ms"] <= TARGET_C1_GAP_MS})
    large = list(served_runs(pipeline, "12mp"))
    if large:
        variant, entry, run = max(large, key=lambda item: item[2]["best_img_per_s"])
        where = f"{variant['variant']}, {run['protocol']}, concurrency {run['best_level']:g}"
        targets[2 if sample else 0:2 if sample else 0] = [
            {"name": "12 MP JPEGs at saturation, fastest variant", "wanted": f">= {TARGET_12MP_IMG_PER_S:g} img/s",
             "measured": f"{run['best_img_per_s']:.1f} img/s ({where})",
             "met": run["best_img_per_s"] >= TARGET_12MP_IMG_PER_S},
            {"name": "12 MP JPEGs, served / in-process (same runtime), fastest variant",
             "wanted": f">= {TARGET_EFFICIENCY:g}",
             "measured": f"{run['efficiency']:.2f} ({run['best_img_per_s']:.1f} / "
                         f"{run_bar(entry, run)['saturation_img_per_s']:.1f} img/s, {where})",
             "met": run["efficiency"] >= TARGET_EFFICIENCY}]
    return targets


def ratio_lines(pipeline: dict) -> list[str]:
    """One line per variant, photo set and protocol: served / in-process img/s at the best level."""
    return [f"{variant['variant']} main job, {entry['photos']} photos, {run['protocol']}: {run['efficiency']:.2f} "
            f"of in-process ({run['best_img_per_s']:.1f} / {run_bar(entry, run)['saturation_img_per_s']:.1f} img/s, "
            f"concurrency {run['best_level']:g}; in-process {variant['inprocess_twin']['network_label']})"
            + cpu_phrase(run.get("best_server_cpu_ms_per_inference"), run_bar(entry, run).get("saturation_cpu_ms_per_image"))
            for variant, entry, run in served_runs(pipeline)]


def print_targets(targets: list[dict], file=sys.stdout) -> None:
    """One line per target: met / MISSED, name, measured, wanted."""
    for target in targets:
        print(f"  {'met   ' if target['met'] else 'MISSED'} {target['name']}: {target['measured']} "
              f"(wanted {target['wanted']})", file=file)
