"""The steps of `bench gpu` (resnet18_kit/tools/bench/gpu_run.py runs them in order, each bounded in time):
unpack the bundle, check the environment, export the network, the in-process bar, serve the gpu_python
variant, its tensors under perf_analyzer, the main job (photos through the ensemble), stop.

Each step takes the run's `GpuContext` and returns its record (a dict for the JSON), or raises `Skipped`
(with the reason: the step has nothing to do here) or any other exception (the step failed: its first line
is the reason). In a dry run (`--dry-run`, no CUDA) every step runs on the CPU with short loads: the
network's instances are KIND_CPU, the in-process bar runs at batch 1-2 and is recorded as skipped.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import warnings
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from resnet18_kit.contract import ENSEMBLE_MODEL, LOGITS_BYTES, PREPROCESS_MODEL, TORCHSCRIPT_MODEL
from resnet18_kit.observe.statistics import model_statistics, statistics_delta
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.contract import STUB_EXECUTABLE
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.server.tritonserver import tritonserver_binary
from resnet18_kit.server.resources import python_backend_regions
from resnet18_kit.tools.bench import gpu_env
from resnet18_kit.tools.bench.gpu_bar import measure_bar, served_runner
from resnet18_kit.tools.bench.gpu_pack import (GPU_VARIANT, MANIFEST, PAYLOAD, STUB_NUMPY_WHY, STUB_SITE,
                                              numpy_fits_stub)
from resnet18_kit.tools.load.perf_analyzer import LoadSpec, PerfAnalyzerError, run_level
from resnet18_kit.tools.load.photos import write_input_data

#: The gpu_python variant's max_batch_size (resnet18_torchscript/configs/gpu_python.pbtxt).
GPU_MAX_BATCH_SIZE = 16
#: Tensor concurrency: powers of two up to 2 x max_batch_size x 2 instances (Triton's rule of thumb for
#: saturation), which the variant's queue of 64 still holds (tests/test_gpu_run.py checks both).
TENSOR_LEVELS = (1, 2, 4, 8, 16, 32, 64)
#: Batch sizes at which the served model's runner is timed alone (gpu_bar.served_runner).
SERVED_RUNNER_BATCHES = (1, 8, 16)
#: Photo concurrency through the ensemble (its steps' queues hold 64 each).
PHOTO_LEVELS = (1, 4, 16, 32, 64)
#: A dry run's levels and fixed request counts: enough to run every piece once.
DRY_LEVELS, DRY_REQUESTS = (1, 2), 4
#: Busy fraction of a stage's instances from which it bounds the main job.
SATURATED = 0.85
#: /dev/shm the run needs: 5 stubs x 16 MiB and perf_analyzer's regions (64 requests' tensors), with room.
SHM_NEEDED_MIB = 256


class Skipped(Exception):
    """A step with nothing to do here (its reason is the message); not a failure."""


@dataclass
class GpuContext:
    """What the steps share: the bundle, the folders, what earlier steps found and started."""

    bundle: Path
    out: Path
    work: Path
    dry_run: bool
    manifest: dict = field(default_factory=dict)
    #: "cuda:0" when torch sees a GPU (and not a dry run), else "cpu" (environment step).
    device: str = "cpu"
    #: Why the server cannot start here (environment step), one line; None when it can.
    blocker: str | None = None
    server: EmbeddedTritonServer | None = None
    #: Instance counts that replace the served configs' (model -> count; None: as configured).
    instances: dict[str, int | None] = field(default_factory=dict)
    #: The python3 whose installation the stubs use (environment step); None: this Python.
    stub_python: Path | None = None

    @property
    def site(self) -> Path:
        return self.work / "site"

    @property
    def repository(self) -> ModelRepository:
        return ModelRepository(self.work / "model_repository")

    @property
    def perf_analyzer(self) -> Path:
        return self.work / "bin" / "perf_analyzer"


def read_manifest(bundle: Path) -> dict:
    """The manifest of a bundle written by `bench gpu-pack`. ValueError (one line) for another file."""
    if not zipfile.is_zipfile(bundle):
        raise ValueError(f"{bundle}: not a zip application written by `resnet18-kit bench gpu-pack`")
    with zipfile.ZipFile(bundle) as archive:
        names = set(archive.namelist())
        if not {MANIFEST, PAYLOAD} <= names:
            raise ValueError(f"{bundle}: no {MANIFEST} and {PAYLOAD}: not a bundle of `resnet18-kit bench gpu-pack`")
        return json.loads(archive.read(MANIFEST))


def unpack(run: GpuContext) -> dict:
    """Extract the payload into run.work, check it against the manifest, and put its tritonserver first on
    sys.path and its libraries (lib/) on LD_LIBRARY_PATH, for this process and the ones it starts."""
    run.manifest = read_manifest(run.bundle)
    with zipfile.ZipFile(run.bundle) as archive, archive.open(PAYLOAD) as payload, \
            tarfile.open(fileobj=payload, mode="r|xz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.12, 3.11.4+: nothing outside run.work
            tar.extractall(run.work, filter="data")
        else:
            tar.extractall(run.work)
    missing = [name for name in run.manifest["files"] if not os.path.lexists(run.work / name)]
    if missing:
        raise RuntimeError(f"{len(missing)} files of the manifest missing after unpacking, e.g. {missing[0]}")
    sys.path.insert(0, str(run.site))
    importlib.invalidate_caches()
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(run.work / "lib"),
                                                                   os.environ.get("LD_LIBRARY_PATH")]))
    if not tritonserver_binary().is_relative_to(run.work):
        raise RuntimeError(f"tritonserver resolves to {tritonserver_binary()}, not the bundle's")
    unpacked = sum(f.stat().st_size for f in run.work.rglob("*") if f.is_file() and not f.is_symlink())
    return {"work": str(run.work), "files": len(run.manifest["files"]), "unpacked_mib": round(unpacked / 2**20, 1),
            "bundle_mib": round(run.bundle.stat().st_size / 2**20, 1),
            "manifest": {k: run.manifest.get(k) for k in ("triton_version", "gpu_variant", "stub_pythons", "created_utc")}}


def environment(run: GpuContext) -> dict:
    """The machine, the GPU (nvidia-smi, torch.cuda), onnxruntime's providers, and ldd of tritonserver,
    this Python's stub and perf_analyzer. Sets run.device and, when serving cannot work, run.blocker."""
    binaries = {"tritonserver": run.site / "pytriton" / "tritonserver" / "bin" / "tritonserver",
                "perf_analyzer": run.perf_analyzer}
    record = {"machine": gpu_env.machine(), "nvidia_smi": gpu_env.nvidia_smi(), "torch": gpu_env.torch_facts(),
              "onnxruntime_providers": gpu_env.onnxruntime_providers(),
              "ldd": {name: gpu_env.library_report(path) for name, path in binaries.items()}}
    stub, run.blocker = gpu_env.check_stub(run.site, run.manifest.get("stub_pythons", []), run.work / "libpython")
    for version in run.manifest.get("stub_pythons", []):  # the others for the record: not this Python's
        record["ldd"][f"stub {version}"] = stub if version == gpu_env.this_python() else gpu_env.library_report(
            run.site / "pytriton" / "tritonserver" / "python_backend_stubs" / version / STUB_EXECUTABLE)
    if record["ldd"]["tritonserver"]["missing"] and run.blocker is None:
        run.blocker = f"tritonserver lacks {', '.join(record['ldd']['tritonserver']['missing'])} (ldd)"
    record["stub_python"] = stub_python(run)
    if record["stub_python"].get("error") and run.blocker is None:
        run.blocker = record["stub_python"]["error"]
    cuda = record["torch"]["cuda_available"]
    run.device = "cuda:0" if cuda and not run.dry_run else "cpu"
    if not cuda and not run.dry_run and run.blocker is None:
        run.blocker = "torch sees no CUDA device: the KIND_GPU instances cannot load"
    if record["machine"]["shm_free_mib"] < SHM_NEEDED_MIB:  # 16 MiB per stub, perf_analyzer's tensors
        record["shm_warning"] = (f"/dev/shm has {record['machine']['shm_free_mib']} MiB free, under "
                                 f"{SHM_NEEDED_MIB}: the stubs or perf_analyzer may fail to allocate")
    record["device"], record["blocker"] = run.device, run.blocker
    return record


def stub_python(run: GpuContext) -> dict:
    """When the bundle has a numpy for this Python (STUB_SITE/<X.Y>: STUB_NUMPY_WHY), a virtual environment
    over this Python with that numpy first (gpu_env.overlay_python), which the stubs then use
    (run.stub_python); and a check, in a child Python of the environment the stubs get, that what the
    models import loads: {"python", "numpy", "error" (one line, when it fails or would find numpy 2)}."""
    packages = run.work / STUB_SITE / gpu_env.this_python()
    if packages.is_dir():
        run.stub_python = gpu_env.overlay_python(run.work / "stub-python", packages)
    python = run.stub_python or Path(sys.executable)
    probe = "import numpy, PIL, torch; torch.from_numpy(numpy.zeros(2, numpy.float32)); print(numpy.__version__)"
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    record = {"python": str(python), "numpy": result.stdout.strip() or None}
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        record["error"] = f"the stubs' imports (numpy, PIL, torch) fail in {python}: {why}"
    elif record["numpy"] and not numpy_fits_stub(record["numpy"]):
        record["error"] = f"the stubs would import numpy {record['numpy']}: {STUB_NUMPY_WHY}"
    return record


def export(run: GpuContext) -> dict:
    """ResNet-18 traced to TorchScript into the unpacked repository (resnet18_kit/export; the seeded random
    init: no weights can be downloaded there, and speed does not depend on them), the preprocess warmup
    image, and the exported file's logits on run.device against eager torch on the CPU."""
    import numpy as np
    import torch

    from resnet18_kit.export import resnet18 as r18
    from resnet18_kit.export.__main__ import write_warmup_image

    repository = run.repository
    model, source = r18.load_model(None, seed=0, allow_download=False)
    with warnings.catch_warnings():  # torch marks its TorchScript tracer deprecated (export.__main__ too)
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
        r18.export_torchscript(model, repository.torchscript_path)
    write_warmup_image(repository.warmup_image_path)
    batch = r18.parity_batch()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
        scripted = torch.jit.load(str(repository.torchscript_path), map_location=run.device).eval()
    with torch.inference_mode():
        logits = scripted(torch.from_numpy(batch).to(run.device))[0].cpu().numpy()
    return {"weights": source.spec, "weights_meaningful": source.meaningful,
            "model_pt_mib": round(repository.torchscript_path.stat().st_size / 2**20, 1), "device": run.device,
            "max_abs_logit_diff_vs_eager_cpu": float(np.max(np.abs(logits - r18.eager_logits(model, batch))))}


def inprocess(run: GpuContext, deadline: float) -> dict:
    """The in-process bar (gpu_bar.measure_bar) on run.device, and the served model's runner timed alone
    (gpu_bar.served_runner, "served_runner" in the record), until `deadline` (time.monotonic())."""
    path = run.repository.torchscript_path
    if run.dry_run:
        measure_bar(path, "cpu", GPU_MAX_BATCH_SIZE, deadline, batch_sizes=(1, 2), stream_counts=(2,),
                    window_s=0.1, warmup_passes=1)
        import torch

        runtimes = run.repository.runtimes()
        served_runner(runtimes.GpuRunner(torch.jit.load(str(path)).eval(), "cpu"), (1, 2), deadline, window_s=0.1,
                      warmup_passes=1)
        raise Skipped("dry run, no CUDA: the bar's and the served runner's code ran on the CPU at batch 1 and 2;"
                      " no figures kept")
    if run.device == "cpu":
        raise RuntimeError("torch sees no CUDA device")
    import torch

    try:
        record = measure_bar(path, run.device, GPU_MAX_BATCH_SIZE, deadline)
        runtimes = run.repository.runtimes()
        runner = runtimes.load(runtimes.RuntimeSpec(path, "torchscript", device=run.device))
        record["served_runner"] = served_runner(runner, SERVED_RUNNER_BATCHES, deadline)
        return record
    finally:
        torch.cuda.empty_cache()  # the GPU's memory to the server that follows


def serve(run: GpuContext, deadline: float) -> dict:
    """Start tritonserver from the bundle on free ports with --model-config-name gpu_python (a dry run:
    its network instances turned KIND_CPU) and wait until it is ready."""
    if run.blocker:
        raise RuntimeError(run.blocker)
    if run.dry_run:
        variant = run.repository.config_path(TORCHSCRIPT_MODEL, GPU_VARIANT)
        variant.write_text(re.sub(r"\bkind: KIND_GPU\b", "kind: KIND_CPU", variant.read_text()))
    for model, count in run.instances.items():
        if count is not None:
            served = run.repository.config_path(model, GPU_VARIANT)
            served.write_text(re.sub(r"\bcount: \d+", f"count: {count}", served.read_text(), count=1))
    config = config_on_free_ports(model_repository=run.repository.root, model_config_name=GPU_VARIANT,
                                  backend_root=run.work / "backends", stub_python=run.stub_python,
                                  refuse_first=False, exit_timeout_s=10)
    run.server = EmbeddedTritonServer(config, log_path=run.work / "tritonserver.log")
    ready_s = run.server.start(ready_timeout_s=max(10.0, deadline - time.monotonic() - 5))
    served, preprocess = (config_over_http(config.http_url, model) for model in (TORCHSCRIPT_MODEL, PREPROCESS_MODEL))
    return {"ready_s": round(ready_s, 1), "variant": GPU_VARIANT, "instance_group": served.get("instance_group"),
            "preprocess_instance_group": preprocess.get("instance_group"),
            "max_batch_size": served.get("max_batch_size"), "stubs": sorted(run.server.stub_processes())}


def config_over_http(http_url: str, model: str) -> dict:
    """The config tritonserver at `http_url` ("host:port") serves for `model` (/v2/models/<model>/config)."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/config", timeout=10) as response:
        return json.load(response)


def tensors(run: GpuContext, deadline: float) -> dict:
    """perf_analyzer over gRPC with system shared memory, batch-1 UINT8 pixel requests to resnet18_torchscript,
    at TENSOR_LEVELS: infer/s, p50/p99 and the average batch per level; the best level."""
    load = LoadSpec("concurrency", DRY_LEVELS if run.dry_run else TENSOR_LEVELS, shared_memory="system",
                    output_shm_bytes=LOGITS_BYTES, measurement_ms=2000, max_trials=4,
                    request_count=DRY_REQUESTS if run.dry_run else 0)
    levels = measure_levels(run, TORCHSCRIPT_MODEL, load, "tensors", (TORCHSCRIPT_MODEL,), deadline)
    return {"model": TORCHSCRIPT_MODEL, "protocol": "grpc", "shared_memory": "system", "levels": levels,
            "best": best(levels)}


def main_job(run: GpuContext, deadline: float) -> dict:
    """The sample photos as encoded BYTES requests to the `resnet18` ensemble over gRPC at PHOTO_LEVELS:
    img/s and p99 per level, each step's share of busy instances, and the stage that bounds the best level."""
    photos = [run.work / name for name in run.manifest["photos"]]
    input_data = write_input_data(photos, run.work / "photos.json")
    load = LoadSpec("concurrency", DRY_LEVELS if run.dry_run else PHOTO_LEVELS, input_data=input_data,
                    profile_export=False, measurement_ms=2000, max_trials=4,
                    request_count=DRY_REQUESTS if run.dry_run else 0)
    levels = measure_levels(run, ENSEMBLE_MODEL, load, "photos", (PREPROCESS_MODEL, TORCHSCRIPT_MODEL), deadline)
    top = best(levels)
    return {"model": ENSEMBLE_MODEL, "protocol": "grpc", "photos": run.manifest["photos"], "levels": levels,
            "best": top, "bound_by": bound_by(top["stages"]) if top else None}


def stop(run: GpuContext) -> dict:
    """Stop the server (SIGTERM, 10 s, then its process group) and remove its shared memory."""
    if run.server is None:
        raise Skipped("no server was started")
    status = run.server.stop(drain_s=10)
    return {"exit_status": status, "shm_regions_left": len(python_backend_regions(run.server.shm_prefix))}


def measure_levels(run: GpuContext, model: str, load: LoadSpec, name: str, stages: tuple[str, ...],
                   deadline: float) -> list[dict]:
    """One perf_analyzer run per level of `load` (measure_level), until `deadline` is near."""
    if run.server is None or not run.server.running:
        raise Skipped("no server: the serve step did not start one")
    levels, previous = [], 0.0
    for level in load.levels:
        if time.monotonic() + 15 > deadline:
            levels.append({"concurrency": level, "error": "not measured: the step's time ran out"})
            continue
        fallback = max(200, int(previous * 4))  # ~4 s of requests when no 3 windows agree
        levels.append(measure_level(run, model, replace(load, fallback_request_count=fallback), level,
                                    run.work / "perf" / name / f"c{level:g}", stages, deadline))
        previous = levels[-1].get("infer_per_s", previous)
    return levels


def measure_level(run: GpuContext, model: str, load: LoadSpec, level: float, folder: Path,
                  stages: tuple[str, ...], deadline: float) -> dict:
    """One level: perf_analyzer's infer/s and latency percentiles (ms), GPU busy share and peak memory,
    and per stage (statistics extension, this level only) its average batch, queue and compute per request
    (ms) and the busy share of its instances."""
    config = run.server.config
    before = {m: model_statistics(config.http_url, m) for m in stages}
    started = time.monotonic()
    with gpu_env.GpuSampler() as gpu:
        try:
            row = run_level(model, config.grpc_url, "grpc", load, level, folder, binary=run.perf_analyzer,
                            timeout_s=max(10.0, deadline - time.monotonic() - 5))
        except PerfAnalyzerError as exc:
            return {"concurrency": level, "error": exc.summary}
    wall_s = time.monotonic() - started
    after = {m: model_statistics(config.http_url, m) for m in stages}
    record = {"concurrency": level, "infer_per_s": round(row.throughput, 1), "p50_ms": round(row.p50_us / 1000, 2),
              "p90_ms": round(row.p90_us / 1000, 2), "p99_ms": round(row.p99_us / 1000, 2),
              "gpu_busy": gpu.mean_busy, "gpu_memory_mib": gpu.peak_memory_mib, "stages": {}}
    stubs = run.server.stub_processes()
    for model_name in stages:
        delta = statistics_delta(before[model_name], after[model_name])
        instances = sum(bool(re.fullmatch(rf"{model_name}_\d+_\d+", stub)) for stub in stubs) or 1
        record["stages"][model_name] = {
            "instances": instances, "average_batch": round(delta["average_batch"], 2),
            "queue_ms": round(delta["queue_us"] / 1000, 2), "compute_infer_ms": round(delta["compute_infer_us"] / 1000, 2),
            "busy": round(busy_s(before[model_name], after[model_name]) / (wall_s * instances), 3)}
    return record


def busy_s(before: dict, after: dict) -> float:
    """Seconds a model's instances spent executing between two statistics snapshots (every batch's
    compute input + infer + output: batch_stats counts each execution once)."""
    def total_ns(record: dict) -> int:
        return sum(int(entry[part]["ns"]) for entry in record.get("batch_stats", [])
                   for part in ("compute_input", "compute_infer", "compute_output"))
    return (total_ns(after) - total_ns(before)) / 1e9


def best(levels: list[dict]) -> dict | None:
    """The measured level with the most infer/s (None when none was measured)."""
    measured = [level for level in levels if "infer_per_s" in level]
    return max(measured, key=lambda level: level["infer_per_s"]) if measured else None


def bound_by(stages: dict) -> str:
    """Which stage bounds a level: the busiest one when its instances are SATURATED, else a sentence
    saying none is (then the client or the server's front end bounds it)."""
    name, stage = max(stages.items(), key=lambda item: item[1]["busy"])
    if stage["busy"] >= SATURATED:
        return f"{name} ({stage['instances']} instances, {stage['busy']:.0%} busy)"
    return (f"no stage saturated (busiest: {name}, {stage['busy']:.0%} of {stage['instances']} instances): "
            "the client or the server's front end (gRPC, the ensemble's tensor copies)")


def keep_server_log(run: GpuContext, limit_bytes: int = 4 << 20) -> Path | None:
    """Copy the server log's last `limit_bytes` into run.out (what comes back); None without a log."""
    log = run.work / "tritonserver.log"
    if not log.is_file():
        return None
    target = run.out / "tritonserver.log"
    with open(log, "rb") as source, open(target, "wb") as kept:
        source.seek(max(0, log.stat().st_size - limit_bytes))
        shutil.copyfileobj(source, kept)
    return target
