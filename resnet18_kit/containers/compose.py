"""One docker compose project of docker-compose.yaml on an Engine: its own name, ports and settings, so
that several can run side by side (the tests run theirs on free ports of 127.0.0.1).

    project = ComposeProject(engine, "demo", ComposePorts.free(), admin_key="...")
    project.run("up", "--wait")          # CompletedProcess; ComposeError (its last line) when it fails
    project.server_config()              # ServerConfig whose URLs are the published ports
    project.down()                       # containers, networks and the project's volumes removed

Compose is Compose v2 (the binary scripts/setup_deploy_tools.sh puts in the venv, else `docker compose`).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from resnet18_kit.containers.engine import Engine, EngineError, last_line
from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.server.config import ServerConfig, free_ports

#: The compose file of the CPU deployment (docker-compose.gpu.yaml, the GPU override, goes in extra_files).
COMPOSE_FILE = REPO_ROOT / "docker-compose.yaml"
#: Where the docker compose CLI plugin may be (Compose v2 in the venv, as the set-up installs it).
VENV_COMPOSE = Path(sys.executable).parent / "docker-compose-v2"


class ComposeError(EngineError):
    """A compose command failed; the message is its last error line."""


def compose_command() -> list[str]:
    """How to run Compose v2 here: the venv's binary, else the docker CLI plugin."""
    if VENV_COMPOSE.is_file():
        return [str(VENV_COMPOSE)]
    if shutil.which("docker-compose-v2"):
        return ["docker-compose-v2"]
    return ["docker", "compose"]


@dataclass(frozen=True)
class ComposePorts:
    """Host ports the project publishes (docker-compose.yaml's TRITON_*_PORT, PROMETHEUS_PORT, GRAFANA_PORT)."""
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    prometheus: int = 9090
    grafana: int = 3000

    @classmethod
    def free(cls) -> "ComposePorts":
        """Five ports free on 127.0.0.1 now."""
        return cls(*free_ports(5))

    def environment(self) -> dict[str, str]:
        """The compose file's port settings: {"TRITON_HTTP_PORT": "8000", ...}."""
        return {"TRITON_HTTP_PORT": str(self.http), "TRITON_GRPC_PORT": str(self.grpc),
                "TRITON_METRICS_PORT": str(self.metrics), "PROMETHEUS_PORT": str(self.prometheus),
                "GRAFANA_PORT": str(self.grafana)}


class ComposeProject:
    """docker compose -p `name` on `engine`, with docker-compose.yaml (plus `extra_files`, e.g. an override),
    `profiles` active and these settings in the environment: the ports, TRITON_ADMIN_KEY (None: unset, to
    check that compose refuses), and `settings` (any other variable of the compose file)."""

    def __init__(self, engine: Engine, name: str, ports: ComposePorts, admin_key: str | None,
                 profiles: tuple[str, ...] = (), extra_files: tuple[Path, ...] = (),
                 settings: dict[str, str] | None = None):
        self.engine, self.name, self.ports, self.profiles = engine, name, ports, profiles
        self.files = (COMPOSE_FILE, *extra_files)
        env = {k: v for k, v in engine.environment().items() if not k.startswith(("TRITON_", "COMPOSE_"))}
        env.update(ports.environment())
        env.update(settings or {})
        if admin_key is not None:
            env["TRITON_ADMIN_KEY"] = admin_key
        self.env = env

    def command(self, *args: str) -> list[str]:
        """The argv of `docker compose <args>` for this project (name, files, profiles)."""
        cmd = [*compose_command(), "-p", self.name, "--project-directory", str(REPO_ROOT)]
        for path in self.files:
            cmd += ["-f", str(path)]
        for profile in self.profiles:
            cmd += ["--profile", profile]
        return cmd + list(args)

    def run(self, *args: str, timeout_s: float = 600.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run `docker compose <args>`; output captured (text). ComposeError with its last line when check
        and it fails."""
        result = subprocess.run(self.command(*args), env=self.env, capture_output=True, text=True,
                                timeout=timeout_s, check=False, cwd=REPO_ROOT)
        if check and result.returncode != 0:
            raise ComposeError(f"docker compose {' '.join(args[:2])}: {last_line(result.stderr or result.stdout)}")
        return result

    def timed_up(self, *services: str) -> float:
        """`up --wait` (every service started; those with a health check healthy); seconds it took."""
        start = time.monotonic()
        self.run("up", "--wait", *services)
        return time.monotonic() - start

    def container(self, service: str) -> str:
        """The id of the service's container (the first when scaled)."""
        ids = self.run("ps", "-q", "--all", service).stdout.split()
        if not ids:
            raise ComposeError(f"{self.name}: no container of service {service}")
        return ids[0]

    def state(self, service: str) -> dict:
        """docker inspect's State of the service's container: Status, Running, ExitCode, Pid, Health..."""
        return json.loads(self.engine.docker("inspect", "--format", "{{json .State}}", self.container(service)).stdout)

    def restart_count(self, service: str) -> int:
        """How many times Docker's restart policy has restarted the service's container."""
        return int(self.engine.docker("inspect", "--format", "{{.RestartCount}}", self.container(service)).stdout)

    def server_config(self) -> ServerConfig:
        """A ServerConfig whose URLs are this project's published ports on 127.0.0.1 (for the clients)."""
        return ServerConfig(host="127.0.0.1", http_port=self.ports.http, grpc_port=self.ports.grpc,
                            metrics_port=self.ports.metrics)

    def resources(self) -> dict[str, list[str]]:
        """What the engine holds of this project: containers, networks, volumes (names)."""
        label = f"label=com.docker.compose.project={self.name}"
        listed = {"container": ("--all",), "network": (), "volume": ()}  # --all: stopped containers too
        return {kind: self.engine.docker(kind, "ls", "-q", *extra, "--filter", label).stdout.split()
                for kind, extra in listed.items()}

    def down(self, timeout_s: float = 120.0) -> None:
        """`down --volumes --remove-orphans`: nothing of the project is left."""
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "45", timeout_s=timeout_s)

