"""The one place that names the model repository and every file the export writes into it.

Everything else (the server, the clients, the tests, the benchmarks) asks this module for paths.
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"

#: Model names as the server knows them (directory names under the model repository).
PREPROCESS_MODEL = "preprocess"
ONNX_MODEL = "resnet18_onnx"
TORCHSCRIPT_MODEL = "resnet18_torchscript"
ENSEMBLE_MODEL = "resnet18"
ALL_MODELS = (PREPROCESS_MODEL, ONNX_MODEL, TORCHSCRIPT_MODEL, ENSEMBLE_MODEL)

#: Exported networks, in version 1 of their models. Names are the native backends' defaults
#: (onnxruntime: model.onnx, pytorch: model.pt), so the `configs/gpu.pbtxt` variants need no filename.
ONNX_PATH = MODEL_REPOSITORY / ONNX_MODEL / "1" / "model.onnx"
TORCHSCRIPT_PATH = MODEL_REPOSITORY / TORCHSCRIPT_MODEL / "1" / "model.pt"
#: Weights source, library versions, parity figures and sha256 of each exported file (JSON), the same
#: record next to each export so a version folder copied alone still says where it came from.
PROVENANCE_PATHS = (ONNX_PATH.with_name("provenance.json"), TORCHSCRIPT_PATH.with_name("provenance.json"))
#: ImageNet-1k class names, one per line, line i = class index i (committed, not generated).
LABELS_PATH = MODEL_REPOSITORY / ENSEMBLE_MODEL / "labels.txt"
#: One encoded photo, serialized as a Triton BYTES tensor, for the preprocess model's warmup.
WARMUP_IMAGE_PATH = MODEL_REPOSITORY / PREPROCESS_MODEL / "warmup" / "image_bytes"

GENERATED = (ONNX_PATH, TORCHSCRIPT_PATH, *PROVENANCE_PATHS, WARMUP_IMAGE_PATH)


def missing_artifacts() -> list[Path]:
    """Return the generated files the model repository still lacks (empty when export has run)."""
    return [path for path in GENERATED if not path.is_file()]
