"""A fleet on one machine: N supervised embedded tritonservers (replicas) behind one HAProxy.

Each replica is a `Supervisor` (server.supervisor) with its own ports, log and shared-memory prefix, as
`resnet18-kit serve` runs one; HAProxy (fleet.haproxy) spreads requests over them and checks each on
/v2/health/ready. The fleet ties the two together:

  * a replica whose supervisor finds a fault (tritonserver exited, a stub died, no answer) is put in
    maintenance in HAProxy at once (no new request reaches it) and back to ready once its supervisor has
    it serving again. Triton itself keeps answering ready with a dead stub (upstream defect dead-stub),
    so HAProxy's check alone would keep it in the pool;
  * `restart(i)` and `roll()` (the rolling restart, SIGHUP to the command) drain a replica in HAProxy
    first, wait until it holds no request, stop it gracefully, start it again, and wait until HAProxy's
    check has it UP before touching the next: clients see no error;
  * `stop()` stops HAProxy (soft stop: it finishes the requests under way) and then every replica
    (SIGTERM, drain, shared memory removed).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from resnet18_kit.fleet.haproxy import (BACKENDS, HAPROXY_CONFIG, FrontEnd, HAProxyProcess, check_config,
                                        haproxy_binary, replica_name, servers_file)
from resnet18_kit.server.config import (ConfigurationError, PortBusyError, ServerConfig, ServerStartError,
                                        check_ports_free)
from resnet18_kit.server.resources import busy_port
from resnet18_kit.server.supervisor import Supervisor, SupervisorEvent, SupervisorPolicy

#: Ports of replica i (0-based) from a base port b: HTTP b + 10 i, gRPC b + 10 i + 1, metrics b + 10 i + 2,
#: and behind its gRPC guard tritonserver's own gRPC b + 10 i + 3 (on 127.0.0.1).
REPLICA_PORT_STRIDE = 10


def replica_configs(template: ServerConfig, count: int, base_port: int) -> tuple[ServerConfig, ...]:
    """`count` replica ServerConfigs like `template`, on ports from `base_port` (REPLICA_PORT_STRIDE apart),
    each with a gRPC guard when `template` has one (triton_grpc_port set); ConfigurationError when a port
    would pass 65535."""
    if count < 1:
        raise ConfigurationError(f"--replicas {count}: a fleet needs at least 1 replica")
    guarded = template.triton_grpc_port is not None
    last = base_port + REPLICA_PORT_STRIDE * (count - 1) + (3 if guarded else 2)
    if not 1 <= base_port or last > 65535:
        raise ConfigurationError(f"--replica-base-port {base_port}: {count} replicas need ports up to {last}; "
                                 "a TCP port is 1 to 65535")
    return tuple(replace(template, http_port=base_port + REPLICA_PORT_STRIDE * i,
                         grpc_port=base_port + REPLICA_PORT_STRIDE * i + 1,
                         metrics_port=base_port + REPLICA_PORT_STRIDE * i + 2,
                         triton_grpc_port=base_port + REPLICA_PORT_STRIDE * i + 3 if guarded else None)
                 for i in range(count))


@dataclass(frozen=True)
class FleetConfig:
    """replicas: one ServerConfig each (replica_configs); front: where HAProxy listens; workdir: the
    servers file, HAProxy's log and socket, one log per replica; policy: the HAProxy policy file;
    supervisor: each replica's SupervisorPolicy (poll_interval_s is also how soon a dead stub takes a
    replica out; take_out_on_fault below); ready_timeout_s: seconds for every replica to be ready and UP in HAProxy; haproxy: the
    haproxy executable (None: found on PATH or in /usr/sbin)."""

    replicas: tuple[ServerConfig, ...]
    front: FrontEnd
    workdir: Path
    policy: Path = HAPROXY_CONFIG
    supervisor: SupervisorPolicy = SupervisorPolicy(poll_interval_s=0.2)
    ready_timeout_s: float = 300.0
    haproxy: Path | None = None
    #: Put a replica in maintenance as soon as its supervisor finds a fault (False: leave it to HAProxy's
    #: check, which a dead stub passes (upstream defect dead-stub); the fleet scenarios measure it this way).
    take_out_on_fault: bool = True


class Fleet:
    """The replicas and HAProxy of `config`. on_event(replica index or None for HAProxy, kind, detail)
    tells what happens (default: nothing; the command prints it). Context manager: start() / stop(), or
    stop(hurry=True) with drain_on_exit=False (for a fleet whose requests no longer matter then, such as a
    measurement's)."""

    def __init__(self, config: FleetConfig, on_event: Callable[[int | None, str, str], None] | None = None,
                 drain_on_exit: bool = True):
        self.config = config
        self.drain_on_exit = drain_on_exit
        self.on_event = on_event or (lambda index, kind, detail: None)
        self.supervisors: list[Supervisor | None] = [None] * len(config.replicas)
        self.haproxy: HAProxyProcess | None = None
        self._lock = threading.Lock()
        #: Replicas the fleet is restarting itself (their supervisor's events do not touch HAProxy).
        self._restarting: set[int] = set()

    # -- checks before anything starts ---------------------------------------------------------------------

    def check(self) -> None:
        """HAProxy installed, its configuration valid, every port free and distinct: ConfigurationError
        (HAProxyError, PortBusyError) naming the first problem, before anything starts."""
        haproxy_binary(self.config.haproxy)
        front = self.config.front
        taken = [port for c in self.config.replicas
                 for port in (c.http_port, c.grpc_port, c.metrics_port, c.triton_grpc_port) if port is not None]
        for flag, port in (("--http-port", front.http_port), ("--grpc-port", front.grpc_port)):
            if not 1 <= port <= 65535:
                raise ConfigurationError(f"{flag} {port}: a TCP port is 1 to 65535")
            if port in taken:
                raise ConfigurationError(f"{flag} {port} is also a replica's port; choose another "
                                         "--replica-base-port or front-end port")
            taken.append(port)
        if front.http_port == front.grpc_port:
            raise ConfigurationError("--http-port and --grpc-port are the same port; the front ends need one each")
        problem = busy_port(front.host, (("front-end HTTP", "--http-port", front.http_port),
                                         ("front-end gRPC", "--grpc-port", front.grpc_port)))
        if problem:
            raise PortBusyError(problem)
        for index, replica in enumerate(self.config.replicas):
            try:
                check_ports_free(replica)
            except PortBusyError as exc:
                raise PortBusyError(f"replica {index + 1}: {exc} (replicas use --replica-base-port and up)") from None
        self.config.workdir.mkdir(parents=True, exist_ok=True)
        self.servers_path.write_text(servers_file(list(self.config.replicas)))
        check_config(self.config.policy, self.servers_path, front, self.config.haproxy)

    @property
    def servers_path(self) -> Path:
        return self.config.workdir / "servers.cfg"

    def replica_log(self, index: int) -> Path:
        """Replica `index`'s tritonserver log (emptied when the fleet starts)."""
        return self.config.workdir / f"{replica_name(index)}-tritonserver.log"

    # -- start and stop ------------------------------------------------------------------------------------

    def start(self, cancelled: Callable[[], bool] = lambda: False) -> float:
        """check(), start every replica (in parallel) and HAProxy, and wait until HAProxy has every replica
        UP; returns the seconds that took. On any failure everything started is stopped and the error
        raised (ConfigurationError: exit status 2; ServerStartError: 1)."""
        started = time.monotonic()
        self.check()
        for index in range(len(self.config.replicas)):
            self.replica_log(index).write_bytes(b"")
        try:
            with ThreadPoolExecutor(len(self.config.replicas)) as pool:
                for future in [pool.submit(self._start_replica, index) for index in range(len(self.supervisors))]:
                    future.result()
            if cancelled():
                raise ServerStartError("stopped while starting")
            self.haproxy = HAProxyProcess(self.config.policy, self.servers_path, self.config.front,
                                          self.config.workdir / "haproxy.log", self.config.haproxy)
            self.haproxy.start()
            self.on_event(None, "ready", f"HAProxy pid {self.haproxy.process.pid}: HTTP {self.config.front.host}:"
                                         f"{self.config.front.http_port}, gRPC {self.config.front.host}:"
                                         f"{self.config.front.grpc_port}")
            for index in range(len(self.supervisors)):
                self.wait_status(index, "UP", self.config.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - started

    def _start_replica(self, index: int) -> None:
        supervisor = Supervisor(self.config.replicas[index], self.config.supervisor,
                                log_path=self.replica_log(index), on_event=self._replica_event(index))
        self.supervisors[index] = supervisor
        try:
            supervisor.start(self.config.ready_timeout_s + 5)
        except ServerStartError:
            failure = next((e.detail for e in reversed(supervisor.events) if e.kind in ("start-failed", "gave-up")),
                           None)
            reason = (failure or f"not ready within {self.config.ready_timeout_s:g} s").split("; server log tail:")[0]
            error = ConfigurationError if supervisor.exit_status == 2 else ServerStartError
            raise error(f"replica {index + 1}: {reason} (log: {self.replica_log(index)})") from None

    def _replica_event(self, index: int) -> Callable[[SupervisorEvent], None]:
        def on_event(event: SupervisorEvent) -> None:
            if event.kind == "start-failed":
                self.on_event(index, event.kind, event.detail)
                return
            self.on_event(index, event.kind, event.detail)
            if self.haproxy is None or index in self._restarting or not self.config.take_out_on_fault:
                return
            if event.kind in ("fault", "gave-up"):   # out of the pool before the restart begins
                self._set_state(index, "maint")
            elif event.kind == "ready":
                self._set_state(index, "ready")
        return on_event

    def _set_state(self, index: int, state: str) -> None:
        try:
            self.haproxy.api.set_state(replica_name(index), state)
            self.on_event(index, "pool", f"HAProxy: {replica_name(index)} set to {state}")
        except (OSError, RuntimeError) as exc:
            self.on_event(index, "pool", f"HAProxy: could not set {replica_name(index)} {state}: {exc}")

    def stop(self, hurry: bool = False) -> int:
        """Soft-stop HAProxy (requests under way finish), then stop every replica gracefully, in parallel;
        returns 0 when every part stopped cleanly, else 1. Safe to call twice. hurry: HAProxy and every
        replica killed at once (what they hold fails; shared memory removed all the same), returns 1."""
        status = 0
        if self.haproxy is not None:
            if (self.haproxy.stop(timeout_s=0.0) if hurry else self.haproxy.stop()) not in (0, None):
                status = 1
            self.on_event(None, "stopped", "HAProxy stopped")
        running = [s for s in self.supervisors if s is not None]
        with ThreadPoolExecutor(max(1, len(running))) as pool:
            statuses = list(pool.map(lambda s: s.stop(hurry=hurry), running))
        self.supervisors = [None] * len(self.supervisors)
        return 1 if status or any(s not in (0, None) for s in statuses) else 0

    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(hurry=not self.drain_on_exit)

    # -- HAProxy's view ------------------------------------------------------------------------------------

    def statuses(self) -> dict[str, dict[str, str]]:
        """replica name -> {backend: HAProxy status (UP, DOWN, MAINT, DRAIN, ...) with the last check's
        result in brackets when not UP}."""
        out: dict[str, dict[str, str]] = {}
        for (backend, server), row in self.haproxy.api.states().items():
            shown = row["status"] if row["status"] == "UP" else f"{row['status']} ({row.get('check_status', '')})"
            out.setdefault(server, {})[backend] = shown
        return out

    def status(self, index: int) -> set[str]:
        """The plain statuses (no check detail) of replica `index` in the backends, e.g. {"UP"}."""
        rows = self.haproxy.api.states()
        return {rows[(backend, replica_name(index))]["status"] for backend in BACKENDS.values()}

    def wait_status(self, index: int, status: str, timeout_s: float, poll_s: float = 0.02) -> float:
        """Block until replica `index` has `status` in every backend; seconds waited. ServerStartError
        after `timeout_s`."""
        started = time.monotonic()
        while self.status(index) != {status}:
            if time.monotonic() - started > timeout_s:
                raise ServerStartError(f"{replica_name(index)} not {status} in HAProxy after {timeout_s:.0f} s: "
                                       f"{self.statuses().get(replica_name(index))}")
            time.sleep(poll_s)
        return time.monotonic() - started

    def sessions(self, index: int) -> int:
        """Requests HAProxy has under way on replica `index`, over both backends (`scur`)."""
        rows = self.haproxy.api.states()
        return sum(int(rows[(backend, replica_name(index))]["scur"] or 0) for backend in BACKENDS.values())

    # -- restarts ------------------------------------------------------------------------------------------

    def restart(self, index: int, drain_timeout_s: float = 30.0) -> dict[str, float]:
        """Restart replica `index` with nothing lost: drain it in HAProxy, wait until it holds no request
        (up to `drain_timeout_s`), put it in maintenance, stop it (SIGTERM), start it again, set it ready
        and wait until HAProxy's check has it UP. Returns the seconds of each step (drain, stop, start,
        rejoin). ServerStartError when it does not come back."""
        times: dict[str, float] = {}
        self._restarting.add(index)
        try:
            mark = time.monotonic()
            self._set_state(index, "drain")
            while self.sessions(index) and time.monotonic() - mark < drain_timeout_s:
                time.sleep(0.02)
            self._set_state(index, "maint")
            times["drain_s"] = time.monotonic() - mark
            mark = time.monotonic()
            self.supervisors[index].stop()
            times["stop_s"] = time.monotonic() - mark
            mark = time.monotonic()
            self._start_replica(index)
            times["start_s"] = time.monotonic() - mark
            mark = time.monotonic()
            self._set_state(index, "ready")
            times["rejoin_s"] = self.wait_status(index, "UP", self.config.ready_timeout_s)
        finally:
            self._restarting.discard(index)
        self.on_event(index, "restarted", ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in times.items()))
        return times

    def roll(self) -> list[dict[str, float]]:
        """The rolling restart: restart(i) for every replica in turn (each back UP before the next)."""
        return [self.restart(index) for index in range(len(self.supervisors))]

    def gave_up(self) -> list[int]:
        """Indexes of replicas whose supervisor gave up (it restarts no more)."""
        return [i for i, s in enumerate(self.supervisors)
                if s is not None and s.exit_status is not None and i not in self._restarting]
