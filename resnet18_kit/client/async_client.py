"""The asyncio client: `AsyncTritonClassifierClient`, the twin of client.sync_client.TritonClassifierClient
(same arguments, methods, retries, deadlines and typed errors, as coroutines over tritonclient.http.aio /
tritonclient.grpc.aio). Both are shells around client.core.ClientCore; see client.sync_client for the
behaviour they share.

    async with AsyncTritonClassifierClient("127.0.0.1:8000", protocol="http") as client:
        top5 = await client.classify([image_bytes])  # [[Prediction, ...]]
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import numpy as np

from resnet18_kit.client.core import Call, ClientCore, Prediction, Sleep, Steps, advance
from resnet18_kit.client.errors import RequestCancelledError
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL
from resnet18_kit.observe.model_config import ModelConfigView


class AsyncTritonClassifierClient(ClientCore):
    """The asyncio twin of `TritonClassifierClient`: the same arguments, methods and errors, as
    coroutines, over tritonclient.http.aio / tritonclient.grpc.aio. Use `async with`."""

    _asyncio_api = True

    def __init__(self, url: str | None = None, protocol: str = "http", **options):
        super().__init__(url, protocol, **options)
        if protocol == "http":
            self._client = self._module.InferenceServerClient(self.url, conn_timeout=3600.0)
        else:
            self._client = self._module.InferenceServerClient(self.url)
        self._lock = asyncio.Lock()
        #: Inferences whose caller stopped waiting (its deadline, or its task cancelled): (task, loop time
        #: by which the RPC ends). close() awaits them, so no request is cancelled (client.sync_client).
        self._unanswered: dict[asyncio.Task, float | None] = {}

    @property
    def raw(self):
        """The underlying tritonclient aio InferenceServerClient."""
        return self._client

    async def _perform(self, call: Call):
        if call.name != "infer":
            return await getattr(self._client, call.name)(*call.args, **call.kwargs)
        loop = asyncio.get_running_loop()
        ends_at = None if call.rpc_timeout_s is None else loop.time() + call.rpc_timeout_s
        request = asyncio.ensure_future(self._client.infer(*call.args, **call.kwargs))
        if call.cancel is not None:
            return await self._cancellable(request, call)
        try:
            return await asyncio.wait_for(asyncio.shield(request), call.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:  # the request goes on, unanswered
            self._unanswered[request] = ends_at
            request.add_done_callback(self._forget)
            if isinstance(exc, asyncio.TimeoutError):
                raise TimeoutError(f"{call.timeout_s:.3f} s") from None
            raise

    async def _cancellable(self, request: asyncio.Future, call: Call):
        """Wait for `request` until its answer, the caller's event (the request is cancelled:
        RequestCancelledError) or call.timeout_s (cancelled too: TimeoutError)."""
        cancelled = asyncio.ensure_future(call.cancel.wait())
        try:
            done, _ = await asyncio.wait({request, cancelled}, timeout=call.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if request in done:
            return request.result()
        request.cancel()  # HTTP: aiohttp closes the request's connection; gRPC: the RPC is cancelled
        await asyncio.gather(request, return_exceptions=True)
        if cancelled in done:
            raise RequestCancelledError("cancelled by the caller")
        raise TimeoutError(f"{call.timeout_s:.3f} s")

    def _forget(self, request: asyncio.Task) -> None:
        self._unanswered.pop(request, None)
        if not request.cancelled():
            request.exception()  # retrieved: nobody waits for it any more

    async def _run_inference(self, steps: Steps):
        """_run for an inference: one at a time on this client when it uses shared memory (its regions are
        reused by every call)."""
        if not self.shared_memory:
            return await self._run(steps)
        async with self._lock:
            return await self._run(steps)

    async def _run(self, steps: Steps):
        """Drive a core operation: await each Call, asyncio.sleep each Sleep, return the result."""
        done, step = advance(steps)
        while not done:
            try:
                answer = await (asyncio.sleep(step.seconds) if isinstance(step, Sleep) else self._perform(step))
            except Exception as exc:
                done, step = advance(steps, failure=exc)
            else:
                done, step = advance(steps, answer)
        return step

    async def is_server_live(self) -> bool:
        """As `TritonClassifierClient.is_server_live`: True when the server is live."""
        return await self._run(self._is_server_live())

    async def is_server_ready(self) -> bool:
        """As `TritonClassifierClient.is_server_ready`: True when the server is ready to serve."""
        return await self._run(self._is_server_ready())

    async def is_model_ready(self, model: str) -> bool:
        """As `TritonClassifierClient.is_model_ready`: True when `model` is loaded and ready."""
        return await self._run(self._is_model_ready(model))

    async def server_metadata(self) -> dict:
        """The server's KServe v2 metadata {"name", "version", "extensions"}; ServerUnavailableError when
        the endpoint is not a Triton server."""
        return await self._run(self._server_metadata())

    async def model_metadata(self, model: str) -> dict:
        """As `TritonClassifierClient.model_metadata`."""
        return await self._run(self._model_metadata(model))

    async def model_config(self, model: str) -> dict:
        """As `TritonClassifierClient.model_config`."""
        return await self._run(self._model_config(model))

    async def model_config_view(self, model: str) -> ModelConfigView:
        """As `TritonClassifierClient.model_config_view`."""
        return await self._run(self._model_config_view(model))

    async def priority_levels(self, model: str = ENSEMBLE_MODEL) -> int:
        """As `TritonClassifierClient.priority_levels`."""
        return await self._run(self._priority_levels(model))

    async def check_priority(self, model: str, priority: int) -> None:
        """As `TritonClassifierClient.check_priority`."""
        await self._run(self._check_priority(model, priority))

    async def weights_meaningful(self, model: str = ENSEMBLE_MODEL) -> bool | None:
        """As `TritonClassifierClient.weights_meaningful`."""
        return await self._run(self._weights_meaningful(model))

    async def classify(self, images: Sequence[bytes], top_k: int = 5, model: str = ENSEMBLE_MODEL,
                       deadline_s: float | None = None, priority: int = 0,
                       cancel: asyncio.Event | None = None) -> list[list[Prediction]]:
        """Classify encoded images in one request: the arguments, return value and errors of
        `TritonClassifierClient.classify`.

        Args:
            images: encoded image files as bytes, at most max_batch_size (16).
            top_k: predictions per image, 1..1000. model: the ensemble (default "resnet18").
            deadline_s: the call's time budget in seconds. priority: 1 = interactive, 0 = default.
            cancel: an asyncio.Event; setting it cancels the request over gRPC and HTTP alike (over HTTP
                the connection is closed and the caller freed; Triton still computes the request).
                Cancelling the task instead leaves the request to finish unanswered, as a deadline does.

        Returns:
            One list per image of its top_k Prediction rows, most probable first.

        Raises:
            The InferenceError subclasses of `TritonClassifierClient.classify`; ValueError for bad
            arguments.
        """
        return await self._run_inference(self._classify(images, top_k, model, deadline_s, priority, cancel))

    async def infer_tensor(self, batch: np.ndarray, model: str = ONNX_MODEL, deadline_s: float | None = None,
                           priority: int = 0, cancel: asyncio.Event | None = None) -> np.ndarray:
        """Run the network alone: numpy uint8 pixels [N, 3, 224, 224] (RGB, 0-255) -> float32 [N, 1000]
        logits; arguments, errors and `cancel` as for `classify` and `TritonClassifierClient.infer_tensor`."""
        return await self._run_inference(self._infer_tensor(batch, model, deadline_s, priority, cancel))

    async def close(self) -> None:
        """Await the inferences the caller stopped waiting for (each within its RPC deadline, so no request
        is cancelled), unregister and destroy shared-memory regions, then close the connection (idempotent)."""
        loop = asyncio.get_running_loop()
        for request, ends_at in list(self._unanswered.items()):
            await asyncio.wait({request}, timeout=None if ends_at is None else max(0.0, ends_at - loop.time()))
        await self._run(self._close())

    async def __aenter__(self) -> "AsyncTritonClassifierClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
