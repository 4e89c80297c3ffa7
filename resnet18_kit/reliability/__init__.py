"""python -m resnet18_kit.reliability: overload, queue timeouts, readiness, bad input, faults and shutdown against
the real embedded tritonserver, with every request accounted for.

Each scenario sends requests, classifies every outcome (answered correctly, refused with 503 /
UNAVAILABLE, timed out in the queue, refused as bad input, wrong answer, other error, or lost: no
outcome at all within a generous client-side bound) and compares what the clients saw with what the
server counted (metrics endpoint and statistics extension). The tests (tests/test_reliability*.py) run
the same functions with small numbers; this command runs them bigger and prints the table of
docs/reliability.md (also written as JSON under results/reliability/):

    .venv/bin/python -m resnet18_kit.reliability                       # every scenario, about 3 minutes
    .venv/bin/python -m resnet18_kit.reliability --scenario burst --burst-requests 600

The 10-minute soak at 80% of capacity is `python -m resnet18_kit.reliability.soak`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tritonclient.utils import InferenceServerException

from resnet18_kit.client.classifier import protocol_module
from resnet18_kit.client.errors import QUEUE_FULL_MESSAGE, QUEUE_TIMEOUT_MESSAGE
from resnet18_kit.observe.metrics import model_counters
from resnet18_kit.observe.statistics import PeriodicSampler
from resnet18_kit.contract import (ENSEMBLE_MODEL, MODEL_REPOSITORY, ONNX_MODEL, PROTOCOLS, REPO_ROOT, TRITON_VERSION,
                                   results_dir)
from resnet18_kit.server.embedded import EmbeddedTritonServer, ServerConfig, config_on_free_ports

#: The scenarios' own models (beside this module): an echo with a short queue and a slow model with a queue timeout.
RELIABILITY_REPOSITORY = Path(__file__).parent / "model_repository"
ECHO_MODEL = "reliability_echo"        # model_repository/ here: y = x after 200 ms, queue of 8
TIMEOUT_MODEL = "reliability_timeout"  # model_repository/ here: 300 ms per request, 1 s queue timeout
RESULTS_DIR = results_dir("reliability")
#: A request with no outcome after this long is counted as lost (hung). Far above any queue wait here.
HANG_BOUND_S = 60.0
#: Tolerance between an answer under load (any batch size) and the reference answer (batch of 1).
RTOL, ATOL = 1e-4, 1e-4

# -- outcomes ------------------------------------------------------------------------------------------

ANSWERED = "answered"        # a response with the right request id and the right values
REFUSED = "refused"          # 503 / UNAVAILABLE "Exceeds maximum queue size": never queued
TIMED_OUT = "timed-out"      # 503 / UNAVAILABLE "Request timeout expired": left the queue unserved
INVALID = "invalid"          # 400 / INVALID_ARGUMENT
WRONG = "wrong"              # a response, but not the answer to this request
ERROR = "error"              # any other failure
LOST = "lost"                # no outcome within HANG_BOUND_S


@dataclass
class Outcome:
    """What one request got. latency_s: from just before the send to the outcome."""

    index: int
    kind: str
    latency_s: float
    status: str | None = None
    message: str = ""


def classify_error(exc: InferenceServerException) -> tuple[str, str | None, str]:
    status, message = exc.status(), exc.message() or str(exc)
    if QUEUE_FULL_MESSAGE in message:
        kind = REFUSED
    elif QUEUE_TIMEOUT_MESSAGE in message:
        kind = TIMED_OUT
    elif status in ("400", "StatusCode.INVALID_ARGUMENT"):
        kind = INVALID
    else:
        kind = ERROR
    return kind, status, message


def response_id(result) -> str:
    response = result.get_response()
    return response["id"] if isinstance(response, dict) else response.id


def summarize(outcomes: list[Outcome], sent: int) -> dict:
    """Counts per kind, `lost` = sent minus every outcome seen, and latency percentiles (ms) of
    answers and refusals."""
    counts = {kind: sum(o.kind == kind for o in outcomes)
              for kind in (ANSWERED, REFUSED, TIMED_OUT, INVALID, WRONG, ERROR, LOST)}
    counts[LOST] += sent - len(outcomes)
    summary = {"sent": sent, **counts}
    for kind in (ANSWERED, REFUSED, TIMED_OUT):
        latencies = sorted(o.latency_s * 1000 for o in outcomes if o.kind == kind)
        if latencies:
            summary[f"{kind}_ms"] = {"p50": round(percentile(latencies, 50), 1),
                                     "p99": round(percentile(latencies, 99), 1),
                                     "max": round(latencies[-1], 1)}
    return summary


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


# -- what the server counted ---------------------------------------------------------------------------

def server_counts(config: ServerConfig, model: str) -> dict[str, float]:
    """The server's own counts for `model`: metrics endpoint (requests succeeded, failed per reason,
    inferences, executions) and statistics extension (success and fail counts)."""
    import tritonclient.http as httpclient

    metrics = model_counters(config.metrics_url, model)
    client = httpclient.InferenceServerClient(config.http_url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    finally:
        client.close()
    counts = {"metrics_success": metrics.get("nv_inference_request_success", 0.0),
              "metrics_failure": metrics.get("nv_inference_request_failure", 0.0),
              "metrics_inferences": metrics.get("nv_inference_count", 0.0),
              "stats_success": float(stats["success"].get("count", 0)),
              "stats_fail": float(stats["fail"].get("count", 0))}
    return counts


def failure_reasons(config: ServerConfig, model: str) -> dict[str, float]:
    """nv_inference_request_failure of `model` per `reason` label (REJECTED, CANCELED, BACKEND, OTHER)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(config.metrics_url, timeout=5) as response:
        text = response.read().decode()
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "nv_inference_request_failure" and sample.labels.get("model") == model:
                reason = sample.labels.get("reason", "")
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return reasons


def settled_counts(config: ServerConfig, model: str, timeout_s: float = 10.0) -> dict[str, float]:
    """server_counts once they stop changing (two reads 0.5 s apart agree) or `timeout_s` passed:
    the server updates its counters as each request completes, a moment after the client's outcome."""
    deadline = time.monotonic() + timeout_s
    counts = server_counts(config, model)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = server_counts(config, model)
        if again == counts:
            break
        counts = again
    return counts


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {key: int(round(after[key] - before[key])) for key in after}


# -- overload: a burst far above capacity --------------------------------------------------------------

@dataclass
class TensorLoad:
    """Requests for one model: `inputs[i % len(inputs)]` as tensor `input_name`, answered correctly when
    output `output_name` equals `expected[i % len(inputs)]` within RTOL/ATOL."""

    model: str
    input_name: str
    output_name: str
    datatype: str
    inputs: list[np.ndarray]
    expected: list[np.ndarray] = field(default_factory=list)

    def input_for(self, index: int) -> np.ndarray:
        return self.inputs[index % len(self.inputs)]

    def correct(self, index: int, output: np.ndarray) -> bool:
        reference = self.expected[index % len(self.expected)]
        return output.shape == reference.shape and (
            np.allclose(output, reference, rtol=RTOL, atol=ATOL) if output.dtype.kind == "f"
            else np.array_equal(output, reference))


def onnx_load(count: int = 8, seed: int = 0) -> TensorLoad:
    """`count` distinct random images for resnet18_onnx (FP32 [1, 3, 224, 224] each)."""
    rng = np.random.default_rng(seed)
    return TensorLoad(ONNX_MODEL, "input", "logits", "FP32",
                      [rng.standard_normal((1, 3, 224, 224), dtype=np.float32) for _ in range(count)])


def ensemble_load(count: int = 5) -> TensorLoad:
    """The sample photos as encoded bytes for the `resnet18` ensemble (BYTES [1, 1] each)."""
    from resnet18_kit.client.samples import sample_photos

    photos = [p.read_bytes() for p in sample_photos()[:count]]
    return TensorLoad(ENSEMBLE_MODEL, "image", "logits", "BYTES",
                      [np.array([[photo]], dtype=np.object_) for photo in photos])


def echo_load(count: int = 16) -> TensorLoad:
    return TensorLoad(ECHO_MODEL, "x", "y", "FP32",
                      [np.full((1, 4), i, np.float32) for i in range(count)],
                      [np.full((1, 4), i, np.float32) for i in range(count)])


def _infer_input(module, load: TensorLoad, index: int):
    array = load.input_for(index)
    request = module.InferInput(load.input_name, list(array.shape), load.datatype)
    request.set_data_from_numpy(array)
    return request


def reference_answers(config: ServerConfig, load: TensorLoad) -> TensorLoad:
    """Fill `load.expected` with the server's answer to each input sent alone, at no load."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(config.grpc_url)
    try:
        load.expected = [client.infer(load.model, [_infer_input(grpcclient, load, i)],
                                      outputs=[grpcclient.InferRequestedOutput(load.output_name)]
                                      ).as_numpy(load.output_name)
                         for i in range(len(load.inputs))]
    finally:
        client.close()
    return load


def _judge(load: TensorLoad, index: int, result, started: float) -> Outcome:
    latency = time.perf_counter() - started
    if response_id(result) != str(index):
        return Outcome(index, WRONG, latency, message=f"response id {response_id(result)!r}")
    if not load.correct(index, result.as_numpy(load.output_name)):
        return Outcome(index, WRONG, latency, message="values differ from the reference")
    return Outcome(index, ANSWERED, latency)


async def _send_all(url: str, protocol: str, load: TensorLoad, indices: range,
                    timeout_us: int | None = None) -> list[Outcome]:
    """Send every request of `indices` at once (asyncio, one connection or stream each) and wait for
    all outcomes. Requests are built before the first is sent, so they leave together."""
    module = protocol_module(protocol, asyncio_api=True)
    if protocol == "http":
        client = module.InferenceServerClient(url, conn_limit=len(indices) + 1, conn_timeout=HANG_BOUND_S)
    else:
        client = module.InferenceServerClient(url)
    requested = [module.InferRequestedOutput(load.output_name)]
    prepared = [(i, _infer_input(module, load, i)) for i in indices]
    extra = {} if timeout_us is None else {"timeout": timeout_us}

    async def one(index: int, request) -> Outcome:
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(
                client.infer(load.model, [request], outputs=requested, request_id=str(index), **extra),
                HANG_BOUND_S)
        except asyncio.TimeoutError:
            return Outcome(index, LOST, time.perf_counter() - started, message="no outcome (hung)")
        except InferenceServerException as exc:
            kind, status, message = classify_error(exc)
            return Outcome(index, kind, time.perf_counter() - started, status, message)
        except Exception as exc:  # connection reset, ...
            return Outcome(index, ERROR, time.perf_counter() - started, None, f"{type(exc).__name__}: {exc}")
        return _judge(load, index, result, started)

    try:
        return list(await asyncio.gather(*(one(i, r) for i, r in prepared)))
    finally:
        await client.close()


def _probe(url: str, protocol: str, load: TensorLoad, first_index: int, stop: threading.Event,
           interval_s: float, outcomes: list[Outcome]) -> None:
    """Send one request at a time until `stop`, appending each outcome to `outcomes`: each request alone
    on its connection, so a refusal's latency is the server's time to refuse (plus loopback)."""
    module = protocol_module(protocol)
    client = module.InferenceServerClient(url)
    index = first_index
    try:
        while not stop.is_set():
            request = _infer_input(module, load, index)
            started = time.perf_counter()
            try:
                result = client.infer(load.model, [request], outputs=[module.InferRequestedOutput(load.output_name)],
                                       request_id=str(index))
                outcomes.append(_judge(load, index, result, started))
            except InferenceServerException as exc:
                kind, status, message = classify_error(exc)
                outcomes.append(Outcome(index, kind, time.perf_counter() - started, status, message))
            index += 1
            stop.wait(interval_s)
    finally:
        client.close()


@dataclass
class BurstResult:
    protocol: str
    model: str
    outcomes: list[Outcome]
    server: dict[str, int]          # delta of server_counts over the burst
    failure_reasons: dict[str, int]  # delta of nv_inference_request_failure per reason
    wall_s: float

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    def summary(self) -> dict:
        return {"protocol": self.protocol, "model": self.model, "wall_s": round(self.wall_s, 2),
                "total": summarize(self.outcomes, self.sent), "server": self.server,
                "failure_reasons": self.failure_reasons}


def burst(config: ServerConfig, protocol: str, load: TensorLoad, requests: int) -> BurstResult:
    """Send `requests` requests at once to `load.model`, classify every outcome, and read the server's
    counts before and after. A burst request's refusal waits until the server has read the burst; the
    server's own time to refuse is `refusal_latency`'s measure."""
    url = config.http_url if protocol == "http" else config.grpc_url
    # settled: the counters of requests answered just before (reference answers) may still be moving
    before, reasons_before = settled_counts(config, load.model), failure_reasons(config, load.model)
    started = time.perf_counter()
    outcomes = asyncio.run(_send_all(url, protocol, load, range(requests)))
    wall = time.perf_counter() - started
    after = settled_counts(config, load.model)
    reasons = {k: int(v - reasons_before.get(k, 0.0)) for k, v in failure_reasons(config, load.model).items()}
    return BurstResult(protocol, load.model, outcomes, delta(before, after), reasons, wall)


def refusal_latency(config: ServerConfig, protocol: str, load: TensorLoad, seconds: float = 4.0,
                    probes: int = 4) -> dict:
    """The server's time to refuse a request that meets a full queue.

    Fillers (asyncio, max_queue_size + max_batch_size + 16 of them, each sending its next request as
    soon as the previous one is answered, 20 ms after a refusal) keep `load.model`'s queue full; once they
    are being refused, `probes` threads send single requests one after another for `seconds`, each alone
    on its connection (a probe that finds room waits its turn, seconds). Every outcome, fillers' and
    probes', is accounted for."""
    from resnet18_kit.server.overload import queue_limits

    url = config.http_url if protocol == "http" else config.grpc_url
    limit = queue_limits((MODEL_REPOSITORY, RELIABILITY_REPOSITORY))[load.model]
    fillers = limit.max_queue_size + limit.max_batch_size + 16
    stop = threading.Event()
    filler_outcomes: list[Outcome] = []

    async def fill():
        module = protocol_module(protocol, asyncio_api=True)
        client = (module.InferenceServerClient(url, conn_limit=fillers + 1, conn_timeout=HANG_BOUND_S)
                  if protocol == "http" else module.InferenceServerClient(url))
        requested = [module.InferRequestedOutput(load.output_name)]

        async def worker(index: int):
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    result = await asyncio.wait_for(client.infer(
                        load.model, [_infer_input(module, load, index)], outputs=requested,
                        request_id=str(index)), HANG_BOUND_S)
                    filler_outcomes.append(_judge(load, index, result, started))
                except asyncio.TimeoutError:
                    filler_outcomes.append(Outcome(index, LOST, time.perf_counter() - started))
                except InferenceServerException as exc:
                    kind, status, message = classify_error(exc)
                    filler_outcomes.append(Outcome(index, kind, time.perf_counter() - started, status, message))
                    await asyncio.sleep(0.02)
                index += fillers

        try:
            await asyncio.gather(*(worker(k) for k in range(fillers)))
        finally:
            await client.close()

    filler = threading.Thread(target=lambda: asyncio.run(fill()), daemon=True)
    filler.start()
    probe_outcomes: list[Outcome] = []
    try:
        deadline = time.monotonic() + 60  # probe once the fillers are being refused: the queue is full
        while sum(o.kind == REFUSED for o in filler_outcomes) < 20:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{load.model}'s queue never filled")
            time.sleep(0.01)
        probe_stop = threading.Event()
        threads = [threading.Thread(target=_probe, args=(url, protocol, load, 10_000_000 * (k + 1), probe_stop,
                                                          0.02, probe_outcomes)) for k in range(probes)]
        for thread in threads:
            thread.start()
        started = time.monotonic()  # `seconds`, longer while fewer than 10 probes met the full queue
        while time.monotonic() - started < seconds or (
                sum(o.kind == REFUSED for o in list(probe_outcomes)) < 10 and time.monotonic() - started < 30):
            time.sleep(0.05)
        probe_stop.set()
        for thread in threads:
            thread.join(HANG_BOUND_S)
    finally:
        stop.set()
        filler.join(HANG_BOUND_S)
    return {"protocol": protocol, "model": load.model, "fillers": fillers,
            "probes": summarize(probe_outcomes, len(probe_outcomes)),
            "fillers_outcomes": summarize(filler_outcomes, len(filler_outcomes))}


# -- queue timeouts -----------------------------------------------------------------------------------

def queue_timeouts(config: ServerConfig, protocol: str, requests: int = 16) -> dict:
    """reliability_timeout: 200 ms per request (batch 1), queue timeout 2 s (default_timeout_microseconds).

    Phase "default": `requests` requests at once; the k-th starts after about 0.2 k s, so those still
    queued after 2 s are refused with "Request timeout expired". Each refusal's latency minus 2 s is how
    late Triton noticed the expiry.
    Phase "override": one request occupies the instance, then 2 requests with the default timeout (they
    wait about 0.2 and 0.4 s) and one asking for 50 ms (`timeout` parameter, allow_timeout_override):
    the 50 ms one is refused, the others are answered.
    Phase "longer": 13 requests at once, each asking for 5 s (2.6 s of work in all): those still queued
    after 2 s are refused all the same (a request can only shorten its queue timeout).
    """
    url = config.http_url if protocol == "http" else config.grpc_url
    load = echo_load(16)
    load.model = TIMEOUT_MODEL
    default_timeout_s = 2.0
    before = settled_counts(config, TIMEOUT_MODEL)

    default = asyncio.run(_send_all(url, protocol, load, range(requests)))

    async def override_phase():
        first = asyncio.ensure_future(_send_all(url, protocol, load, range(100, 101)))
        await asyncio.sleep(0.05)
        normal = asyncio.ensure_future(_send_all(url, protocol, load, range(101, 103)))
        short = asyncio.ensure_future(_send_all(url, protocol, load, range(103, 104), timeout_us=50_000))
        return (await first) + (await normal), await short

    others, short = asyncio.run(override_phase())

    # 13 requests of 200 ms: answered in 2.6 s if their 5 s would hold; refused after 2 s where it does not.
    longer = asyncio.run(_send_all(url, protocol, load, range(200, 213), timeout_us=5_000_000))
    after = settled_counts(config, TIMEOUT_MODEL)
    everything = default + others + short + longer
    lateness = sorted((o.latency_s - default_timeout_s) * 1000 for o in default if o.kind == TIMED_OUT)
    return {
        "protocol": protocol, "model": TIMEOUT_MODEL, "default_timeout_s": default_timeout_s,
        "default": summarize(default, requests),
        "default_refusal_after_expiry_ms": {"min": round(lateness[0], 1), "max": round(lateness[-1], 1)}
        if lateness else None,
        "override_others": summarize(others, 3), "override_50ms": summarize(short, 1),
        "override_50ms_refused_after_ms": round(short[0].latency_s * 1000, 1),
        "override_5s": summarize(longer, len(longer)),
        "override_5s_refused_after_ms": sorted(round(o.latency_s * 1000, 1) for o in longer if o.kind == TIMED_OUT),
        "total": summarize(everything, len(everything)),
        "server": delta(before, after), "outcomes": [asdict(o) for o in everything],
    }


# -- readiness while the queue is full ----------------------------------------------------------------

def readiness_under_overload(config: ServerConfig, requests: int = 30) -> dict:
    """Overload reliability_echo (8 queued + 4 executing at most) with `requests` at once and, while it
    refuses, read what an operator or a load balancer sees: /v2/health/ready (HTTP and gRPC), model
    readiness, and nv_inference_pending_request_count at its highest (server.overload)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from resnet18_kit.server.overload import PENDING_GAUGE, queue_limits

    limit = queue_limits((RELIABILITY_REPOSITORY,))[ECHO_MODEL]
    seen: dict = {"pending": 0}
    done = threading.Event()

    def observe():
        """Poll the gauge until the burst is over; at each new high, read readiness at that moment."""
        http = httpclient.InferenceServerClient(config.http_url)
        grpc = grpcclient.InferenceServerClient(config.grpc_url)
        try:
            while not done.is_set():
                pending = model_counters(config.metrics_url, ECHO_MODEL).get(PENDING_GAUGE, 0)
                if pending > seen["pending"]:
                    seen.update(pending=pending, server_ready_http=http.is_server_ready(),
                                server_ready_grpc=grpc.is_server_ready(), model_ready=http.is_model_ready(ECHO_MODEL))
                time.sleep(0.005)
        finally:
            http.close()
            grpc.close()

    observer = threading.Thread(target=observe)
    observer.start()
    try:
        outcomes = asyncio.run(_send_all(config.grpc_url, "grpc", echo_load(requests), range(requests)))
    finally:
        done.set()
        observer.join()
    after = model_counters(config.metrics_url, ECHO_MODEL).get(PENDING_GAUGE)
    return {"model": ECHO_MODEL, "max_queue_size": limit.max_queue_size, "max_batch_size": limit.max_batch_size,
            "overload_threshold": limit.overload_threshold, "at_highest_pending": seen, "pending_after": after,
            **summarize(outcomes, requests)}


# -- memory -------------------------------------------------------------------------------------------

class MemorySampler(PeriodicSampler):
    """Samples the resident memory of tritonserver and its stubs (sum) every `interval_s` on a thread,
    at entry and exit too: (seconds since entry, bytes); start, end and peak in bytes."""

    def __init__(self, server: EmbeddedTritonServer, interval_s: float = 0.2):
        super().__init__(interval_s, at_edges=True)
        self.server = server
        self._origin = time.monotonic()

    def __enter__(self) -> "MemorySampler":
        self._origin = time.monotonic()
        return super().__enter__()

    def total_bytes(self) -> int:
        return sum(self.server.resident_memory_bytes().values())

    def sample(self) -> tuple[float, int]:
        return time.monotonic() - self._origin, self.total_bytes()

    @property
    def start(self) -> int:
        return self.samples[0][1]

    @property
    def end(self) -> int:
        return self.samples[-1][1]

    @property
    def peak(self) -> int:
        return max(value for _, value in self.samples)


MiB = 1 << 20


# -- bad input ----------------------------------------------------------------------------------------

def _encode(image, fmt: str, **options) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height with almost no pixel data: a decompression bomb."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


def odd_images() -> dict[str, bytes]:
    """Valid images in every awkward mode and container; each must be answered, not refused."""
    import numpy as np
    from PIL import Image

    from resnet18_kit.client.samples import sample_photos

    rgb = Image.open(sample_photos()[0]).convert("RGB")
    gray = rgb.convert("L")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    frames = [rgb.quantize(64), rgb.rotate(180).quantize(64)]
    animated = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return {
        "grayscale-png": _encode(gray, "PNG"),
        "rgba-png": _encode(rgb.convert("RGBA"), "PNG"),
        "palette-png": _encode(rgb.quantize(64), "PNG"),
        "cmyk-jpeg": _encode(rgb.convert("CMYK"), "JPEG", quality=90),
        "16bit-png": _encode(Image.fromarray(np.asarray(gray, dtype=np.uint16) * 257), "PNG"),
        "animated-gif": animated,
        "exif-rotated-jpeg": _encode(rgb, "JPEG", quality=90, exif=exif),
        "tiny-1x1-png": _encode(rgb.resize((1, 1)), "PNG"),
    }


@dataclass(frozen=True)
class BadImage:
    name: str
    data: bytes
    message: str  # a fragment the error message must contain


def bad_images(max_image_bytes: int = 20_000_000) -> list[BadImage]:
    """Encoded images the `resnet18` ensemble must refuse with 400 / INVALID_ARGUMENT."""
    from PIL import Image

    from resnet18_kit.client.samples import sample_photos

    photo = sample_photos()[0].read_bytes()
    rng = np.random.default_rng(7)
    return [
        BadImage("zero-byte", b"", "empty image"),
        BadImage("truncated-png", photo[: len(photo) * 6 // 10], "truncated"),
        BadImage("random-bytes", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not an image"),
        BadImage("bomb-png-50000x50000", png_claiming(50_000, 50_000), "too large"),
        BadImage("over-max-image-bytes", b"\xff\xd8\xff\xe0" + bytes(max_image_bytes), "too large"),
        BadImage("aspect-ratio-200:1", _encode(Image.new("RGB", (2000, 10)), "PNG"), "aspect ratio"),
        BadImage("corrupt-ppm-header", b"P6\n2t5 80\n255\n" + bytes(64), "corrupt or truncated"),
    ]


@dataclass(frozen=True)
class BadTensor:
    """A tensor request tritonclient can build: `array` sent as `datatype`, then declared as `shape`."""

    name: str
    model: str
    input_name: str
    array: np.ndarray
    datatype: str
    message: str
    shape: tuple[int, ...] | None = None  # declared shape, when it differs from the array's


def bad_tensors() -> list[BadTensor]:
    images = np.array([[b"x"]] * 17, dtype=np.object_)
    return [
        BadTensor("wrong-dtype", ONNX_MODEL, "input", np.zeros((1, 3, 224, 224), np.float64), "FP64", "data-type"),
        BadTensor("wrong-shape", ONNX_MODEL, "input", np.zeros((1, 3, 100, 100), np.float32), "FP32", "unexpected shape"),
        BadTensor("too-many-elements", ONNX_MODEL, "input", np.zeros((2, 3, 224, 224), np.float32), "FP32",
                  "byte size mismatch", shape=(1, 3, 224, 224)),
        BadTensor("batch-over-max", ENSEMBLE_MODEL, "image", images, "BYTES", "batch-size must be <= 16"),
        BadTensor("image-as-fp32", ENSEMBLE_MODEL, "image", np.zeros((1, 1), np.float32), "FP32", "data-type"),
        BadTensor("unknown-input-name", ONNX_MODEL, "inputt", np.zeros((1, 3, 224, 224), np.float32), "FP32",
                  "unexpected inference input"),
    ]


def send_image(client, module, model: str, data: bytes, output: str = "logits"):
    request = module.InferInput("image", [1, 1], "BYTES")
    request.set_data_from_numpy(np.array([[data]], dtype=np.object_))
    return client.infer(model, [request], outputs=[module.InferRequestedOutput(output)])


def send_tensor(client, module, case: BadTensor):
    request = module.InferInput(case.input_name, list(case.array.shape), case.datatype)
    request.set_data_from_numpy(case.array)
    if case.shape is not None:
        request.set_shape(list(case.shape))
    return client.infer(case.model, [request])


def http_raw(config: ServerConfig, path: str, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    """POST `body` as it is (no client library checks); (status, body text)."""
    import http.client

    host, port = config.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=HANG_BOUND_S)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def grpc_raw_infer(config: ServerConfig, request_bytes: bytes) -> tuple[str, str]:
    """Send a serialized ModelInferRequest as it is; (status code name, details), "OK" on success."""
    import grpc

    channel = grpc.insecure_channel(config.grpc_url)
    try:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        call(request_bytes, timeout=HANG_BOUND_S)
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    finally:
        channel.close()


def non_utf8_requests(config: ServerConfig, protocol: str) -> list[tuple[str, str, str, str]]:
    """Names that are not UTF-8: (case, status, message, expected fragment) per request."""
    from tritonclient.grpc import service_pb2

    if protocol == "http":
        body = b'{"inputs":[{"name":"\xff\xfe","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
        status, text = http_raw(config, f"/v2/models/{ECHO_MODEL}/infer", body)
        model_status, model_text = http_raw(config, "/v2/models/%FF%FE/infer", b"{}")
        return [("input-name-0xFFFE", str(status), text, "unexpected inference input"),
                ("model-name-%FF%FE", str(model_status), model_text, "unknown model")]
    request = service_pb2.ModelInferRequest(model_name=ECHO_MODEL)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "Q", "FP32"
    tensor.shape.extend([1, 4])
    request.raw_input_contents.append(np.zeros((1, 4), np.float32).tobytes())
    good = request.SerializeToString()
    bad_input = good.replace(b"\x0a\x01Q", b"\x0a\x01\xff")  # field 1 (name), length 1: the byte 0xFF
    bad_model = good.replace(ECHO_MODEL.encode(), ECHO_MODEL[:-1].encode() + b"\xff")
    return [("input-name-0xFF", *grpc_raw_infer(config, bad_input), ""),
            ("model-name-0xFF", *grpc_raw_infer(config, bad_model), "")]


@dataclass
class CaseResult:
    case: str
    expected: str        # ANSWERED or INVALID
    kind: str
    status: str | None
    message: str
    latency_s: float
    ok: bool             # the outcome is the expected one, with the expected message fragment


def _run_case(name: str, expected: str, fragment: str, send) -> CaseResult:
    started = time.perf_counter()
    try:
        send()
        kind, status, message = ANSWERED, None, ""
    except InferenceServerException as exc:
        kind, status, message = classify_error(exc)
    latency = time.perf_counter() - started
    ok = kind == expected and (expected == ANSWERED or fragment in message)
    return CaseResult(name, expected, kind, status, message[:300], latency, ok)


def bad_input_corpus(config: ServerConfig, protocol: str) -> list[CaseResult]:
    """Every fixed case once over `protocol`: bad images to the ensemble, odd valid images to the
    ensemble, bad tensors, names that are not UTF-8."""
    module = protocol_module(protocol)
    url = config.http_url if protocol == "http" else config.grpc_url
    client = module.InferenceServerClient(url)
    results = []
    try:
        for case in bad_images():
            results.append(_run_case(f"image: {case.name}", INVALID, case.message,
                                     lambda c=case: send_image(client, module, ENSEMBLE_MODEL, c.data)))
        for name, data in odd_images().items():
            results.append(_run_case(f"valid image: {name}", ANSWERED, "",
                                     lambda d=data: send_image(client, module, ENSEMBLE_MODEL, d)))
        for case in bad_tensors():
            results.append(_run_case(f"tensor: {case.name}", INVALID, case.message,
                                     lambda c=case: send_tensor(client, module, c)))
    finally:
        client.close()
    for name, status, message, fragment in non_utf8_requests(config, protocol):
        refused = status.startswith("4") or status in ("INVALID_ARGUMENT", "NOT_FOUND", "INTERNAL")
        results.append(CaseResult(f"non-UTF-8: {name}", INVALID, INVALID if refused else ANSWERED, status,
                                  message[:300], 0.0, refused and fragment in message))
    return results


# -- faults: a stub killed, the server crashed, SIGTERM with requests in flight -------------------------

def repository_with(models: list[str], target: Path) -> Path:
    """A model repository in `target` holding links to `models` (from model_repository/ or
    the reliability model repository), so a dedicated server loads only those."""
    target.mkdir(parents=True, exist_ok=True)
    for model in models:
        source = MODEL_REPOSITORY / model
        if not source.is_dir():
            source = RELIABILITY_REPOSITORY / model
        (target / model).symlink_to(source)
    return target


class SteadyLoad:
    """One request at a time to `load.model` on a thread, recording every outcome, until stopped.
    Connection failures (server restarting) are outcomes too (ERROR), so nothing goes unaccounted."""

    def __init__(self, config: ServerConfig, protocol: str, load: TensorLoad, interval_s: float = 0.05):
        self.config, self.protocol, self.load, self.interval_s = config, protocol, load, interval_s
        self.outcomes: list[tuple[float, Outcome]] = []  # (monotonic time of the outcome, outcome)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        module = protocol_module(self.protocol)
        url = self.config.http_url if self.protocol == "http" else self.config.grpc_url
        index = 0
        while not self._stop.is_set():
            client = module.InferenceServerClient(url)  # a fresh connection: survives restarts
            started = time.perf_counter()
            try:
                result = client.infer(self.load.model, [_infer_input(module, self.load, index)],
                                      outputs=[module.InferRequestedOutput(self.load.output_name)],
                                      request_id=str(index))
                outcome = _judge(self.load, index, result, started)
            except InferenceServerException as exc:
                kind, status, message = classify_error(exc)
                outcome = Outcome(index, kind, time.perf_counter() - started, status, message)
            except Exception as exc:  # connection refused while the server restarts
                outcome = Outcome(index, ERROR, time.perf_counter() - started, None,
                                  f"{type(exc).__name__}: {exc}")
            finally:
                try:
                    client.close()
                except Exception:
                    pass
            self.outcomes.append((time.monotonic(), outcome))
            index += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "SteadyLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(HANG_BOUND_S)

    @property
    def sent(self) -> int:
        return len(self.outcomes)


def stub_kill(supervisor, model: str, load: TensorLoad, protocol: str = "grpc",
              after_recovery: int = 20, interval_s: float = 0.05) -> dict:
    """With `supervisor` (server.supervisor.Supervisor, started) serving, send `load` one request at a
    time, SIGKILL the stub of `model`'s first instance, and measure until `after_recovery` requests in a
    row are answered after the restart: errors seen, time to detect, time to the first good answer."""
    server = supervisor.server
    instance, pid = next((name, pid) for name, pid in server.stub_processes().items() if name.startswith(model))
    restarts_before = supervisor.restarts
    with SteadyLoad(supervisor.config, protocol, load, interval_s) as steady:
        deadline = time.monotonic() + 30
        while sum(o.kind == ANSWERED for _, o in steady.outcomes) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = killed_at + supervisor.policy.ready_timeout_s + 60
        while time.monotonic() < deadline:
            after = [o for t, o in steady.outcomes if t > killed_at]
            tail = after[-after_recovery:]
            if supervisor.restarts > restarts_before and len(tail) == after_recovery and \
                    all(o.kind == ANSWERED for o in tail):
                break
            time.sleep(0.1)
    after_kill = [(t, o) for t, o in steady.outcomes if t > killed_at]
    failed = [(t, o) for t, o in after_kill if o.kind != ANSWERED]
    first_good_after = next((t for t, o in after_kill if o.kind == ANSWERED and t > (failed[-1][0] if failed else 0)),
                            None)
    fault = next((e for e in supervisor.events if e.kind == "fault" and e.at_s >= killed_at - supervisor._origin),
                 None)
    messages = sorted({(o.status, o.message.split(" (")[0][:100]) for _, o in failed}, key=str)
    return {
        "model": model, "instance": instance, "protocol": protocol,
        "detected_after_s": round(fault.at_s - (killed_at - supervisor._origin), 2) if fault else None,
        "recovered_after_s": round(first_good_after - killed_at, 2) if first_good_after else None,
        "restarts": supervisor.restarts - restarts_before,
        "total": summarize([o for _, o in steady.outcomes], steady.sent),
        "after_kill": summarize([o for _, o in after_kill], len(after_kill)),
        "errors_seen": [{"status": s, "message": m} for s, m in messages],
        "answered_in_a_row_at_end": len(list(_takewhile_answered_from_end([o for _, o in after_kill]))),
    }


def _takewhile_answered_from_end(outcomes: list[Outcome]):
    for outcome in reversed(outcomes):
        if outcome.kind != ANSWERED:
            return
        yield outcome


def sigterm_in_flight(repository: Path, model: str, load: TensorLoad, in_flight: int, exit_timeout_s: int,
                      log_path: Path, extra_serve_args: tuple[str, ...] = ()) -> dict:
    """`python -m resnet18_kit.server` (the serve command) on `repository`; `in_flight` requests sent at once over
    gRPC and HTTP (half each), SIGTERM to serve once the server holds them; then new requests on fresh
    connections every 100 ms until it exits. Returns outcomes and how long the exit took."""
    import subprocess

    from resnet18_kit.server.embedded import free_ports

    http_port, grpc_port, metrics_port = free_ports(3)
    config = ServerConfig(model_repository=repository, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, exit_timeout_s=exit_timeout_s)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "resnet18_kit.server", "--model-repository", str(repository), "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--exit-timeout-s",
             str(exit_timeout_s), *extra_serve_args], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "TRITON_ADMIN_KEY"})
    try:
        wait_ready(config, process, 300)
        accepted: list[Outcome] = []
        done_at: list[float] = []

        async def in_flight_requests():
            half = in_flight // 2
            http = asyncio.ensure_future(_send_all(config.http_url, "http", load, range(half)))
            grpc = asyncio.ensure_future(_send_all(config.grpc_url, "grpc", load, range(half, in_flight)))
            return (await http) + (await grpc)

        runner = threading.Thread(target=lambda: (accepted.extend(asyncio.run(in_flight_requests())),
                                                  done_at.append(time.monotonic())))
        runner.start()
        deadline = time.monotonic() + 30  # SIGTERM once the server holds the requests: some queued or done
        while True:
            counts = model_counters(config.metrics_url, model)
            if counts.get("nv_inference_pending_request_count", 0) >= 1 or \
                    counts.get("nv_inference_request_success", 0) >= 1:
                break
            if time.monotonic() > deadline or not runner.is_alive():
                raise RuntimeError("the in-flight requests never reached the server")
            time.sleep(0.01)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        after: list[tuple[float, str, Outcome]] = []
        index = 10_000
        while process.poll() is None and time.monotonic() - signalled < exit_timeout_s + 30:
            for protocol in PROTOCOLS:
                sent_s = round(time.monotonic() - signalled, 3)  # when it was sent, after SIGTERM
                after.append((sent_s, protocol, _one_fresh(config, protocol, load, index)))
                index += 1
            time.sleep(0.1)
        process.wait(exit_timeout_s + 30)
        exit_s = time.monotonic() - signalled
        runner.join(HANG_BOUND_S)
    finally:
        if process.poll() is None:  # an error above: stop serve (and so its server) before leaving
            process.terminate()
            try:
                process.wait(exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                process.kill()  # its tritonserver follows (die_with_parent)
                process.wait()
    return {"model": model, "in_flight": summarize(accepted, in_flight), "exit_status": process.returncode,
            "last_in_flight_answered_after_sigterm_s": round(done_at[0] - signalled, 2) if done_at else None,
            "exit_s": round(exit_s, 2), "exit_timeout_s": exit_timeout_s,
            "after_sigterm": [{"sent_s": t, "latency_s": round(o.latency_s, 3), "protocol": p, "kind": o.kind,
                               "status": o.status,
                               "message": o.message[:120]} for t, p, o in after]}


def wait_ready(config: ServerConfig, process, timeout_s: float) -> None:
    """Block until the server of `config` (run by `process`) is ready; RuntimeError if it exits first."""
    import tritonclient.http as httpclient

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} before ready")
        client = httpclient.InferenceServerClient(config.http_url, connection_timeout=2.0)
        try:
            if client.is_server_ready():
                return
        except Exception:
            pass
        finally:
            client.close()
        time.sleep(0.25)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def _one_fresh(config: ServerConfig, protocol: str, load: TensorLoad, index: int) -> Outcome:
    module = protocol_module(protocol)
    started = time.perf_counter()
    try:
        client = module.InferenceServerClient(config.http_url if protocol == "http" else config.grpc_url)
    except Exception as exc:
        return Outcome(index, ERROR, 0.0, None, f"{type(exc).__name__}: {exc}")
    try:
        result = client.infer(load.model, [_infer_input(module, load, index)],
                              outputs=[module.InferRequestedOutput(load.output_name)], request_id=str(index),
                              **({"client_timeout": 10.0} if protocol == "grpc" else {}))
        return _judge(load, index, result, started)
    except InferenceServerException as exc:
        kind, status, message = classify_error(exc)
        return Outcome(index, kind, time.perf_counter() - started, status, message)
    except Exception as exc:
        return Outcome(index, ERROR, time.perf_counter() - started, None, f"{type(exc).__name__}: {exc}")
    finally:
        try:
            client.close()
        except Exception:
            pass


#: An HTTP/JSON inference request whose `shape` claims 10^12 x 4 elements while `data` holds 4: Triton
#: 2.51 sizes a buffer from the shape before checking it, throws std::bad_alloc and aborts (the whole
#: server, every model). Binary-data HTTP requests and gRPC check the byte size first and get 400 /
#: INVALID_ARGUMENT. Upstream fix: triton-inference-server/server PR #8174 (after 2.51).
CRASHING_JSON_BODY = b'{"inputs":[{"name":"x","shape":[1000000000000,4],"datatype":"FP32","data":[1,2,3,4]}]}'


def send_crashing_request(config: ServerConfig, model: str = ECHO_MODEL) -> str:
    """Send CRASHING_JSON_BODY; what came back (the server usually closes the connection as it dies)."""
    try:
        status, text = http_raw(config, f"/v2/models/{model}/infer", CRASHING_JSON_BODY)
        return f"HTTP {status}: {text[:120]}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


# -- security -----------------------------------------------------------------------------------------

def restricted_api_checks(config: ServerConfig) -> list[dict]:
    """Against a server started with an admin key: each restricted API without and with the key, and
    inference without it (open). Returns one row per call: protocol, api, key sent, outcome."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from resnet18_kit.server.embedded import ADMIN_GRPC_HEADER, ADMIN_HEADER

    rows = []

    def attempt(protocol, api, with_key, call):
        try:
            call()
            outcome = "OK"
        except InferenceServerException as exc:
            outcome = f"{exc.status()}: {(exc.message() or '')[:80]}"
        rows.append({"protocol": protocol, "api": api, "key": with_key, "outcome": outcome})

    http = httpclient.InferenceServerClient(config.http_url)
    grpc = grpcclient.InferenceServerClient(config.grpc_url)
    load = echo_load(1)
    try:
        for with_key in (False, True):
            h = {ADMIN_HEADER: config.admin_key} if with_key else {}
            g = {ADMIN_GRPC_HEADER: config.admin_key} if with_key else {}
            attempt("http", "model-repository (index)", with_key, lambda: http.get_model_repository_index(headers=h))
            attempt("http", "shared-memory (status)", with_key, lambda: http.get_system_shared_memory_status(headers=h))
            attempt("http", "trace (settings)", with_key, lambda: http.get_trace_settings(headers=h))
            attempt("grpc", "model-repository (index)", with_key, lambda: grpc.get_model_repository_index(headers=g))
            attempt("grpc", "shared-memory (status)", with_key, lambda: grpc.get_system_shared_memory_status(headers=g))
            attempt("grpc", "trace (settings)", with_key, lambda: grpc.get_trace_settings(headers=g))
        attempt("http", "inference (open)", False,
                lambda: http.infer(ECHO_MODEL, [_infer_input(httpclient, load, 0)]))
        attempt("grpc", "inference (open)", False,
                lambda: grpc.infer(ECHO_MODEL, [_infer_input(grpcclient, load, 0)]))
        attempt("http", "health (open)", False, lambda: http.is_server_ready())
        attempt("http", "statistics (open)", False, lambda: http.get_inference_statistics(ECHO_MODEL))
    finally:
        http.close()
        grpc.close()
    return rows


# -- the command ----------------------------------------------------------------------------------------

SCENARIOS = ("burst", "refusal", "timeout", "readiness", "bad-input", "stub-kill", "crash-request", "sigterm",
             "security")


def _ms(figures: dict | None, key: str = "p50") -> str:
    return "-" if not figures else f"{figures[key]:.0f}"


def run_overload(config: ServerConfig, server: EmbeddedTritonServer, args, rows: list, record: dict) -> None:
    onnx = reference_answers(config, onnx_load())
    ensemble = reference_answers(config, ensemble_load())
    for protocol, load in (("http", onnx), ("grpc", onnx), ("grpc", ensemble), ("http", ensemble)):
        if "burst" not in args.scenario:
            break
        result = burst(config, protocol, load, args.burst_requests).summary()
        record.setdefault("burst", []).append(result)
        total, server_counted = result["total"], result["server"]
        counted = server_counted["metrics_success"] == total["answered"] == server_counted["stats_success"]
        rows.append([f"burst of {args.burst_requests} at once, {load.model}, {protocol}",
                     f"--scenario burst --burst-requests {args.burst_requests}", total["sent"], total["answered"],
                     total["refused"], total["lost"] + total["wrong"] + total["error"],
                     f"burst refusals p50 {_ms(total.get('refused_ms'))} / max {_ms(total.get('refused_ms'), 'max')} ms "
                     f"(wall {result['wall_s']} s)",
                     f"server successes = answered: {'yes' if counted else 'NO'} ({server_counted['metrics_success']}); "
                     f"failures counted {server_counted['metrics_failure']}"])
    for protocol in PROTOCOLS:
        if "refusal" not in args.scenario:
            break
        result = refusal_latency(config, protocol, onnx)
        record.setdefault("refusal", []).append(result)
        probes, fill = result["probes"], result["fillers_outcomes"]
        rows.append([f"a request meeting a full queue, resnet18_onnx, {protocol} ({result['fillers']} senders keep "
                     f"it full)", "--scenario refusal", probes["sent"] + fill["sent"],
                     probes["answered"] + fill["answered"], probes["refused"] + fill["refused"],
                     probes["lost"] + probes["wrong"] + probes["error"] + fill["lost"] + fill["wrong"] + fill["error"],
                     f"single-request refusals ({probes['refused']}): p50 {_ms(probes.get('refused_ms'))} / p99 "
                     f"{_ms(probes.get('refused_ms'), 'p99')} / max {_ms(probes.get('refused_ms'), 'max')} ms",
                     "probe requests sent one at a time, 4 threads"])
    if "timeout" in args.scenario:
        for protocol in PROTOCOLS:
            result = queue_timeouts(config, protocol)
            record.setdefault("timeout", []).append({k: v for k, v in result.items() if k != "outcomes"})
            total = result["total"]
            late = result["default_refusal_after_expiry_ms"] or {"min": float("nan"), "max": float("nan")}
            rows.append([f"queue timeout 2 s (+50 ms and 5 s overrides), {protocol}", "--scenario timeout",
                         total["sent"], total["answered"], f"{total['timed-out']} timed out",
                         total["lost"] + total["wrong"] + total["error"],
                         f"refused {late['min']:.0f} to {late['max']:.0f} ms after expiry; 50 ms override refused "
                         f"after {result['override_50ms_refused_after_ms']:.0f} ms",
                         f"5 s override capped at 2 s: {result['override_5s']['timed-out']} of 13 refused; server "
                         f"failures (REJECTED) {result['server']['metrics_failure']}"])
    if "readiness" in args.scenario:
        result = readiness_under_overload(config)
        record["readiness"] = result
        seen = result["at_highest_pending"]
        rows.append(["readiness while refusing (reliability_echo)", "--scenario readiness", result["sent"],
                     result["answered"], result["refused"], result["lost"] + result["wrong"] + result["error"],
                     f"refusal p50 {_ms(result.get('refused_ms'))} ms",
                     f"/v2/health/ready {'200' if seen.get('server_ready_http') else 'not ready'} at "
                     f"{seen['pending']:.0f} pending (threshold {result['overload_threshold']})"])
    if "bad-input" in args.scenario:
        for protocol in PROTOCOLS:
            with MemorySampler(server) as memory:
                results = bad_input_corpus(config, protocol)
            record.setdefault("bad_input", []).append({"protocol": protocol, "cases": [asdict(r) for r in results],
                                                        "memory_mib": [memory.start / MiB, memory.peak / MiB,
                                                                       memory.end / MiB]})
            answered = sum(r.kind == ANSWERED for r in results)
            rows.append([f"bad-input corpus ({len(results)} cases), {protocol}", "--scenario bad-input", len(results),
                         f"{answered} (valid odd images)", f"{len(results) - answered} as 4xx",
                         sum(not r.ok for r in results),
                         f"slowest {max(r.latency_s for r in results) * 1000:.0f} ms",
                         f"RSS server+stubs {memory.start / MiB:.0f} -> peak {memory.peak / MiB:.0f} -> "
                         f"{memory.end / MiB:.0f} MiB"])


def run_faults(args, out_dir: Path, rows: list, record: dict) -> None:
    from resnet18_kit.server.supervisor import Supervisor, SupervisorPolicy

    policy = SupervisorPolicy()  # what `serve` runs with
    if "stub-kill" in args.scenario:
        config = config_on_free_ports(extra_model_repositories=(RELIABILITY_REPOSITORY,))
        with Supervisor(config, policy, log_path=out_dir / "tritonserver-stub-kill.log") as supervisor:
            load = reference_answers(config, ensemble_load())
            result = stub_kill(supervisor, ONNX_MODEL, load, protocol="grpc", after_recovery=20)
            result["supervisor_events"] = [asdict(e) for e in supervisor.events]
        record["stub_kill"] = result
        total = result["total"]
        rows.append(["SIGKILL of the resnet18_onnx stub under load (ensemble, gRPC), supervised",
                     "--scenario stub-kill", total["sent"], total["answered"], f"{total['error']} failed",
                     total["lost"] + total["wrong"], f"detected {result['detected_after_s']} s, answering again "
                     f"{result['recovered_after_s']} s after the kill",
                     f"{result['restarts']} restart; then {result['answered_in_a_row_at_end']} answered in a row"])
    if "crash-request" in args.scenario:
        config = config_on_free_ports(extra_model_repositories=(RELIABILITY_REPOSITORY,))
        with Supervisor(config, policy, log_path=out_dir / "tritonserver-crash.log") as supervisor:
            with SteadyLoad(config, "grpc", reference_answers(config, onnx_load())) as steady:
                time.sleep(2)
                sent_at = time.monotonic()
                reply = send_crashing_request(config, ECHO_MODEL)
                deadline = time.monotonic() + policy.ready_timeout_s
                while time.monotonic() < deadline and not (supervisor.restarts and supervisor.events[-1].kind == "ready"):
                    time.sleep(0.1)
                time.sleep(3)
            after = [(t, o) for t, o in steady.outcomes if t > sent_at]
            good = next((t for t, o in after if o.kind == ANSWERED and t > max(
                [t2 for t2, o2 in after if o2.kind != ANSWERED] or [0])), None)
            result = {"reply": reply, "restarts": supervisor.restarts, "total": summarize(
                [o for _, o in steady.outcomes], steady.sent), "recovered_after_s": round(good - sent_at, 2) if good else None,
                "supervisor_events": [asdict(e) for e in supervisor.events]}
        record["crash_request"] = result
        total = result["total"]
        rows.append(["one HTTP/JSON request with shape [10^12, 4] (aborts Triton 2.51), supervised",
                     "--scenario crash-request", total["sent"], total["answered"], f"{total['error']} failed",
                     total["lost"] + total["wrong"], f"answering again {result['recovered_after_s']} s after it",
                     f"{result['restarts']} restart (tritonserver exited on std::bad_alloc)"])
    if "sigterm" in args.scenario:
        result = sigterm_in_flight(MODEL_REPOSITORY, ONNX_MODEL, reference_answers_from_new_server(out_dir),
                                   in_flight=args.sigterm_in_flight, exit_timeout_s=30,
                                   log_path=out_dir / "serve-sigterm.log")
        record["sigterm"] = result
        after = result["after_sigterm"]
        grpc_answered = sum(r["kind"] == ANSWERED for r in after if r["protocol"] == "grpc")
        http_answered = sum(r["kind"] == ANSWERED for r in after if r["protocol"] == "http")
        rows.append([f"SIGTERM to `python -m resnet18_kit.server` with {args.sigterm_in_flight} resnet18_onnx requests sent",
                     "--scenario sigterm", result["in_flight"]["sent"], result["in_flight"]["answered"],
                     result["in_flight"]["refused"], result["in_flight"]["lost"] + result["in_flight"]["error"],
                     f"last accepted answered {result['last_in_flight_answered_after_sigterm_s']} s after SIGTERM; "
                     f"exit {result['exit_s']} s (limit 30), status {result['exit_status']}",
                     f"after SIGTERM: HTTP answered {http_answered} of {sum(r['protocol'] == 'http' for r in after)}, "
                     f"gRPC answered {grpc_answered} of {sum(r['protocol'] == 'grpc' for r in after)}"])
    if "security" in args.scenario:
        import secrets

        repository = repository_with([ECHO_MODEL], Path(tempfile.mkdtemp(dir=out_dir)) / "repository")
        config = config_on_free_ports(model_repository=repository, admin_key=secrets.token_hex(16))
        with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver-security.log"):
            checks = restricted_api_checks(config)
        record["security"] = checks
        refused = [c for c in checks if not c["key"] and "open" not in c["api"]]
        rows.append(["restricted APIs (model-repository, shared-memory, trace), admin key", "--scenario security",
                     len(checks), sum(c["outcome"] == "OK" for c in checks),
                     f"{sum(c['outcome'] != 'OK' for c in checks)} without key", 0,
                     "-", "without key: " + ", ".join(sorted({c["outcome"].split(':')[0] for c in refused}))])


def reference_answers_from_new_server(out_dir: Path) -> TensorLoad:
    """Reference answers for onnx_load from a short-lived server (the SIGTERM scenario's own server is
    the one being stopped)."""
    config = config_on_free_ports()
    with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver-reference.log"):
        return reference_answers(config, onnx_load())




def cpu_steal_ticks() -> tuple[int, int]:
    """(steal, total) CPU ticks of all cores from /proc/stat: steal is time the hypervisor gave this
    VM's cores to others, the noise of a shared machine."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def markdown_table(rows: list[list]) -> str:
    header = ["case", "`python -m resnet18_kit.reliability` ...", "sent", "answered", "refused / failed", "lost",
              "time to refuse / recover", "also"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resnet18_kit.reliability", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--burst-requests", type=int, default=400,
                        help="requests per burst (default 400: five times what the 64-request queue and a "
                             "batch of 16 hold)")
    parser.add_argument("--sigterm-in-flight", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    from resnet18_kit.observe.machine import machine_info

    record: dict = {"started": stamp, "machine": machine_info(TRITON_VERSION), "cpu_steal_share": None,
                    "args": {k: str(v) for k, v in vars(args).items()}}
    steal_before = cpu_steal_ticks()
    rows: list[list] = []
    if set(args.scenario) & {"burst", "refusal", "timeout", "readiness", "bad-input"}:
        config = config_on_free_ports(extra_model_repositories=(RELIABILITY_REPOSITORY,))
        with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver.log") as server:
            run_overload(config, server, args, rows, record)
    run_faults(args, out_dir, rows, record)
    steal_after = cpu_steal_ticks()
    record["cpu_steal_share"] = round((steal_after[0] - steal_before[0]) / max(1, steal_after[1] - steal_before[1]), 3)
    table = markdown_table(rows)
    record["table"] = table
    (out_dir / "reliability.json").write_text(json.dumps(record, indent=1, default=str))
    (out_dir / "reliability.md").write_text(table + "\n")
    print(table)
    print(f"\nCPU steal during the run: {record['cpu_steal_share']:.1%}; full record: {out_dir / 'reliability.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
