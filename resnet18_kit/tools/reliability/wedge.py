"""A wedged server under `serve`: alive, perhaps answering its health checks, but serving no inference.

Two ways to wedge it on purpose (what a corrupt heap or stuck threads look like from outside):
  * "stubs": SIGSTOP every Python-backend stub. tritonserver answers /v2/health/live and /ready with 200;
    every inference waits or fails;
  * "server": SIGSTOP tritonserver itself. Nothing answers, and the liveness check alone would wait
    `unresponsive_after_s` (30 s).
`wedge` does each in turn on one `serve`, and measures how long serve's supervisor takes to report the
fault ("wedged: ...") and to have a new server ready, and whether /v2/health/ready still said 200 during
the wedge.
"""
from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

from resnet18_kit.tools.reliability.lifecycle import ServeRun, wait_for_restart
from resnet18_kit.tools.reliability.sigterm import serve_command
from resnet18_kit.server.config import ServerConfig

CASES = ("stubs", "server")
#: How long `wedge` waits for serve to report the fault.
DETECT_BOUND_S = 60.0


def ready_status(http_url: str) -> str:
    """What GET /v2/health/ready answers within 1 s: the status code, or "no answer"."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=1.0) as response:
            return str(response.status)
    except urllib.error.HTTPError as error:
        return str(error.code)
    except OSError:
        return "no answer"


def wedge(config: ServerConfig, work_dir: Path, cases: tuple[str, ...] = CASES) -> list[dict]:
    """Start one `serve` on `config`, then for each of `cases` (CASES) in turn: wedge its server that way,
    measure, and let the supervisor's new server settle before the next. One record per case: {"case",
    "ready_during" (what /v2/health/ready answered 1 s into the wedge), "detected_s" (seconds from the
    SIGSTOP to serve's fault line), "fault" (that line), "serving_again_s" (seconds from the SIGSTOP to
    the new server ready), "exit_status" (serve's, after SIGTERM at the end), "leftovers"}; a case whose
    fault is never reported ends the run (the later cases are not tried). ValueError for an unknown case."""
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        raise ValueError(f"unknown wedge case {unknown[0]!r}; one of {', '.join(CASES)}")
    run = ServeRun(config, work_dir, serve_command(config, work_dir / "tritonserver.log"))
    records: list[dict] = []
    try:
        run.wait_ready()
        for case in cases:
            records.append(_wedge_once(run, config, case))
            if records[-1]["serving_again_s"] is None:
                break
    finally:
        stopped = run.terminate()
        for record in records:
            record.update(stopped)
    return records


def _wedge_once(run: ServeRun, config: ServerConfig, case: str) -> dict:
    """Wedge the server `run` supervises as `case` says; the record of `wedge` without the stop's fields."""
    record: dict = {"case": case, "serving_again_s": None}
    time.sleep(2.0)  # a few probe rounds with progress
    lines_before = len(run.stderr_lines())
    targets = run.stub_pids() if case == "stubs" else [run.server_pid()]
    stopped_at = time.monotonic()
    for pid in targets:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(1.0)
    record["ready_during"] = ready_status(config.http_url)
    deadline = stopped_at + DETECT_BOUND_S
    fault = None
    while fault is None and time.monotonic() < deadline:
        fault = next((line for line in run.stderr_lines()[lines_before:] if line.startswith("serve: fault: ")), None)
        time.sleep(0.05)
    record["detected_s"] = round(time.monotonic() - stopped_at, 2) if fault else None
    record["fault"] = fault
    if fault:
        wait_for_restart(run, lines_before)
        record["serving_again_s"] = round(time.monotonic() - stopped_at, 2)
    return record


def table_row(result: dict) -> list:
    """One row of the reliability table."""
    what = "every stub" if result["case"] == "stubs" else "tritonserver"
    return [f"wedged server: SIGSTOP of {what}, supervised", "--scenario wedge", "", "", "", "",
            f"wedge reported {result.get('detected_s')} s, serving again {result.get('serving_again_s')} s "
            f"after the SIGSTOP", f"/v2/health/ready said {result.get('ready_during')} meanwhile; serve exit "
                                   f"{result.get('exit_status')}, left running: {result.get('leftovers') or 'none'}"]
