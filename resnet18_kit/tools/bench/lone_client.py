"""One client sending tensors to `resnet18_onnx`, every request timed (resnet18-kit bench lone-client).

The check for Triton 2.51's lost wake-up (docs/benchmarks.md): with a bounded queue and one instance, a
request that arrives as the instance finishes can wait 500 ms. A lone client is the worst case: each
request is sent the moment the previous answer arrives. For `--seconds` (default 60) one gRPC client with
system shared memory (client.sync_client.TritonClassifierClient, the product's client) sends UINT8
[1, 3, 224, 224] batches back to back to the config variant's `resnet18_onnx`; every request's latency is
timed on the client. Beside it, before and after, the same network in-process (the variant's runtime
spec, batch 1, bench.inprocess.measure): the figure a server cannot beat.

Reports p50 / p99 / max ms and the requests over 200 ms, served and in-process, and the two checks:
served p99 <= 2 x in-process batch-1 p99 (the mean of before and after), and no request over 200 ms.
Writes <results>/lone-client-<UTC time>/lone_client.json (--out to choose the folder).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from resnet18_kit.tools.bench import inprocess
from resnet18_kit.client.sync_client import TritonClassifierClient
from resnet18_kit.contract import DEFAULT_VARIANT, ONNX_MODEL
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.settings import Settings, shown

log = logging.getLogger(__name__)
PREFIX = "resnet18-kit bench lone-client"

#: A request slower than this is a stall (the lost wake-up sleeps 500 ms; a batch-1 execution takes ~12 ms).
STALL_MS = 200.0


def latency_summary_ms(latencies_ms: np.ndarray) -> dict:
    """{requests, p50_ms, p99_ms, max_ms, over_200_ms} of latencies in milliseconds (numpy's linear
    percentiles)."""
    return {"requests": int(latencies_ms.size), "p50_ms": float(np.percentile(latencies_ms, 50)),
            "p99_ms": float(np.percentile(latencies_ms, 99)), "max_ms": float(latencies_ms.max()),
            "over_200_ms": int(np.sum(latencies_ms > STALL_MS))}


def inprocess_batch1(repository: ModelRepository, variant: str, duration_s: float) -> dict:
    """The variant's network in-process at batch 1 (UINT8 [1, 3, 224, 224]) for duration_s seconds:
    {p50_ms, p99_ms (milliseconds per batch), img_per_s}."""
    loaders = repository.runtimes()
    parameters = ModelConfigView.for_variant(repository, ONNX_MODEL, variant).parameters
    spec = loaders.RuntimeSpec.from_parameters(parameters, repository.onnx_path.parent)
    (result,) = inprocess.measure(repository, spec.runtime, [1], duration_s=duration_s, runner=loaders.load(spec))
    return {"p50_ms": result.p50_ms, "p99_ms": result.p99_ms, "img_per_s": result.throughput}


def served_lone_client(url: str, seconds: float) -> np.ndarray:
    """Latencies (ms) of back-to-back batch-1 tensor requests from one gRPC client for `seconds`."""
    batch = np.random.default_rng(0).integers(0, 256, (1, 3, 224, 224), dtype=np.uint8)
    latencies = []
    with TritonClassifierClient(url, "grpc", shared_memory=True) as client:
        client.infer_tensor(batch, model=ONNX_MODEL)  # registers the shared-memory regions, untimed
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            client.infer_tensor(batch, model=ONNX_MODEL)
            latencies.append((time.perf_counter() - started) * 1e3)
    return np.array(latencies)


def measure(repository: ModelRepository, variant: str, seconds: float, inprocess_s: float, out: Path,
            served_repository: Path | None = None) -> dict:
    """In-process, served for `seconds` (from `served_repository` when given, else `repository`),
    in-process again (`repository`'s network); the record `run` writes. The server's log goes to
    out/tritonserver.log."""
    before = inprocess_batch1(repository, variant, inprocess_s)
    config = config_on_free_ports(model_config_name=None if variant == DEFAULT_VARIANT else variant,
                                  model_repository=served_repository or repository.root)
    log.info("serving %s; one gRPC client for %g s", variant, seconds)
    with EmbeddedTritonServer(config, log_path=out / "tritonserver.log"):
        served = latency_summary_ms(served_lone_client(config.grpc_url, seconds))
    after = inprocess_batch1(repository, variant, inprocess_s)
    reference_p99_ms = (before["p99_ms"] + after["p99_ms"]) / 2
    return {"variant": variant, "seconds": seconds, "served_repository": str(served_repository or ""),
            "served": served,
            "inprocess_before": before, "inprocess_after": after, "inprocess_p99_ms": reference_p99_ms,
            "checks": [
                {"name": "served p99 <= 2 x in-process batch-1 p99", "met": served["p99_ms"] <= 2 * reference_p99_ms,
                 "measured": f"{served['p99_ms']:.1f} ms vs 2 x {reference_p99_ms:.1f} ms"},
                {"name": f"no request over {STALL_MS:.0f} ms", "met": served["over_200_ms"] == 0,
                 "measured": f"{served['over_200_ms']} of {served['requests']} (max {served['max_ms']:.1f} ms)"}]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """lone-client's options."""
    parser.add_argument("--variant", default=DEFAULT_VARIANT, help="config variant (default: config.pbtxt)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the served run, s (default 60)")
    parser.add_argument("--inprocess-s", type=float, default=5.0, help="in-process seconds, before and after")
    parser.add_argument("--out", type=Path, help="results folder (default <results>/lone-client-<time>)")
    parser.add_argument("--served-repository", type=Path, metavar="DIR",
                        help="serve from this model repository (e.g. an older checkout's, for a before/after); "
                             "the in-process figure is --model-repository's")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Measure (module doc); exit status 0, 2 for a bad command line or missing model files."""
    repository = settings.repository
    problem = ("model files missing: run `resnet18-kit export` first" if repository.missing_artifacts()
               else repository.unknown_variant(args.variant))
    if problem is None and args.served_repository is not None and not (args.served_repository / ONNX_MODEL).is_dir():
        problem = f"--served-repository: no model repository with {ONNX_MODEL} at {args.served_repository}"
    elif problem is None and (args.seconds <= 0 or args.inprocess_s <= 0):
        problem = "--seconds and --inprocess-s must be > 0"
    if problem:
        print(f"{PREFIX}: {problem}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or settings.results_dir(f"lone-client-{stamp:%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    record = measure(repository, args.variant, args.seconds, args.inprocess_s, out, args.served_repository)
    record["command"] = "resnet18-kit " + shlex.join(sys.argv[1:])
    (out / "lone_client.json").write_text(json.dumps(record, indent=2) + "\n")
    s = record["served"]
    print(f"served ({args.variant}, gRPC, 1 client, {args.seconds:g} s): {s['requests']} requests, "
          f"p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms, max {s['max_ms']:.1f} ms")
    print(f"in-process batch 1: p99 {record['inprocess_before']['p99_ms']:.1f} / "
          f"{record['inprocess_after']['p99_ms']:.1f} ms (before / after)")
    for check in record["checks"]:
        print(f"  {'met   ' if check['met'] else 'MISSED'} {check['name']}: {check['measured']}")
    print(f"{PREFIX}: {shown(out / 'lone_client.json')}", file=sys.stderr)
    return 0
