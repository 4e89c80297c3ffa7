"""Measure the ensemble's profile (resnet18_kit/tools/planner/ensemble.py) through the embedded tritonserver.

Three kinds of runs, each from a scratch model repository in <out> (version folders and label files linked
to the real ones, configs derived from the repository's, warmups dropped: measured runs warm up):
  1. the network alone: `measure_profile` (resnet18_kit/tools/planner/measure.py) for its config variant, batch
     sizes up to the ensemble's max_batch_size, no speed traces;
  2. preprocess alone, per instance count p: no dynamic batcher, p instances, perf_analyzer at
     concurrency 2p on the sample photos (BYTES input data): the batch-1 time is the instances' cycle
     p / throughput; its compute_infer per image (statistics extension) is the alone figure for (3);
  3. both at once, per pair (p, n): the ensemble with preprocess's shipped batcher and p instances and the
     network's config with n instances, closed loop at ENSEMBLE_CONCURRENCY on the same photos; each
     stage's compute_infer per execution, over its alone figure (the network's at the average batch the
     run formed, interpolated between the sizes measured alone), is the pair's interference factor.
The pairs' shared factor (ensemble.calibrated) from each closed-loop run's throughput. The fixed overhead: a
lone photo's p50 latency through the ensemble (concurrency 1) minus both stages'
batch-1 times alone, from the first pair.
"""
from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import numpy as np

from resnet18_kit.contract import DEFAULT_VARIANT, ENSEMBLE_MODEL, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.tools.load.perf_analyzer import LoadSpec, run_level
from resnet18_kit.tools.load.photos import photo_set, write_input_data
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.observe.statistics import model_statistics, statistics_delta
from resnet18_kit.tools.planner.batcher import BatcherConfig, batcher_from_config
from resnet18_kit.tools.planner.cpu import wait_until_quiet
from resnet18_kit.tools.planner.ensemble import EnsembleProfile, Interference, calibrated
from resnet18_kit.tools.planner.measure import instance_parameters, measure_profile
from resnet18_kit.tools.planner.pbtxt import planned_config, write_config
from resnet18_kit.tools.planner.profile import BatchTiming, Profile
from resnet18_kit.progress import log_status
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

#: Requests in flight for the interference runs: enough to keep every instance of both stages busy.
ENSEMBLE_CONCURRENCY = 16
#: Requests measured per run (after a warm-up run of WARMUP_REQUESTS).
REQUESTS = 240
WARMUP_REQUESTS = 40


def link_model(source: ModelRepository, target: Path, model: str, config) -> None:
    """target/<model>: everything of the source model folder linked (versions, labels) but its configs;
    `config` (a ModelConfig) written as its config.pbtxt, warmups dropped."""
    folder = target / model
    folder.mkdir(parents=True, exist_ok=True)
    for entry in (source.root / model).iterdir():
        if entry.name in ("config.pbtxt", "configs") or (folder / entry.name).exists():
            continue
        (folder / entry.name).symlink_to(entry.resolve())
    del config.model_warmup[:]
    write_config(config, folder / "config.pbtxt", header=f"{model}: ensemble-profile measurement copy")


def stage_config(source: ModelRepository, model: str, variant: str, instances: int, batcher: BatcherConfig | None):
    """The model's config `variant` with `instances` instances (and their threads) and `batcher` (None: the
    config's own)."""
    base = ModelConfigView.for_variant(source, model, variant)
    return planned_config(base.proto, batcher or batcher_from_config(base), instances,
                          instance_parameters(base.parameters, instances))


def photos_load(photos: Path, concurrency: int, requests: int) -> LoadSpec:
    return LoadSpec("concurrency", (concurrency,), input_data=photos, profile_export=False, request_count=requests)


def run_stats(http: str, grpc: str, models: tuple[str, ...], model: str, load: LoadSpec, out: Path,
              session_id: int) -> tuple[object, dict[str, dict]]:
    """One perf_analyzer run on `model`; (its PerfRow, {each of `models`: statistics_delta over the run,
    plus "execution_compute_ms"}."""
    wait_until_quiet(session_id=session_id)
    before = {m: model_statistics(http, m) for m in models}
    row = run_level(model, grpc, "grpc", load, load.levels[0], out)
    after = {m: model_statistics(http, m) for m in models}
    return row, {m: {**statistics_delta(before[m], after[m]),
                     "execution_compute_ms": execution_compute_ms(before[m], after[m])} for m in models}


def execution_compute_ms(before: dict, after: dict) -> float:
    """Mean compute (input + infer + output) per execution between two statistics snapshots, ms, from
    the per-batch-size records (the per-request ones give each request its whole batch's time)."""
    def totals(record: dict) -> tuple[int, int]:
        count = sum(int(b["compute_infer"]["count"]) for b in record["batch_stats"])
        ns = sum(int(b[k]["ns"]) for b in record["batch_stats"]
                 for k in ("compute_input", "compute_infer", "compute_output"))
        return count, ns
    (count_a, ns_a), (count_b, ns_b) = totals(after), totals(before)
    return (ns_a - ns_b) / (count_a - count_b) / 1e6 if count_a > count_b else 0.0


def network_alone_compute_ms(network: Profile, instances: int, batch: float) -> float:
    """The network's compute per execution alone at `batch` (interpolated), ms, from the profile's runs."""
    runs = network.extra["runs"]
    sizes = sorted(int(k.split("/b")[1]) for k in runs if k.startswith(f"{instances}x/"))
    values = [runs[f"{instances}x/b{b}"]["server_compute_ms"] for b in sizes]
    return float(np.interp(batch, sizes, values))


def measure_ensemble_profile(source: ModelRepository, out: Path, preprocess_instances: tuple[int, ...],
                             network_instances: tuple[int, ...], variant: str = DEFAULT_VARIANT,
                             network_profile: Profile | None = None, results: Path | None = None,
                             progress=log_status) -> EnsembleProfile:
    """The three kinds of runs (module doc); returns the EnsembleProfile (not saved)."""
    started = datetime.datetime.now(datetime.timezone.utc)
    ensemble = ModelConfigView.for_variant(source, ENSEMBLE_MODEL)
    max_batch = ensemble.max_batch_size
    out.mkdir(parents=True, exist_ok=True)
    photos = write_input_data(photo_set("sample", results or out), out / "photos.json")
    if network_profile is None:
        network_profile = measure_profile(ONNX_MODEL, tuple(b for b in (1, 2, 4, 8, 16, 32) if b <= max_batch),
                                          network_instances, out / "network", source, speed_under_load=False,
                                          progress=progress, variant=variant)
    pre_timings: dict[int, dict[int, BatchTiming]] = {}
    pre_alone_ms: dict[int, float] = {}
    for p in preprocess_instances:
        folder = out / f"preprocess-{p}x"
        shutil.rmtree(folder / "repository", ignore_errors=True)
        link_model(source, folder / "repository", PREPROCESS_MODEL, stage_config(
            source, PREPROCESS_MODEL, DEFAULT_VARIANT, p, BatcherConfig(max_batch, dynamic_batching=False)))
        with EmbeddedTritonServer(config_on_free_ports(model_repository=folder / "repository"),
                                  log_path=folder / "tritonserver.log") as server:
            http, grpc = server.config.http_url, server.config.grpc_url
            run_level(PREPROCESS_MODEL, grpc, "grpc", photos_load(photos, 2 * p, WARMUP_REQUESTS), 2 * p, folder / "warmup")
            row, stats = run_stats(http, grpc, (PREPROCESS_MODEL,), PREPROCESS_MODEL,
                                   photos_load(photos, 2 * p, REQUESTS), folder / "run", server.process.pid)
        cycle_ms = p / row.throughput * 1e3
        pre_timings[p] = {1: BatchTiming(cycle_ms, 0.0, stats[PREPROCESS_MODEL]["execution_count"])}
        pre_alone_ms[p] = stats[PREPROCESS_MODEL]["execution_compute_ms"]
        progress(f"profile-ensemble: preprocess alone, {p} instance(s): {cycle_ms:.1f} ms per photo per instance "
                 f"(compute {pre_alone_ms[p]:.1f} ms)", step=True)
    pairs, overhead_us = [], 0.0
    for p in preprocess_instances:
        for n in network_instances:
            folder = out / f"ensemble-{p}x{n}"
            repository = folder / "repository"
            shutil.rmtree(repository, ignore_errors=True)
            link_model(source, repository, PREPROCESS_MODEL, stage_config(source, PREPROCESS_MODEL, DEFAULT_VARIANT, p, None))
            link_model(source, repository, ONNX_MODEL, stage_config(source, ONNX_MODEL, variant, n, None))
            ensemble_config = type(ensemble.proto)()
            ensemble_config.CopyFrom(ensemble.proto)
            link_model(source, repository, ENSEMBLE_MODEL, ensemble_config)
            models = (PREPROCESS_MODEL, ONNX_MODEL)
            with EmbeddedTritonServer(config_on_free_ports(model_repository=repository),
                                      log_path=folder / "tritonserver.log") as server:
                http, grpc = server.config.http_url, server.config.grpc_url
                run_level(ENSEMBLE_MODEL, grpc, "grpc", photos_load(photos, ENSEMBLE_CONCURRENCY, WARMUP_REQUESTS),
                          ENSEMBLE_CONCURRENCY, folder / "warmup")
                row, stats = run_stats(http, grpc, models, ENSEMBLE_MODEL,
                                       photos_load(photos, ENSEMBLE_CONCURRENCY, REQUESTS), folder / "run",
                                       server.process.pid)
                if not pairs:
                    lone, _ = run_stats(http, grpc, models, ENSEMBLE_MODEL, photos_load(photos, 1, 40),
                                        folder / "lone", server.process.pid)
                    overhead_us = max(0.0, lone.p50_us - 1e3 * (pre_timings[p][1].mean_ms
                                                                + network_profile.timing(1, n).mean_ms))
            pre, net = stats[PREPROCESS_MODEL], stats[ONNX_MODEL]
            pre_factor = pre["execution_compute_ms"] / max(pre["average_batch"], 1) / pre_alone_ms[p]
            net_factor = net["execution_compute_ms"] / network_alone_compute_ms(network_profile, n, net["average_batch"])
            pairs.append(Interference(p, n, pre_factor, net_factor, {
                "ensemble_throughput": row.throughput, "ensemble_p99_ms": row.p99_us / 1e3,
                "preprocess_average_batch": pre["average_batch"], "network_average_batch": net["average_batch"]}))
            progress(f"profile-ensemble: {p} preprocess x {n} network instance(s): {row.throughput:.1f} images/s "
                     f"closed loop; preprocess x{pre_factor:.2f}, network x{net_factor:.2f} (average batch "
                     f"{net['average_batch']:.1f})", step=True)
    preprocess = Profile(model=PREPROCESS_MODEL, timings=pre_timings, device=network_profile.device,
                         source="perf_analyzer at concurrency 2 x instances, sample photos, no dynamic batcher; "
                                "exec(1) = instances / throughput; a batch of b = b x exec(1)",
                         measured_utc=started.isoformat(timespec="seconds"))
    profile = EnsembleProfile(preprocess, network_profile, tuple(pairs), overhead_us, "sample",
                              started.isoformat(timespec="seconds"))
    return calibrated(profile, batcher_from_config(ModelConfigView.for_variant(source, PREPROCESS_MODEL)),
                      batcher_from_config(ModelConfigView.for_variant(source, ONNX_MODEL, variant)))
