"""A rolling swap of a running fleet (`resnet18-kit swap --fleet`): each replica in turn is drained in
HAProxy, given the new configs through its model-control API (model_control.swap) and put back in the
pool once HAProxy's check has it UP, so a client that never retries sees no failure.

It works from the fleet's files, so it runs in a process of its own beside `resnet18-kit fleet`: the
servers file (which replica listens where) and HAProxy's runtime socket, both under <results>/fleet/.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from resnet18_kit.fleet.haproxy import BACKENDS, RuntimeAPI, runtime_socket_in
from resnet18_kit.model_control import DEFAULT_SWAP_TIMEOUT_S, ModelControl, SwapError, SwapTarget, swap

#: Seconds a replica may take to finish the requests it holds once drained.
DRAIN_TIMEOUT_S = 30.0


@dataclass
class ReplicaSwap:
    """One replica's swap: its name and gRPC address, the seconds of each step (drain, swap, rejoin) and
    the lines model_control.swap said for it."""

    name: str
    url: str
    seconds: dict[str, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def fleet_replicas(workdir: Path) -> list[tuple[str, str]]:
    """(replica name, gRPC host:port) of each replica in the servers file of the fleet in `workdir`
    (fleet.haproxy.servers_file; model control goes over gRPC: model_control.ModelControl);
    SwapError when there is none."""
    path = Path(workdir) / "servers.cfg"
    try:
        text = path.read_text()
    except OSError:
        raise SwapError(f"no fleet in {workdir}: {path.name} is missing (start one with `resnet18-kit fleet`)") from None
    section = text.split(f"backend {BACKENDS['grpc']}", 1)[-1].split("backend ", 1)[0]
    replicas = re.findall(r"^\s*server\s+(\S+)\s+(\S+)", section, flags=re.MULTILINE)
    if not replicas:
        raise SwapError(f"{path}: no replica in backend {BACKENDS['grpc']}")
    return replicas


def swap_fleet(workdir: Path, targets: list[SwapTarget], admin_key: str | None,
               timeout_s: float = DEFAULT_SWAP_TIMEOUT_S, on_line: Callable[[str], None] = lambda line: None
               ) -> list[ReplicaSwap]:
    """Swap every replica of the fleet in `workdir` to `targets`, one after another (module doc). SwapError
    (one line) when the fleet does not answer or a replica's swap fails; the replicas swapped before it
    then get their previous configs back and every replica is back in the pool."""
    api = RuntimeAPI(runtime_socket_in(workdir))
    replicas = fleet_replicas(workdir)
    try:
        api.states()
    except OSError as exc:
        raise SwapError(f"the fleet's HAProxy does not answer on {api.socket_path}: {exc.strerror or exc} "
                        "(is `resnet18-kit fleet` running with this results folder?)") from None
    done: list[tuple[ReplicaSwap, dict]] = []
    for name, url in replicas:
        replica = ReplicaSwap(name, url)
        try:
            with ModelControl(url, admin_key, timeout_s) as control:
                previous = control.served_configs()
                on_line(f"{name}: draining in HAProxy")
                replica.seconds["drain_s"] = _drain(api, name)
                mark = time.monotonic()
                swap(control, targets, timeout_s, on_line=lambda line: replica.lines.append(f"{name}: {line}"),
                     served=previous)
                replica.seconds["swap_s"] = time.monotonic() - mark
        except SwapError as exc:
            _rejoin(api, name, timeout_s)
            undone = _undo(done, admin_key, timeout_s)
            raise SwapError(f"{name} ({url}): {exc}{undone}", exc.exit_status) from None
        for line in replica.lines:
            on_line(line)
        replica.seconds["rejoin_s"] = _rejoin(api, name, timeout_s)
        on_line(f"{name}: back in the pool (" + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s"
                                                          for k, v in replica.seconds.items()) + ")")
        done.append((replica, previous))
    return [replica for replica, _ in done]


def _drain(api: RuntimeAPI, name: str) -> float:
    """Drain replica `name` and wait until HAProxy holds no request on it; seconds waited."""
    started = time.monotonic()
    api.set_state(name, "drain")
    while time.monotonic() - started < DRAIN_TIMEOUT_S:
        rows = api.states()
        if not sum(int(rows[(backend, name)]["scur"] or 0) for backend in BACKENDS.values()):
            break
        time.sleep(0.02)
    return time.monotonic() - started


def _rejoin(api: RuntimeAPI, name: str, timeout_s: float) -> float:
    """Put replica `name` back in the pool and wait until HAProxy has it UP in every backend; seconds."""
    started = time.monotonic()
    api.set_state(name, "ready")
    while {api.states()[(backend, name)]["status"] for backend in BACKENDS.values()} != {"UP"}:
        if time.monotonic() - started > timeout_s:
            raise SwapError(f"{name} not UP in HAProxy {timeout_s:.0f} s after its swap", 1)
        time.sleep(0.02)
    return time.monotonic() - started


def _undo(done: list[tuple[ReplicaSwap, dict]], admin_key: str | None, timeout_s: float) -> str:
    """Give the replicas already swapped their previous configs back; what the message adds about it."""
    failed = []
    for replica, previous in done:
        try:
            with ModelControl(replica.url, admin_key, timeout_s) as control:
                swap(control, [SwapTarget(model, config, "its previous config") for model, config in previous.items()],
                     timeout_s)
        except SwapError:
            failed.append(replica.name)
    if failed:
        return f"; could not put back the previous configs of {', '.join(failed)}"
    return f"; {', '.join(r.name for r, _ in done)} got their previous configs back" if done else ""
