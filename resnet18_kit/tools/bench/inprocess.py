"""The in-process bar: the exported ResNet-18 a config serves, run with no server, arranged the fastest way
a user could write in one process with the same libraries.

The same file, runtime and precision the config's parameters name (resnet18_onnx/1/runtimes.py loads
them, the served models' own code), on the same cores, in each arrangement of `arrangement_names`, every
runner looping in its own Python thread (every runtime releases the GIL while it computes):
  "1 runner x all cores"   one runner with one intra-op thread per usable core;
  "1 thread x N runners"   one single-threaded runner per core, side by side;
  "openvino streams"       OpenVINO only: the file compiled with PERFORMANCE_HINT THROUGHPUT and one runner
                           per infer request OpenVINO asks for, so every stream is busy (runtimes.load_streams).
The bar is the most images/s over arrangements x batch sizes (`bar_batch_sizes`: up to the config's
max_batch_size, the batch chosen by measurement), so a server config cannot look efficient merely because
the in-process side used a slower arrangement. Efficiency = served infer/s / bar infer/s.
`measure` times one runner at given batch sizes (bench runtimes, lone-client). The end-to-end twin
(decode + network, encoded photos in) is resnet18_kit/tools/bench/pipeline_inprocess.py.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

import numpy as np

from resnet18_kit.observe.process_cpu import process_cpu_ms
from resnet18_kit.repository import ModelRepository

ALL_CORES = "1 runner x all cores"
THREAD_PER_CORE = "1 thread x N runners"
STREAMS = "openvino streams"


@dataclass
class InProcessResult:
    """runtime: what ran (a runtime name, or "<runtime> <file>, <arrangement>"); batch_size; throughput in
    images/s over the timed runs (all runners together); p50_ms / mean_ms / p99_ms: latency of one batch
    on one runner, milliseconds; runs: timed batches; cpu_ms_per_image: this process's CPU time (every
    thread, os.times user + system) over the timed runs per image, milliseconds (`process_cpu_ms`)."""

    runtime: str
    batch_size: int
    throughput: float
    p50_ms: float
    mean_ms: float
    runs: int
    p99_ms: float = float("nan")
    cpu_ms_per_image: float = float("nan")


#: load_runner's runtimes -> the ModelRepository property naming the exported file each runs.
RUNTIME_FILES = {"onnxruntime": "onnx_path", "torchscript": "torchscript_path"}


def load_runner(repository: ModelRepository, runtime: str, threads: int = 0):
    """A function FP32 [N,3,224,224] -> [logits FP32 [N,1000], probabilities FP32 [N,1000]] for `runtime`
    ("onnxruntime": the repository's model.onnx, "torchscript": its model.pt), loaded once by the served
    models' own loader code (resnet18_onnx/1/runtimes.py via ModelRepository.runtimes()); threads: intra-op
    threads, 0 = one per core. ONNX Runtime keeps its default spin-waiting here."""
    if runtime not in RUNTIME_FILES:
        raise ValueError(f"unknown runtime {runtime!r} (onnxruntime, torchscript)")
    loaders = repository.runtimes()
    path = getattr(repository, RUNTIME_FILES[runtime])
    return loaders.load(loaders.RuntimeSpec(path=path, runtime=runtime, threads=threads))


def _batch(batch_size: int) -> np.ndarray:
    """Uniform random UINT8 pixels [batch_size, 3, 224, 224], the networks' input."""
    return np.random.default_rng(batch_size).integers(0, 256, (batch_size, 3, 224, 224), dtype=np.uint8)


def measure(repository: ModelRepository | None, runtime: str, batch_sizes: list[int], duration_s: float = 5.0,
            threads: int = 0, runner=None) -> list[InProcessResult]:
    """Time one runner at each batch size for about `duration_s` seconds (after 2 untimed warm-up runs,
    at least 3 timed runs), input `_batch`. `runner` (a loaded function) is timed when given, else
    load_runner(repository, runtime, threads) (repository may then be None); `runtime` is also the label."""
    run = runner or load_runner(repository, runtime, threads)
    results = []
    for batch_size in batch_sizes:
        batch = _batch(batch_size)
        run(batch), run(batch)
        times = []
        started, cpu_ms = time.perf_counter(), process_cpu_ms()
        while len(times) < 3 or time.perf_counter() - started < duration_s:
            t0 = time.perf_counter()
            run(batch)
            times.append(time.perf_counter() - t0)
        cpu_ms = process_cpu_ms() - cpu_ms
        seconds = np.array(times)
        results.append(InProcessResult(runtime, batch_size, float(batch_size * len(times) / seconds.sum()),
                                       float(np.median(seconds) * 1e3), float(seconds.mean() * 1e3), len(times),
                                       float(np.percentile(seconds, 99) * 1e3), cpu_ms / (batch_size * len(times))))
    return results


def measure_workers(runners: list, batch_size: int, duration_s: float, label: str) -> InProcessResult:
    """Every runner of `runners` in a loop on its own thread, side by side, for about `duration_s` seconds
    (each warmed up once first, then at least 2 timed batches each). throughput: images/s of all runners
    together (the sum of each one's own rate, as they ran the whole time); p50_ms / mean_ms / p99_ms: one
    batch on one runner."""
    batch = _batch(batch_size)
    for run in runners:
        run(batch)
    times: list[list[float]] = [[] for _ in runners]
    start = threading.Barrier(len(runners) + 1)
    deadline = [0.0]
    errors: list[BaseException] = []

    def loop(run, record):
        start.wait()
        try:
            while time.perf_counter() < deadline[0] or len(record) < 2:
                t0 = time.perf_counter()
                run(batch)
                record.append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - raised again below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(run, record)) for run, record in zip(runners, times)]
    for thread in threads:
        thread.start()
    deadline[0] = time.perf_counter() + duration_s
    cpu_ms = process_cpu_ms()
    start.wait()
    for thread in threads:
        thread.join()
    cpu_ms = process_cpu_ms() - cpu_ms
    if errors:
        raise errors[0]
    throughput = sum(batch_size * len(t) / sum(t) for t in times)
    seconds = np.concatenate([np.array(t) for t in times])
    return InProcessResult(label, batch_size, float(throughput), float(np.median(seconds) * 1e3),
                           float(seconds.mean() * 1e3), int(seconds.size), float(np.percentile(seconds, 99) * 1e3),
                           cpu_ms / (batch_size * int(seconds.size)))


def arrangement_names(spec) -> tuple[str, ...]:
    """The arrangements tried for a runtimes.RuntimeSpec (module docstring): streams for OpenVINO only."""
    return (ALL_CORES, THREAD_PER_CORE) + ((STREAMS,) if spec.runtime == "openvino" else ())


def allocate_as_served(repository: ModelRepository) -> bool:
    """Give this process the malloc settings every served model sets in its initialize()
    (preprocess/1/allocator.py of `repository`: freed large blocks kept), so the bar spends no page faults the
    server does not. True when set (False where the C library is not glibc)."""
    return repository.served_module("allocator").keep_large_blocks()


def load_arrangement(loaders, spec, name: str) -> list:
    """The runners of arrangement `name` for `spec` (loaders: the model repository's runtimes module)."""
    # Every batch of an arrangement on its own thread count: a config's intra_op_threads_batched left out.
    if name == ALL_CORES:
        return [loaders.load(replace(spec, threads=0, batched_threads=None))]
    if name == THREAD_PER_CORE:
        return [loaders.load(replace(spec, threads=1, batched_threads=None)) for _ in range(loaders.usable_cores())]
    if name == STREAMS:
        return loaders.load_streams(spec)
    raise ValueError(f"unknown arrangement {name!r} (one of {ALL_CORES!r}, {THREAD_PER_CORE!r}, {STREAMS!r})")


def bar_batch_sizes(max_batch_size: int, dynamic_batching: bool, quick: bool) -> list[int]:
    """Batch sizes the bar tries: without a dynamic batcher a served execution is one request (batch 1),
    so [1]; else the config's max_batch_size and its half (and its quarter unless `quick`)."""
    if not dynamic_batching or max_batch_size <= 1:
        return [1]
    sizes = {max_batch_size, max(1, max_batch_size // 2)} | (set() if quick else {max(1, max_batch_size // 4)})
    return sorted(sizes)


@dataclass
class TensorBar:
    """The in-process bar of one config: `best` (arrangement, batch_size, img_per_s, runners, cpu_ms_per_image)
    and every measurement `tried` ({arrangement, runners, **InProcessResult}), for the report."""

    model_file: str
    runtime: str
    precision: str
    best: dict
    tried: list

    def label(self) -> str:
        """e.g. "openvino model.int8.onnx, openvino streams x2, batch 16"."""
        return (f"{self.runtime} {self.model_file}, {self.best['arrangement']} x{self.best['runners']}, "
                f"batch {self.best['batch_size']}")


def strongest(loaders, spec, batch_sizes: list[int], duration_s: float) -> TensorBar:
    """Measure `spec` (a runtimes.RuntimeSpec) in every arrangement at every batch size (measure_workers,
    duration_s each) and keep the fastest (module docstring)."""
    tried = []
    for name in arrangement_names(spec):
        runners = load_arrangement(loaders, spec, name)
        for batch_size in batch_sizes:
            result = measure_workers(runners, batch_size, duration_s,
                                     f"{spec.runtime} {spec.path.name}, {name} x{len(runners)}")
            tried.append({"arrangement": name, "runners": len(runners), **asdict(result)})
        del runners
    best = max(tried, key=lambda row: row["throughput"])
    return TensorBar(spec.path.name, spec.runtime, spec.precision,
                     {"arrangement": best["arrangement"], "batch_size": best["batch_size"],
                      "img_per_s": best["throughput"], "runners": best["runners"],
                      "cpu_ms_per_image": best["cpu_ms_per_image"]}, tried)


def again(loaders, spec, bar: TensorBar, duration_s: float) -> Callable[[], InProcessResult]:
    """A callable that measures the bar's best arrangement and batch once more (measure_workers, duration_s)
    each time it is called; its runners are loaded once, here."""
    runners = load_arrangement(loaders, spec, bar.best["arrangement"])
    return partial(measure_workers, runners, bar.best["batch_size"], duration_s, bar.best["arrangement"])


def paired(bar: Callable[[], object], measure: Callable[[], dict], figures: Callable[[object], dict]) -> dict:
    """One served level measured between two in-process measurements of its bar: bar(), measure(), bar().
    Returns measure()'s row with "inprocess_paired": the mean of each of `figures(result)` (a dict of
    numbers) over the two bar results, and "before" / "after" (each one's figures). The machine's speed
    drifts by up to 15 % within a minute (shared cores), so a served level is compared with the bar
    measured right around it, not minutes away. Used by the tensor sweeps (bar: `again`) and the main job
    (bar: PipelineTwin.saturation)."""
    before = figures(bar())
    row = measure()
    after = figures(bar())
    row["inprocess_paired"] = {**mean_of(before, after), "before": before, "after": after}
    return row


def mean_of(before: dict, after: dict) -> dict:
    """Field-wise mean of two dicts of numbers with the same keys (one measurement before and one after
    something served), so a drift of a shared machine's speed does not land on one side only."""
    return {key: (before[key] + after[key]) / 2 for key in before}


def tensor_figures(result: InProcessResult) -> dict:
    """`paired`'s figures of a tensor bar measurement: {"img_per_s", "cpu_ms_per_image"}."""
    return {"img_per_s": result.throughput, "cpu_ms_per_image": result.cpu_ms_per_image}
