"""What the scenarios send, and how an answer is judged.

A `TensorLoad` is a list of inputs for one model; request i carries input i % len(inputs) and is
answered correctly when its output equals the reference answer to that input, taken from the server
itself at no load (`reference_answers`), within RTOL/ATOL.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL
from resnet18_kit.tools.load.outcomes import ANSWERED, WRONG, Outcome
from resnet18_kit.tools.reliability import ECHO_MODEL
from resnet18_kit.server.config import ServerConfig

#: A request with no outcome after this long is counted as lost (hung). Far above any queue wait here.
HANG_BOUND_S = 60.0
#: Tolerance between an answer under load (any batch size) and the reference answer (batch of 1).
RTOL, ATOL = 1e-4, 1e-4


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
    #: Other reference answers that are right too, one list per config (a swap's: INT8 answers differ
    #: from FP32's beyond RTOL/ATOL).
    also_expected: list[list[np.ndarray]] = field(default_factory=list)

    def input_for(self, index: int) -> np.ndarray:
        return self.inputs[index % len(self.inputs)]

    def correct(self, index: int, output: np.ndarray) -> bool:
        """True when `output` is the reference answer to request `index`, or one of also_expected's (same
        shape; floats within RTOL/ATOL, other types equal)."""
        for answers in (self.expected, *self.also_expected):
            reference = answers[index % len(answers)]
            if output.shape == reference.shape and (
                    np.allclose(output, reference, rtol=RTOL, atol=ATOL) if output.dtype.kind == "f"
                    else np.array_equal(output, reference)):
                return True
        return False


def onnx_load(count: int = 8, seed: int = 0) -> TensorLoad:
    """`count` distinct random images for resnet18_onnx (UINT8 pixels [1, 3, 224, 224] each); no reference yet."""
    rng = np.random.default_rng(seed)
    return TensorLoad(ONNX_MODEL, "input", "logits", "UINT8",
                      [rng.integers(0, 256, (1, 3, 224, 224), dtype=np.uint8) for _ in range(count)])


def ensemble_load(count: int = 5) -> TensorLoad:
    """The sample photos as encoded bytes for the `resnet18` ensemble (BYTES [1, 1] each); no reference yet."""
    from resnet18_kit.client.samples import sample_photos

    photos = [p.read_bytes() for p in sample_photos()[:count]]
    return TensorLoad(ENSEMBLE_MODEL, "image", "logits", "BYTES",
                      [np.array([[photo]], dtype=np.object_) for photo in photos])


def echo_load(count: int = 16) -> TensorLoad:
    """`count` inputs for reliability_echo (FP32 [1, 4] filled with i), each its own reference answer."""
    return TensorLoad(ECHO_MODEL, "x", "y", "FP32",
                      [np.full((1, 4), i, np.float32) for i in range(count)],
                      [np.full((1, 4), i, np.float32) for i in range(count)])


def infer_input(module, load: TensorLoad, index: int):
    """The InferInput of request `index` for tritonclient's `module` (http, grpc or their aio)."""
    array = load.input_for(index)
    request = module.InferInput(load.input_name, list(array.shape), load.datatype)
    request.set_data_from_numpy(array)
    return request


def reference_answers(config: ServerConfig, load: TensorLoad) -> TensorLoad:
    """Fill `load.expected` with the server's answer to each input sent alone, at no load (gRPC);
    returns `load`. Raises tritonclient's InferenceServerException when a request fails."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(config.grpc_url)
    try:
        load.expected = [client.infer(load.model, [infer_input(grpcclient, load, i)],
                                      outputs=[grpcclient.InferRequestedOutput(load.output_name)]
                                      ).as_numpy(load.output_name)
                         for i in range(len(load.inputs))]
    finally:
        client.close()
    return load


def response_id(result) -> str:
    """The request id a response (HTTP or gRPC InferResult) carries."""
    response = result.get_response()
    return response["id"] if isinstance(response, dict) else response.id


def judge(load: TensorLoad, index: int, result, started: float) -> Outcome:
    """The outcome of request `index` answered with `result`; `started`: time.perf_counter() just
    before the send. ANSWERED when the response carries this request's id and its reference answer,
    WRONG otherwise."""
    latency_s = time.perf_counter() - started
    if response_id(result) != str(index):
        return Outcome(index, WRONG, latency_s, message=f"response id {response_id(result)!r}")
    if not load.correct(index, result.as_numpy(load.output_name)):
        return Outcome(index, WRONG, latency_s, message="values differ from the reference")
    return Outcome(index, ANSWERED, latency_s)
