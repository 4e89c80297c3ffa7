"""The in-process bar on a GPU: the model.pt the gpu_python variant serves, run by TorchScript on the same GPU
with no server, arranged the fastest way a user could write in one process.

Each runner owns a CUDA stream, a pinned (page-locked) host batch UINT8 [b,3,224,224], its copy on the GPU and
pinned host buffers for both outputs (logits, probabilities: FP32 [b,1000]); one pass copies the batch in,
runs the network and copies both outputs out (what the served model does per batch), then waits for its
stream. Runners loop in Python threads, one stream each, so copies and kernels of different runners overlap.
Measured: one runner at each batch size of `batch_sizes`, then `stream_counts` runners at the fastest batch
within the served max_batch_size and at the fastest of all. The bar (what "served / in-process" divides by)
is the most img/s within max_batch_size, the kit's rule (docs/benchmarks.md); the best of all batch sizes is
recorded beside it (whether a larger max_batch_size would pay). Same file, same torch defaults (TF32 in
convolutions, cuDNN's default algorithm choice) as the served model.

On the CPU (`bench gpu --dry-run`) the same code runs without streams or pinned memory, to check it.
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from pathlib import Path

import numpy as np

#: Batch sizes tried with one runner on a GPU (a batch of 256 is 154 MB of input).
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Runners (CUDA streams) tried side by side.
STREAM_COUNTS = (2, 4)
#: Passes each runner makes before the timed window (kernel choice, allocator, clocks up).
WARMUP_PASSES = 3


class Runner:
    """One stream's buffers and one pass (module doc). device: "cuda:<i>" or "cpu"."""

    def __init__(self, module, device: str, batch_size: int):
        import torch

        self.torch, self.module, self.batch_size = torch, module, batch_size
        self.cuda = device.startswith("cuda")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        host = torch.randn(batch_size, 3, 224, 224)
        self.host_in = host.pin_memory() if self.cuda else host
        self.device_in = torch.empty_like(host, device=device)
        self.host_out = [torch.empty(batch_size, 1000, pin_memory=self.cuda) for _ in range(2)]

    def once(self) -> None:
        """Copy the batch in, run the network, copy both outputs out, wait for it all."""
        torch = self.torch
        with torch.no_grad(), (torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()):
            self.device_in.copy_(self.host_in, non_blocking=self.cuda)
            for host, output in zip(self.host_out, self.module(self.device_in)):
                host.copy_(output, non_blocking=self.cuda)
        if self.cuda:
            self.stream.synchronize()


def timed(module, device: str, batch_size: int, streams: int, window_s: float, warmup_passes: int = WARMUP_PASSES
          ) -> dict:
    """`streams` runners at `batch_size` for `window_s` seconds after `warmup_passes` each: {"batch",
    "streams", "img_per_s", "p50_ms", "p99_ms" (one pass of one runner), "passes"}."""
    runners = [Runner(module, device, batch_size) for _ in range(streams)]
    for runner in runners:
        for _ in range(warmup_passes):
            runner.once()
    latencies: list[list[float]] = [[] for _ in runners]
    start = threading.Barrier(streams + 1)
    end = [0.0]

    def loop(runner: Runner, spent: list[float]) -> None:
        start.wait()
        while time.perf_counter() < end[0]:
            began = time.perf_counter()
            runner.once()
            spent.append(time.perf_counter() - began)
    threads = [threading.Thread(target=loop, args=pair, daemon=True) for pair in zip(runners, latencies)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    end[0] = began + window_s
    start.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    return {"batch": batch_size, "streams": streams,
            **rates(batch_size, [s for spent in latencies for s in spent], elapsed)}


def rates(batch_size: int, spent_s: list[float], elapsed_s: float) -> dict:
    """{"img_per_s", "p50_ms", "p99_ms" (one pass), "passes"} of passes that took `spent_s` seconds each
    at `batch_size` images, in a window of `elapsed_s` seconds."""
    every = np.array(spent_s) * 1000.0
    return {"img_per_s": round(len(spent_s) * batch_size / elapsed_s, 1),
            "p50_ms": round(float(np.percentile(every, 50)), 3) if spent_s else None,
            "p99_ms": round(float(np.percentile(every, 99)), 3) if spent_s else None, "passes": len(spent_s)}


def measure_bar(model_path: Path, device: str, max_batch_size: int, deadline: float,
                batch_sizes: tuple[int, ...] = BATCH_SIZES, stream_counts: tuple[int, ...] = STREAM_COUNTS,
                window_s: float = 1.0, warmup_passes: int = WARMUP_PASSES) -> dict:
    """The bar (module doc) for the TorchScript file `model_path` on `device`; stops trying new
    arrangements when `deadline` (time.monotonic()) is near. Returns {"device", "batch_sizes": [timed()],
    "streams": [timed()], "bar": the best within max_batch_size, "best_any_batch", "not_measured": [...]}.
    Raises RuntimeError when not even batch 1 could be measured before the deadline."""
    import torch

    with warnings.catch_warnings():  # torch marks torch.jit deprecated; the served model loads the same way
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
        module = torch.jit.load(str(model_path), map_location=device).eval()
    margin_s = 3 * window_s + 2.0
    single, skipped = [], []
    for batch_size in batch_sizes:
        if time.monotonic() + margin_s > deadline:
            skipped.append(f"batch {batch_size}")
            continue
        single.append(timed(module, device, batch_size, 1, window_s, warmup_passes))
    within = [r for r in single if r["batch"] <= max_batch_size]
    if not within:
        raise RuntimeError(f"no batch size measured before the step's deadline (tried {batch_sizes})")
    fastest = {max(within, key=lambda r: r["img_per_s"])["batch"], max(single, key=lambda r: r["img_per_s"])["batch"]}
    streams = []
    for count in stream_counts:
        for batch_size in sorted(fastest):
            if time.monotonic() + margin_s > deadline:
                skipped.append(f"{count} streams at batch {batch_size}")
                continue
            streams.append(timed(module, device, batch_size, count, window_s, warmup_passes))
    candidates = within + [r for r in streams if r["batch"] <= max_batch_size]
    return {"device": device, "max_batch_size": max_batch_size, "window_s": window_s, "batch_sizes": single,
            "streams": streams, "bar": max(candidates, key=lambda r: r["img_per_s"]),
            "best_any_batch": max(single + streams, key=lambda r: r["img_per_s"]), "not_measured": skipped}


def served_runner(runner, batch_sizes: tuple[int, ...], deadline: float, window_s: float = 1.0,
                  warmup_passes: int = WARMUP_PASSES) -> list[dict]:
    """The served model's own runner (the repository's resnet18_onnx/1/runtimes.py: `load` for a GPU, or its
    `GpuRunner` on "cpu" to check the code) called as model.py calls it, on one thread with no server:
    per-request arrays UINT8 [1,3,224,224] concatenated into its staging buffer, the batch run, the outputs
    back as arrays. Per batch size: {"batch", "img_per_s", "p50_ms", "p99_ms", "passes"}; stops when
    `deadline` (time.monotonic()) is near. Beside the bar and the served figures it splits the serving
    path's cost: the runner's (copies, launches) against the server's (batching, IPC, gRPC)."""
    rows = []
    for batch_size in batch_sizes:
        if time.monotonic() + 2 * window_s + 1.0 > deadline:
            break
        requests = [np.random.default_rng(i).integers(0, 256, (1, 3, 224, 224), dtype=np.uint8) for i in range(batch_size)]

        def once() -> None:
            staging = getattr(runner, "staging", None)
            batch = (np.concatenate(requests, out=staging(batch_size, requests[0])) if staging
                     else np.concatenate(requests))
            runner(batch)
        for _ in range(warmup_passes):
            once()
        spent, end = [], time.perf_counter() + window_s
        began = time.perf_counter()
        while time.perf_counter() < end:
            start = time.perf_counter()
            once()
            spent.append(time.perf_counter() - start)
        rows.append({"batch": batch_size, **rates(batch_size, spent, time.perf_counter() - began)})
    return rows
