"""Where the Python-backend stubs spend their time under load, by py-spy (resnet18-kit bench stub-profile).

Starts the embedded tritonserver with one config of the model, keeps perf_analyzer running at one
concurrency (gRPC, system shared memory, as `resnet18-kit bench run`), and meanwhile samples every stub process
with `py-spy record --idle` for `--seconds`. Each sample is one moment of the stub's main thread:

  * in ONNX Runtime (`Session.run`) or TorchScript (the model's forward): compute;
  * elsewhere in `execute()`: the Python work around the model (reading inputs, concatenating, splitting,
    building responses);
  * no Python frame: the stub is outside Python, i.e. waiting for Triton to hand it the next batch or
    moving tensors through its shared memory (the part of the round trip the stub itself runs).

Prints, per stub, the share of samples in each class (the busy share of an instance is the first two).
py-spy reads the stub's embedded CPython 3.11 from outside; it needs ptrace (root here, or
`kernel.yama.ptrace_scope=0`). Raw py-spy output is left in --out (default <results>/stub-profile).

    resnet18-kit bench stub-profile --config throughput --concurrency 64 --seconds 20
"""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from resnet18_kit.tools.load.perf_analyzer import RESNET18_LOGITS_BYTES, LoadSpec, run_level
from resnet18_kit.contract import ONNX_MODEL
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.settings import Settings

log = logging.getLogger(__name__)
PREFIX = "resnet18-kit bench stub-profile"

#: Frames that are the model itself, not the Python around it.
COMPUTE_FRAMES = ("Session.run", "torch/nn/modules", "RecursiveScriptModule")


def classify(stack: str) -> str:
    """'compute', 'python' or 'outside python' for one py-spy raw stack ("frame;frame;..." or empty)."""
    if not stack.strip():
        return "outside python"
    return "compute" if any(frame in stack for frame in COMPUTE_FRAMES) else "python"


def summarize(raw_path: Path) -> Counter:
    """Samples per class from a `py-spy record -f raw` file (lines "stack count"; idle stacks may be
    empty or consist of the thread name only)."""
    shares: Counter = Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = ";".join(f for f in stack.split(";") if "(" in f)  # drop "thread (0x..)"-only entries
        shares[classify(frames)] += int(count)
    return shares


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """stub-profile's options."""
    parser.add_argument("--model", default=ONNX_MODEL, help=f"model to load and profile (default {ONNX_MODEL})")
    parser.add_argument("--config", default="throughput",
                        help="config variant (default throughput; default = config.pbtxt)")
    parser.add_argument("--concurrency", type=int, default=64, help="perf_analyzer's requests in flight (default 64)")
    parser.add_argument("--seconds", type=float, default=20.0, help="py-spy sampling time, s (default 20)")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default 100)")
    parser.add_argument("--out", type=Path, help="folder for the raw py-spy output (default <results>/stub-profile)")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Profile (module doc); exit status 0, 2 for a bad command line or no py-spy."""
    py_spy = Path(sys.executable).parent / "py-spy"
    variants = settings.repository.variant_names(args.model)
    problem = None
    if not py_spy.is_file():
        problem = f"no py-spy at {py_spy} (pip install py-spy)"
    elif args.config not in variants:
        problem = f"--config {args.config!r}: no such config of {args.model} (one of {', '.join(variants)})"
    elif args.concurrency < 1 or args.seconds <= 0 or args.rate < 1:
        problem = "--concurrency and --rate must be >= 1, --seconds > 0"
    if problem:
        print(f"{PREFIX}: {problem}", file=sys.stderr)
        return 2
    args.out = args.out or settings.results_dir("stub-profile")
    args.out.mkdir(parents=True, exist_ok=True)
    config = config_on_free_ports(model_config_name=None if args.config == "default" else args.config,
                                  model_repository=settings.model_repository)
    log.info("starting tritonserver with %s, then perf_analyzer at concurrency %d", args.config, args.concurrency)
    with EmbeddedTritonServer(config, log_path=args.out / "tritonserver.log") as server:
        # perf_analyzer runs past the sampling window: warm-up, then at least the sampled seconds.
        load = LoadSpec("concurrency", (args.concurrency,), shared_memory="system",
                        output_shm_bytes=RESNET18_LOGITS_BYTES, measurement_ms=int((args.seconds + 10) * 1000),
                        max_trials=1, stability_pct=100)
        loader = threading.Thread(target=run_level, daemon=True,
                                  args=(args.model, config.grpc_url, "grpc", load, args.concurrency, args.out / "load"))
        loader.start()
        time.sleep(8.0)  # past perf_analyzer's start and the first batches
        stubs = {name: pid for name, pid in server.stub_processes().items() if name.startswith(args.model + "_")}
        records = {name: subprocess.Popen([str(py_spy), "record", "--idle", "-f", "raw", "-r", str(args.rate),
                                           "-d", str(int(args.seconds)), "-p", str(pid),
                                           "-o", str(args.out / f"{name}.txt")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                   for name, pid in sorted(stubs.items())}
        log.info("py-spy on %d stub(s) for %g s", len(records), args.seconds)
        for process in records.values():
            process.wait()
        loader.join()
    print(f"{args.model} config {args.config}, perf_analyzer concurrency {args.concurrency}, "
          f"py-spy --idle {args.rate}/s for {args.seconds:g} s per stub:")
    for name in records:
        shares = summarize(args.out / f"{name}.txt")
        total = sum(shares.values()) or 1
        print(f"  {name}: {total} samples; " + ", ".join(
            f"{kind} {shares[kind] / total:.0%}" for kind in ("compute", "python", "outside python")))
    return 0
