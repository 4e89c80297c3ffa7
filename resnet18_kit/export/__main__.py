"""Write ResNet-18 (ONNX + TorchScript + INT8 ONNX) into the model repository, parity-checked.

Writes, in the model repository (--model-repository): resnet18_onnx/1/model.onnx, its INT8 quantization
model.int8.onnx (calibrated on the sample photos or --calibration-dir), resnet18_torchscript/1/model.pt,
a provenance.json next to each (weights and whether they are meaningful, versions, parity, calibration
set, INT8 agreement with FP32), and the preprocess model's warmup image. Checks the committed labels file
against torchvision's ImageNet category names.

    resnet18-kit export                     # ImageNet weights (hub cache or download), else a random init
    resnet18-kit export --if-missing        # only when a file is missing or predates the served outputs
    resnet18-kit export --weights my.pth --calibration-dir photos/

Exit status 0 when written (or nothing to do), 1 when the parity check fails, 2 for a bad --weights or
--calibration-dir or a labels file that does not match (nothing is written then).
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import re
import logging
import os
import platform
import struct
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

from resnet18_kit.contract import ENSEMBLE_MODEL, TENSOR_DTYPE
from resnet18_kit.client.samples import HELD_OUT_PHOTO_NAMES, sample_photos
from typing import TYPE_CHECKING

from resnet18_kit.export import quantize
from resnet18_kit.repository import ModelRepository
from resnet18_kit.settings import Settings, shown

if TYPE_CHECKING:  # torch is imported by the functions that use it: a bad flag is refused in a second
    from resnet18_kit.export import resnet18 as r18

log = logging.getLogger(__name__)


@contextmanager
def atomic_path(final: Path):
    """Yield a temporary path beside `final`; rename it into place only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=final.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a container's server may run as another user
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def labels_problem(repository: ModelRepository) -> str | None:
    """Why `repository`'s labels file is not torchvision's 1000 ImageNet category names in class order
    (one line), or None when it is."""
    from resnet18_kit.export import resnet18 as r18

    expected = r18.IMAGENET_WEIGHTS.meta["categories"]
    try:
        actual = repository.labels_path.read_text().splitlines()
    except OSError as exc:
        return f"{repository.labels_path}: {exc.strerror or exc}"
    if actual != expected:
        return f"{repository.labels_path} does not match torchvision's ImageNet categories"
    return None


def write_warmup_image(path: Path) -> None:
    """A 320x240 JPEG (a smooth synthetic scene) as one Triton BYTES element: uint32 length + bytes."""
    from PIL import Image

    image = Image.merge("RGB", [Image.linear_gradient("L").resize((320, 240)),
                                Image.radial_gradient("L").resize((320, 240)),
                                Image.linear_gradient("L").rotate(90).resize((320, 240))])
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<I", buffer.tell()) + buffer.getvalue())


def provenance(repository: ModelRepository, source: r18.WeightsSource, diffs: dict[str, float], int8: dict) -> dict:
    """The provenance.json record of an export into `repository` (its files hashed as they are now)."""
    import onnx
    import onnxruntime

    from resnet18_kit.export import resnet18 as r18
    import torch
    import torchvision

    return {
        "weights": source.spec,
        # False for the seeded random init: classify/evaluate/demo say the labels are meaningless.
        "weights_meaningful": source.meaningful,
        "weights_unavailable_reason": source.reason,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                     "python": platform.python_version()},
        "onnx_opset": r18.ONNX_OPSET,
        "outputs": list(r18.OUTPUT_NAMES),
        # The files' input dtype (numpy name): UINT8 pixels, normalized in the graph (resnet18.ServedNetwork).
        "input_dtype": TENSOR_DTYPE,
        "parity": {"rtol": r18.PARITY_RTOL, "atol": r18.PARITY_ATOL,
                   "max_abs_diff_vs_eager": diffs, "batch_size": len(r18.parity_batch())},
        "int8": int8,
        "sha256": {str(p.relative_to(repository.root)): r18.sha256(p)
                   for p in (repository.onnx_path, repository.onnx_int8_path, repository.torchscript_path,
                             repository.labels_path)},
    }


def record_weights_in_ensemble_config(repository: ModelRepository, meaningful: bool) -> None:
    """Set the parameter `weights_meaningful` ("true" / "false") of the ensemble's configs (config.pbtxt
    and each configs/<variant>.pbtxt) to what this export wrote, so that a client asking the server
    (client.core: the served config's parameters) can say when the labels come from random weights. The
    committed configs say "false", what an export without downloadable weights writes, so the files change
    only for an export of trained weights."""
    value = "true" if meaningful else "false"
    pattern = re.compile(r'(key: "weights_meaningful"\s*value: \{\s*string_value: ")(true|false)(")')
    parameter = f'parameters {{ key: "weights_meaningful" value: {{ string_value: "{value}" }} }}\n'
    for variant in repository.variant_names(ENSEMBLE_MODEL):
        path = repository.config_path(ENSEMBLE_MODEL, variant)
        text = path.read_text()
        if pattern.search(text):
            updated = pattern.sub(rf"\g<1>{value}\g<3>", text)
        else:
            updated = text.replace('platform: "ensemble"\n', 'platform: "ensemble"\n' + parameter, 1)
        if updated != text:
            path.write_text(updated)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The export command's options."""
    parser.add_argument("--weights", type=Path, metavar="FILE", help="ResNet-18 state dict file (torch.save of state_dict())")
    parser.add_argument("--offline", action="store_true",
                        help="do not try to download IMAGENET1K_V1 (use the hub cache or a random init)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random init fallback (default 0)")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when every file already exists and matches this code's outputs")
    parser.add_argument("--calibration-dir", type=Path, metavar="DIR",
                        help="images to calibrate the INT8 model on, any Pillow format, searched recursively "
                             "(default: the sample photos; a few hundred of your own traffic's images are better)")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Export into settings.repository (module doc); the exit status."""
    # torch marks the TorchScript tracer and ONNX exporter used here as deprecated; they are pinned.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx|resnet18_kit\.export")
    return export(settings.repository, weights=args.weights, offline=args.offline, seed=args.seed,
                  if_missing=args.if_missing, calibration_dir=args.calibration_dir)


def export(repository: ModelRepository, weights: Path | None = None, offline: bool = False, seed: int = 0,
           if_missing: bool = False, calibration_dir: Path | None = None) -> int:
    """Write every generated file of `repository` (ModelRepository.generated); the exit status (module
    doc). Problems are one line on stderr."""
    from resnet18_kit.export import resnet18 as r18

    problem = labels_problem(repository)
    if problem:
        print(f"export: {problem}", file=sys.stderr)
        return 2
    if if_missing and not repository.missing_artifacts():
        reason = repository.outdated_reason()
        if reason is None:
            log.info("files present in %s, nothing to do (run without --if-missing to re-export)",
                     shown(repository.root))
            return 0
        log.info("re-exporting: %s", reason)
    transform = repository.image_transform()
    try:  # decoded before anything is written, so a bad calibration image leaves the repository as it was
        calibration = quantize.image_files(calibration_dir) if calibration_dir else sample_photos()
        calibration_inputs = quantize.calibration_batch(repository, calibration)
    except (FileNotFoundError, transform.ImageDecodeError) as exc:
        print(f"export: --calibration-dir: {exc}", file=sys.stderr)
        return 2
    calibration_source = str(calibration_dir.resolve()) if calibration_dir else "sample photos"
    if weights is not None and not weights.is_file():
        print(f"export: --weights: no such file: {weights}", file=sys.stderr)
        return 2
    try:
        model, source = r18.load_model(weights, seed, allow_download=not offline)
    except Exception as exc:  # torch.load / load_state_dict: not a ResNet-18 state dict
        print(f"export: --weights {weights}: not a ResNet-18 state dict: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 2
    log.info("weights %s; exporting into %s", source.spec, shown(repository.root))
    with atomic_path(repository.onnx_path) as onnx_tmp, atomic_path(repository.torchscript_path) as ts_tmp:
        r18.export_onnx(model, onnx_tmp)
        r18.export_torchscript(model, ts_tmp)
        try:
            diffs = r18.check_parity(model, onnx_tmp, ts_tmp)
        except AssertionError as exc:
            print(f"export: PARITY CHECK FAILED: {exc}", file=sys.stderr)
            return 1
    log.info("parity vs eager torch, max |diff| of logits: %s (bound %s + %s*|eager|)",
             ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()), r18.PARITY_ATOL, r18.PARITY_RTOL)
    held_out = quantize.calibration_batch(repository, sample_photos(HELD_OUT_PHOTO_NAMES))
    log.info("quantizing to INT8, calibrated on %d inputs (%s)", len(calibration_inputs), calibration_source)
    with atomic_path(repository.onnx_int8_path) as int8_tmp:
        int8 = quantize.export_int8(repository.onnx_path, int8_tmp, calibration, calibration_inputs,
                                    calibration_source, held_out)
    for name, figures in int8["agreement_vs_fp32"].items():
        log.info("INT8 vs FP32 on %s %s: top-1 agreement %.3f, top-5 overlap %.3f, max |logit diff| %.3f",
                 figures["inputs"], name.replace("_", " "), figures["top1_agreement"], figures["top5_overlap"],
                 figures["max_abs_logit_diff"])
    record = json.dumps(provenance(repository, source, diffs, int8), indent=2) + "\n"
    for path in repository.provenance_paths:
        path.write_text(record)
    record_weights_in_ensemble_config(repository, source.meaningful)
    write_warmup_image(repository.warmup_image_path)
    for path in repository.generated:
        log.info("wrote %s (%s bytes)", shown(path), f"{path.stat().st_size:,}")
    if not source.meaningful:
        r18.warn_random_weights(seed, source.reason)
    return 0
