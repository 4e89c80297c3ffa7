"""The GPU table in one command, on a bare GPU machine (python3.12 with torch; no tritonserver, tritonclient or
perf_analyzer, no internet), from the one file `resnet18-kit bench gpu-pack` wrote here:

    python3 resnet18_kit_gpu.pyz --out DIR [--dry-run]      # on the GPU machine: the same as
    resnet18-kit bench gpu --bundle resnet18_kit_gpu.pyz --out DIR [--dry-run] [--work DIR] [--budget-s 480]

Steps, in order, each logged with a UTC timestamp when it starts and ends, each bounded in time (STEPS;
the whole run by --budget-s: past it the server is stopped, the results written, exit status 1):
  unpack       the payload into --work (default: a temporary folder, removed at the end)
  environment  the machine, nvidia-smi, torch.cuda, onnxruntime's providers, ldd of tritonserver, of this
               Python's Python-backend stub (libpython) and of perf_analyzer
  export       ResNet-18 (seeded random init: speed does not depend on the weights) traced to TorchScript
  inprocess    the in-process bar on the same GPU: TorchScript, pinned memory, 1-4 CUDA streams (gpu_bar.py)
  serve        the bundle's tritonserver 2.51, --model-config-name gpu_python (KIND_GPU), on free ports
  tensors      perf_analyzer: UINT8 pixel tensors to resnet18_torchscript, gRPC, concurrency 1 to 64
  main_job     perf_analyzer: the sample photos through the resnet18 ensemble, gRPC, concurrency 1 to 64
  stop         the server stopped, its shared memory removed
A step that fails records why (one line, in the JSON and the log) and the run goes on; a step with nothing
to do (no server to measure) is "skipped". --dry-run needs no GPU: every step runs on the CPU with short
loads (the network's instances KIND_CPU), the in-process bar's code runs at batch 1-2 and counts as skipped.

Writes into --out (what comes back, a few files well under 16 MiB each): gpu.json (infer/s and p99 per
concurrency, the best served / in-process ratio, the main job's img/s and the stage that bounds it, wall
seconds per step), summary.md (the same, short), run.log, tritonserver.log (its last 4 MiB).
Exit status 0 when no step failed, 1 when one did, 2 for a bad --bundle, --out, --work or --budget-s.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from resnet18_kit.contract import PREPROCESS_MODEL, TORCHSCRIPT_MODEL
from resnet18_kit.settings import Settings
from resnet18_kit.tools.bench import gpu_steps
from resnet18_kit.tools.bench.gpu_report import summary_markdown
from resnet18_kit.tools.bench.gpu_steps import GpuContext, Skipped

#: (step, its bound in seconds), in order. Their sum is above --budget-s: a step gets what is left of the
#: run's budget when that is less (RESERVE_S kept back for stopping the server and writing the results).
STEPS = (("unpack", 60), ("environment", 60), ("export", 120), ("inprocess", 100), ("serve", 240),
         ("tensors", 150), ("main_job", 110), ("stop", 40))
#: Steps that are given their deadline (time.monotonic()) to stop starting new work near it.
WITH_DEADLINE = ("inprocess", "serve", "tensors", "main_job")
RESERVE_S = 25.0
DEFAULT_BUDGET_S = 480.0
RESULTS_JSON, SUMMARY_MD, RUN_LOG = "gpu.json", "summary.md", "run.log"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """bench gpu's options."""
    parser.add_argument("--bundle", type=Path, required=True, metavar="FILE",
                        help="the .pyz `resnet18-kit bench gpu-pack` wrote (build/gpu/resnet18_kit_gpu.pyz)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help=f"where {RESULTS_JSON}, {SUMMARY_MD}, {RUN_LOG} and tritonserver.log go (created)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: every step on the CPU with short loads, GPU parts recorded as skipped")
    parser.add_argument("--work", type=Path, metavar="DIR",
                        help="unpack here and keep it (a new or empty folder; default: a temporary one, removed)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="S",
                        help=f"the whole run's limit in seconds (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--preprocess-instances", type=int, metavar="N",
                        help="serve preprocess with N CPU instances (default: its config's 3, sized for 2 cores; "
                             "the main job on a many-core GPU host is bound by it)")
    parser.add_argument("--network-instances", type=int, metavar="N",
                        help="serve the network with N KIND_GPU instances (default: the gpu_python config's 2)")


def argument_problem(args: argparse.Namespace) -> str | None:
    """The one line a bad option gets (exit 2), or None."""
    if not args.bundle.is_file():
        return f"--bundle {args.bundle}: no such file (resnet18-kit bench gpu-pack writes it)"
    try:
        gpu_steps.read_manifest(args.bundle)
    except (ValueError, OSError) as exc:
        return f"--bundle {exc}"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out}: not a folder"
    if args.work is not None and args.work.exists() and (not args.work.is_dir() or any(args.work.iterdir())):
        return f"--work {args.work}: not a new or empty folder"
    if not args.budget_s > 0:
        return f"--budget-s {args.budget_s:g}: give seconds above 0"
    for option in ("preprocess_instances", "network_instances"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            return f"--{option.replace('_', '-')} {getattr(args, option)}: give a count of 1 or more"
    return None


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Run the steps (module doc); the exit status."""
    problem = argument_problem(args)
    if problem:
        print(f"bench gpu: {problem}", file=sys.stderr)
        return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        work = args.work or Path(tempfile.mkdtemp(prefix="resnet18_kit_gpu-"))
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"bench gpu: --out or --work: {exc.strerror or exc}: {exc.filename}", file=sys.stderr)
        return 2
    context = GpuContext(bundle=args.bundle.resolve(), out=args.out.resolve(), work=work.resolve(),
                         dry_run=args.dry_run, instances={PREPROCESS_MODEL: args.preprocess_instances,
                                                          TORCHSCRIPT_MODEL: args.network_instances})
    cleanup = (lambda: None) if args.work else (lambda: shutil.rmtree(work, ignore_errors=True))
    try:
        return GpuRun(context, args.budget_s, cleanup).run()
    finally:
        cleanup()


def bounded(function: Callable[[], dict | None], timeout_s: float) -> dict | None:
    """function() on a thread of its own, waited for up to `timeout_s` seconds: its result or its exception;
    TimeoutError when it has not ended by then (it is left running, as a daemon thread)."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
    thread = threading.Thread(target=target, daemon=True, name="bench-gpu-step")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no end after {timeout_s:.0f} s, the step's bound; left running")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def one_line(exc: BaseException) -> str:
    """`exc` as one line: its type and the first line of its message, at most 300 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class GpuRun:
    """The steps run in order with their bounds, the run's budget watched by a timer, the record written
    after every step (so a run cut short still leaves its JSON)."""

    def __init__(self, context: GpuContext, budget_s: float, cleanup: Callable[[], None]):
        self.context, self.budget_s, self.cleanup = context, budget_s, cleanup
        self.started = time.monotonic()
        self.lock = threading.RLock()
        self.current: str | None = None
        self.record: dict = {"command": "resnet18-kit bench gpu", "dry_run": context.dry_run,
                             "started_utc": utc_now(), "bundle": context.bundle.name, "budget_s": budget_s,
                             "steps": [], "problems": []}

    def run(self) -> int:
        handler = logging.FileHandler(self.context.out / RUN_LOG, mode="w")
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%SZ")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
        logging.getLogger("resnet18_kit").addHandler(handler)
        watchdog = threading.Timer(self.budget_s, self.budget_spent)
        watchdog.daemon = True
        watchdog.start()
        try:
            for name, bound_s in STEPS:
                self.step(name, bound_s)
        finally:
            watchdog.cancel()
            server = self.context.server
            if server is not None and server.running:  # interrupted (Ctrl-C, SIGTERM) before the stop step
                server.stop(drain_s=0)
            with self.lock:
                self.finish()
            logging.getLogger("resnet18_kit").removeHandler(handler)
            handler.close()
        failed = [step["name"] for step in self.record["steps"] if step["status"] == "failed"]
        log.info("bench gpu: %s in %.0f s; %s", self.context.out / SUMMARY_MD, self.record["wall_s"],
                 f"failed: {', '.join(failed)}" if failed else "no step failed")
        return 1 if failed else 0

    def step(self, name: str, bound_s: float) -> None:
        """Run step `name` within min(bound_s, what the budget leaves), and record it."""
        left_s = self.budget_s - (time.monotonic() - self.started) - (0.0 if name == "stop" else RESERVE_S)
        bound_s = min(bound_s, left_s)
        unpacked = any(s["name"] == "unpack" and s["status"] == "ok" for s in self.record["steps"])
        started = time.monotonic()
        result, status, reason = None, "ok", None
        if name != "unpack" and not unpacked:
            status, reason = "skipped", "the bundle was not unpacked"
        elif bound_s <= 1:
            status, reason = "skipped", f"the run's --budget-s {self.budget_s:g} was spent"
        else:
            log.info("[%s] started (bound %.0f s)", name, bound_s)
            self.current = name
            deadline = started + bound_s
            function = getattr(gpu_steps, name)
            try:
                result = bounded((lambda: function(self.context, deadline)) if name in WITH_DEADLINE
                                 else (lambda: function(self.context)), bound_s)
            except Skipped as exc:
                status, reason = "skipped", str(exc)
            except Exception as exc:  # noqa: BLE001 - a failed step is recorded, the run goes on
                status, reason = "failed", one_line(exc)
        with self.lock:
            self.current = None
            entry = {"name": name, "status": status, "seconds": round(time.monotonic() - started, 1)}
            self.record["steps"].append({**entry, **({"reason": reason} if reason else {})})
            if result is not None:
                self.record[name] = result
            if name == "environment":
                for problem in (self.context.blocker, (result or {}).get("shm_warning")):
                    if problem:
                        self.record["problems"].append(problem)
                        log.warning("[environment] %s", problem)
            self.write_json()
        level = logging.WARNING if status == "failed" else logging.INFO
        log.log(level, "[%s] %s in %.1f s%s", name, status, entry["seconds"], f": {reason}" if reason else "")

    def budget_spent(self) -> None:
        """The watchdog: the run's budget is spent. Record it against the running step, stop the server,
        write the results, remove a temporary work folder and end the process (exit status 1)."""
        with self.lock:
            name = self.current or "between steps"
            log.error("[%s] the run's --budget-s %.0f is spent: stopping the server, writing the results",
                      name, self.budget_s)
            self.record["steps"].append({"name": name, "status": "failed", "seconds": None,
                                         "reason": f"the run's --budget-s {self.budget_s:g} was spent in this step"})
            server = self.context.server
            if server is not None and server.running:
                server.stop(drain_s=0)
            self.finish()
        self.cleanup()
        logging.shutdown()
        os._exit(1)

    def write_json(self) -> None:
        self.record["wall_s"] = round(time.monotonic() - self.started, 1)
        self.record["headline"] = headline(self.record)
        (self.context.out / RESULTS_JSON).write_text(json.dumps(self.record, indent=1) + "\n")

    def finish(self) -> None:
        """The final gpu.json, summary.md and the server log's tail, in --out."""
        self.write_json()
        (self.context.out / SUMMARY_MD).write_text(summary_markdown(self.record))
        gpu_steps.keep_server_log(self.context)


def headline(record: dict) -> dict:
    """The figures the run is for: best served tensors (infer/s, concurrency, p99), the in-process bar,
    their ratio, and the main job's best img/s with the stage that bounds it (None where not measured)."""
    served = (record.get("tensors") or {}).get("best") or {}
    bar = (record.get("inprocess") or {}).get("bar") or {}
    main = record.get("main_job") or {}
    photos = main.get("best") or {}
    ratio = served["infer_per_s"] / bar["img_per_s"] if served and bar else None
    return {"served_infer_per_s": served.get("infer_per_s"), "served_concurrency": served.get("concurrency"),
            "served_p99_ms": served.get("p99_ms"), "inprocess_img_per_s": bar.get("img_per_s"),
            "served_over_inprocess": None if ratio is None else round(ratio, 3),
            "main_job_img_per_s": photos.get("infer_per_s"), "main_job_concurrency": photos.get("concurrency"),
            "main_job_bound_by": main.get("bound_by")}


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
