"""The asyncio client: `AsyncTritonClassifierClient`, the twin of client.classifier.TritonClassifierClient
(same arguments, methods, retries, deadlines and typed errors, as coroutines over tritonclient.http.aio /
tritonclient.grpc.aio; see client.classifier for the behaviour both share).

    async with AsyncTritonClassifierClient("127.0.0.1:8000", protocol="http") as client:
        top5 = await client.classify([image_bytes])  # [[Prediction, ...]]
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import numpy as np
from tritonclient.utils import InferenceServerException

from resnet18_kit.client.classifier import (UNREGISTER_TRIES, UNREGISTER_WAIT_S, Prediction, _ClientBase, _metadata_json,
                                            _Retry)
from resnet18_kit.client.errors import ServerUnavailableError, from_triton
from resnet18_kit.client.shared_memory import TensorRegions
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL


class AsyncTritonClassifierClient(_ClientBase):
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

    @property
    def raw(self):
        """The underlying tritonclient aio InferenceServerClient."""
        return self._client

    async def _call(self, awaitable):
        try:
            return await awaitable
        except InferenceServerException as exc:
            raise from_triton(exc) from None
        except (ConnectionError, OSError) as exc:
            raise ServerUnavailableError(f"cannot reach the server at {self.url}: {exc}") from None

    async def is_server_live(self) -> bool:
        return await self._call(self._client.is_server_live())

    async def is_server_ready(self) -> bool:
        return await self._call(self._client.is_server_ready())

    async def is_model_ready(self, model: str) -> bool:
        return await self._call(self._client.is_model_ready(model))

    async def model_metadata(self, model: str) -> dict:
        """As `TritonClassifierClient.model_metadata`."""
        if self.protocol == "http":
            return await self._call(self._client.get_model_metadata(model))
        return _metadata_json(await self._call(self._client.get_model_metadata(model, as_json=True)))

    async def model_config(self, model: str) -> dict:
        """As `TritonClassifierClient.model_config`."""
        if model not in self._configs:
            if self.protocol == "http":
                self._configs[model] = await self._call(self._client.get_model_config(model))
            else:
                reply = await self._call(self._client.get_model_config(model, as_json=True))
                self._configs[model] = reply["config"]
        return self._configs[model]

    async def _infer(self, model: str, build, parse, deadline_s: float | None):
        await self.model_config(model)
        retry = _Retry(self.retry_policy, self.retry_policy.deadline_s if deadline_s is None else deadline_s)
        while True:
            try:
                inputs, outputs = build()
                remaining_s = retry.remaining_s()
                timeout = self._server_timeout(model, remaining_s)
                if self.protocol == "grpc":
                    timeout["client_timeout"] = remaining_s
                call = self._client.infer(model, inputs, outputs=outputs, **timeout)
                return parse(await asyncio.wait_for(call, remaining_s))
            except (InferenceServerException, asyncio.TimeoutError, ConnectionError, OSError) as exc:
                wait = retry.wait_after(exc)
                self.retries += 1
                await asyncio.sleep(wait)

    async def classify(self, images: Sequence[bytes], top_k: int = 5, model: str = ENSEMBLE_MODEL,
                       deadline_s: float | None = None) -> list[list[Prediction]]:
        """As `TritonClassifierClient.classify`."""
        return await self._infer(model, lambda: self._classify_request(images, top_k),
                                 lambda result: self._predictions(result, len(images)), deadline_s)

    async def infer_tensor(self, batch: np.ndarray, model: str = ONNX_MODEL,
                           deadline_s: float | None = None) -> np.ndarray:
        """As `TritonClassifierClient.infer_tensor`."""
        if not self.shared_memory:
            return await self._infer(model, lambda: self._tensor_request(batch, None),
                                     lambda result: self._logits(result, len(batch), None), deadline_s)
        async with self._lock:
            regions = await self._regions_for(model)
            return await self._infer(model, lambda: self._tensor_request(batch, regions),
                                     lambda result: self._logits(result, len(batch), regions), deadline_s)

    async def _regions_for(self, model: str) -> TensorRegions:
        if model not in self._regions:
            await self.model_config(model)
            regions = self._new_regions(model)
            try:
                for name, key, size in regions.registrations():
                    await self._call(self._client.register_system_shared_memory(name, key, size))
            except BaseException:
                await self._release(regions)
                raise
            self._regions[model] = regions
        return self._regions[model]

    async def _release(self, regions: TensorRegions) -> None:
        for name, _, _ in regions.registrations():
            for attempt in range(UNREGISTER_TRIES):
                try:
                    await self._client.unregister_system_shared_memory(name)
                    break
                except InferenceServerException as exc:
                    if "in use" not in (exc.message() or "") or attempt == UNREGISTER_TRIES - 1:
                        break
                    await asyncio.sleep(UNREGISTER_WAIT_S)
                except Exception:
                    break
        regions.close()

    async def close(self) -> None:
        """Unregister and destroy shared-memory regions, then close the connection (idempotent)."""
        while self._regions:
            await self._release(self._regions.popitem()[1])
        await self._client.close()

    async def __aenter__(self) -> "AsyncTritonClassifierClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
