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
#: The same network quantized to INT8 (ONNX Runtime static quantization, QDQ, per-channel weights,
#: calibrated on real photos: export/quantize.py), beside the FP32 file; configs that name it serve it.
ONNX_INT8_PATH = ONNX_PATH.with_name("model.int8.onnx")
#: Weights source, library versions, parity figures and sha256 of each exported file (JSON), the same
#: record next to each export so a version folder copied alone still says where it came from.
PROVENANCE_PATHS = (ONNX_PATH.with_name("provenance.json"), TORCHSCRIPT_PATH.with_name("provenance.json"))
#: ImageNet-1k class names, one per line, line i = class index i (committed, not generated).
LABELS_PATH = MODEL_REPOSITORY / ENSEMBLE_MODEL / "labels.txt"
#: One encoded photo, serialized as a Triton BYTES tensor, for the preprocess model's warmup.
WARMUP_IMAGE_PATH = MODEL_REPOSITORY / PREPROCESS_MODEL / "warmup" / "image_bytes"

GENERATED = (ONNX_PATH, ONNX_INT8_PATH, TORCHSCRIPT_PATH, *PROVENANCE_PATHS, WARMUP_IMAGE_PATH)


def missing_artifacts() -> list[Path]:
    """Return the generated files the model repository still lacks (empty when export has run)."""
    return [path for path in GENERATED if not path.is_file()]


def outdated_reason() -> str | None:
    """Why the exported files present do not fit the served code (an export made before the files carried
    every output of runtimes().OUTPUT_NAMES), or None when they do; read from the provenance record."""
    import json

    recorded = json.loads(PROVENANCE_PATHS[0].read_text()).get("outputs", ["logits"])
    expected = list(runtimes().OUTPUT_NAMES)
    if recorded != expected:
        return f"the exported files have outputs {recorded}, this code serves {expected}"
    return None

#: Code of the served models that in-process code runs too, by module name -> its file in the repository:
#: the preprocess model's decode/transform and the network models' runtime loaders.
SERVED_MODULES = {
    "image_transform": MODEL_REPOSITORY / PREPROCESS_MODEL / "1" / "image_transform.py",
    "runtimes": MODEL_REPOSITORY / ONNX_MODEL / "1" / "runtimes.py",
}


def served_module(name: str):
    """Import one of SERVED_MODULES from the model repository, so in-process code (export's calibration,
    the benchmarks' in-process pipeline, the evaluation, the tests) runs exactly the code the served
    models run. Raises KeyError for a name not in SERVED_MODULES."""
    import importlib.util
    import sys

    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, SERVED_MODULES[name])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def image_transform():
    """model_repository/preprocess/1/image_transform.py (see served_module)."""
    return served_module("image_transform")


def runtimes():
    """model_repository/resnet18_onnx/1/runtimes.py (see served_module)."""
    return served_module("runtimes")
