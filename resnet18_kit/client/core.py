"""The client core: everything both clients do, written once and free of I/O.

Each operation of the client API (health, metadata, config, classify, infer_tensor, shared-memory
registration, close) is a generator method of `ClientCore`. It builds the requests, decides about
retries and backoff, maps failures to the typed errors of `client.errors` and parses the answers; for
every exchange with the server it yields a `Call` (a tritonclient method name and its arguments), for
every wait a `Sleep`, and it receives the answer (or has the failure thrown in) in return. The shells
drive these generators: `client.sync_client.TritonClassifierClient` with blocking calls and time.sleep,
`client.async_client.AsyncTritonClassifierClient` with awaits and asyncio.sleep. So the two clients
differ only in how a Call is performed, never in what is sent or how an answer is read.

Model configs the server reports are read through observe.model_config.ModelConfigView.from_served:
the queue policy's allow_timeout_override (the request's `timeout` parameter, microseconds) and
max_batch_size (the shared-memory region sizes), plus `weights_meaningful` (see `weights_meaningful`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Sequence

import numpy as np
from tritonclient.utils import InferenceServerException

from resnet18_kit.client.backoff import Deadline, RetryPolicy
from resnet18_kit.client.errors import (DeadlineExceededError, QueueFullError, RequestCancelledError,
                                        ServerUnavailableError, typed_error)
from resnet18_kit.client.shared_memory import TensorRegions, bytes_byte_size, photo_region_bytes
from resnet18_kit.contract import (DEFAULT_URLS, FP32_BYTES, IMAGE_INPUT, IMAGE_SHAPE, LOGITS_OUTPUT, NUM_CLASSES,
                                   PROBABILITIES_OUTPUT, PROTOCOLS, TENSOR_DATATYPE, TENSOR_DTYPE, TENSOR_INPUT, host_port)
from resnet18_kit.observe.model_config import ModelConfigView, priority_levels

#: Right after an inference Triton may still hold a region and refuse to unregister it ("currently in
#: use"); close() retries up to UNREGISTER_TRIES times, UNREGISTER_WAIT_S apart (1 s in all).
UNREGISTER_TRIES = 20
UNREGISTER_WAIT_S = 0.05
#: A request's RPC deadline sits beyond the longest time Triton can hold it once its own queue timeout is
#: the caller's remaining time T: the ensemble hands the full timeout to each of its STEP_QUEUES steps'
#: queues, each followed by an execution (under 2 s at max batch here), so the server answers or refuses
#: within STEP_QUEUES x T + RPC_GRACE_S, and the RPC is never cancelled under it (a cancellation under
#: load crashes tritonserver before the fix of upstream defect grpc-cancellation: docs/reliability.md). The caller still gets
#: its answer or DeadlineExceededError at T; the RPC goes on unanswered and close() waits for it.
STEP_QUEUES = 2
RPC_GRACE_S = 30.0
#: The model-config parameter that says whether the served weights are trained ones ("true") or the
#: seeded random init of an export without downloadable weights ("false"); read by `weights_meaningful`.
WEIGHTS_PARAMETER = "weights_meaningful"


@dataclass(frozen=True)
class Prediction:
    """One of the top-k classes of an image, from the ensemble's `probabilities` and `logits` outputs
    (Triton's classification extension); immutable.

    Attributes:
        label: the ImageNet class name, from the model's label file (model_repository/resnet18/labels.txt).
        class_index: 0..999, the row of the label file.
        probability: the softmax of the logits, 0..1 (the 1000 classes sum to 1).
        logit: the unnormalized score; NaN in the rare case of a tie at the k-th place that left this
            class out of the logits' top k.
    """

    label: str          # ImageNet class name, from the model's label file
    class_index: int    # 0..999
    probability: float  # softmax of the logits, 0..1 (all 1000 classes sum to 1)
    logit: float        # the unnormalized score; NaN in the rare case of a tie at the k-th place that
                        # left this class out of the logits' top k


@dataclass(frozen=True)
class Call:
    """One exchange with the server: tritonclient's InferenceServerClient.<name>(*args, **kwargs).
    For infer: timeout_s, how long the caller waits for the answer, seconds (None = no bound); past it the
    shell raises TimeoutError and leaves the request to finish unanswered (never cancelled: see
    STEP_QUEUES); rpc_timeout_s, the RPC's own bound (rpc_deadline_s), how long close() waits for it."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    timeout_s: float | None = None
    rpc_timeout_s: float | None = None
    #: The caller's cancellation (threading.Event for the blocking client, asyncio.Event for the asyncio
    #: one): once set, the shell cancels the request (module doc of client.sync_client, "Cancellation").
    cancel: object = None


def rpc_deadline_s(remaining_s: float | None) -> float | None:
    """The RPC's own deadline for a caller with `remaining_s` seconds left (None: none); see STEP_QUEUES."""
    return None if remaining_s is None else STEP_QUEUES * remaining_s + RPC_GRACE_S


@dataclass(frozen=True)
class Sleep:
    """A wait of `seconds` before the next Call (backoff)."""

    seconds: float


Steps = Generator  # of Call | Sleep, receiving each Call's answer; returns the operation's result


def advance(steps: Steps, answer=None, failure: BaseException | None = None) -> tuple[bool, object]:
    """Hand a core operation the answer to its last Call (or throw in the failure): (False, its next Call
    or Sleep), or (True, its result) when it has finished. Its own errors propagate."""
    try:
        return False, steps.throw(failure) if failure is not None else steps.send(answer)
    except StopIteration as stop:
        return True, stop.value


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


class ClientCore:
    """State and operations shared by both clients; see the module doc. The shells subclass it and add
    the driver; the attributes below are public on both.

    url: "host:port" (default 127.0.0.1:8000 for http, :8001 for grpc), or a URL with the protocol's
        scheme ("http://host:port"); ValueError for anything else (contract.host_port).
    protocol: "http" or "grpc" (ValueError for another).
    retry: backoff and default deadline (`deadline_s`, seconds) of each call.
    shared_memory: pass infer_tensor's input and output, and classify's photos, through system shared
        memory (client.shared_memory).
    connection_timeout_s: seconds to wait for a connection (HTTP).
    """

    _asyncio_api = False

    def __init__(self, url: str | None = None, protocol: str = "http", *,
                 retry: RetryPolicy = RetryPolicy(), shared_memory: bool = False,
                 connection_timeout_s: float = 10.0):
        self._module = protocol_module(protocol, self._asyncio_api)
        self.protocol = protocol
        self.url = host_port(url or DEFAULT_URLS[protocol], protocol)  # ValueError before any connection
        self.retry_policy = retry
        self.shared_memory = shared_memory
        self.connection_timeout_s = connection_timeout_s
        #: Queue-full refusals this client retried, over all its calls.
        self.retries = 0
        self._configs: dict[str, dict] = {}
        self._views: dict[str, ModelConfigView] = {}
        self._regions: dict[str, TensorRegions] = {}

    # -- one exchange, errors typed ---------------------------------------------------------------------

    def _ask(self, name: str, *args, **kwargs) -> Steps:
        """One Call whose failure is raised as a typed error (no retry); over gRPC bounded by
        connection_timeout_s (HTTP: the connection timeout of the client)."""
        if self.protocol == "grpc":
            kwargs.setdefault("client_timeout", self.connection_timeout_s)
        try:
            return (yield Call(name, args, kwargs))
        except Exception as exc:
            raise typed_error(exc, self.url, self.protocol) from None

    # -- health, metadata, config ---------------------------------------------------------------------

    def _is_server_live(self) -> Steps:
        return bool((yield from self._ask("is_server_live")))

    def _is_server_ready(self) -> Steps:
        return bool((yield from self._ask("is_server_ready")))

    def _is_model_ready(self, model: str) -> Steps:
        return bool((yield from self._ask("is_model_ready", model)))

    def _server_metadata(self) -> Steps:
        """{"name", "version", "extensions"}; ServerUnavailableError "not a Triton server" when the answer
        lacks them (another HTTP server that answers 200 with JSON)."""
        metadata = yield from self._ask("get_server_metadata", **({} if self.protocol == "http" else {"as_json": True}))
        if not isinstance(metadata, dict) or "version" not in metadata or "extensions" not in metadata:
            raise ServerUnavailableError(f"{self.url} is not a Triton server (its server metadata has no version)")
        return metadata

    def _model_metadata(self, model: str) -> Steps:
        if self.protocol == "http":
            return (yield from self._ask("get_model_metadata", model))
        metadata = yield from self._ask("get_model_metadata", model, as_json=True)
        for tensor in metadata.get("inputs", []) + metadata.get("outputs", []):
            tensor["shape"] = [int(d) for d in tensor["shape"]]  # gRPC's JSON renders int64 as strings
        return metadata

    def _model_config(self, model: str) -> Steps:
        if model not in self._configs:
            if self.protocol == "http":
                self._configs[model] = yield from self._ask("get_model_config", model)
            else:
                self._configs[model] = (yield from self._ask("get_model_config", model, as_json=True))["config"]
        return self._configs[model]

    def _model_config_view(self, model: str) -> Steps:
        if model not in self._views:
            self._views[model] = ModelConfigView.from_served((yield from self._model_config(model)))
        return self._views[model]

    def _weights_meaningful(self, model: str) -> Steps:
        """True / False from the WEIGHTS_PARAMETER ("true" / "false") of `model`'s served config, else of
        the first step of its ensemble that has one; None when none says (unknown)."""
        view = yield from self._model_config_view(model)
        names = [model] + [step.model_name for step in view.proto.ensemble_scheduling.step]
        for name in names:
            if name != model:
                view = yield from self._model_config_view(name)
            value = view.parameters.get(WEIGHTS_PARAMETER, "").strip().lower()
            if value in ("true", "1", "yes"):
                return True
            if value in ("false", "0", "no"):
                return False
        return None

    # -- inference ------------------------------------------------------------------------------------

    def _priority_levels(self, model: str) -> Steps:
        """The most priority levels `model`, or any step of its ensemble, serves (0: none)."""
        view = yield from self._model_config_view(model)
        levels = priority_levels(view.proto)
        for step in view.proto.ensemble_scheduling.step:
            levels = max(levels, priority_levels((yield from self._model_config_view(step.model_name)).proto))
        return levels

    def _check_priority(self, model: str, priority: int) -> Steps:
        """ValueError unless `priority` is 0 (the model's default level) or one of the levels `model`
        serves: Triton itself would serve an unknown level at the default one without a word."""
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise ValueError(f"priority must be an integer >= 0 (0: the model's default level), not {priority!r}")
        if priority:
            levels = yield from self._priority_levels(model)
            if priority > levels:
                served = f"serves priority levels 1..{levels}" if levels > 1 else "serves no priority levels"
                raise ValueError(f"priority {priority}: {model} {served} (1 is served first)")

    def _infer(self, model: str, build, parse, deadline_s: float | None, priority: int = 0,
               cancel=None) -> Steps:
        """Send one inference, retrying queue-full refusals with backoff until the deadline (module doc of
        client.sync_client). build() -> (inputs, outputs); parse(result) -> the answer. The remaining
        time goes to the server as the request's `timeout` (microseconds): a queue that allows it
        (allow_timeout_override) refuses the request once nobody waits for it, instead of the client
        cancelling it; the RPC's own deadline is rpc_deadline_s of it. priority: the request's priority
        level (0 = the model's default; ValueError for one it does not serve); cancel: an event that
        cancels the request when set (RequestCancelledError)."""
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be a positive number of seconds, not {deadline_s!r}")
        yield from self._model_config_view(model)  # the model exists; errors typed before the first try
        yield from self._check_priority(model, priority)
        deadline = Deadline(self.retry_policy.deadline_s if deadline_s is None else deadline_s)
        attempts = 0
        while True:
            inputs, outputs = build()
            remaining_s = deadline.remaining_s()
            if remaining_s is not None and remaining_s <= 0:
                raise DeadlineExceededError("deadline expired before the request could be sent", retries=attempts)
            if cancel is not None and cancel.is_set():
                raise RequestCancelledError("cancelled by the caller before it was sent", retries=attempts)
            options = {} if remaining_s is None else {"timeout": max(1, int(remaining_s * 1e6))}
            if priority:
                options["priority"] = priority
            rpc_timeout_s = rpc_deadline_s(remaining_s)
            if self.protocol == "grpc":
                options["client_timeout"] = rpc_timeout_s
            try:
                result = yield Call("infer", (model, inputs), {"outputs": outputs, **options}, remaining_s,
                                    rpc_timeout_s, cancel)
            except Exception as exc:
                error = typed_error(exc, self.url, self.protocol, deadline, probe=False)
                error.retries = attempts
                wait = self.retry_policy.backoff_s(attempts)
                remaining_s = deadline.remaining_s()
                if not isinstance(error, QueueFullError) or (remaining_s is not None and wait >= remaining_s):
                    raise error from None
                attempts += 1
                self.retries += 1
                yield Sleep(wait)
                continue
            return parse(result)

    def _classify(self, images: Sequence[bytes], top_k: int, model: str, deadline_s: float | None,
                  priority: int = 0, cancel=None) -> Steps:
        if not 1 <= top_k <= NUM_CLASSES:
            raise ValueError(f"top_k must be 1..{NUM_CLASSES}, not {top_k}")
        region = (yield from self._photo_region_for(model, bytes_byte_size(images))) if self.shared_memory else None
        return (yield from self._infer(model, lambda: self._classify_request(images, top_k, region),
                                       lambda result: self._predictions(result, len(images)), deadline_s,
                                       priority, cancel))

    def _infer_tensor(self, batch: np.ndarray, model: str, deadline_s: float | None, priority: int = 0,
                      cancel=None) -> Steps:
        regions = (yield from self._regions_for(model)) if self.shared_memory else None
        return (yield from self._infer(model, lambda: self._tensor_request(batch, regions),
                                       lambda result: self._logits(result, len(batch), regions), deadline_s,
                                       priority, cancel))

    def _classify_request(self, images: Sequence[bytes], top_k: int, region: TensorRegions | None):
        array = np.array([bytes(image) for image in images], dtype=np.object_).reshape(-1, 1)
        request = self._module.InferInput(IMAGE_INPUT, list(array.shape), "BYTES")
        if region is None:
            request.set_data_from_numpy(array)
        else:
            request.set_shared_memory(region.input_name, region.write_input(array))
        return [request], [self._module.InferRequestedOutput(name, class_count=top_k)
                           for name in (PROBABILITIES_OUTPUT, LOGITS_OUTPUT)]

    def _tensor_request(self, batch: np.ndarray, regions: TensorRegions | None):
        batch = np.ascontiguousarray(batch)
        if batch.dtype != TENSOR_DTYPE or batch.ndim != 4 or batch.shape[1:] != IMAGE_SHAPE:
            raise ValueError(f"batch must be {TENSOR_DATATYPE} pixels [N, 3, 224, 224], got {batch.dtype} {list(batch.shape)}")
        request = self._module.InferInput(TENSOR_INPUT, list(batch.shape), TENSOR_DATATYPE)
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

    # -- shared memory --------------------------------------------------------------------------------

    def _regions_for(self, model: str) -> Steps:
        """The model's registered regions, created (sized for its served max_batch_size) on first use."""
        if model not in self._regions:
            view = yield from self._model_config_view(model)
            image_bytes = int(np.prod(IMAGE_SHAPE)) * np.dtype(TENSOR_DTYPE).itemsize
            yield from self._register(model, TensorRegions(model, view.max_batch_size * image_bytes,
                                                           view.max_batch_size * NUM_CLASSES * FP32_BYTES))
        return self._regions[model]

    def _photo_region_for(self, model: str, byte_size: int) -> Steps:
        """The registered input region for `model`'s encoded photos, replaced by a larger one
        (photo_region_bytes) when a request of `byte_size` bytes does not fit."""
        key = f"{model} photos"
        if key in self._regions and self._regions[key].input_bytes < byte_size:
            yield from self._release(self._regions.pop(key))
        if key not in self._regions:
            yield from self._register(key, TensorRegions(model, photo_region_bytes(byte_size)))
        return self._regions[key]

    def _register(self, key: str, regions: TensorRegions) -> Steps:
        try:
            for name, shm_key, size in regions.registrations():
                yield from self._ask("register_system_shared_memory", name, shm_key, size)
        except BaseException:
            yield from self._release(regions)
            raise
        self._regions[key] = regions

    def _release(self, regions: TensorRegions) -> Steps:
        """Unregister both regions (retrying "in use"), then destroy them; never raises for the server."""
        for name, _, _ in regions.registrations():
            for attempt in range(UNREGISTER_TRIES):
                try:
                    yield Call("unregister_system_shared_memory", (name,))
                    break
                except InferenceServerException as exc:
                    if "in use" not in (exc.message() or "") or attempt == UNREGISTER_TRIES - 1:
                        break  # server gone, or still busy after the retries: nothing more to do
                    yield Sleep(UNREGISTER_WAIT_S)
                except Exception:  # connection closed: nothing left to unregister there
                    break
        regions.close()

    def _close(self) -> Steps:
        while self._regions:
            yield from self._release(self._regions.popitem()[1])
        yield Call("close")
