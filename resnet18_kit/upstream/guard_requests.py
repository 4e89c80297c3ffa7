"""How the gRPC guard (upstream.grpc_guard) rewrites a ModelInfer on its way to tritonserver, and its answer.

The timeout: `with_timeout` / `set_timeout` put the client's remaining deadline in the request's `timeout`
parameter (module doc of upstream.grpc_guard).

The outputs of a cached model, against a Triton 2.51 defect of the response cache: its key is the model, its
version and the request's inputs (core src/cache_manager.cc, TritonCache::Hash), not the outputs the
request asks for. A request that asks for `logits` only leaves an entry holding `logits` only, and a later
request for `probabilities` of the same image is answered from it with `logits` (docs/usage.md "Traffic
controls"; reproduced in tests/test_traffic_controls.py).

What the guard does: a ModelInfer to a model whose config has
`response_cache { enable: true }` that asks for some of the model's outputs is sent on asking for every
output (those asked for as they were, with their classification parameters; the others plain), and the
answer is trimmed back to the outputs asked for. So every entry made through the guard holds every output,
and a gRPC client of `serve` gets what it asked for from any such entry. Entries made over HTTP by a
request for one output can still hold one: the HTTP path has no kit code in front of tritonserver.

`CachedOutputs` learns each model's outputs from tritonserver's ModelConfig, read again every CONFIG_MAX_AGE_S (a swap
can change it).
"""
from __future__ import annotations

import time

import grpc

#: The request parameter Triton reads as the request's queue timeout (microseconds).
TIMEOUT_PARAMETER = "timeout"

#: Seconds the guard waits for a model's config before treating it as not cached.
CONFIG_TIMEOUT_S = 5.0
#: Seconds a model's config read by the guard is believed: a swap (`resnet18-kit swap`) can turn its
#: response cache on or off, so it is read again after this (one ModelConfig call per model and period).
CONFIG_MAX_AGE_S = 5.0


def with_timeout(raw_request: bytes, remaining_s: float | None) -> bytes:
    """A serialized ModelInferRequest with `timeout` (microseconds) set to the client's remaining time,
    or to the request's own timeout when that is smaller; unchanged without a deadline."""
    if remaining_s is None:
        return raw_request
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest.FromString(raw_request)
    set_timeout(request, remaining_s)
    return request.SerializeToString()


def set_timeout(request, remaining_s: float) -> None:
    """Set `request`'s (a ModelInferRequest) `timeout` as with_timeout does."""
    remaining_us = max(1, int(remaining_s * 1e6))
    own_us = request.parameters[TIMEOUT_PARAMETER].int64_param if TIMEOUT_PARAMETER in request.parameters else 0
    request.parameters[TIMEOUT_PARAMETER].int64_param = min(own_us, remaining_us) if own_us > 0 else remaining_us


class CachedOutputs:
    """Per model name: its outputs when its config turns the response cache on, else (). `config_call`:
    the upstream ModelConfig method on raw bytes (grpc.aio unary_unary without serializers)."""

    def __init__(self, config_call):
        self._config_call = config_call
        self._outputs: dict[str, tuple[str, ...]] = {}
        self._read_at: dict[str, float] = {}

    async def outputs_of(self, model: str) -> tuple[str, ...]:
        """The outputs of cached `model`, () when it is not cached; a config that cannot be read now
        counts as not cached and is asked for again next time; one read is kept CONFIG_MAX_AGE_S."""
        if model not in self._outputs or time.monotonic() - self._read_at[model] > CONFIG_MAX_AGE_S:
            from tritonclient.grpc import service_pb2

            try:
                raw = await self._config_call(service_pb2.ModelConfigRequest(name=model).SerializeToString(),
                                              timeout=CONFIG_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                return ()
            config = service_pb2.ModelConfigResponse.FromString(raw).config
            self._outputs[model] = tuple(output.name for output in config.output) if config.response_cache.enable else ()
            self._read_at[model] = time.monotonic()
        return self._outputs[model]


def widen(request, outputs: tuple[str, ...]) -> list[str] | None:
    """Make `request` (a service_pb2.ModelInferRequest, changed in place) ask for every one of `outputs`;
    the names it asked for, or None when nothing changed (not cached, all asked for, or none named: Triton
    then returns all)."""
    asked = [output.name for output in request.outputs]
    if not outputs or not asked or set(outputs) <= set(asked):
        return None
    for name in outputs:
        if name not in asked:
            request.outputs.add(name=name)
    return asked


def trim(raw_response: bytes, asked: list[str]) -> bytes:
    """A serialized ModelInferResponse with only the outputs named in `asked` (and their raw contents)."""
    from tritonclient.grpc import service_pb2

    response = service_pb2.ModelInferResponse.FromString(raw_response)
    keep = [index for index, output in enumerate(response.outputs) if output.name in asked]
    if len(keep) == len(response.outputs):
        return raw_response
    trimmed = service_pb2.ModelInferResponse()
    trimmed.CopyFrom(response)
    del trimmed.outputs[:]
    del trimmed.raw_output_contents[:]
    trimmed.outputs.extend(response.outputs[index] for index in keep)
    if response.raw_output_contents:
        trimmed.raw_output_contents.extend(response.raw_output_contents[index] for index in keep)
    return trimmed.SerializeToString()
