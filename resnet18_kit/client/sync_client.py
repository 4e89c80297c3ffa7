"""Client API for this model repository, over HTTP or gRPC (KServe v2 / Open Inference Protocol).

Two classes with the same methods, one blocking and one for asyncio, both over tritonclient and both
thin shells around one core (client.core.ClientCore: requests, retries, errors, parsing):

    with TritonClassifierClient("127.0.0.1:8001", protocol="grpc") as client:
        top5 = client.classify([open("cat.jpg", "rb").read()], top_k=5)  # [[Prediction, ...]]
        top5[0][0].probability, top5[0][0].logit  # softmax probability (0..1) and raw logit
        logits = client.infer_tensor(batch)  # FP32 [N, 3, 224, 224] -> FP32 [N, 1000]

    async with AsyncTritonClassifierClient("127.0.0.1:8000", protocol="http") as client:  # client.async_client
        top5 = await client.classify([image_bytes])

`protocol` picks tritonclient.http or tritonclient.grpc (their .aio variants for the asyncio class).

Back-pressure: a request refused with HTTP 503 / gRPC UNAVAILABLE "Exceeds maximum queue size" is sent
again after a capped, jittered exponential backoff (`client.backoff.RetryPolicy`) until the call's
deadline; `client.retries` counts those retries. Every other failure raises at once, as one of the typed
errors of `client.errors` (status and server message attached); a server that cannot be reached, or an
address that does not speak the protocol (another port, another HTTP server), is ServerUnavailableError.

Deadlines: each call has a time budget (`deadline_s`, default `RetryPolicy.deadline_s`). What is left
of it goes to the server as the request's `timeout` parameter (microseconds): a queue whose policy allows
it (`allow_timeout_override: true`) refuses the request once its time is up ("Request timeout expired",
DeadlineExceededError), so it is not computed for nobody. The caller gets its answer or
DeadlineExceededError when the budget ends; the request itself is never cancelled (upstream defect
grpc-cancellation): its RPC has a longer deadline (client.core.rpc_deadline_s), goes on
unanswered, and close() waits for it before closing the connection.

Priority: `priority=1` puts a request ahead of every default-priority (2) request still queued in the
steps that configure levels (model_repository/*/config.pbtxt, `priority_levels`); 0 = the model's default
level; a level the model does not serve is a ValueError (Triton would quietly serve it at the default).

Cancellation: pass `cancel=` an event (threading.Event here, asyncio.Event for the asyncio client); setting
it cancels the request and the call raises RequestCancelledError. Over gRPC the RPC is cancelled: the kit's
gRPC guard, where the release needs it (upstream defect grpc-cancellation), answers the caller at once and
never cancels upstream, but marks the request, and the kit's models skip it unless they have begun it;
straight to a tritonserver, the server drops the request from its queues. The asyncio client's HTTP cancel
closes the request's connection; Triton computes the request anyway. So the caller is always freed at once, the server where Triton sees the cancellation or
the guard's mark. The blocking HTTP client cannot cancel (tritonclient.http has no way to abort a
request): ValueError. docs/usage.md "Traffic controls".

Shared memory (`shared_memory=True`): `infer_tensor` passes its input and output through system shared
memory regions registered once per model (sized for its served max_batch_size), `classify` its encoded
photos through a region sized for the largest request so far; both unregistered on close (same host only;
see `client.shared_memory`). Calls on one client then run one at a time (a lock).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Sequence

import numpy as np
from tritonclient.utils import InferenceServerException

from resnet18_kit.client.core import Call, ClientCore, Prediction, Sleep, Steps, advance
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL
from resnet18_kit.client.errors import RequestCancelledError
from resnet18_kit.observe.model_config import ModelConfigView

#: Connections of one blocking HTTP client: one for the call under way, the others for requests whose
#: caller stopped waiting at its deadline while the server still holds them.
HTTP_CONNECTIONS = 4
#: How often a cancellable call looks at its caller's event, seconds (its answer is not delayed by it).
CANCEL_POLL_S = 0.005
#: tritonclient.http's message when InferAsyncRequest.get_result's timeout passes first.
HTTP_NO_ANSWER_YET = "failed to obtain inference response"


class TritonClassifierClient(ClientCore):
    """Blocking client for the `resnet18` ensemble and the ResNet-18 models (use it as a context manager).

    Args:
        url: "host:port" of the server (default 127.0.0.1:8000 for http, 127.0.0.1:8001 for grpc), or a
            URL with the protocol's scheme ("http://host:port").
        protocol: "http" or "grpc" (KServe v2 / Open Inference Protocol).
        retry: RetryPolicy: the backoff after a queue-full refusal and each call's default deadline
            (`deadline_s`, seconds; default 30).
        shared_memory: pass `infer_tensor`'s input and output, and `classify`'s photos, through system shared
            memory (same host).
        connection_timeout_s: seconds to wait for a connection (default 10).

    Raises:
        ValueError: a url that is not host:port or has another scheme, or another protocol; nothing is
            sent. Every method raises the typed errors of `client.errors` (InferenceError subclasses:
            QueueFullError once the deadline ends, DeadlineExceededError, InvalidInputError,
            ModelNotFoundError, ServerUnavailableError, RequestCancelledError), each with the server's
            status and message.
    """

    def __init__(self, url: str | None = None, protocol: str = "http", **options):
        super().__init__(url, protocol, **options)
        if protocol == "http":
            # HTTP_CONNECTIONS: a request the caller stopped waiting for keeps its connection until the
            # server answers; the next calls take the others.
            self._client = self._module.InferenceServerClient(
                self.url, connection_timeout=self.connection_timeout_s, network_timeout=3600.0,
                concurrency=HTTP_CONNECTIONS)
        else:
            self._client = self._module.InferenceServerClient(self.url)
        self._lock = threading.Lock()
        #: Inferences whose caller stopped waiting at its deadline: (answer's getter, monotonic time by
        #: which the RPC ends). close() waits for them. HTTP's belong to the thread that sent them (gevent).
        self._unanswered: list[tuple[object, float | None]] = []

    @property
    def raw(self):
        """The underlying tritonclient InferenceServerClient."""
        return self._client

    def _perform(self, call: Call):
        if call.name != "infer":
            return getattr(self._client, call.name)(*call.args, **call.kwargs)
        ends_at = None if call.rpc_timeout_s is None else time.monotonic() + call.rpc_timeout_s
        if call.cancel is not None:
            return self._cancellable(call)
        answer = self._send(call)
        try:
            return answer(call.timeout_s)
        except TimeoutError:  # the caller's deadline: the request goes on, unanswered (module doc)
            self._unanswered.append((answer, ends_at))
            raise TimeoutError(f"{call.timeout_s:.3f} s") from None

    def _send(self, call: Call):
        """Start an inference; return answer(timeout_s) -> its result, raising its error, or TimeoutError
        when `timeout_s` passes first (the request then goes on)."""
        if self.protocol == "http":
            request = self._client.async_infer(*call.args, **call.kwargs)

            def answer(timeout_s):
                try:
                    return request.get_result(timeout=timeout_s)
                except InferenceServerException as exc:
                    if exc.message() == HTTP_NO_ANSWER_YET:
                        raise TimeoutError() from None
                    raise
            return answer
        future: Future = Future()

        def done(result, error):
            future.set_exception(error) if error is not None else future.set_result(result)
        self._client.async_infer(*call.args, callback=done, **call.kwargs)
        return future.result

    def _cancellable(self, call: Call):
        """A gRPC inference the caller may cancel (call.cancel set): RequestCancelledError once it is."""
        if self.protocol == "http":
            raise ValueError("cancel: the blocking HTTP client cannot cancel a request (tritonclient.http has "
                             "no way to abort one); use protocol='grpc' or the asyncio client")
        future: Future = Future()

        def done(result, error):
            future.set_exception(error) if error is not None else future.set_result(result)
        context = self._client.async_infer(*call.args, callback=done, **call.kwargs)
        ends_at = None if call.timeout_s is None else time.monotonic() + call.timeout_s
        while True:
            try:
                return future.result(timeout=CANCEL_POLL_S)
            except FutureTimeout:
                pass
            if call.cancel.is_set():
                context.cancel()
                raise RequestCancelledError("cancelled by the caller")
            if ends_at is not None and time.monotonic() >= ends_at:
                context.cancel()  # the caller's deadline: cancelled, as the caller asked for cancellation
                raise TimeoutError(f"{call.timeout_s:.3f} s")

    def _wait_unanswered(self) -> None:
        """Let every inference the caller stopped waiting for end (each within its RPC deadline)."""
        while self._unanswered:
            answer, ends_at = self._unanswered.pop()
            try:
                answer(None if ends_at is None else max(0.0, ends_at - time.monotonic()))
            except Exception:  # its answer or error was no longer wanted
                pass

    def _run_inference(self, steps: Steps):
        """_run for an inference: one at a time on this client when it uses shared memory (its regions are
        reused by every call)."""
        if not self.shared_memory:
            return self._run(steps)
        with self._lock:
            return self._run(steps)

    def _run(self, steps: Steps):
        """Drive a core operation: perform each Call, sleep each Sleep, return the operation's result."""
        done, step = advance(steps)
        while not done:
            try:
                answer = time.sleep(step.seconds) if isinstance(step, Sleep) else self._perform(step)
            except Exception as exc:
                done, step = advance(steps, failure=exc)
            else:
                done, step = advance(steps, answer)
        return step

    def is_server_live(self) -> bool:
        """True when the server answers its liveness endpoint (KServe v2 /v2/health/live)."""
        return self._run(self._is_server_live())

    def is_server_ready(self) -> bool:
        """True when the server is ready to serve (/v2/health/ready: every model loaded, not stopping)."""
        return self._run(self._is_server_ready())

    def is_model_ready(self, model: str) -> bool:
        """True when `model` (a name of the model repository, e.g. "resnet18") is loaded and ready."""
        return self._run(self._is_model_ready(model))

    def server_metadata(self) -> dict:
        """The server's KServe v2 metadata {"name", "version", "extensions"}; ServerUnavailableError when
        the endpoint is not a Triton server."""
        return self._run(self._server_metadata())

    def model_metadata(self, model: str) -> dict:
        """KServe v2 model metadata as JSON: {"name", "versions", "platform", "inputs", "outputs"},
        each tensor {"name", "datatype", "shape"} with -1 for variable (batch) dimensions."""
        return self._run(self._model_metadata(model))

    def model_config(self, model: str) -> dict:
        """The model configuration the server loaded, as JSON (fields in camelCase over gRPC); cached."""
        return self._run(self._model_config(model))

    def model_config_view(self, model: str) -> ModelConfigView:
        """The served config as observe.model_config.ModelConfigView (cached)."""
        return self._run(self._model_config_view(model))

    def priority_levels(self, model: str = ENSEMBLE_MODEL) -> int:
        """The most priority levels `model` or a step of its ensemble serves (0: none; 1 is served first)."""
        return self._run(self._priority_levels(model))

    def check_priority(self, model: str, priority: int) -> None:
        """ValueError, one line ("priority 3: resnet18 serves priority levels 1..2 ..."), unless `model`
        serves `priority` (0 = its default level)."""
        self._run(self._check_priority(model, priority))

    def weights_meaningful(self, model: str = ENSEMBLE_MODEL) -> bool | None:
        """Whether the served weights are trained (True), random (False) or unknown (None): the
        `weights_meaningful` parameter of the model's served config, or of its ensemble steps' configs."""
        return self._run(self._weights_meaningful(model))

    def classify(self, images: Sequence[bytes], top_k: int = 5, model: str = ENSEMBLE_MODEL,
                 deadline_s: float | None = None, priority: int = 0,
                 cancel: threading.Event | None = None) -> list[list[Prediction]]:
        """Classify encoded images in one request through the ensemble (decode, resize, network, labels).

        Args:
            images: encoded image files (JPEG, PNG, ... as bytes), one per row; at most the model's
                max_batch_size (16 for the shipped configs).
            top_k: predictions per image, 1..1000.
            model: the ensemble's name (default "resnet18").
            deadline_s: the call's time budget in seconds, > 0 (default: the retry policy's deadline_s);
                what is left of it is sent as the request's queue timeout.
            priority: 1 = served before the default level 2 in the steps that configure priority
                levels; 0 = the model's default level.
            cancel: a threading.Event; setting it cancels the request (gRPC only for this client).

        Returns:
            One list per image, in order: its top_k Prediction(label, class_index, probability 0..1,
            logit), most probable first.

        Raises:
            ValueError: top_k out of range, a priority the model does not serve, cancel over HTTP.
            InvalidInputError: an image the server cannot decode (HTTP 400 / gRPC INVALID_ARGUMENT),
                more images than max_batch_size.
            QueueFullError: the queue stayed full until the deadline (HTTP 503 / gRPC UNAVAILABLE).
            DeadlineExceededError: no answer within deadline_s.
            RequestCancelledError: `cancel` was set.
            ServerUnavailableError: nothing that speaks Triton's protocol at the url.
        """
        return self._run_inference(self._classify(images, top_k, model, deadline_s, priority, cancel))

    def infer_tensor(self, batch: np.ndarray, model: str = ONNX_MODEL, deadline_s: float | None = None,
                     priority: int = 0, cancel: threading.Event | None = None) -> np.ndarray:
        """Run the network alone on a batch of preprocessed images.

        Args:
            batch: numpy uint8 [N, 3, 224, 224], RGB pixels 0-255 as the preprocess model writes them
                (resized to 256, center-cropped to 224, channels first; the network normalizes them),
                N <= the model's max_batch_size.
            model: the network's name (default "resnet18_onnx"; or "resnet18_torchscript").
            deadline_s, priority, cancel: as for classify.

        Returns:
            numpy float32 [N, 1000]: the logits, one row per image (ImageNet class order).

        Raises:
            ValueError: another shape or dtype. InvalidInputError: N > max_batch_size. The other errors
            as for classify.
        """
        return self._run_inference(self._infer_tensor(batch, model, deadline_s, priority, cancel))

    def close(self) -> None:
        """Wait for the inferences the caller stopped waiting for (each within its RPC deadline, so no
        request is cancelled), unregister and destroy shared-memory regions, then close the connection
        (idempotent). Over HTTP, call it from the thread that made the calls (gevent's loop is per thread)."""
        self._wait_unanswered()
        self._run(self._close())

    def __enter__(self) -> "TritonClassifierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
