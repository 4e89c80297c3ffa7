"""What the live compose scenarios ask of a running project: is its gRPC endpoint ready (HTTP readiness is
server.embedded.answers_ready), wait until something holds, kill a container's main process as a crash
would, one line of a load's counts.

Used by tests/test_compose_live.py (the default services) and tests/test_compose_fleet.py (the fleet
profile); every project they start has its own name and free ports on 127.0.0.1.
"""
from __future__ import annotations

import os
import signal
import time

from resnet18_kit.containers.compose import ComposeProject
from resnet18_kit.tools.reliability.fleet_load import Tally

#: docker-compose.yaml's stop_grace_period for Triton (seconds).
GRACE_S = 40.0
#: Seconds a replica or container may take to come back after its process was killed (2-core machine,
#: the other containers serving load meanwhile).
BACK_WITHIN_S = 90.0


def grpc_ready(url: str) -> bool:
    """True when the gRPC endpoint `url` (host:port) says the server is ready within 1 s."""
    import tritonclient.grpc as grpcclient

    try:
        with grpcclient.InferenceServerClient(url) as client:
            return client.is_server_ready(client_timeout=1.0)
    except Exception:  # refused, 503 from HAProxy: not yet
        return False


def wait_for(what: str, condition, timeout_s: float, poll_s: float = 0.1) -> float:
    """Seconds until condition() is true, polled every `poll_s`; AssertionError naming `what` after
    `timeout_s` seconds."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def counts(tally: Tally) -> str:
    """One line: sent, answered, refused, failed, lost, tries by kind, and the longest time in seconds
    between two answers."""
    tries = {kind: len(values) for kind, values in sorted(tally.tries.items())}
    times = [at for at, _ in tally.answered_at]
    gap_s = max((b - a for a, b in zip(times, times[1:])), default=float("nan"))
    return (f"sent {tally.sent}, answered {tally.answered}, refused {tally.refused}, failed {tally.failed}, "
            f"lost {tally.lost}; tries {tries}; longest time without an answer {gap_s:.1f} s")


def ready_inside(project: ComposeProject, service: str) -> bool:
    """/v2/health/ready answers 200 inside the service's container (a replica publishes no port)."""
    probe = "import urllib.request as u; u.urlopen('http://localhost:8000/v2/health/ready', timeout=1)"
    result = project.engine.docker("exec", project.container(service), "python", "-c", probe, check=False,
                                   timeout_s=10)
    return result.returncode == 0


def crash(project: ComposeProject, service: str) -> None:
    """SIGKILL of the container's main process from the host, as the kernel's OOM killer or a crash would
    (`docker kill` counts as a manual stop: Docker then applies no restart policy)."""
    os.kill(project.state(service)["Pid"], signal.SIGKILL)
