"""The contract every other module builds on: model and tensor names, shapes, ports, protocols, the
Triton release, config variants and their files, and the two folders (model repository, results).

It imports nothing else of the package. Everything else (server, clients, export, tests, benchmarks, planner)
asks this module for names and paths instead of writing them again.

Folders, each an option with a default, resolved once when this module is first imported:
- the model repository: $RESNET18_KIT_MODEL_REPOSITORY, else `model_repository/` of the checkout this package
  lives in, else ./model_repository of the working directory (an installed package has no checkout);
- the results folder: $RESNET18_KIT_RESULTS, else `results/` of the checkout, else ./results.
The console scripts' `--model-repository` and `--results` options set those variables (resnet18_kit/cli.py).
"""
from __future__ import annotations

import os
from pathlib import Path

#: The checkout this package sits in (its parent folder); an installed package's parent is site-packages.
REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY_ENV = "RESNET18_KIT_MODEL_REPOSITORY"
RESULTS_ENV = "RESNET18_KIT_RESULTS"
IN_CHECKOUT = (REPO_ROOT / "model_repository").is_dir() and (REPO_ROOT / "pyproject.toml").is_file()


def _folder(env: str, name: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env]).expanduser().resolve()
    return REPO_ROOT / name if IN_CHECKOUT else Path.cwd().resolve() / name


MODEL_REPOSITORY = _folder(MODEL_REPOSITORY_ENV, "model_repository")
#: Where every command writes its results by default, one subfolder per command (results_dir()).
RESULTS = _folder(RESULTS_ENV, "results")


def results_dir(*parts: str) -> Path:
    """RESULTS / parts (not created): e.g. results_dir("reliability"), results_dir("bench-20261123-101500")."""
    return RESULTS.joinpath(*parts)


def bench_summaries(results: Path | None = None):
    """Yield (path, summary) for each <results>/bench-*/summary.json that reads as a JSON object: full runs
    first, then --quick ones (folders ending in "-quick"; they read 10-20 % low), each newest first by folder
    name (bench-YYYYmmdd-HHMMSS). `results` defaults to RESULTS. Unreadable files are passed over."""
    import json

    root = RESULTS if results is None else results
    paths = sorted(root.glob("bench-*/summary.json"),
                   key=lambda p: (not p.parent.name.endswith("-quick"), p.parent.name), reverse=True)
    for path in paths:
        try:
            summary = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if isinstance(summary, dict):
            yield path, summary


def shown(path: Path) -> Path:
    """`path` as a command prints it: relative to the working directory when it lies under it, else as it is."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


#: The Triton release of the embedded server (the `tritonserver` in nvidia-pytriton 0.7.0; NGC 24.10).
TRITON_VERSION = "2.51.0"

#: Client protocols (KServe v2 / Open Inference Protocol over HTTP/REST and gRPC) and the default ports of
#: `make serve` / the embedded server; the metrics port serves Prometheus text at /metrics.
PROTOCOLS = ("http", "grpc")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
DEFAULT_URLS = {protocol: f"{DEFAULT_HOST}:{DEFAULT_PORTS[protocol]}" for protocol in PROTOCOLS}

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
#: calibrated on real photos: resnet18_kit/export/quantize.py), beside the FP32 file; configs that name it serve it.
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


#: Tensors. The ensemble takes encoded images (BYTES [N, 1], one file per row) and returns the network's
#: outputs; the networks take FP32 [N, 3, 224, 224] (normalized RGB) and return FP32 [N, 1000] logits and
#: their softmax, probabilities (each row sums to 1).
IMAGE_INPUT = "image"
TENSOR_INPUT = "input"
LOGITS_OUTPUT = "logits"
PROBABILITIES_OUTPUT = "probabilities"
IMAGE_SHAPE = (3, 224, 224)
NUM_CLASSES = 1000
FP32_BYTES = 4
#: One row of logits (or probabilities) in bytes: 1000 FP32 values.
LOGITS_BYTES = NUM_CLASSES * FP32_BYTES

#: Config variants: a variant is a tritonserver `--model-config-name`; every model with
#: configs/<variant>.pbtxt loads it, the others their config.pbtxt. "default" = config.pbtxt everywhere.
DEFAULT_VARIANT = "default"


def config_path(model: str, variant: str = DEFAULT_VARIANT, repository: Path | None = None) -> Path:
    """The file tritonserver loads for `model` under `variant`: <model>/configs/<variant>.pbtxt when it
    exists, else <model>/config.pbtxt (also for "default"). `repository` defaults to MODEL_REPOSITORY."""
    root = MODEL_REPOSITORY if repository is None else repository
    named = root / model / "configs" / f"{variant}.pbtxt"
    return named if variant != DEFAULT_VARIANT and named.is_file() else root / model / "config.pbtxt"


def variant_names(model: str, repository: Path | None = None) -> list[str]:
    """"default" and the names of `model`'s configs/<name>.pbtxt, sorted."""
    root = MODEL_REPOSITORY if repository is None else repository
    return sorted({DEFAULT_VARIANT, *(path.stem for path in (root / model / "configs").glob("*.pbtxt"))})


def repository_variant_names(repository: Path | None = None) -> list[str]:
    """"default" and every name some model of `repository` has a configs/<name>.pbtxt for, sorted."""
    root = MODEL_REPOSITORY if repository is None else repository
    return sorted({DEFAULT_VARIANT, *(path.stem for path in root.glob("*/configs/*.pbtxt"))})


def variant_exists(variant: str, repository: Path | None = None) -> bool:
    """True for "default" and for a name some model has a configs/<variant>.pbtxt for."""
    root = MODEL_REPOSITORY if repository is None else repository
    return variant == DEFAULT_VARIANT or any(root.glob(f"*/configs/{variant}.pbtxt"))
