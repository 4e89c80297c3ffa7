"""The request that aborts Triton 2.51: one HTTP/JSON request whose shape claims 10^12 elements, sent
while other requests flow, with the supervisor (server.supervisor) bringing the server back."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from resnet18_kit.tools.load.outcomes import ANSWERED, ERROR, LOST, WRONG, summarize
from resnet18_kit.tools.reliability import ECHO_MODEL, RELIABILITY_REPOSITORY
from resnet18_kit.tools.reliability.loads import onnx_load, reference_answers
from resnet18_kit.tools.reliability.senders import SteadyLoad, http_raw, recovered_at
from resnet18_kit.server.config import ServerConfig, config_on_free_ports
from resnet18_kit.server.supervisor import Supervisor, SupervisorPolicy

#: An HTTP/JSON inference request whose `shape` claims 10^12 x 4 elements while `data` holds 4: Triton
#: 2.51 sizes a buffer from the shape before checking it, throws std::bad_alloc and aborts (the whole
#: server, every model). Binary-data HTTP requests and gRPC check the byte size first and get 400 /
#: INVALID_ARGUMENT. Upstream fix: triton-inference-server/server PR #8174 (after 2.51).
CRASHING_JSON_BODY = b'{"inputs":[{"name":"x","shape":[1000000000000,4],"datatype":"FP32","data":[1,2,3,4]}]}'


def send_crashing_request(config: ServerConfig, model: str = ECHO_MODEL) -> str:
    """Send CRASHING_JSON_BODY to `model`; what came back, as text (the server usually closes the
    connection as it dies: the exception's type and message then)."""
    try:
        status, text = http_raw(config, f"/v2/models/{model}/infer", CRASHING_JSON_BODY)
        return f"HTTP {status}: {text[:120]}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def supervised_crash(repository: Path, out_dir: Path, policy: SupervisorPolicy, settle_s: float = 3.0) -> dict:
    """The command's run: the shipped model repository `repository` and reliability_echo under a Supervisor with `policy` (log
    in `out_dir`), resnet18_onnx requests one at a time over gRPC; after 2 s the crashing request, then
    requests go on until the restarted server is ready and `settle_s` seconds more.

    Returns {"reply" (send_crashing_request's), "restarts", "total" (load.outcomes.summarize),
    "recovered_after_s" (from the crashing request to the first answer after the last failure; None
    if none), "supervisor_events"}.
    """
    config = config_on_free_ports(model_repository=repository, extra_model_repositories=(RELIABILITY_REPOSITORY,))
    with Supervisor(config, policy, log_path=out_dir / "tritonserver-crash.log") as supervisor:
        with SteadyLoad(config, "grpc", reference_answers(config, onnx_load())) as steady:
            time.sleep(2)
            sent_at = time.monotonic()
            reply = send_crashing_request(config, ECHO_MODEL)
            deadline = time.monotonic() + policy.ready_timeout_s
            while time.monotonic() < deadline and not (supervisor.restarts and supervisor.events[-1].kind == "ready"):
                time.sleep(0.1)
            time.sleep(settle_s)
        good = recovered_at([(t, o) for t, o in steady.outcomes if t > sent_at])
        return {"reply": reply, "restarts": supervisor.restarts,
                "total": summarize([o for _, o in steady.outcomes], steady.sent),
                "recovered_after_s": round(good - sent_at, 2) if good else None,
                "supervisor_events": [asdict(e) for e in supervisor.events]}


def table_row(result: dict) -> list:
    """The table's row of supervised_crash's result."""
    total = result["total"]
    return ["one HTTP/JSON request with shape [10^12, 4] (aborts Triton 2.51), supervised",
            "--scenario crash-request", total["sent"], total[ANSWERED], f"{total[ERROR]} failed",
            total[LOST] + total[WRONG], f"answering again {result['recovered_after_s']} s after it",
            f"{result['restarts']} restart (tritonserver exited on std::bad_alloc)"]
