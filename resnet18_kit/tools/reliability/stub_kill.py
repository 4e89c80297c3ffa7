"""A Python-backend stub process SIGKILLed under load, with the supervisor (server.supervisor) serving:
the errors clients see, how soon the fault is detected and how soon requests are answered again."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

from resnet18_kit.contract import ONNX_MODEL
from resnet18_kit.tools.load.outcomes import ANSWERED, ERROR, LOST, WRONG, summarize
from resnet18_kit.tools.reliability import RELIABILITY_REPOSITORY
from resnet18_kit.tools.reliability.loads import TensorLoad, ensemble_load, reference_answers
from resnet18_kit.tools.reliability.senders import SteadyLoad, recovered_at
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.supervisor import Supervisor, SupervisorPolicy


def stub_kill(supervisor: Supervisor, model: str, load: TensorLoad, protocol: str = "grpc",
              after_recovery: int = 20, interval_s: float = 0.05) -> dict:
    """With `supervisor` (started) serving, send `load` one request at a time every `interval_s`
    seconds, SIGKILL the stub of `model`'s first instance, and measure until `after_recovery` requests
    in a row are answered after the restart (or the supervisor's ready timeout + 60 s passed).

    Returns {"model", "instance", "protocol", "detected_after_s" (kill to the supervisor's fault event),
    "recovered_after_s" (kill to the first answer after the last failure), "restarts", "total" and
    "after_kill" (load.outcomes.summarize), "errors_seen" ([{"status", "message"}], distinct),
    "answered_in_a_row_at_end"}; times in seconds, None when it did not happen.
    """
    instance, pid = next((name, pid) for name, pid in supervisor.server.stub_processes().items()
                         if name.startswith(model))
    restarts_before = supervisor.restarts
    with SteadyLoad(supervisor.config, protocol, load, interval_s) as steady:
        deadline = time.monotonic() + 30
        while sum(o.kind == ANSWERED for _, o in steady.outcomes) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = killed_at + supervisor.policy.ready_timeout_s + 60
        while time.monotonic() < deadline:
            tail = [o for t, o in steady.outcomes if t > killed_at][-after_recovery:]
            if supervisor.restarts > restarts_before and len(tail) == after_recovery and \
                    all(o.kind == ANSWERED for o in tail):
                break
            time.sleep(0.1)
    after_kill = [(t, o) for t, o in steady.outcomes if t > killed_at]
    failed = [o for _, o in after_kill if o.kind != ANSWERED]
    first_good_after = recovered_at(after_kill)
    killed_at_s = killed_at - supervisor._origin  # on the clock of the supervisor's events
    fault = next((e for e in supervisor.events if e.kind == "fault" and e.at_s >= killed_at_s), None)
    messages = sorted({(o.status, o.message.split(" (")[0][:100]) for o in failed}, key=str)
    in_a_row = 0
    for _, outcome in reversed(after_kill):
        if outcome.kind != ANSWERED:
            break
        in_a_row += 1
    return {
        "model": model, "instance": instance, "protocol": protocol,
        "detected_after_s": round(fault.at_s - killed_at_s, 2) if fault else None,
        "recovered_after_s": round(first_good_after - killed_at, 2) if first_good_after else None,
        "restarts": supervisor.restarts - restarts_before,
        "total": summarize([o for _, o in steady.outcomes], steady.sent),
        "after_kill": summarize([o for _, o in after_kill], len(after_kill)),
        "errors_seen": [{"status": s, "message": m} for s, m in messages],
        "answered_in_a_row_at_end": in_a_row,
    }


def supervised_stub_kill(repository: Path, out_dir: Path, policy: SupervisorPolicy) -> dict:
    """The command's run: the shipped model repository `repository` under a Supervisor with `policy` (log in `out_dir`), the
    ensemble's photos one at a time over gRPC, resnet18_onnx's stub killed; stub_kill's result with
    "supervisor_events"."""
    config = config_on_free_ports(model_repository=repository, extra_model_repositories=(RELIABILITY_REPOSITORY,))
    with Supervisor(config, policy, log_path=out_dir / "tritonserver-stub-kill.log") as supervisor:
        load = reference_answers(config, ensemble_load())
        result = stub_kill(supervisor, ONNX_MODEL, load, protocol="grpc", after_recovery=20)
        result["supervisor_events"] = [asdict(e) for e in supervisor.events]
    return result


def table_row(result: dict) -> list:
    """The table's row of supervised_stub_kill's result."""
    total = result["total"]
    return [f"SIGKILL of the {result['model']} stub under load (ensemble, gRPC), supervised",
            "--scenario stub-kill", total["sent"], total[ANSWERED], f"{total[ERROR]} failed",
            total[LOST] + total[WRONG], f"detected {result['detected_after_s']} s, answering again "
            f"{result['recovered_after_s']} s after the kill",
            f"{result['restarts']} restart; then {result['answered_in_a_row_at_end']} answered in a row"]
