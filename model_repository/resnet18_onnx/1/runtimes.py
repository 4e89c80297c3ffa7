"""The network's runtimes: an exported ResNet-18 file -> a function UINT8 pixels [N,3,224,224] -> its
outputs, logits and probabilities, both FP32 [N,1000] (OUTPUT_NAMES, in the files' order). The files
normalize the pixels in their own graph (resnet18_kit/export/resnet18.py), so no runtime here does.

One place for how each runtime is loaded and configured, used by the served models (model.py beside this
file reads a `RuntimeSpec` from its config's parameters) and by the in-process measurements (bench/), so
the in-process figures are the served code's.

  onnxruntime  model.onnx (FP32) or model.int8.onnx (INT8 QDQ), CPUExecutionProvider;
  openvino     the same ONNX files compiled by OpenVINO for "CPU": `precision` "f32" or "bf16" (its
               INFERENCE_PRECISION_HINT; on a CPU with AVX-512 BF16 OpenVINO's own default is bf16) for
               the layers that are not INT8;
  torchscript  model.pt, torch.jit on the CPU, or on a GPU for a model instance of kind KIND_GPU (its
               device: `instance_device`; batches are copied to it and the outputs back).

Config parameters (all string values): model_filename; runtime (default: onnxruntime for .onnx,
torchscript for .pt); intra_op_threads (0 = one thread per usable core); intra_op_threads_batched
(openvino only: the threads of an execution of more than one image; unset = intra_op_threads; see
`_openvino`); allow_spinning ("1"/"0", ONNX Runtime: idle intra-op threads spin-wait for work, which takes
cores from other processes); precision (openvino: "f32" or "bf16").

Placement: no thread is pinned to a core. A served model runs as several stub processes (instances,
preprocess stubs) that know nothing of each other, and a runtime pinning its threads picks the same cores
in each of them: OpenVINO pins each inference thread (its ENABLE_CPU_PINNING, on by default), so two
single-threaded instances both ran on core 0 of 2 (two such processes in-process: 41 img/s together
pinned, 82-93 unpinned; one pinned to a core each by hand, 82-83); ONNX Runtime pins its intra-op
workers when intra_op_num_threads is left at 0, so here the count of usable cores is passed explicitly,
which leaves them unpinned (same speed). The OS scheduler then spreads every thread over the cores.
TorchScript pins nothing. tests/test_placement.py reads the threads' affinities of a serving server.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

#: The exported files' outputs, in their order (export/resnet18.py OUTPUT_NAMES): the logits and their
#: softmax over the 1000 classes, computed in the exported graph.
OUTPUT_NAMES = ("logits", "probabilities")
#: One batch UINT8 [N,3,224,224] -> [logits, probabilities], each FP32 [N,1000].
Runner = Callable[[np.ndarray], list]
RUNTIMES = ("onnxruntime", "openvino", "torchscript")
_DEFAULT_RUNTIME = {".onnx": "onnxruntime", ".pt": "torchscript"}


@dataclass(frozen=True)
class RuntimeSpec:
    """How to run one exported file. threads: intra-op threads, 0 = one per core. device: "cpu", or
    "cuda:<index>" (torchscript only). batched_threads: openvino only, the intra-op threads of an execution
    of more than one image (None = threads)."""

    path: Path
    runtime: str = "onnxruntime"
    threads: int = 0
    allow_spinning: bool = True
    precision: str = "f32"
    device: str = "cpu"
    batched_threads: int | None = None

    @classmethod
    def from_parameters(cls, params: dict[str, str], version_dir: Path, device: str = "cpu") -> "RuntimeSpec":
        """The spec a model config's `parameters` (key -> string value) describe, for the file in
        `version_dir`, run on `device` (`instance_device`). Raises ValueError naming an unknown runtime or
        precision, a runtime that runs on the CPU only given a GPU, or intra_op_threads_batched for a
        runtime other than openvino."""
        path = Path(version_dir) / params["model_filename"]
        batched = params.get("intra_op_threads_batched")
        spec = cls(path=path, runtime=params.get("runtime", _DEFAULT_RUNTIME.get(path.suffix, "")),
                   threads=int(params.get("intra_op_threads", "0")),
                   allow_spinning=params.get("allow_spinning", "1") != "0",
                   precision=params.get("precision", "f32"), device=device,
                   batched_threads=None if batched is None else int(batched))
        if spec.runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {spec.runtime!r} for {path.name} (one of {', '.join(RUNTIMES)})")
        if spec.precision not in ("f32", "bf16"):
            raise ValueError(f"unknown precision {spec.precision!r} (f32 or bf16)")
        if spec.device != "cpu" and spec.runtime != "torchscript":
            raise ValueError(f"runtime {spec.runtime} runs on the CPU only; a KIND_GPU instance needs torchscript")
        if spec.batched_threads is not None and spec.runtime != "openvino":
            raise ValueError(f"intra_op_threads_batched is read by the openvino runtime only, not {spec.runtime}")
        return spec


def instance_device(args: dict) -> str:
    """The device of the model instance Triton's Python backend describes in `args` (initialize()'s):
    "cuda:<model_instance_device_id>" for an instance of kind KIND_GPU, else "cpu"."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id', 0))}"
    return "cpu"


def load(spec: RuntimeSpec) -> Runner:
    """Load `spec.path` with its runtime, once; the returned function runs one batch and returns the
    file's outputs as a list of arrays in OUTPUT_NAMES order."""
    return {"onnxruntime": _onnxruntime, "openvino": _openvino, "torchscript": _torchscript}[spec.runtime](spec)


def _onnxruntime(spec: RuntimeSpec) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    # An explicit count: with 0 ONNX Runtime pins its workers to cores (module docstring, "Placement").
    options.intra_op_num_threads = spec.threads or usable_cores()
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spec.allow_spinning else "0")
    session = ort.InferenceSession(str(spec.path), options, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    return lambda batch: session.run(list(OUTPUT_NAMES), {input_name: batch})


def _openvino(spec: RuntimeSpec) -> Runner:
    """With spec.batched_threads set (and different from the threads), the file is compiled twice, and a
    batch of one image runs on `threads`, a larger batch on `batched_threads` (BatchedThreads). A batch of
    several images means that requests queued while this instance was busy: the server is loaded, and the
    cores are wanted by the other instances and steps, where a second intra-op thread waits at each
    layer's barrier for a thread that may be off its core. A lone request keeps every core."""
    config = {"INFERENCE_PRECISION_HINT": spec.precision, "PERFORMANCE_HINT": "LATENCY",
              "ENABLE_CPU_PINNING": False}  # module docstring, "Placement"
    config["INFERENCE_NUM_THREADS"] = threads = spec.threads or usable_cores()
    compiled = _compile_openvino(spec.path, config)
    lone = _openvino_runner(compiled, compiled.create_infer_request())
    if not spec.batched_threads or spec.batched_threads == threads:
        return lone
    compiled = _compile_openvino(spec.path, {**config, "INFERENCE_NUM_THREADS": spec.batched_threads})
    return BatchedThreads(lone, _openvino_runner(compiled, compiled.create_infer_request()),
                          threads, spec.batched_threads)


class BatchedThreads:
    """A Runner that runs a batch of one image on `lone` (compiled with `threads` intra-op threads) and a
    larger batch on `batched` (`batched_threads`); see `_openvino`."""

    def __init__(self, lone: Runner, batched: Runner, threads: int, batched_threads: int):
        self.lone, self.batched = lone, batched
        self.threads, self.batched_threads = threads, batched_threads

    def __call__(self, batch: np.ndarray) -> list:
        return (self.lone if len(batch) == 1 else self.batched)(batch)


def _compile_openvino(path: Path, config: dict):
    """`path` compiled for OpenVINO's CPU plugin with `config`, on a thread of its own that ends at once.
    OpenVINO 2026.4 sets a signal alternate stack (sigaltstack) on the thread that compiles, and after
    several compiled models in one process come and go it can leave that thread's alternate stack pointing
    at freed memory: the next signal handled there (SIGTERM, Ctrl-C) crashed the process with SIGSEGV
    (bench's in-process pipeline built and dropped, then a SIGTERM: tests/test_int8.py). No OpenVINO
    release is known to fix it (seen with 2026.4.1). A thread that ends takes its alternate stack with it,
    so the caller's signals stay safe."""
    import openvino as ov

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="openvino-compile") as pool:
        return pool.submit(ov.Core().compile_model, str(path), "CPU", config).result()


def _openvino_runner(compiled, request) -> Runner:
    """A Runner on one infer request of `compiled` (an openvino CompiledModel, also its `compiled` attribute)."""
    outputs = [compiled.output(name) for name in OUTPUT_NAMES]

    def run(batch: np.ndarray) -> list:
        request.infer({0: batch})
        return [request.get_tensor(output).data.copy() for output in outputs]  # the request reuses its buffers
    run.compiled = compiled
    return run


def load_streams(spec: RuntimeSpec) -> list[Runner]:
    """OpenVINO only: `spec.path` compiled once with PERFORMANCE_HINT THROUGHPUT (OpenVINO picks the
    streams, each a share of the cores running its own inference) and one runner per infer request it
    asks for (OPTIMAL_NUMBER_OF_INFER_REQUESTS). Each runner blocks its calling thread and releases the
    GIL, so one thread per runner keeps every stream busy. For in-process measurements (bench/): the
    served instances run one inference at a time each. Raises ValueError for another runtime."""
    if spec.runtime != "openvino":
        raise ValueError(f"streams are OpenVINO's; {spec.path.name} runs on {spec.runtime}")
    compiled = _compile_openvino(spec.path, {"INFERENCE_PRECISION_HINT": spec.precision,
                                             "PERFORMANCE_HINT": "THROUGHPUT"})
    requests = compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
    return [_openvino_runner(compiled, compiled.create_infer_request()) for _ in range(requests)]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset narrows)."""
    return len(os.sched_getaffinity(0))


def _torchscript(spec: RuntimeSpec) -> Runner:
    import torch

    # torch's intra-op thread count is one setting per process: each run sets its own, so two runners
    # with different counts in one process (in-process comparisons) do not change each other's.
    threads = spec.threads or usable_cores()
    module = torch.jit.load(str(spec.path), map_location=spec.device).eval()
    if spec.device != "cpu":
        return GpuRunner(module, spec.device)

    def run(batch: np.ndarray) -> list:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            return [tensor.numpy() for tensor in module(torch.from_numpy(batch))]
    return run


class GpuRunner:
    """A TorchScript module on a GPU, arranged as the in-process GPU bar runs it
    (resnet18_kit/tools/bench/gpu_bar.py): a CUDA stream of its own, a pinned (page-locked) host batch, its
    copy on the GPU and pinned host buffers for the outputs; both copies are asynchronous on the stream and
    the call waits once, for the stream. A pageable batch costs the driver a staging copy and a wait per
    copy: in the first H200 run, a served batch of 8 computed in 5.7 ms against the bar's 1.3 ms.

    Call with a batch UINT8 [N,3,224,224]: the outputs, FP32 [N,1000] each, as new arrays. staging(N, like) is a
    view of the pinned input buffer: a batch written there (np.concatenate(..., out=)) is not copied again.
    The buffers grow to the largest N seen and are this runner's alone: one call at a time. On device
    "cpu" the same code runs without a stream or pinned memory (tests/test_gpu_run.py checks it there)."""

    def __init__(self, module, device: str):
        import torch

        self.torch, self.module, self.device = torch, module, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.capacity = 0

    def _grow(self, size: int, sample: np.ndarray) -> None:
        torch = self.torch
        self.host_in = torch.empty((size, *sample.shape[1:]), dtype=torch.from_numpy(sample[:0]).dtype,
                                   pin_memory=self.cuda)
        self.host_in_array = self.host_in.numpy()
        self.device_in = torch.empty_like(self.host_in, device=self.device)
        self.host_out: list = []
        self.capacity = size

    def staging(self, size: int, like: np.ndarray) -> np.ndarray:
        """The first `size` rows of the pinned input buffer, shaped and typed as rows of `like`."""
        if size > self.capacity or self.host_in_array.shape[1:] != like.shape[1:] \
                or self.host_in_array.dtype != like.dtype:
            self._grow(size, like)
        return self.host_in_array[:size]

    def __call__(self, batch: np.ndarray) -> list:
        torch, size = self.torch, len(batch)
        staged = self.staging(size, batch)
        if not np.shares_memory(staged, batch):
            np.copyto(staged, batch)
        with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()):
            self.device_in[:size].copy_(self.host_in[:size], non_blocking=self.cuda)
            outputs = self.module(self.device_in[:size])
            if len(self.host_out) != len(outputs) or self.host_out[0].shape[0] < self.capacity:
                self.host_out = [torch.empty((self.capacity, *o.shape[1:]), dtype=o.dtype, pin_memory=self.cuda)
                                 for o in outputs]
            for host, output in zip(self.host_out, outputs):
                host[:size].copy_(output, non_blocking=self.cuda)
        if self.cuda:
            self.stream.synchronize()
        # Copies: the buffers are reused by the next call, and a response may still hold its outputs then.
        return [host[:size].numpy().copy() for host in self.host_out]
