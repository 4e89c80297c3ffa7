"""The main job in-process, with no server: the strongest pipeline a user could write in one process with
the same code and files, the bar a served config variant is measured against.

Encoded photo bytes -> decode + transform (the preprocess model's own code,
preprocess/1/image_transform.py of the model repository via ModelRepository.image_transform(), with the
limits of the variant's preprocess config) -> UINT8 [B, 3, 224, 224] -> the network (the file, runtime and
precision of the variant's resnet18_onnx config, loaded by its own runtimes.py) -> logits FP32 [B, 1000].
Arranged for speed, not as the server is:
  * the network: the fastest in-process arrangement of that file and runtime (bench/inprocess.py:
    OpenVINO's streams each with its own infer request, one single-threaded runner per core, or one
    runner on every core) at the fastest batch size up to the config's max_batch_size, both chosen by a
    short tensor measurement when the twin is built (`choose_s`);
  * decode: one thread per usable core and one more (DECODE_THREADS_OVER_CORES; Pillow's decoders and resize, and numpy's arithmetic, release
    the GIL, so threads decode in parallel), filling batches of B rows handed to the network's runners
    through a queue (depth: the runners' count, at least 2), each runner on its own thread: while the
    network runs one batch per runner, the decoders fill the next.

Two figures, over the same photo bytes cycled in order:
  * saturation throughput (img/s): after each runner's first batch (warm-up), img/s = B x (n - 1) /
    (t_n - t_1), with t_1 .. t_n the completion times of the n >= 3 batches completed in the timed window:
    the steady rate between completions; and the CPU per image over the same span, (c_n - c_1) /
    (B x (n - 1)), with c_i this process's CPU time at completion i (over the whole window it would also
    count the batches still being decoded and run at its end, not counted as images: 12-15 % more);
  * batch-1 latency (ms): per image, decode it and run the network on a batch of 1, one after the other
    on one thread, with the network loaded as the served config loads it (its intra-op threads): what a
    lone request costs without a server; p50 and p99 over the timed images.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from resnet18_kit.tools.bench import inprocess
from resnet18_kit.contract import IMAGE_SHAPE, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.observe.process_cpu import process_cpu_ms
from resnet18_kit.repository import ModelRepository

#: Batches the decode threads may have filled ahead of the network, at least (the queue between the
#: two stages; the runners' count when more).
QUEUE_DEPTH = 2
#: Decode threads beyond one per core: a decoder also runs Python between the GIL-free calls and waits
#: to hand over a full batch. Measured (int8, 2 cores, sample photos): 3 threads 57.5 / 63.8 img/s against
#: 53.2 / 56.2 with 2; the same on 12 MP JPEGs (47.9 / 47.6 against 48.1 / 47.7).
DECODE_THREADS_OVER_CORES = 1
#: Seconds per arrangement and batch size of the tensor measurement that picks the network's arrangement.
CHOOSE_S = 1.0
#: Shape of one network input row: UINT8 [3, 224, 224].
ROW_SHAPE = IMAGE_SHAPE
#: The warm-up (every network worker's first batch) must end within this many seconds.
WARMUP_LIMIT_S = 120.0


class _Batch:
    """One batch being filled by the decode threads: pixels UINT8 [B, 3, 224, 224]; claimed: rows handed
    to a decode thread; decoded: rows written."""

    def __init__(self, batch_size: int):
        self.pixels = np.empty((batch_size, *ROW_SHAPE), np.uint8)
        self.claimed = 0
        self.decoded = 0


@dataclass
class InProcessPipelineResult:
    """One in-process measurement of a variant's pipeline on one photo set.

    saturation_img_per_s: images/s through decode + network at saturation; saturation_batches: batches
    timed (n above). batch1_p50_ms / batch1_p99_ms: decode + network at batch 1, per image, milliseconds;
    batch1_images: images timed; saturation_cpu_ms_per_image: below."""

    saturation_img_per_s: float
    saturation_batches: int
    batch1_p50_ms: float
    batch1_p99_ms: float
    batch1_images: int
    #: This process's CPU time (every thread) per image between the first and the last timed completion
    #: (the span the throughput is measured over), milliseconds.
    saturation_cpu_ms_per_image: float = float("nan")


class PipelineTwin:
    """A config variant's main job in-process, arranged for speed (see the module docstring), its runtimes
    loaded once.

    repository: the model repository whose configs, code and exported files it runs; variant: a
    tritonserver --model-config-name ("default" = config.pbtxt everywhere); choose_s: seconds per
    arrangement and batch size of the tensor measurement that picks the network's arrangement.
    Attributes: spec (runtimes.RuntimeSpec of the variant's network), network_bar (bench.inprocess.TensorBar
    of that choice), batch_size, decode_threads, network_workers, runners, limits (image_transform.
    ImageLimits of the variant's preprocess config)."""

    def __init__(self, repository: ModelRepository, variant: str, choose_s: float = CHOOSE_S):
        network = ModelConfigView.for_variant(repository, ONNX_MODEL, variant)
        preprocess = ModelConfigView.for_variant(repository, PREPROCESS_MODEL, variant)
        loaders, transform = repository.runtimes(), repository.image_transform()
        self.allocator_as_served = inprocess.allocate_as_served(repository)
        self.variant = variant
        self.spec = loaders.RuntimeSpec.from_parameters(network.parameters, repository.onnx_path.parent)
        sizes = inprocess.bar_batch_sizes(network.max_batch_size, network.dynamic_batching, quick=True)
        self.network_bar = inprocess.strongest(loaders, self.spec, sizes, choose_s)
        self.batch_size = self.network_bar.best["batch_size"]
        self.runners = inprocess.load_arrangement(loaders, self.spec, self.network_bar.best["arrangement"])
        self.network_workers = len(self.runners)
        self.decode_threads = loaders.usable_cores() + DECODE_THREADS_OVER_CORES
        params = preprocess.parameters
        self.limits = transform.ImageLimits(max_image_bytes=int(params["max_image_bytes"]),
                                            max_image_pixels=int(params["max_image_pixels"]),
                                            max_aspect_ratio=float(params["max_aspect_ratio"]))
        self._preprocess = transform.preprocess
        self._lone = loaders.load(self.spec)  # batch-1 latency: the network as the served config loads it

    def describe(self) -> dict:
        """The arrangement, for the report: runtime spec fields, batch size, thread counts."""
        return {"variant": self.variant, "model_file": self.spec.path.name, "runtime": self.spec.runtime,
                "intra_op_threads": self.spec.threads, "allow_spinning": self.spec.allow_spinning,
                "precision": self.spec.precision, "batch_size": self.batch_size,
                "decode_threads": self.decode_threads, "network_workers": self.network_workers,
                "allocator_as_served": self.allocator_as_served,
                "network_arrangement": self.network_bar.best["arrangement"], "network_label": self.label(),
                "network_tried": self.network_bar.tried}

    def label(self) -> str:
        """One phrase: decode threads, the network's arrangement and batch."""
        return f"{self.decode_threads} decode threads, {self.network_bar.label()}"

    def decode_into(self, data: bytes, row: np.ndarray) -> None:
        """Decode + transform one encoded image into `row` (UINT8 [3, 224, 224]), as the served model does."""
        self._preprocess(data, self.limits, out=row)

    def saturation(self, photos: list[bytes], duration_s: float) -> tuple[float, int, float]:
        """Images/s of the pipelined decode -> network at saturation, the batches timed (module docstring),
        and this process's CPU ms per image between the first and the last timed completion (all threads).
        Warm-up until every network worker ran one batch, then about duration_s seconds, and on until at
        least 3 batches completed in the timed window."""
        batches: queue.Queue = queue.Queue(maxsize=max(QUEUE_DEPTH, self.network_workers))
        stop, warm, lock = threading.Event(), threading.Event(), threading.Lock()
        order = itertools.cycle(range(len(photos)))
        filling = [_Batch(self.batch_size)]
        finished = [0]  # batches the network completed, warm-up included
        completions: list[tuple[float, float]] = []  # (perf_counter(), process CPU ms) at each timed completion
        errors: list[BaseException] = []

        def decode() -> None:
            while not stop.is_set():
                with lock:
                    if filling[0].claimed == self.batch_size:
                        filling[0] = _Batch(self.batch_size)
                    batch, row, data = filling[0], filling[0].claimed, photos[next(order)]
                    batch.claimed += 1
                self.decode_into(data, batch.pixels[row])
                with lock:
                    batch.decoded += 1
                    complete = batch.decoded == self.batch_size
                while complete and not stop.is_set():
                    try:
                        batches.put(batch.pixels, timeout=0.05)
                        break
                    except queue.Full:
                        pass

        def network(run) -> None:
            while not stop.is_set():
                try:
                    pixels = batches.get(timeout=0.05)
                except queue.Empty:
                    continue
                run(pixels)
                with lock:
                    finished[0] += 1
                    if warm.is_set():
                        completions.append((time.perf_counter(), process_cpu_ms()))

        def guarded(target, *args) -> None:
            try:
                target(*args)
            except BaseException as exc:  # noqa: BLE001 - raised again by the caller
                errors.append(exc)
                stop.set()

        workers = [threading.Thread(target=guarded, args=(decode,)) for _ in range(self.decode_threads)]
        workers += [threading.Thread(target=guarded, args=(network, run)) for run in self.runners]
        for worker in workers:
            worker.start()
        try:
            give_up = time.perf_counter() + WARMUP_LIMIT_S
            while not stop.is_set() and finished[0] < self.network_workers:
                if time.perf_counter() > give_up:
                    raise TimeoutError(f"in-process pipeline: no batch through the network in {WARMUP_LIMIT_S:g} s")
                time.sleep(0.01)
            warm.set()
            ends = time.perf_counter() + duration_s
            while not stop.is_set() and (time.perf_counter() < ends or len(completions) < 3):
                time.sleep(0.01)
        finally:
            stop.set()
            for worker in workers:
                worker.join()
        if errors:
            raise errors[0]
        (first_s, first_cpu_ms), (last_s, last_cpu_ms) = completions[0], completions[-1]
        images = self.batch_size * (len(completions) - 1)  # completed between the first and the last
        return images / (last_s - first_s), len(completions), (last_cpu_ms - first_cpu_ms) / images

    def batch1_latency(self, photos: list[bytes], duration_s: float, min_images: int = 20
                       ) -> tuple[float, float, int]:
        """(p50 ms, p99 ms, images timed) of decode + network at batch 1 per image, for about duration_s
        seconds and at least min_images images (after one untimed pass over the photos)."""
        pixels = np.empty((1, *ROW_SHAPE), np.uint8)
        run = self._lone
        for data in photos:
            self.decode_into(data, pixels[0])
            run(pixels)
        times = []
        ends = time.perf_counter() + duration_s
        for data in itertools.cycle(photos):
            if len(times) >= min_images and time.perf_counter() >= ends:
                break
            started = time.perf_counter()
            self.decode_into(data, pixels[0])
            run(pixels)
            times.append(time.perf_counter() - started)
        ms = np.array(times) * 1e3
        return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), len(times)

    def measure(self, photos: list[bytes], saturation_s: float, batch1_s: float) -> dict:
        """Both figures on `photos` (encoded files): an InProcessPipelineResult as a dict."""
        throughput, batches_timed, cpu_ms = self.saturation(photos, saturation_s)
        p50_ms, p99_ms, images = self.batch1_latency(photos, batch1_s)
        return asdict(InProcessPipelineResult(throughput, batches_timed, p50_ms, p99_ms, images, cpu_ms))
