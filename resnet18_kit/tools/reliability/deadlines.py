"""Deadlines and cancellation under overload: the tables of docs/records/reliability.md (deadlines).

Two measurements against `resnet18-kit serve` (default config), each on a fresh serve:
  * `storm_runs`: a raw gRPC client with short deadlines (reliability.deadline_storm), `rounds` rounds per
    deadline range, sent to serve's gRPC port: through the kit's gRPC guard (the default), or straight
    to tritonserver (`--no-grpc-guard`), where Triton 2.51 crashes;
  * `classify_runs`: the kit's own `resnet18-kit classify --concurrency 128 --deadline-s 1` over a folder
    of photos, `runs` times per protocol, straight to tritonserver (no guard: the client alone must not
    trigger the crash). A run is clean when it exits 0 or 1 (1: some images refused), every image has
    one line (classified, or refused with its reason), and nothing on stderr is a traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from resnet18_kit.tools.reliability.deadline_storm import rounds
from resnet18_kit.tools.reliability.lifecycle import ServeRun
from resnet18_kit.tools.reliability.sigterm import environment_without_admin_key, serve_command
from resnet18_kit.server.config import ServerConfig

#: The deadline ranges of the storm, milliseconds: mostly expiring in the queue, and mostly while running.
DEADLINE_RANGES_MS = ((1.0, 50.0), (50.0, 400.0))
#: classify's options in the runs: four times the requests the ensemble's queues and batches hold, and a
#: deadline shorter than the queue's wait at that load.
CLASSIFY_CONCURRENCY = 128
CLASSIFY_DEADLINE_S = 1.0
#: A classify run still going after this long is a hang.
CLASSIFY_BOUND_S = 300.0


def serve(config: ServerConfig, work_dir: Path, guard: bool) -> ServeRun:
    """`resnet18-kit serve` on `config`, with or without the gRPC guard, restarts allowed without bound
    (the storm may crash it every round), ready."""
    extra = ("--max-restarts", "1000") + (() if guard else ("--no-grpc-guard",))
    run = ServeRun(config, work_dir, serve_command(config, work_dir / "tritonserver.log", extra))
    run.wait_ready()
    return run


def storm_runs(config: ServerConfig, work_dir: Path, photos: list[bytes], rounds_per_range: int,
               guard: bool) -> list[dict]:
    """For each of DEADLINE_RANGES_MS, `rounds_per_range` storms against one serve (guarded or not):
    deadline_storm.rounds' record plus "target", "deadline_ms" and serve's exit."""
    results = []
    for low, high in DEADLINE_RANGES_MS:
        run = serve(config, work_dir / f"storm-{'guard' if guard else 'raw'}-{low:g}-{high:g}", guard)
        try:
            record = rounds(run, photos, rounds_per_range, deadline_ms=(low, high))
        finally:
            record_stop = run.terminate()
        results.append({"target": "gRPC guard" if guard else "tritonserver (no guard)",
                        "deadline_ms": [low, high], **record, **record_stop})
    return results


def jpeg_folder(folder: Path, count: int = 300) -> Path:
    """`folder` with `count` JPEGs (quality 90) made from the sample photos, each a few pixels smaller
    than the last of the same photo so that no two files are equal; written once."""
    from PIL import Image

    from resnet18_kit.client.samples import sample_photos

    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.jpg"))) >= count:
        return folder
    photos = [Image.open(path).convert("RGB") for path in sample_photos()]
    for i in range(count):
        photo = photos[i % len(photos)]
        shrink = i // len(photos)
        photo.resize((photo.width - shrink, photo.height - shrink)).save(folder / f"photo-{i:03d}.jpg", quality=90)
    return folder


def classify_once(config: ServerConfig, folder: Path, protocol: str) -> dict:
    """One `resnet18-kit classify --json` run over `folder` (CLASSIFY_CONCURRENCY, CLASSIFY_DEADLINE_S):
    {"exit_status" (None: hung), "images", "classified", "refused" (an error line with its reason),
    "unaccounted" (images without a line), "traceback" (True when stderr has one), "reasons" (error
    message -> count), "seconds"}."""
    command = [sys.executable, "-m", "resnet18_kit", "classify", "--json", "--no-progress", "--url",
               config.url(protocol), "--protocol", protocol, "--concurrency", str(CLASSIFY_CONCURRENCY),
               "--deadline-s", str(CLASSIFY_DEADLINE_S), str(folder)]
    images = sum(1 for path in folder.iterdir() if path.is_file())
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CLASSIFY_BOUND_S,
                              env=environment_without_admin_key())
    except subprocess.TimeoutExpired as expired:
        return {"exit_status": None, "images": images, "classified": 0, "refused": 0, "unaccounted": images,
                "traceback": "Traceback" in (expired.stderr or b"").decode(errors="replace"), "reasons": {},
                "seconds": CLASSIFY_BOUND_S}
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    reasons: dict[str, int] = {}
    for line in lines:
        if "error" in line:
            reason = line["error"].split("] ")[-1][:90]
            reasons[reason] = reasons.get(reason, 0) + 1
    classified = sum("predictions" in line for line in lines)
    refused = sum("error" in line and bool(line["error"]) for line in lines)
    return {"exit_status": done.returncode, "images": images, "classified": classified, "refused": refused,
            "unaccounted": images - classified - refused, "traceback": "Traceback" in done.stderr,
            "reasons": reasons, "seconds": round(time.monotonic() - started, 1)}


def classify_runs(config: ServerConfig, work_dir: Path, folder: Path, runs: int) -> list[dict]:
    """`runs` classify runs per protocol (gRPC, then HTTP) against one serve without the guard; per
    protocol {"protocol", "runs", "crashes" (serve's fault lines), "hangs", "unaccounted", "tracebacks",
    "bad_exits" (not 0 or 1), "images", "classified", "refused", "reasons", serve's exit}."""
    run = serve(config, work_dir / "classify", guard=False)
    results = []
    try:
        for protocol in ("grpc", "http"):
            lines_before = len(run.stderr_lines())
            outcomes = [classify_once(config, folder, protocol) for _ in range(runs)]
            faults = [line for line in run.stderr_lines()[lines_before:] if line.startswith("serve: fault: ")]
            reasons: dict[str, int] = {}
            for outcome in outcomes:
                for reason, count in outcome["reasons"].items():
                    reasons[reason] = reasons.get(reason, 0) + count
            results.append({
                "protocol": protocol, "runs": runs, "crashes": len(faults), "faults": faults,
                "hangs": sum(o["exit_status"] is None for o in outcomes),
                "unaccounted": sum(o["unaccounted"] for o in outcomes),
                "tracebacks": sum(o["traceback"] for o in outcomes),
                "bad_exits": sum(o["exit_status"] not in (0, 1, None) for o in outcomes),
                "images": sum(o["images"] for o in outcomes), "classified": sum(o["classified"] for o in outcomes),
                "refused": sum(o["refused"] for o in outcomes), "reasons": reasons,
                "seconds": [o["seconds"] for o in outcomes]})
    finally:
        final = run.terminate()
    for result in results:
        result.update(final)
    return results


STORM_COLUMNS = ("target", "deadlines", "rounds", "requests", "crashes", "hangs", "lost", "client saw")
CLASSIFY_COLUMNS = ("protocol", "runs", "images", "classified", "refused (reason given)", "unaccounted",
                    "crashes", "hangs", "tracebacks")


def storm_cells(result: dict) -> list:
    counts = result["counts"]
    low, high = result["deadline_ms"]
    return [result["target"], f"{low:g}-{high:g} ms", result["rounds"], result["sent"], result["crashes"],
            result["hangs"], result["lost"], ", ".join(f"{kind} {n}" for kind, n in counts.items() if n)]


def classify_cells(result: dict) -> list:
    return [result["protocol"], result["runs"], result["images"], result["classified"], result["refused"],
            result["unaccounted"], result["crashes"], result["hangs"], result["tracebacks"]]
