"""The contract every other module builds on: true constants, and what a server address may be. Model and
tensor names, shapes, ports, protocols, host:port from a user's URL, the Triton release and the name of the
default config variant.

It imports nothing else of the package. Folders (model repository, results) are settings
(resnet18_kit.settings), files inside the model repository are resnet18_kit.repository.ModelRepository's.
"""
from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

#: Where this package's source sits (its parent folder): a checkout's root in an editable install, holding
#: deploy/ and docs/; site-packages for an installed package. Never a setting: Settings decides the folders.
REPO_ROOT = Path(__file__).resolve().parent.parent

#: The Triton release of the embedded server (the `tritonserver` in nvidia-pytriton 0.7.0; NGC 24.10).
TRITON_VERSION = "2.51.0"
#: Executable name of the Python backend's per-instance stub process (its first argument is
#: <repository>/<model>/<version>/model.py).
STUB_EXECUTABLE = "triton_python_backend_stub"

#: Client protocols (KServe v2 / Open Inference Protocol over HTTP/REST and gRPC) and the default ports of
#: `make serve` / the embedded server; the metrics port serves Prometheus text at /metrics.
PROTOCOLS = ("http", "grpc")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
DEFAULT_URLS = {protocol: f"{DEFAULT_HOST}:{DEFAULT_PORTS[protocol]}" for protocol in PROTOCOLS}


def host_port(url: str, protocol: str) -> str:
    """The "host:port" tritonclient takes, from what a user gives: "host:port", or a URL whose scheme is
    the protocol's ("http://127.0.0.1:8000", "grpc://127.0.0.1:8001"). Raises ValueError naming the problem:
    another scheme (https needs TLS options this client does not set), a path, no port."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"//{url}")
    if parsed.scheme and parsed.scheme != protocol:
        raise ValueError(f"URL {url!r}: scheme {parsed.scheme}:// does not match the protocol {protocol} "
                         f"(give host:port)")
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number
        port = None
    if parsed.path.strip("/") or parsed.query or not parsed.hostname or port is None:
        raise ValueError(f"URL {url!r}: give host:port, e.g. {DEFAULT_URLS[protocol]}")
    return parsed.netloc

def parse_version(version: str) -> tuple[int, int, int]:
    """A Triton release as (major, minor, patch): "2.51.0" (or "2.51", "2.72.0dev") -> (2, 51, 0).
    ValueError for anything else."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not match:
        raise ValueError(f"not a Triton version: {version!r} (e.g. 2.51.0)")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


#: Model names as the server knows them (directory names under the model repository).
PREPROCESS_MODEL = "preprocess"
ONNX_MODEL = "resnet18_onnx"
TORCHSCRIPT_MODEL = "resnet18_torchscript"
ENSEMBLE_MODEL = "resnet18"
ALL_MODELS = (PREPROCESS_MODEL, ONNX_MODEL, TORCHSCRIPT_MODEL, ENSEMBLE_MODEL)

#: Tensors. The ensemble takes encoded images (BYTES [N, 1], one file per row) and returns the network's
#: outputs; the networks take pixels, UINT8 [N, 3, 224, 224] (RGB, CHW, 0-255: the image resized to 256
#: on its shorter side and center-cropped to 224, as the preprocess model writes them), normalize them in
#: their own graph (PIXEL_MEAN, PIXEL_STD) and return FP32 [N, 1000] logits and their softmax,
#: probabilities (each row sums to 1).
IMAGE_INPUT = "image"
TENSOR_INPUT = "input"
#: The networks' input datatype (KServe v2 name) and its numpy dtype name.
TENSOR_DATATYPE = "UINT8"
TENSOR_DTYPE = "uint8"
LOGITS_OUTPUT = "logits"
PROBABILITIES_OUTPUT = "probabilities"
IMAGE_SHAPE = (3, 224, 224)
#: The normalization at the head of the exported graphs: (pixel / 255 - PIXEL_MEAN) / PIXEL_STD per RGB
#: channel, torchvision's ToTensor + Normalize with the ImageNet-1k training images' mean and std
#: (the values the IMAGENET1K_V1 weights were trained with).
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
NUM_CLASSES = 1000
FP32_BYTES = 4
#: One row of logits (or probabilities) in bytes: 1000 FP32 values.
LOGITS_BYTES = NUM_CLASSES * FP32_BYTES

#: Config variants: a variant is a tritonserver `--model-config-name`; every model with
#: configs/<variant>.pbtxt loads it, the others their config.pbtxt. "default" = config.pbtxt everywhere.
DEFAULT_VARIANT = "default"
