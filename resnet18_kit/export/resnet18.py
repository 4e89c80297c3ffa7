"""Build torchvision's ResNet-18, export it to ONNX and TorchScript, and check both against eager torch.

Weights, in order of preference (`load_model`):
  1. a state dict file given with --weights,
  2. torchvision's IMAGENET1K_V1 (from the torch hub cache, or downloaded into it),
  3. a seeded random init, with a loud warning: the exports then work but their predictions are noise.
"""
from __future__ import annotations

import hashlib
import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torchvision

from resnet18_kit import contract

log = logging.getLogger(__name__)

INPUT_NAME = contract.TENSOR_INPUT    # UINT8 [N, 3, 224, 224] pixels, as model_repository/preprocess writes them
#: The exported files' outputs, in this order, as the served runtimes name them: "logits" FP32 [N, 1000]
#: (unnormalized class scores) and "probabilities" FP32 [N, 1000] (their softmax over the 1000 classes:
#: each row >= 0, summing to 1). Triton's pytorch backend maps a TorchScript module's tuple of outputs to
#: the config's outputs by position. The served runtimes.py of a repository names the same
#: (ModelRepository.outdated_reason compares them with what provenance.json records).
OUTPUT_NAMES = (contract.LOGITS_OUTPUT, contract.PROBABILITIES_OUTPUT)
OUTPUT_NAME, PROBABILITIES_NAME = OUTPUT_NAMES
IMAGE_SHAPE = contract.IMAGE_SHAPE
NUM_CLASSES = contract.NUM_CLASSES
#: 17 is the oldest opset the project supports (all ResNet-18 ops are stable since opset 13).
ONNX_OPSET = 17
#: Parity bound between an export and eager torch, per logit: |export - eager| <= ATOL + RTOL * |eager|
#: (numpy.allclose). Float32 kernels of different libraries differ by ~1e-5 relative on ResNet-18.
PARITY_RTOL = 1e-3
PARITY_ATOL = 1e-3
#: Parity bound of the probabilities (absolute): a logit error e changes a probability p by about p*e.
PROBABILITY_ATOL = 1e-4

IMAGENET_WEIGHTS = torchvision.models.ResNet18_Weights.IMAGENET1K_V1


@dataclass(frozen=True)
class WeightsSource:
    """Where the weights came from; `spec` recreates the same model (see `load_model`)."""

    spec: str         # "torchvision:IMAGENET1K_V1", "file:<path>" or "random:<seed>"
    meaningful: bool  # False for a random init: predictions are noise
    reason: str = ""  # why the ImageNet weights were not used, for a random init (one line)


def load_model(weights_file: Path | None = None, seed: int = 0, allow_download: bool = True,
               download_timeout_s: float = 20.0) -> tuple[torch.nn.Module, WeightsSource]:
    """Return ResNet-18 in eval mode on the CPU and the source of its weights.

    Raises FileNotFoundError / RuntimeError when an explicit --weights file is missing or does not fit.
    """
    if weights_file is not None:
        model = torchvision.models.resnet18(weights=None)
        model.load_state_dict(torch.load(weights_file, map_location="cpu", weights_only=True))
        return model.eval(), WeightsSource(f"file:{Path(weights_file).resolve()}", True)
    reason = "download not attempted (--offline) and none in the torch hub cache"
    if allow_download:
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(download_timeout_s)
        try:
            model = torchvision.models.resnet18(weights=IMAGENET_WEIGHTS)
            return model.eval(), WeightsSource(f"torchvision:{IMAGENET_WEIGHTS.name}", True)
        except Exception as exc:  # offline, proxy, partial download: fall back below
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            log.debug("IMAGENET1K_V1 weights unavailable: %r", exc)
        finally:
            socket.setdefaulttimeout(previous)
    warn_random_weights(seed, reason)
    return random_model(seed), WeightsSource(f"random:{seed}", False, reason)


def random_model(seed: int) -> torch.nn.Module:
    """ResNet-18 with torchvision's default init drawn from torch's CPU generator seeded with `seed`."""
    torch.manual_seed(seed)
    return torchvision.models.resnet18(weights=None).eval()


def model_from_spec(spec: str) -> torch.nn.Module:
    """Recreate the eager model an export was made from (the `weights` field of provenance.json)."""
    kind, _, value = spec.partition(":")
    if kind == "random":
        return random_model(int(value))
    if kind == "file":
        return load_model(Path(value))[0]
    if kind == "torchvision":
        return torchvision.models.resnet18(weights=IMAGENET_WEIGHTS).eval()
    raise ValueError(f"unknown weights spec {spec!r}")


def warn_random_weights(seed: int, reason: str = "") -> None:
    """The loud warning printed when the export falls back to a random init (stderr)."""
    bar = "!" * 78
    print(f"\n{bar}\n"
          f"WARNING: torchvision's IMAGENET1K_V1 weights could not be loaded (no cache, no download).\n"
          + (f"         Reason: {reason}\n" if reason else "") +
          f"         Exporting a RANDOMLY INITIALIZED ResNet-18 (seed {seed}): every prediction of this\n"
          f"         server is MEANINGLESS. For real predictions put {Path(IMAGENET_WEIGHTS.url).name} in\n"
          f"         {Path(torch.hub.get_dir()) / 'checkpoints'} or pass --weights FILE.\n"
          f"{bar}\n", file=sys.stderr, flush=True)


#: The normalization as one multiply-add per value, shaped [1, 3, 1, 1] for an NCHW batch:
#: (pixel / 255 - mean) / std = pixel * PIXEL_SCALE + PIXEL_OFFSET (contract.PIXEL_MEAN, PIXEL_STD).
PIXEL_SCALE = (1.0 / (255.0 * np.array(contract.PIXEL_STD, np.float32))).reshape(1, 3, 1, 1)
PIXEL_OFFSET = (-np.array(contract.PIXEL_MEAN, np.float32) / np.array(contract.PIXEL_STD, np.float32)).reshape(1, 3, 1, 1)


def normalize(pixels: np.ndarray) -> np.ndarray:
    """UINT8 pixels [N, 3, 224, 224] -> FP32 [N, 3, 224, 224], normalized as the exported graphs' head does
    (torchvision's ToTensor + Normalize): what the eager network takes."""
    return np.asarray(pixels, np.float32) * PIXEL_SCALE + PIXEL_OFFSET


class ServedNetwork(torch.nn.Module):
    """The network as exported: UINT8 [N, 3, 224, 224] `input` (the preprocess model's pixels) ->
    (logits, probabilities), both FP32 [N, 1000] (OUTPUT_NAMES). The normalization (a cast and one
    multiply-add, `normalize`) and the softmax are part of the exported graph, so every runtime and backend
    serving the file (Python backend, Triton's native onnxruntime and pytorch backends) takes the same
    4x smaller pixels and returns the same probabilities. forward()'s argument is named `input`: Triton's
    pytorch backend maps inputs by name."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net
        self.register_buffer("scale", torch.from_numpy(PIXEL_SCALE.copy()))
        self.register_buffer("offset", torch.from_numpy(PIXEL_OFFSET.copy()))

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
        logits = self.net(input.float() * self.scale + self.offset)
        return logits, torch.softmax(logits, dim=1)


def export_onnx(model: torch.nn.Module, path: Path) -> None:
    """Write ONNX (opset ONNX_OPSET) of ServedNetwork(model), with a dynamic batch axis on `input` and
    both outputs."""
    example = torch.zeros(1, *IMAGE_SHAPE, dtype=torch.uint8)
    torch.onnx.export(  # TorchScript-based exporter: no onnxscript dependency, exact op set of ResNet
        ServedNetwork(model).eval(), (example,), str(path), dynamo=False, opset_version=ONNX_OPSET,
        input_names=[INPUT_NAME], output_names=list(OUTPUT_NAMES),
        dynamic_axes={name: {0: "batch"} for name in (INPUT_NAME, *OUTPUT_NAMES)})


def export_torchscript(model: torch.nn.Module, path: Path) -> None:
    """Write ServedNetwork(model) traced to TorchScript; ResNet-18 has no data-dependent control flow
    to lose."""
    with torch.inference_mode(False), torch.no_grad():
        traced = torch.jit.trace(ServedNetwork(model).eval(), torch.zeros(2, *IMAGE_SHAPE, dtype=torch.uint8))
    traced.save(str(path))


def eager_logits(model: torch.nn.Module, batch: np.ndarray) -> np.ndarray:
    """Logits FP32 [N, 1000] of eager torch `model` for `batch` [N, 3, 224, 224]: UINT8 pixels (`normalize`d
    first, as the exported graphs do) or FP32 already normalized (torchvision_eval_transform's output).
    The reference every export and served model is compared with."""
    with torch.inference_mode():
        return model(torch.from_numpy(normalize(batch) if batch.dtype == np.uint8 else batch)).numpy()


def torchvision_eval_transform():
    """torchvision's ImageNet eval transform (resize 256, center crop 224, to [0, 1], normalize with the
    ImageNet mean/std): PIL image -> FP32 tensor [3, 224, 224], the reference the preprocess model
    reproduces (its tolerances: tests/test_preprocess.py)."""
    from torchvision import transforms

    return transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(mean=list(contract.PIXEL_MEAN), std=list(contract.PIXEL_STD))])


def parity_batch(batch_size: int = 4, seed: int = 1234) -> np.ndarray:
    """A fixed UINT8 [batch_size, 3, 224, 224] batch of uniform random pixels (0-255)."""
    return np.random.default_rng(seed).integers(0, 256, (batch_size, *IMAGE_SHAPE), dtype=np.uint8)


def check_parity(model: torch.nn.Module, onnx_path: Path, torchscript_path: Path) -> dict[str, float]:
    """Run the same batch through eager torch, ONNX Runtime and TorchScript.

    Returns the max absolute logit difference of each export. Raises AssertionError naming the export
    and the difference when its logits exceed PARITY_ATOL + PARITY_RTOL * |eager|, or its probabilities
    differ from the softmax of eager torch's logits by more than PROBABILITY_ATOL.
    """
    import onnxruntime as ort

    batch = parity_batch()
    with torch.inference_mode():
        eager = model(torch.from_numpy(normalize(batch)))
        expected = (eager.numpy(), torch.softmax(eager, dim=1).numpy())
        scripted = [t.numpy() for t in torch.jit.load(str(torchscript_path)).eval()(torch.from_numpy(batch))]
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    onnx_out = session.run(list(OUTPUT_NAMES), {INPUT_NAME: batch})
    diffs = {}
    for name, (logits, probabilities) in (("onnx", onnx_out), ("torchscript", scripted)):
        if logits.shape != expected[0].shape or probabilities.shape != expected[1].shape:
            raise AssertionError(f"{name} export: output shapes {logits.shape}, {probabilities.shape} "
                                 f"!= {expected[0].shape}")
        diffs[name] = float(np.max(np.abs(logits - expected[0])))
        if not np.allclose(logits, expected[0], rtol=PARITY_RTOL, atol=PARITY_ATOL):
            raise AssertionError(
                f"{name} export differs from eager torch: max |diff| {diffs[name]:.3g} exceeds "
                f"atol {PARITY_ATOL} + rtol {PARITY_RTOL} * |eager|")
        if not np.allclose(probabilities, expected[1], rtol=0, atol=PROBABILITY_ATOL):
            raise AssertionError(f"{name} export: probabilities differ from the softmax of eager torch's "
                                 f"logits by more than {PROBABILITY_ATOL}")
    return diffs


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
