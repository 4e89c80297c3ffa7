"""The model repository on disk: where each generated file lives, which config variants exist, the
provenance of the exported weights, and the one loader of the repository's own Python.

`ModelRepository(root)` is built from Settings (settings.Settings.repository) and passed down; nothing
here is computed at import. Names (models, tensors, variants) come from resnet18_kit.contract.

Served code run in-process. The preprocess model's decode/transform (`preprocess/1/image_transform.py`) and
the network models' runtime loaders (`resnet18_onnx/1/runtimes.py`) are plain files of the repository,
imported by Triton's Python backend from their folders. In-process code (export's calibration, the
in-process pipeline, the evaluation, the tests) runs exactly that code through `served_module`, which
loads the file explicitly under a namespaced name, `resnet18_kit.served.<repository hash>.<name>`, so two
repositories never share a module and nothing is put on sys.path.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT, ENSEMBLE_MODEL, ONNX_MODEL, PREPROCESS_MODEL, TENSOR_DTYPE, TORCHSCRIPT_MODEL

#: Code of the served models that in-process code runs too: module name -> its files relative to the root,
#: the first that exists is loaded. runtimes.py: resnet18_torchscript's is a link to resnet18_onnx's, and the
#: only copy in a repository without resnet18_onnx (the GPU bundle's, `bench gpu-pack`).
SERVED_MODULES = {
    "image_transform": (Path(PREPROCESS_MODEL) / "1" / "image_transform.py",),
    "runtimes": (Path(ONNX_MODEL) / "1" / "runtimes.py", Path(TORCHSCRIPT_MODEL) / "1" / "runtimes.py"),
    "cancellation": (Path(PREPROCESS_MODEL) / "1" / "cancellation.py",),
    "allocator": (Path(PREPROCESS_MODEL) / "1" / "allocator.py",),
}
#: Package under which served modules are registered in sys.modules (never imported by name).
SERVED_PACKAGE = "resnet18_kit.served"


@dataclass(frozen=True)
class ModelRepository:
    """A Triton model repository folder laid out as this kit's `model_repository/`."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).expanduser().resolve())

    # -- generated files ------------------------------------------------------------------------------

    @property
    def onnx_path(self) -> Path:
        """The exported FP32 network (onnxruntime's default file name, so configs/gpu.pbtxt needs none)."""
        return self.root / ONNX_MODEL / "1" / "model.onnx"

    @property
    def onnx_int8_path(self) -> Path:
        """The same network quantized to INT8 (ONNX Runtime static quantization, QDQ, per-channel weights,
        calibrated on real photos: resnet18_kit/export/quantize.py); the configs that name it serve it."""
        return self.onnx_path.with_name("model.int8.onnx")

    @property
    def torchscript_path(self) -> Path:
        """The exported TorchScript network (pytorch backend's default file name)."""
        return self.root / TORCHSCRIPT_MODEL / "1" / "model.pt"

    @property
    def provenance_paths(self) -> tuple[Path, Path]:
        """Weights source, library versions, parity figures and sha256 of each export (JSON), the same
        record beside each export so that a version folder copied alone still says where it came from."""
        return self.onnx_path.with_name("provenance.json"), self.torchscript_path.with_name("provenance.json")

    @property
    def labels_path(self) -> Path:
        """ImageNet-1k class names, line i = class index i (committed, not generated)."""
        return self.root / ENSEMBLE_MODEL / "labels.txt"

    @property
    def warmup_image_path(self) -> Path:
        """One encoded photo serialized as a Triton BYTES tensor, for the preprocess model's warmup."""
        return self.root / PREPROCESS_MODEL / "warmup" / "image_bytes"

    @property
    def generated(self) -> tuple[Path, ...]:
        """Every file the export writes into the models this repository holds (<model>/config.pbtxt present):
        a repository without the TorchScript model's folder, for one, needs no model.pt."""
        files = (self.onnx_path, self.onnx_int8_path, self.torchscript_path, *self.provenance_paths,
                 self.warmup_image_path)
        return tuple(path for path in files if (path.parents[1] / "config.pbtxt").is_file())

    def holds_the_kit_models(self) -> bool:
        """True when this repository has the kit's network models (so the export's files belong in it);
        False for a repository of other models (tests, reliability fixtures)."""
        return (self.root / ONNX_MODEL / "config.pbtxt").is_file()

    def missing_artifacts(self) -> list[Path]:
        """The generated files this repository still lacks (empty once the export has run)."""
        return [path for path in self.generated if not path.is_file()]

    def provenance(self) -> dict:
        """The export's provenance record (JSON object), {} when there is none yet."""
        try:
            return json.loads(self.provenance_paths[0].read_text())
        except (OSError, ValueError):
            return {}

    def weights_meaningful(self) -> bool | None:
        """Whether the exported weights are trained ImageNet weights (provenance `weights_meaningful`):
        False for the seeded random init used when no weights could be downloaded, None when unknown."""
        return self.provenance().get("weights_meaningful")

    def outdated_reason(self) -> str | None:
        """Why the exported files do not fit the served code (an export made before the files carried every
        output of runtimes().OUTPUT_NAMES, or took FP32 input), or None when they do."""
        recorded = self.provenance().get("outputs", ["logits"])
        expected = list(self.runtimes().OUTPUT_NAMES)
        if recorded != expected:
            return f"the exported files have outputs {recorded}, this code serves {expected}"
        recorded_input = self.provenance().get("input_dtype", "float32")  # older exports: FP32 input
        if recorded_input != TENSOR_DTYPE:
            return f"the exported files take {recorded_input} input, this code serves {TENSOR_DTYPE} pixels"
        return None

    # -- config variants ------------------------------------------------------------------------------

    def config_path(self, model: str, variant: str = DEFAULT_VARIANT) -> Path:
        """The file tritonserver loads for `model` under `variant` (`--model-config-name`):
        <model>/configs/<variant>.pbtxt when it exists, else <model>/config.pbtxt (also for "default")."""
        named = self.root / model / "configs" / f"{variant}.pbtxt"
        return named if variant != DEFAULT_VARIANT and named.is_file() else self.root / model / "config.pbtxt"

    def own_config_path(self, model: str, variant: str = DEFAULT_VARIANT) -> Path:
        """`model`'s own file for `variant`; FileNotFoundError naming configs/<variant>.pbtxt when it has none
        (where config_path falls back to config.pbtxt, as tritonserver does for a server-wide variant)."""
        if variant not in self.variant_names(model):
            raise FileNotFoundError(f"no config {variant!r} of {model}: "
                                    f"{self.root / model / 'configs' / f'{variant}.pbtxt'}")
        return self.config_path(model, variant)

    def variant_names(self, model: str | None = None) -> list[str]:
        """"default" and the names of `model`'s configs/<name>.pbtxt (every model's when None), sorted:
        the one list of variants."""
        pattern = f"{model}/configs/*.pbtxt" if model else "*/configs/*.pbtxt"
        return sorted({DEFAULT_VARIANT, *(path.stem for path in self.root.glob(pattern))})

    def unknown_variant(self, variant: str) -> str | None:
        """None when `variant` is one of variant_names(), else the one-line problem a command prints for
        its --variant option."""
        if variant in self.variant_names():
            return None
        return (f"--variant {variant!r}: no configs/{variant}.pbtxt in {self.root} "
                f"(one of {', '.join(self.variant_names())})")

    def model_names(self) -> list[str]:
        """The models of this repository (folders with a config.pbtxt), sorted."""
        return sorted(path.parent.name for path in self.root.glob("*/config.pbtxt"))

    # -- served code ----------------------------------------------------------------------------------

    @cached_property
    def _served_namespace(self) -> str:
        return f"{SERVED_PACKAGE}.r{hashlib.sha1(str(self.root).encode()).hexdigest()[:10]}"

    def served_module(self, name: str):
        """The repository's own module `name` (a key of SERVED_MODULES), loaded once per repository from the
        first of its files that exists, under a namespaced name (module doc). KeyError for another name;
        FileNotFoundError (naming the first file) when none exists."""
        qualified = f"{self._served_namespace}.{name}"
        module = sys.modules.get(qualified)
        if module is None:
            paths = [self.root / relative for relative in SERVED_MODULES[name]]
            path = next((candidate for candidate in paths if candidate.is_file()), None)
            if path is None:
                raise FileNotFoundError(f"served code missing: {paths[0]}")
            spec = importlib.util.spec_from_file_location(qualified, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[qualified] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[qualified]
                raise
        return module

    def image_transform(self):
        """preprocess/1/image_transform.py of this repository (served_module)."""
        return self.served_module("image_transform")

    def runtimes(self):
        """resnet18_onnx/1/runtimes.py of this repository, or resnet18_torchscript's (served_module)."""
        return self.served_module("runtimes")
