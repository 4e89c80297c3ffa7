"""Client API for this model repository, over HTTP or gRPC (KServe v2 / Open Inference Protocol).

Two classes with the same methods, one blocking and one for asyncio, both over tritonclient:

    with TritonClassifierClient("127.0.0.1:8001", protocol="grpc") as client:
        top5 = client.classify([open("cat.jpg", "rb").read()], top_k=5)  # [[Prediction, ...]]
        top5[0][0].probability, top5[0][0].logit  # softmax probability (0..1) and raw logit
        logits = client.infer_tensor(batch)  # FP32 [N, 3, 224, 224] -> FP32 [N, 1000]

    async with AsyncTritonClassifierClient(  # resnet18_kit.client.async_client"127.0.0.1:8000", protocol="http") as client:
        top5 = await client.classify([image_bytes])

`protocol` picks tritonclient.http or tritonclient.grpc (their .aio variants for the asyncio class).

Back-pressure: a request refused with HTTP 503 / gRPC UNAVAILABLE "Exceeds maximum queue size" is sent
again after a capped, jittered exponential backoff (`client.backoff.RetryPolicy`) until the call's
deadline; `client.retries` counts those retries. Every other failure raises at once, as one of the typed
errors of `client.errors` (status and server message attached).

Deadlines: each call has a time budget (`deadline_s`, default `RetryPolicy.deadline_s`). Each try is
bounded on the client side by what is left of it; and when the model's queue policy has
`allow_timeout_override: true`, the same remainder goes to the server as the request's `timeout`
parameter (microseconds), so a request that cannot be served in time is dropped from the queue instead
of computed for nobody.

Shared memory (`shared_memory=True`): `infer_tensor` passes its input and output through system shared
memory regions registered once per model and unregistered on close (same host only; see
`client.shared_memory`). Calls on one client then run one at a time (a lock), as they share the regions.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from tritonclient.utils import InferenceServerException

from resnet18_kit.client.backoff import Deadline, RetryPolicy
from resnet18_kit.client.errors import (DeadlineExceededError, InferenceError, QueueFullError, ServerUnavailableError,
                           from_triton)
from resnet18_kit.client.shared_memory import TensorRegions
from resnet18_kit.client.urls import host_port
from resnet18_kit.contract import (DEFAULT_URLS, ENSEMBLE_MODEL, FP32_BYTES, IMAGE_INPUT, IMAGE_SHAPE,  # noqa: F401 (re-exported)
                                   LOGITS_OUTPUT, NUM_CLASSES, ONNX_MODEL, PROBABILITIES_OUTPUT, PROTOCOLS,
                                   TENSOR_INPUT)
#: Right after an inference Triton may still hold a region and refuse to unregister it ("currently in
#: use"); close() retries up to UNREGISTER_TRIES times, UNREGISTER_WAIT_S apart (1 s in all).
UNREGISTER_TRIES = 20
UNREGISTER_WAIT_S = 0.05


@dataclass(frozen=True)
class Prediction:
    """One of the top-k classes of an image, from the ensemble's `probabilities` and `logits` outputs
    (Triton's classification extension)."""

    label: str          # ImageNet class name, from the model's label file
    class_index: int    # 0..999
    probability: float  # softmax of the logits, 0..1 (all 1000 classes sum to 1)
    logit: float        # the unnormalized score; NaN in the rare case of a tie at the k-th place that
                        # left this class out of the logits' top k


def parse_classification(entry: bytes | str) -> tuple[float, int, str]:
    """Parse one classification-extension string "score:index:label" (e.g. b"12.5:281:tabby") into
    (score, class index, label). Raises ValueError for another format."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    score, index, label = text.split(":", 2)
    return float(score), int(index), label


def protocol_module(protocol: str, asyncio_api: bool = False):
    """tritonclient.http / .grpc, or their .aio variants. Raises ValueError for another protocol."""
    if protocol == "http":
        import tritonclient.http as module
        if asyncio_api:
            import tritonclient.http.aio as module
    elif protocol == "grpc":
        import tritonclient.grpc as module
        if asyncio_api:
            import tritonclient.grpc.aio as module
    else:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    return module


class _Retry:
    """The retry loop's bookkeeping for one call: deadline, attempt count, what to do after a failure."""

    def __init__(self, policy: RetryPolicy, deadline_s: float | None):
        self.policy = policy
        self.deadline = Deadline(deadline_s)
        self.attempts = 0

    def remaining_s(self) -> float | None:
        """Budget of the next try, in seconds. Raises DeadlineExceededError when none is left."""
        remaining = self.deadline.remaining_s()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceededError("deadline expired before the request could be sent",
                                        retries=self.attempts)
        return remaining

    def wait_after(self, exc: BaseException) -> float:
        """Seconds to sleep before the next try after `exc`; raises the typed error instead when the
        failure is not a queue-full refusal or the deadline leaves no room for another try."""
        error = self._typed(exc)
        error.retries = self.attempts
        if not isinstance(error, QueueFullError):
            raise error from None
        wait = self.policy.backoff_s(self.attempts)
        remaining = self.deadline.remaining_s()
        if remaining is not None and wait >= remaining:
            raise error from None
        self.attempts += 1
        return wait

    def _typed(self, exc: BaseException) -> InferenceError:
        if isinstance(exc, InferenceServerException):
            error = from_triton(exc)
        elif isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            error = DeadlineExceededError(f"no response within the deadline ({type(exc).__name__})")
        elif isinstance(exc, (ConnectionError, OSError)):
            error = ServerUnavailableError(f"cannot reach the server: {exc}")
        else:
            raise exc
        if isinstance(error, ServerUnavailableError) and error.status is None and self.deadline.expired():
            return DeadlineExceededError(f"no response within the deadline: {error.message}")
        return error


class _ClientBase:
    """What both clients share: request building, result parsing, model-config lookups."""

    _asyncio_api = False

    def __init__(self, url: str | None = None, protocol: str = "http", *,
                 retry: RetryPolicy = RetryPolicy(), shared_memory: bool = False,
                 connection_timeout_s: float = 10.0):
        self.protocol = protocol
        self.url = host_port(url or DEFAULT_URLS[protocol], protocol)  # ValueError before any connection
        self.retry_policy = retry
        self.shared_memory = shared_memory
        self.connection_timeout_s = connection_timeout_s
        self._module = protocol_module(protocol, self._asyncio_api)
        #: Queue-full refusals this client retried, over all its calls.
        self.retries = 0
        self._configs: dict[str, dict] = {}
        self._regions: dict[str, TensorRegions] = {}

    # -- requests -------------------------------------------------------------------------------------

    def _classify_request(self, images: Sequence[bytes], top_k: int):
        array = np.array([bytes(image) for image in images], dtype=np.object_).reshape(-1, 1)
        request = self._module.InferInput(IMAGE_INPUT, list(array.shape), "BYTES")
        request.set_data_from_numpy(array)
        return [request], [self._module.InferRequestedOutput(name, class_count=top_k)
                           for name in (PROBABILITIES_OUTPUT, LOGITS_OUTPUT)]

    def _tensor_request(self, batch: np.ndarray, regions: TensorRegions | None):
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        if batch.ndim != 4 or batch.shape[1:] != IMAGE_SHAPE:
            raise ValueError(f"batch must be FP32 [N, 3, 224, 224], got shape {batch.shape}")
        request = self._module.InferInput(TENSOR_INPUT, list(batch.shape), "FP32")
        output = self._module.InferRequestedOutput(LOGITS_OUTPUT)
        if regions is None:
            request.set_data_from_numpy(batch)
        else:
            request.set_shared_memory(regions.input_name, regions.write_input(batch))
            output.set_shared_memory(regions.output_name, len(batch) * NUM_CLASSES * FP32_BYTES)
        return [request], [output]

    @staticmethod
    def _predictions(result, count: int) -> list[list[Prediction]]:
        """Per image, its top k by probability, each with its logit from the logits' top k."""
        rows = []
        for by_probability, by_logit in zip(result.as_numpy(PROBABILITIES_OUTPUT).reshape(count, -1),
                                            result.as_numpy(LOGITS_OUTPUT).reshape(count, -1)):
            logits = {index: score for score, index, _ in map(parse_classification, by_logit)}
            rows.append([Prediction(label=label, class_index=index, probability=score,
                                    logit=logits.get(index, float("nan")))
                         for score, index, label in map(parse_classification, by_probability)])
        return rows

    @staticmethod
    def _logits(result, batch_size: int, regions: TensorRegions | None) -> np.ndarray:
        if regions is None:
            return result.as_numpy(LOGITS_OUTPUT)
        return regions.read_output(np.float32, (batch_size, NUM_CLASSES))

    def _server_timeout(self, model: str, remaining_s: float | None) -> dict:
        """{"timeout": microseconds} when the model's queue policy lets a request set its own timeout
        (`allow_timeout_override`), else {}: then only the client enforces the deadline."""
        if remaining_s is None or not _allows_timeout_override(self._configs[model]):
            return {}
        return {"timeout": max(1, int(remaining_s * 1e6))}

    def _new_regions(self, model: str) -> TensorRegions:
        max_batch = int(_field(self._configs[model], "max_batch_size"))
        return TensorRegions(model, max_batch * int(np.prod(IMAGE_SHAPE)) * FP32_BYTES,
                             max_batch * NUM_CLASSES * FP32_BYTES)


def _field(config: dict, snake_name: str, default=None):
    """A model-config field from HTTP's JSON (snake_case) or gRPC's (camelCase)."""
    if snake_name in config:
        return config[snake_name]
    head, *rest = snake_name.split("_")
    return config.get(head + "".join(word.title() for word in rest), default)


def _allows_timeout_override(config: dict) -> bool:
    batcher = _field(config, "dynamic_batching") or {}
    policy = _field(batcher, "default_queue_policy") or {}
    return bool(_field(policy, "allow_timeout_override", False))


def _metadata_json(metadata: dict) -> dict:
    for tensor in metadata.get("inputs", []) + metadata.get("outputs", []):
        tensor["shape"] = [int(d) for d in tensor["shape"]]  # gRPC's JSON renders int64 as strings
    return metadata


class TritonClassifierClient(_ClientBase):
    """Blocking client for the `resnet18` ensemble and the ResNet-18 models.

    url: "host:port" (default 127.0.0.1:8000 for http, :8001 for grpc), or a URL with the protocol's
        scheme ("http://host:port"); ValueError for anything else (see host_port).
    protocol: "http" or "grpc".
    retry: backoff and default deadline (`deadline_s`) of each call.
    shared_memory: pass `infer_tensor`'s input and output through system shared memory.
    Raises the typed errors of `client.errors`.
    """

    def __init__(self, url: str | None = None, protocol: str = "http", **options):
        super().__init__(url, protocol, **options)
        if protocol == "http":
            self._client = self._module.InferenceServerClient(
                self.url, connection_timeout=self.connection_timeout_s, network_timeout=3600.0)
        else:
            self._client = self._module.InferenceServerClient(self.url)
        self._lock = threading.Lock()

    @property
    def raw(self):
        """The underlying tritonclient InferenceServerClient."""
        return self._client

    def _call(self, function, *args):
        try:
            return function(*args)
        except InferenceServerException as exc:
            raise from_triton(exc) from None
        except (ConnectionError, OSError) as exc:
            raise ServerUnavailableError(f"cannot reach the server at {self.url}: {exc}") from None

    def is_server_live(self) -> bool:
        return self._call(self._client.is_server_live)

    def is_server_ready(self) -> bool:
        return self._call(self._client.is_server_ready)

    def is_model_ready(self, model: str) -> bool:
        return self._call(self._client.is_model_ready, model)

    def model_metadata(self, model: str) -> dict:
        """KServe v2 model metadata as JSON: {"name", "versions", "platform", "inputs", "outputs"},
        each tensor {"name", "datatype", "shape"} with -1 for variable (batch) dimensions."""
        if self.protocol == "http":
            return self._call(self._client.get_model_metadata, model)
        return _metadata_json(self._call(lambda: self._client.get_model_metadata(model, as_json=True)))

    def model_config(self, model: str) -> dict:
        """The model configuration the server loaded, as JSON (fields in camelCase over gRPC)."""
        if model not in self._configs:
            if self.protocol == "http":
                self._configs[model] = self._call(self._client.get_model_config, model)
            else:
                self._configs[model] = self._call(
                    lambda: self._client.get_model_config(model, as_json=True))["config"]
        return self._configs[model]

    def _infer(self, model: str, build, parse, deadline_s: float | None):
        self.model_config(model)
        retry = _Retry(self.retry_policy, self.retry_policy.deadline_s if deadline_s is None else deadline_s)
        while True:
            try:
                inputs, outputs = build()
                remaining_s = retry.remaining_s()
                return parse(self._infer_once(model, inputs, outputs, remaining_s))
            except (InferenceServerException, TimeoutError, ConnectionError, OSError) as exc:
                wait = retry.wait_after(exc)
                self.retries += 1
                time.sleep(wait)

    def _infer_once(self, model, inputs, outputs, remaining_s: float | None):
        timeout = self._server_timeout(model, remaining_s)
        if self.protocol == "grpc":
            return self._client.infer(model, inputs, outputs=outputs, client_timeout=remaining_s, **timeout)
        # HTTP: the blocking call has no per-request client timeout; async_infer + get_result has.
        return self._client.async_infer(model, inputs, outputs=outputs, **timeout).get_result(
            timeout=remaining_s)

    def classify(self, images: Sequence[bytes], top_k: int = 5, model: str = ENSEMBLE_MODEL,
                 deadline_s: float | None = None) -> list[list[Prediction]]:
        """Classify encoded images (JPEG, PNG, ...) in one request; len(images) <= the model's
        max_batch_size (16). Returns, per image, its top_k predictions, most probable first.
        deadline_s: time budget of the call in seconds (default: the retry policy's)."""
        return self._infer(model, lambda: self._classify_request(images, top_k),
                           lambda result: self._predictions(result, len(images)), deadline_s)

    def infer_tensor(self, batch: np.ndarray, model: str = ONNX_MODEL,
                     deadline_s: float | None = None) -> np.ndarray:
        """FP32 [N, 3, 224, 224] (normalized as the preprocess model does) -> logits FP32 [N, 1000].
        Raises ValueError for another shape, InvalidInputError for N > max_batch_size."""
        if not self.shared_memory:
            return self._infer(model, lambda: self._tensor_request(batch, None),
                               lambda result: self._logits(result, len(batch), None), deadline_s)
        with self._lock:
            regions = self._regions_for(model)
            return self._infer(model, lambda: self._tensor_request(batch, regions),
                               lambda result: self._logits(result, len(batch), regions), deadline_s)

    def _regions_for(self, model: str) -> TensorRegions:
        if model not in self._regions:
            self.model_config(model)
            regions = self._new_regions(model)
            try:
                for name, key, size in regions.registrations():
                    self._call(self._client.register_system_shared_memory, name, key, size)
            except BaseException:
                self._release(regions)
                raise
            self._regions[model] = regions
        return self._regions[model]

    def _release(self, regions: TensorRegions) -> None:
        for name, _, _ in regions.registrations():
            for attempt in range(UNREGISTER_TRIES):
                try:
                    self._client.unregister_system_shared_memory(name)
                    break
                except InferenceServerException as exc:
                    if "in use" not in (exc.message() or "") or attempt == UNREGISTER_TRIES - 1:
                        break  # server gone, or still busy after the retries: nothing more to do
                    time.sleep(UNREGISTER_WAIT_S)
                except Exception:  # connection closed: nothing left to unregister there
                    break
        regions.close()

    def close(self) -> None:
        """Unregister and destroy shared-memory regions, then close the connection (idempotent)."""
        while self._regions:
            self._release(self._regions.popitem()[1])
        self._client.close()

    def __enter__(self) -> "TritonClassifierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
