"""python -m resnet18_kit.export: write ResNet-18 (ONNX + TorchScript) into the model repository, parity-checked.

Writes model_repository/resnet18_onnx/1/model.onnx, its INT8 quantization model.int8.onnx (calibrated on
the sample photos or --calibration-dir; resnet18_kit/export/quantize.py), resnet18_torchscript/1/model.pt, a
provenance.json next to each (weights, versions, parity, calibration set, INT8 agreement with FP32), and
the preprocess model's warmup image. Checks the committed labels file against
torchvision's ImageNet category names. Exit status 1 with a message when the parity check fails.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import logging
import os
import platform
import struct
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

from resnet18_kit.client.samples import HELD_OUT_PHOTO_NAMES, sample_photos
from resnet18_kit import contract
from resnet18_kit.export import quantize
from resnet18_kit.export import resnet18 as r18


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


def check_labels() -> None:
    """The committed labels file must be torchvision's 1000 ImageNet category names, in class order."""
    expected = r18.IMAGENET_WEIGHTS.meta["categories"]
    actual = contract.LABELS_PATH.read_text().splitlines()
    if actual != expected:
        raise SystemExit(f"export: {contract.LABELS_PATH} does not match torchvision's ImageNet categories")


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


def provenance(source: r18.WeightsSource, diffs: dict[str, float], int8: dict) -> dict:
    import onnx
    import onnxruntime
    import torch
    import torchvision

    return {
        "weights": source.spec,
        "weights_meaningful": source.meaningful,
        "weights_unavailable_reason": source.reason,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                     "python": platform.python_version()},
        "onnx_opset": r18.ONNX_OPSET,
        "outputs": list(r18.OUTPUT_NAMES),
        "parity": {"rtol": r18.PARITY_RTOL, "atol": r18.PARITY_ATOL,
                   "max_abs_diff_vs_eager": diffs, "batch_size": len(r18.parity_batch())},
        "int8": int8,
        "sha256": {str(p.relative_to(contract.MODEL_REPOSITORY)): r18.sha256(p)
                   for p in (contract.ONNX_PATH, contract.ONNX_INT8_PATH, contract.TORCHSCRIPT_PATH,
                             contract.LABELS_PATH)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resnet18_kit.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, help="ResNet-18 state dict file (torch.save of state_dict())")
    parser.add_argument("--offline", action="store_true",
                        help="do not try to download IMAGENET1K_V1 (use the hub cache or a random init)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init fallback (default 0)")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when every artifact already exists and matches this code's outputs")
    parser.add_argument("--calibration-dir", type=Path,
                        help="images to calibrate the INT8 model on, any Pillow format, searched recursively "
                             "(default: the sample photos; a few hundred of your own traffic's images are better)")
    args = parser.parse_args(argv)
    # The export's own messages at INFO; the libraries' (ONNX Runtime's quantization logs every tensor it
    # copies) only from WARNING up.
    logging.basicConfig(level=logging.WARNING, format="export: %(message)s")
    logging.getLogger("export").setLevel(logging.INFO)
    # torch marks the TorchScript tracer and ONNX exporter used here as deprecated; they are pinned.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx|__main__|export")

    check_labels()
    if args.if_missing and not contract.missing_artifacts():
        reason = contract.outdated_reason()
        if reason is None:
            print("export: artifacts present, nothing to do (run without --if-missing to re-export)")
            return 0
        print(f"export: re-exporting: {reason}")
    try:  # decoded before anything is written, so a bad calibration image leaves the repository as it was
        calibration = (quantize.image_files(args.calibration_dir) if args.calibration_dir else sample_photos())
        calibration_inputs = quantize.calibration_batch(calibration)
    except (FileNotFoundError, contract.image_transform().ImageDecodeError) as exc:
        print(f"export: --calibration-dir: {exc}", file=sys.stderr)
        return 2
    calibration_source = str(args.calibration_dir.resolve()) if args.calibration_dir else "sample photos"
    if args.weights is not None and not args.weights.is_file():
        print(f"export: --weights: no such file: {args.weights}", file=sys.stderr)
        return 2
    try:
        model, source = r18.load_model(args.weights, args.seed, allow_download=not args.offline)
    except Exception as exc:  # torch.load / load_state_dict: not a ResNet-18 state dict
        print(f"export: --weights {args.weights}: not a ResNet-18 state dict: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 2
    print(f"export: weights {source.spec}")
    with atomic_path(contract.ONNX_PATH) as onnx_tmp, atomic_path(contract.TORCHSCRIPT_PATH) as ts_tmp:
        r18.export_onnx(model, onnx_tmp)
        r18.export_torchscript(model, ts_tmp)
        try:
            diffs = r18.check_parity(model, onnx_tmp, ts_tmp)
        except AssertionError as exc:
            print(f"export: PARITY CHECK FAILED: {exc}", file=sys.stderr)
            return 1
    print("export: parity vs eager torch, max |diff| of logits: "
          + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
          + f" (bound {r18.PARITY_ATOL} + {r18.PARITY_RTOL}*|eager|)")
    held_out = quantize.calibration_batch(sample_photos(HELD_OUT_PHOTO_NAMES))
    with atomic_path(contract.ONNX_INT8_PATH) as int8_tmp:
        int8 = quantize.export_int8(contract.ONNX_PATH, int8_tmp, calibration, calibration_inputs,
                                    calibration_source, held_out)
    for name, figures in int8["agreement_vs_fp32"].items():
        print(f"export: INT8 vs FP32 on {figures['inputs']} {name.replace('_', ' ')}: top-1 agreement "
              f"{figures['top1_agreement']:.3f}, top-5 overlap {figures['top5_overlap']:.3f}, "
              f"max |logit diff| {figures['max_abs_logit_diff']:.3f}")
    record = json.dumps(provenance(source, diffs, int8), indent=2) + "\n"
    for path in contract.PROVENANCE_PATHS:
        path.write_text(record)
    write_warmup_image(contract.WARMUP_IMAGE_PATH)
    for path in contract.GENERATED:
        print(f"export: wrote {contract.shown(path)} ({path.stat().st_size:,} bytes)")
    if not source.meaningful:
        r18.warn_random_weights(args.seed, source.reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
