"""INT8 ResNet-18: ONNX Runtime static quantization of the FP32 export, calibrated on real photos.

Recipe (ONNX Runtime's `onnxruntime.quantization`, the documented CPU path):
  1. `quant_pre_process`: shape inference and graph optimization of the FP32 model (folds BatchNorm
     into the convolutions, so each is quantized once);
  2. `quantize_static` in QDQ format: weights QInt8 per output channel, activations QUInt8 per tensor,
     ranges from MinMax calibration over the calibration batch. On a CPU with AVX-512 VNNI the result
     runs ~3x the FP32 model's speed (docs/benchmarks.md has this machine's figures).

Calibration images: the sample photos (resnet18_kit/client/samples.py) or every image of a `--calibration-dir`, each
also mirrored left-right (twice the inputs, the same statistics a horizontally symmetric world has),
through the served transform of the repository exported into (preprocess/1/image_transform.py, loaded by
ModelRepository.image_transform), so the ranges are the ones the served pipeline produces.
"""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from resnet18_kit.client.samples import IMAGE_SUFFIXES, expand_paths
from resnet18_kit.contract import LOGITS_OUTPUT, TENSOR_INPUT
from resnet18_kit.repository import ModelRepository


def image_files(directory: Path) -> list[Path]:
    """Every image file under `directory` (recursively), sorted. Raises FileNotFoundError when there is
    none or the folder does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"not a folder: {directory}")
    files = expand_paths([directory])
    if not files:
        raise FileNotFoundError(f"no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under {directory}")
    return files


def calibration_batch(repository: ModelRepository, paths: list[Path]) -> np.ndarray:
    """UINT8 pixels [2 x len(paths), 3, 224, 224]: each image through `repository`'s served transform, then
    mirrored. Raises repository.image_transform().ImageDecodeError naming the file that does not decode."""
    transform = repository.image_transform()
    rows = []
    for path in paths:
        try:
            rows.append(transform.preprocess(Path(path).read_bytes()))
        except transform.ImageDecodeError as exc:
            raise transform.ImageDecodeError(f"{path}: {exc}") from None
    batch = np.stack(rows)
    return np.ascontiguousarray(np.concatenate([batch, batch[..., ::-1]]))


@dataclass(frozen=True)
class Agreement:
    """How closely a candidate model's logits follow the FP32 reference's on the same inputs.

    top1_agreement: fraction of inputs whose top-1 class is the reference's (0..1).
    top5_overlap: mean |top-5(candidate) & top-5(reference)| / 5 (0..1).
    max_abs_logit_diff: largest |candidate - reference| over all inputs and classes (logit units).
    inputs: how many inputs were compared.
    """

    top1_agreement: float
    top5_overlap: float
    max_abs_logit_diff: float
    inputs: int


def agreement(reference: np.ndarray, candidate: np.ndarray) -> Agreement:
    """Compare logits FP32 [N, C] of a candidate with the reference's [N, C]. Raises ValueError when the
    shapes differ."""
    if reference.shape != candidate.shape or reference.ndim != 2:
        raise ValueError(f"logits shapes differ or are not [N, C]: {reference.shape} vs {candidate.shape}")
    top5_ref = np.argsort(-reference, axis=1)[:, :5]
    top5_cand = np.argsort(-candidate, axis=1)[:, :5]
    overlap = [len(set(a) & set(b)) / 5 for a, b in zip(top5_ref, top5_cand)]
    return Agreement(top1_agreement=float(np.mean(top5_ref[:, 0] == top5_cand[:, 0])),
                     top5_overlap=float(np.mean(overlap)),
                     max_abs_logit_diff=float(np.max(np.abs(candidate - reference))),
                     inputs=int(reference.shape[0]))


def quantize_int8(fp32_path: Path, int8_path: Path, batch: np.ndarray) -> dict:
    """Write the INT8 QDQ model of `fp32_path` to `int8_path`, calibrated on `batch` (UINT8 pixels
    [N,3,224,224], the files' input). The graph's head (the cast and normalization of the pixels) and its
    softmax stay FP32: only the network between them is quantized. Returns the settings used (for
    provenance.json)."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.rows = iter(batch[i:i + 1] for i in range(len(batch)))

        def get_next(self):
            row = next(self.rows, None)
            return None if row is None else {TENSOR_INPUT: row}

    import onnx

    settings = {"tool": "onnxruntime.quantization.quantize_static", "format": "QDQ",
                "weights": "QInt8, per channel", "activations": "QUInt8, per tensor",
                "calibration_method": "MinMax", "preprocess": "quant_pre_process",
                # 8-bit probabilities would round every class under 1/256 to 0; the softmax stays FP32.
                "not_quantized": ["the input's normalization", "Softmax"]}
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32_path), str(prepared))
        # torch.onnx names the network's nodes /net/...; the others are the head and the softmax.
        outside_net = [node.name for node in onnx.load(str(prepared)).graph.node
                       if not node.name.startswith("/net/")]
        quantize_static(str(prepared), str(int8_path), Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
                        calibrate_method=CalibrationMethod.MinMax, nodes_to_exclude=outside_net)
    return settings


def onnx_logits(path: Path, batch: np.ndarray) -> np.ndarray:
    """Logits FP32 [N, 1000] of the ONNX model at `path` for `batch`, by ONNX Runtime on the CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run([LOGITS_OUTPUT], {TENSOR_INPUT: batch})[0]


def calibration_record(paths: list[Path], source: str) -> dict:
    """What provenance.json says of the calibration set: where it came from, each file's name and
    sha256, and how the inputs were made."""
    return {"source": source, "inputs": 2 * len(paths), "mirrored": True,
            "files": {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}}


def export_int8(fp32_path: Path, int8_path: Path, calibration: list[Path], batch: np.ndarray, source: str,
                evaluation: np.ndarray) -> dict:
    """Quantize on `batch` (calibration_batch(calibration): UINT8 [2N,3,224,224]), then compare the INT8
    model with the FP32 one on those inputs and on `evaluation` (UINT8 [M,3,224,224] inputs not used for
    calibration). Returns the provenance record."""
    settings = quantize_int8(fp32_path, int8_path, batch)
    return {"quantization": settings, "calibration": calibration_record(calibration, source),
            "agreement_vs_fp32": {
                "calibration_inputs": asdict(agreement(onnx_logits(fp32_path, batch), onnx_logits(int8_path, batch))),
                "held_out_inputs": asdict(agreement(onnx_logits(fp32_path, evaluation),
                                                    onnx_logits(int8_path, evaluation)))}}
