"""A small synchronous client for this model repository, over HTTP or gRPC (KServe v2 protocol).

    with TritonClassifierClient("127.0.0.1:8000", protocol="http") as client:
        predictions = client.classify([open("cat.jpg", "rb").read()], top_k=5)
        logits = client.infer_tensor(batch)  # FP32 [N, 3, 224, 224] -> FP32 [N, 1000]

Errors come from tritonclient as `tritonclient.utils.InferenceServerException`; `status()` is the
HTTP status ("400", "503") or the gRPC code ("StatusCode.INVALID_ARGUMENT") and `message()` the
server's message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from export.artifacts import ENSEMBLE_MODEL, ONNX_MODEL

PROTOCOLS = ("http", "grpc")
DEFAULT_URLS = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}
IMAGE_INPUT = "image"    # ensemble input: BYTES [N, 1], one encoded image per row
TENSOR_INPUT = "input"   # ResNet-18 input: FP32 [N, 3, 224, 224]
LOGITS_OUTPUT = "logits"  # FP32 [N, 1000]


@dataclass(frozen=True)
class Prediction:
    """One of the top-k classes of an image (Triton's classification extension)."""

    label: str        # ImageNet class name, from the model's label file
    class_index: int  # 0..999
    score: float      # the logit (unnormalized), as the classification extension reports it


def parse_classification(entry: bytes | str) -> Prediction:
    """Parse one classification-extension string "score:index:label" (e.g. b"12.5:281:tabby")."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    score, index, label = text.split(":", 2)
    return Prediction(label=label, class_index=int(index), score=float(score))


def _protocol_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as module
    elif protocol == "grpc":
        import tritonclient.grpc as module
    else:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    return module


class TritonClassifierClient:
    """Synchronous client for the `resnet18` ensemble and the ResNet-18 models.

    url: "host:port" without scheme (HTTP default port 8000, gRPC 8001).
    protocol: "http" or "grpc".
    timeout_s: network timeout of one call, in seconds.
    """

    def __init__(self, url: str | None = None, protocol: str = "http", timeout_s: float = 60.0):
        self.protocol = protocol
        self._module = _protocol_module(protocol)
        self.url = url or DEFAULT_URLS[protocol]
        self.timeout_s = timeout_s
        if protocol == "http":
            self._client = self._module.InferenceServerClient(
                self.url, connection_timeout=timeout_s, network_timeout=timeout_s)
        else:
            self._client = self._module.InferenceServerClient(self.url)

    @property
    def raw(self):
        """The underlying tritonclient InferenceServerClient."""
        return self._client

    def is_server_ready(self) -> bool:
        return self._client.is_server_ready()

    def is_model_ready(self, model: str) -> bool:
        return self._client.is_model_ready(model)

    def model_metadata(self, model: str) -> dict:
        """KServe v2 model metadata as JSON: {"name", "versions", "platform", "inputs", "outputs"},
        each tensor {"name", "datatype", "shape"} with -1 for variable (batch) dimensions."""
        if self.protocol == "http":
            return self._client.get_model_metadata(model)
        metadata = self._client.get_model_metadata(model, as_json=True)
        for tensor in metadata.get("inputs", []) + metadata.get("outputs", []):
            tensor["shape"] = [int(d) for d in tensor["shape"]]  # gRPC's JSON renders int64 as strings
        return metadata

    def model_config(self, model: str) -> dict:
        """The model configuration the server loaded, as JSON (fields in camelCase over gRPC)."""
        if self.protocol == "http":
            return self._client.get_model_config(model)
        return self._client.get_model_config(model, as_json=True)["config"]

    def _infer(self, model: str, inputs, outputs):
        kwargs = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        return self._client.infer(model, inputs, outputs=outputs, **kwargs)

    def classify(self, images: Sequence[bytes], top_k: int = 5,
                 model: str = ENSEMBLE_MODEL) -> list[list[Prediction]]:
        """Classify encoded images (JPEG, PNG, ...) in one request; len(images) <= the model's
        max_batch_size (16). Returns, per image, its top_k predictions, best first."""
        array = np.array([bytes(image) for image in images], dtype=np.object_).reshape(-1, 1)
        request = self._module.InferInput(IMAGE_INPUT, list(array.shape), "BYTES")
        request.set_data_from_numpy(array)
        output = self._module.InferRequestedOutput(LOGITS_OUTPUT, class_count=top_k)
        entries = self._infer(model, [request], [output]).as_numpy(LOGITS_OUTPUT)
        return [[parse_classification(entry) for entry in row] for row in entries.reshape(len(images), -1)]

    def infer_tensor(self, batch: np.ndarray, model: str = ONNX_MODEL) -> np.ndarray:
        """FP32 [N, 3, 224, 224] (normalized as the preprocess model does) -> logits FP32 [N, 1000]."""
        request = self._module.InferInput(TENSOR_INPUT, list(batch.shape), "FP32")
        request.set_data_from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
        output = self._module.InferRequestedOutput(LOGITS_OUTPUT)
        return self._infer(model, [request], [output]).as_numpy(LOGITS_OUTPUT)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "TritonClassifierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
