"""Every CPU runtime of the network side by side in-process, with its agreement (resnet18-kit bench runtimes).

One run, on this machine, of the exported ResNet-18 by each runtime the served models can use
(resnet18_onnx/1/runtimes.py of the model repository, the same loader code): ONNX Runtime FP32 and INT8,
OpenVINO FP32 / BF16 (its INFERENCE_PRECISION_HINT) / INT8, TorchScript FP32. For each: images/s and
p50 / p99 latency of one batch at each batch size, with every core (threads 0) and with one thread (the
served int8 variant's arrangement); then each one's logits against ONNX Runtime FP32 (the reference) on
real photos through the served transform: the sample photos and the held-out photos, each also mirrored
(resnet18_kit/client/samples.py): top-1 agreement, top-5 overlap, max |logit difference| (resnet18_kit/export/quantize.py).

Rounds: the runtimes are measured in turn, `--rounds` times (A/B interleaved), and each figure is the
median over rounds, so a drift of a shared machine's speed does not land on one runtime only.
Writes <results>/runtimes-<UTC time>/runtimes.json (--out to choose the folder) and prints a Markdown
table on stdout.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from resnet18_kit.tools.bench import inprocess
from resnet18_kit.client.samples import HELD_OUT_PHOTO_NAMES, sample_photos
from resnet18_kit.export.quantize import agreement, calibration_batch
from resnet18_kit.repository import ModelRepository
from resnet18_kit.settings import Settings, shown

log = logging.getLogger(__name__)
PREFIX = "resnet18-kit bench runtimes"
#: name -> (ModelRepository property naming the file, runtime, precision). INT8 files keep some layers in
#: floating point: "f32" for them.
CANDIDATES = {
    "onnxruntime fp32": ("onnx_path", "onnxruntime", "f32"),
    "onnxruntime int8": ("onnx_int8_path", "onnxruntime", "f32"),
    "openvino fp32": ("onnx_path", "openvino", "f32"),
    "openvino bf16": ("onnx_path", "openvino", "bf16"),
    "openvino int8": ("onnx_int8_path", "openvino", "f32"),
    "torchscript fp32": ("torchscript_path", "torchscript", "f32"),
}
REFERENCE = "onnxruntime fp32"


def spec(repository: ModelRepository, name: str, threads: int):
    """The runtimes.RuntimeSpec of candidate `name` in `repository` with `threads` intra-op threads (0 = all
    cores)."""
    path, runtime, precision = CANDIDATES[name]
    return repository.runtimes().RuntimeSpec(path=getattr(repository, path), runtime=runtime, threads=threads,
                                              precision=precision)


def measure_speed(repository: ModelRepository, names: list[str], batch_sizes: list[int], threads: list[int],
                  rounds: int, duration_s: float) -> list[dict]:
    """Rows {name, threads, batch_size, img_per_s, p50_ms, p99_ms, rounds}: medians over `rounds`
    interleaved rounds of inprocess.measure (duration_s seconds per batch size and round; latencies in
    milliseconds per batch of UINT8 [batch_size, 3, 224, 224])."""
    load = repository.runtimes().load
    runners = {(n, t): load(spec(repository, n, t)) for n in names for t in threads}
    samples: dict[tuple, list] = {}
    for round_number in range(rounds):
        log.info("round %d of %d", round_number + 1, rounds)
        for (name, t), run in runners.items():
            for r in inprocess.measure(repository, name, batch_sizes, duration_s=duration_s, runner=run):
                samples.setdefault((name, t, r.batch_size), []).append(r)
    return [{"name": n, "threads": t, "batch_size": b,
             "img_per_s": float(np.median([r.throughput for r in rs])),
             "p50_ms": float(np.median([r.p50_ms for r in rs])),
             "p99_ms": float(np.median([r.p99_ms for r in rs])), "rounds": len(rs)}
            for (n, t, b), rs in samples.items()]


def measure_agreement(repository: ModelRepository, names: list[str]) -> dict[str, dict]:
    """Per candidate: Agreement (as a dict) of its logits FP32 [N, 1000] with the reference's on the sample
    and held-out photos (and their mirror images), UINT8 [N, 3, 224, 224] through the served transform."""
    batch = calibration_batch(repository, sample_photos() + sample_photos(HELD_OUT_PHOTO_NAMES))
    load = repository.runtimes().load
    reference = load(spec(repository, REFERENCE, 0))(batch)[0]  # [logits, probabilities]: the logits
    return {name: asdict(agreement(reference, load(spec(repository, name, 0))(batch)[0])) for name in names}


def markdown(rows: list[dict], agree: dict[str, dict], batch_sizes: list[int]) -> str:
    """One line per runtime and thread count: img/s and p50/p99 ms per batch size, then its agreement."""
    header = ["runtime", "threads"] + [f"batch {b}: img/s, p50 / p99 ms" for b in batch_sizes] + [
        "top-1 agreement", "top-5 overlap", "max abs logit diff"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, t in dict.fromkeys((r["name"], r["threads"]) for r in rows):
        cells = [name, str(t) if t else "all cores"]
        for b in batch_sizes:
            r = next(r for r in rows if (r["name"], r["threads"], r["batch_size"]) == (name, t, b))
            cells.append(f"{r['img_per_s']:.1f}, {r['p50_ms']:.1f} / {r['p99_ms']:.1f}")
        a = agree[name]
        cells += [f"{a['top1_agreement']:.3f}", f"{a['top5_overlap']:.3f}", f"{a['max_abs_logit_diff']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """runtimes' options."""
    parser.add_argument("--runtimes", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES),
                        metavar="NAME", help=f"default: all of {', '.join(CANDIDATES)}")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="*", default=[0, 1],
                        help="intra-op thread counts to try (0 = one per core; default 0 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, median reported (default 3)")
    parser.add_argument("--duration-s", type=float, default=2.0, help="seconds per batch size and round")
    parser.add_argument("--out", type=Path, help="results folder (default <results>/runtimes-<time>)")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Measure (module doc); exit status 0, 2 for a bad command line or missing model files."""
    repository = settings.repository
    missing = repository.missing_artifacts()
    if missing:
        print(f"{PREFIX}: model files missing ({missing[0].name}): run `resnet18-kit export` first", file=sys.stderr)
        return 2
    if min(args.batch_sizes + [1]) < 1 or args.rounds < 1 or args.duration_s <= 0:
        print(f"{PREFIX}: --batch-sizes and --rounds must be >= 1, --duration-s > 0", file=sys.stderr)
        return 2
    names = list(dict.fromkeys([REFERENCE] + args.runtimes))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or settings.results_dir(f"runtimes-{stamp:%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    rows = measure_speed(repository, names, args.batch_sizes, args.threads, args.rounds, args.duration_s)
    log.info("agreement with %s on the sample and held-out photos", REFERENCE)
    agree = measure_agreement(repository, names)
    table = markdown(rows, agree, args.batch_sizes)
    (out / "runtimes.json").write_text(json.dumps({
        "command": "resnet18-kit " + shlex.join(sys.argv[1:]),
        "started_utc": stamp.isoformat(timespec="seconds"), "reference": REFERENCE,
        "rows": rows, "agreement": agree, "markdown": table}, indent=2) + "\n")
    print(table)
    print(f"{PREFIX}: {shown(out / 'runtimes.json')}", file=sys.stderr)
    return 0
