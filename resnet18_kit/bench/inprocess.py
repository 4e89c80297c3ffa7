"""The ceiling: the exported ResNet-18 run in-process, with no server, at the batch sizes served.

The same files the server loads (model.onnx with ONNX Runtime, model.pt with TorchScript), on the same
cores, arranged two ways: one session using every core (`measure`, intra-op threads 0 = one per core),
and one single-threaded session per core running side by side (`measure_parallel`), the in-process
twin of N model instances with `intra_op_threads: 1`. The ceiling is the better of the two, so a server
config cannot look efficient merely by using an arrangement the in-process baseline did not try.
Serving efficiency = served infer/s / ceiling infer/s at the batch size the server formed.
The networks are loaded by the served models' own code (runtimes.py, see `load_runner`). The end-to-end
twin (decode + network, encoded photos in) is resnet18_kit/bench/pipeline_inprocess.py.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from resnet18_kit.repository import ModelRepository


@dataclass
class InProcessResult:
    """runtime: "onnxruntime" or "torchscript"; batch_size; throughput in images/s over the timed
    runs; p50_ms / mean_ms / p99_ms: latency of one batch, milliseconds; runs: timed batches."""

    runtime: str  # "onnxruntime", or "onnxruntime x2 sessions, 1 thread each" from measure_parallel
    batch_size: int
    throughput: float
    p50_ms: float
    mean_ms: float
    runs: int
    p99_ms: float = float("nan")


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


def measure(repository: ModelRepository | None, runtime: str, batch_sizes: list[int], duration_s: float = 5.0,
            threads: int = 0, runner=None) -> list[InProcessResult]:
    """Time `runtime` at each batch size for about `duration_s` seconds (after 2 untimed warm-up runs,
    at least 3 timed runs). Input: standard-normal FP32 [batch, 3, 224, 224], the scale of normalized
    images. `runner` (a loaded function) is timed when given, else load_runner(repository, runtime, threads)
    (repository may then be None); `runtime` is also the result's label."""
    run = runner or load_runner(repository, runtime, threads)
    results = []
    for batch_size in batch_sizes:
        batch = np.random.default_rng(batch_size).standard_normal((batch_size, 3, 224, 224), dtype=np.float32)
        run(batch), run(batch)
        times = []
        started = time.perf_counter()
        while len(times) < 3 or time.perf_counter() - started < duration_s:
            t0 = time.perf_counter()
            run(batch)
            times.append(time.perf_counter() - t0)
        seconds = np.array(times)
        results.append(InProcessResult(runtime, batch_size, float(batch_size * len(times) / seconds.sum()),
                                       float(np.median(seconds) * 1e3), float(seconds.mean() * 1e3), len(times),
                                       float(np.percentile(seconds, 99) * 1e3)))
    return results


def measure_parallel(repository: ModelRepository, batch_size: int, duration_s: float = 5.0,
                     sessions: int | None = None) -> InProcessResult:
    """ONNX Runtime on the repository's model.onnx, `sessions` single-threaded sessions (default: one per
    usable core), each run in a loop
    by its own Python thread (ONNX Runtime releases the GIL), for about `duration_s`. throughput: images/s
    of all sessions together; p50_ms / mean_ms: one batch on one session."""
    sessions = sessions or len(os.sched_getaffinity(0))
    runners = [load_runner(repository, "onnxruntime", threads=1) for _ in range(sessions)]
    batch = np.random.default_rng(batch_size).standard_normal((batch_size, 3, 224, 224), dtype=np.float32)
    for run in runners:
        run(batch)
    times: list[list[float]] = [[] for _ in runners]
    start = threading.Barrier(sessions + 1)
    deadline = [0.0]

    def loop(run, record):
        start.wait()
        while time.perf_counter() < deadline[0] or len(record) < 2:
            t0 = time.perf_counter()
            run(batch)
            record.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=loop, args=(run, record)) for run, record in zip(runners, times)]
    for thread in threads:
        thread.start()
    deadline[0] = time.perf_counter() + duration_s
    start.wait()
    for thread in threads:
        thread.join()
    # The sessions ran side by side the whole time: total rate = sum of each session's own rate.
    throughput = sum(batch_size * len(t) / sum(t) for t in times)
    seconds = np.concatenate([np.array(t) for t in times])
    return InProcessResult(f"onnxruntime x{sessions} sessions, 1 thread each", batch_size, float(throughput),
                           float(np.median(seconds) * 1e3), float(seconds.mean() * 1e3), int(seconds.size),
                           float(np.percentile(seconds, 99) * 1e3))
