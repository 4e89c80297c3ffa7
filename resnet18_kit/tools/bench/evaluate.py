"""Top-1 / top-5 accuracy of served model-config variants on a labelled image folder, and their agreement
with a reference variant (default: the FP32 network) on any image folder (resnet18-kit evaluate).

For the reference and each --variants NAME (a tritonserver `--model-config-name`: models with
configs/NAME.pbtxt load it, the others their config.pbtxt; "default" = config.pbtxt everywhere = the FP32
ONNX Runtime network), in turn: start the embedded tritonserver on free ports, send every image under
FOLDER (recursive) to the `resnet18` ensemble, --batch-size images per request, keep the full logits,
stop the server; the servers serve --model-repository. With --url the already running server at HOST:PORT
(--protocol, default http) is evaluated instead, as the one variant "served", against the embedded
reference started as above.

Tensors: request input "image" BYTES [n, 1] (one encoded file per row, n <= --batch-size, capped at the
ensemble's max_batch_size 16); output "logits" FP32 [n, 1000]; per variant FP32 [N, 1000] over the N
images of FOLDER. Labels int64 [N], class index 0..999.

An image the server refuses (HTTP 400 / gRPC INVALID_ARGUMENT: a corrupt file) is counted and listed
with the server's message, and left out of every metric; when a batch is refused its images are sent
again one per request, so a bad file fails only itself.

Labelled folder: when every immediate subfolder of FOLDER that holds images is named by a class index
(0..999) or an ImageNet WordNet id (n01440764 ...), an image's label is the subfolder it lies in (images
directly in FOLDER are unlabelled); a subfolder with images named otherwise is an error. No subfolder
with images: agreement only. Wnid -> class index comes from
resnet18/wnids.txt of the model repository: line i = wnid of class i, the 1000 ids sorted, which is the class
order of torchvision's ImageNet models (ImageFolder sorts the wnid folders). That file is
timm/data/_info/imagenet_synsets.txt of the timm 1.0.31 wheel on PyPI, unchanged.

Metrics, with z_i the logits of image i and y_i its label (logits are unnormalized, in logit units):
  top-k accuracy   = (1/L) sum_i [y_i in top-k(z_i)], over the L labelled images the variant accepted
                     (k = 1: argmax z_i == y_i); a fraction in [0, 1].
  top-1 agreement  = (1/M) sum_i [argmax z_i == argmax r_i], r_i the reference's logits, over the M images
                     both accepted (export.quantize.agreement); fraction in [0, 1].
  top-5 overlap    = (1/M) sum_i |top-5(z_i) & top-5(r_i)| / 5; fraction in [0, 1].
  max |logit diff| = max over i and the 1000 classes of |z_ic - r_ic|, in logit units.

Weights: the export uses a seeded random init when no ImageNet weights are available (the provenance of
the model repository says which). Accuracy is then meaningless: about 0.1% top-1 (1/1000) is expected by
chance; the command says so once on stderr and in the JSON report ("weights_meaningful": false, "note").
Agreement stays meaningful: it measures how far a variant's network (e.g. int8) departs from FP32. With
real weights (`resnet18-kit export --weights FILE`, FILE torchvision's IMAGENET1K_V1 ResNet-18
checkpoint) and an ImageNet validation folder with one subfolder per wnid, accuracy is real:
torchvision's documentation publishes 69.76% top-1 / 89.08% top-5 for IMAGENET1K_V1 ResNet-18 with this
exact eval transform (resize 256, center crop 224).

Output: the table on stdout; progress and notes on stderr. Exit status: 0 done (refused images included);
1 a server failed; 2 a problem with the command line (missing folder, no images, unknown variant, bad
class folder name, --url unreachable), named on one line.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
from tritonclient.utils import InferenceServerException

from resnet18_kit.client.sync_client import TritonClassifierClient
from resnet18_kit.client.core import protocol_module
from resnet18_kit.client.errors import InferenceError, InvalidInputError, from_triton
from resnet18_kit.contract import DEFAULT_VARIANT, ENSEMBLE_MODEL, IMAGE_INPUT, LOGITS_OUTPUT, NUM_CLASSES
from resnet18_kit.export.quantize import agreement, image_files
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import ServerStartError, config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.options import add_server_address_options
from resnet18_kit.settings import Settings

log = logging.getLogger(__name__)
PREFIX = "evaluate"
SERVED_VARIANT = "served"
WNID_PATTERN = re.compile(r"n\d{8}")
#: Said once on stderr, and put in the JSON report, when the served weights are a random init.
RANDOM_WEIGHTS_NOTE = ("the model's weights are a seeded RANDOM init (no ImageNet weights were available): "
                       "top-1 / top-5 accuracy and labels are meaningless (about 0.1% top-1 by chance); "
                       "agreement between variants still holds; see README 'Weights'")


class UsageError(Exception):
    """A problem with the command line, reported on one line with exit status 2."""


def wnids_path(repository: ModelRepository) -> Path:
    """ImageNet-1k WordNet ids of `repository`, line i = class index i (resnet18/wnids.txt; module doc)."""
    return repository.root / ENSEMBLE_MODEL / "wnids.txt"


def load_wnids(path: Path) -> dict[str, int]:
    """{wnid: class index} from wnids.txt (1000 lines, line i = class i)."""
    wnids = path.read_text().split()
    if len(wnids) != NUM_CLASSES or len(set(wnids)) != NUM_CLASSES:
        raise ValueError(f"{path}: expected {NUM_CLASSES} distinct wnids, found {len(wnids)}")
    return {wnid: index for index, wnid in enumerate(wnids)}


def class_of_folder(name: str, wnids: dict[str, int]) -> int | None:
    """Class index named by a folder: "281" or "n02123045" -> 281; None when it names no class."""
    if name.isdecimal() and int(name) < NUM_CLASSES:
        return int(name)
    return wnids.get(name) if WNID_PATTERN.fullmatch(name) else None


def folder_labels(folder: Path, files: Sequence[Path], wnids_file: Path) -> np.ndarray | None:
    """Labels int64 [len(files)] from the class subfolders of `folder` (-1: a file directly in `folder`),
    or None when no file lies in a subfolder (subfolders without images, e.g. __pycache__, are ignored).
    wnids_file: wnids.txt (load_wnids), read only when there are subfolders. Raises UsageError naming the
    first subfolder (sorted) that is neither a class index nor a wnid."""
    parts = [Path(f).relative_to(folder).parts for f in files]
    subfolders = sorted({p[0] for p in parts if len(p) > 1})
    if not subfolders:
        return None
    wnids = load_wnids(wnids_file)
    classes = {name: class_of_folder(name, wnids) for name in subfolders}
    bad = next((name for name, index in classes.items() if index is None), None)
    if bad is not None:
        raise UsageError(f"class folder {Path(folder) / bad} is named neither by an ImageNet class index "
                         "(0..999) nor by a WordNet id of ImageNet-1k (n01440764 ...)")
    return np.array([classes[p[0]] if len(p) > 1 else -1 for p in parts], dtype=np.int64)


def topk_accuracy(logits: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Fraction (0..1) of rows of logits FP32 [N, C] whose label (int [N]) is among their k largest."""
    top = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return float(np.mean(np.any(top == np.asarray(labels)[:, None], axis=1)))


def infer_logits(client: TritonClassifierClient, images: Sequence[bytes]) -> np.ndarray:
    """Encoded images, one request to the ensemble -> logits FP32 [len(images), 1000].
    Raises the typed errors of client.errors (InvalidInputError when the server refuses the request)."""
    module = protocol_module(client.protocol)
    array = np.array([bytes(image) for image in images], dtype=np.object_).reshape(-1, 1)
    request = module.InferInput(IMAGE_INPUT, list(array.shape), "BYTES")
    request.set_data_from_numpy(array)
    try:
        result = client.raw.infer(ENSEMBLE_MODEL, [request], outputs=[module.InferRequestedOutput(LOGITS_OUTPUT)])
    except InferenceServerException as exc:
        raise from_triton(exc) from None
    return result.as_numpy(LOGITS_OUTPUT).astype(np.float32, copy=False).reshape(len(images), NUM_CLASSES)


def collect_logits(url: str, protocol: str, files: Sequence[Path], batch_size: int,
                   ) -> tuple[np.ndarray, dict[int, str]]:
    """Every file through the ensemble at `url`: (logits FP32 [N, 1000], NaN rows for refused files;
    {file position: server's message} of the refused ones)."""
    logits = np.full((len(files), NUM_CLASSES), np.nan, dtype=np.float32)
    refused: dict[int, str] = {}
    with TritonClassifierClient(url, protocol) as client:
        max_batch = ModelConfigView.from_served(client.model_config(ENSEMBLE_MODEL)).max_batch_size or batch_size
        step = max(1, min(batch_size, max_batch))
        for start in range(0, len(files), step):
            images = [Path(f).read_bytes() for f in files[start:start + step]]
            try:
                logits[start:start + len(images)] = infer_logits(client, images)
                continue
            except InvalidInputError:
                pass  # one bad file refuses the whole request: find it, one request per image
            for offset, image in enumerate(images):
                try:
                    logits[start + offset] = infer_logits(client, [image])[0]
                except InvalidInputError as exc:
                    refused[start + offset] = exc.message
    return logits, refused


def run_embedded(repository: ModelRepository, variant: str, files: Sequence[Path], protocol: str, batch_size: int,
                 log_dir: Path) -> tuple[np.ndarray, dict[int, str]]:
    """collect_logits on an embedded tritonserver of `repository` started with `--model-config-name variant`
    (none for "default") on free ports, stopped afterwards."""
    config = config_on_free_ports(model_config_name=None if variant == DEFAULT_VARIANT else variant,
                                  model_repository=repository.root)
    log.info("%s: starting tritonserver, %d images", variant, len(files))
    with EmbeddedTritonServer(config, log_path=log_dir / f"tritonserver-{variant}.log"):
        url = config.url(protocol)
        return collect_logits(url, protocol, files, batch_size)


def check_reachable(url: str, protocol: str) -> None:
    """Raises UsageError when no Triton server with a ready `resnet18` answers at `url`."""
    try:
        with TritonClassifierClient(url, protocol, connection_timeout_s=5.0) as client:
            ready = client.is_server_ready() and client.is_model_ready(ENSEMBLE_MODEL)
    except Exception as exc:  # connection refused, bad address: the client's errors vary by protocol
        detail = exc.message if isinstance(exc, InferenceError) else str(exc) or type(exc).__name__
        raise UsageError(f"--url {url} ({protocol}): {detail.splitlines()[0]}") from None
    if not ready:
        raise UsageError(f"the server at {url} is not ready or has no ready model '{ENSEMBLE_MODEL}'")


def accepted_mask(count: int, refused: dict[int, str]) -> np.ndarray:
    """bool [count]: True for the files the server answered."""
    mask = np.ones(count, dtype=bool)
    mask[list(refused)] = False
    return mask


def summarize(variant: str, logits: np.ndarray, refused: dict[int, str], files: Sequence[Path],
              folder: Path, labels: np.ndarray | None,
              reference: tuple[np.ndarray, dict[int, str]] | None) -> dict:
    """One row of the report: counts, accuracies (labelled folder), agreement with the reference's
    (logits, refused) (None for the reference itself), refused files with the server's messages."""
    accepted = accepted_mask(len(files), refused)
    row: dict = {"variant": variant, "reference": reference is None, "images": int(accepted.sum()),
                 "refused": [{"file": str(Path(files[i]).relative_to(folder)), "message": message}
                             for i, message in sorted(refused.items())]}
    if labels is not None:
        scored = accepted & (labels >= 0)
        row["labelled"] = int(scored.sum())
        for k in (1, 5):
            row[f"top{k}_accuracy"] = topk_accuracy(logits[scored], labels[scored], k) if scored.any() else None
    both = accepted & (accepted_mask(len(files), reference[1]) if reference is not None else False)
    result = agreement(reference[0][both], logits[both]) if both.any() else None
    row["compared"] = result.inputs if result else 0
    row["top1_agreement"] = result.top1_agreement if result else None
    row["top5_overlap"] = result.top5_overlap if result else None
    row["max_abs_logit_diff"] = result.max_abs_logit_diff if result else None
    return row


def table(rows: Sequence[dict], labelled: bool) -> str:
    """The report as a fixed-width text table, refused files listed below it."""
    columns = ["variant", "images"] + (["top-1 acc", "top-5 acc"] if labelled else []) + [
        "top-1 agree", "top-5 overlap", "max |logit diff|", "refused"]

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f}%"

    lines = []
    for row in rows:
        cells = [row["variant"] + (" (reference)" if row["reference"] else ""), str(row["images"])]
        if labelled:
            cells += [pct(row["top1_accuracy"]), pct(row["top5_accuracy"])]
        diff = row["max_abs_logit_diff"]
        cells += [pct(row["top1_agreement"]), pct(row["top5_overlap"]),
                  "-" if diff is None else f"{diff:.6g}", str(len(row["refused"]))]
        lines.append(cells)
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(columns)]
    text = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            for cells in [columns, *lines]]
    for row in rows:
        text += [f"refused by {row['variant']}: {r['file']}: {r['message']}" for r in row["refused"]]
    return "\n".join(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """evaluate's options (the server address ones from settings.add_server_address_options)."""
    parser.add_argument("folder", type=Path, help="image folder (recursive); class subfolders = labelled")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help="model-config variants to evaluate, each on its own embedded server (default int8; "
                             "not with --url)")
    parser.add_argument("--reference", default=DEFAULT_VARIANT, metavar="NAME",
                        help="variant the others are compared with (default: default = FP32)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="images per request (default 8; capped at the ensemble's max_batch_size, 16)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON there")
    add_server_address_options(parser)


def evaluate(repository: ModelRepository, args: argparse.Namespace, url: str | None, protocol: str) -> dict:
    """The whole run: validate the command line (UsageError), evaluate the variants of `repository` (and the
    server at `url` when given), return the JSON report."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, not {args.batch_size}")
    if url and args.variants:
        raise UsageError("--variants and --url exclude each other (--url evaluates the server running there)")
    try:
        files = image_files(args.folder)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    labels = folder_labels(args.folder, files, wnids_path(repository))
    variants = [] if url else list(dict.fromkeys(args.variants or ["int8"]))
    known = repository.variant_names()
    unknown = [name for name in [args.reference, *variants] if name not in known]
    if unknown:
        raise UsageError(f"unknown variant {unknown[0]!r} (known: {', '.join(known)})")
    missing = repository.missing_artifacts()
    if missing:
        raise UsageError(f"model files missing ({missing[0].name} ...): run `resnet18-kit export` first")
    if url:
        check_reachable(url, protocol)
    weights_meaningful = repository.weights_meaningful()
    if weights_meaningful is False:
        print(f"{PREFIX}: NOTE {RANDOM_WEIGHTS_NOTE}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="evaluate-") as log_dir:
        reference = run_embedded(repository, args.reference, files, protocol, args.batch_size, Path(log_dir))
        runs = {name: run_embedded(repository, name, files, protocol, args.batch_size, Path(log_dir))
                for name in variants}
    if url:
        log.info("%s: %s server at %s, %d images", SERVED_VARIANT, protocol, url, len(files))
        runs[SERVED_VARIANT] = collect_logits(url, protocol, files, args.batch_size)
    rows = [summarize(args.reference, *reference, files, args.folder, labels, None)]
    rows += [summarize(name, *run, files, args.folder, labels, reference) for name, run in runs.items()]
    report = {"folder": str(args.folder), "protocol": protocol, "batch_size": args.batch_size,
              "reference": args.reference, "labelled": labels is not None, "model_repository": str(repository.root),
              "weights": repository.provenance().get("weights"), "weights_meaningful": weights_meaningful}
    if weights_meaningful is False:
        report["note"] = RANDOM_WEIGHTS_NOTE
    return {**report, "variants": rows}


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Evaluate (module doc); the table on stdout; exit status 0, 1 a server failed, 2 a usage problem."""
    url = settings.url if args.url is not None else None
    try:
        report = evaluate(settings.repository, args, url, settings.protocol)
    except UsageError as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 2
    except (ServerStartError, InferenceError, OSError) as exc:
        print(f"{PREFIX}: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(table(report["variants"], report["labelled"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
