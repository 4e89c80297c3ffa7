"""The Docker engine the kit talks to: the user's own (DOCKER_HOST, or Docker's default socket), or a
private `dockerd` it starts and stops itself.

A private engine touches nothing of the machine's own Docker: its own API socket, data root (the image
cache, kept between runs: a build output under build/docker/), exec root and pidfile; no default bridge
(`--bridge=none`) and no iptables rules (`--iptables=false`): containers reach each other on the networks
compose creates, and published ports go through Docker's userland proxy. It is stopped by its pid
(SIGTERM: it stops its containers, then its containerd) and leaves no process behind.

Needs `dockerd` (Debian 12's `docker.io`, 20.10; scripts/setup_deploy_tools.sh installs it) and root.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from resnet18_kit.observe.processes import process_alive

#: The environment variable that points the docker CLI (and compose) at an engine.
DOCKER_HOST_ENV = "DOCKER_HOST"


class EngineError(RuntimeError):
    """No engine can be reached or started; the message is one line naming why."""


@dataclass(frozen=True)
class Engine:
    """A Docker engine reached through `host` (a DOCKER_HOST value such as unix:///path/docker.sock; None:
    the docker CLI's own default). `private`: started by PrivateEngine."""
    host: str | None = None
    private: bool = False

    def environment(self) -> dict[str, str]:
        """This process's environment with DOCKER_HOST set for this engine (for docker and docker compose)."""
        env = dict(os.environ)
        if self.host:
            env[DOCKER_HOST_ENV] = self.host
        return env

    def docker(self, *args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run `docker <args>` against this engine, output captured as text. Raises EngineError (one line:
        the command and docker's last error line) when check and it fails, subprocess.TimeoutExpired past
        timeout_s."""
        result = subprocess.run(["docker", *args], env=self.environment(), capture_output=True, text=True,
                                timeout=timeout_s, check=False)
        if check and result.returncode != 0:
            raise EngineError(f"docker {' '.join(args[:3])}: {last_line(result.stderr or result.stdout)}")
        return result

    def version(self) -> str | None:
        """The engine's version ("20.10.24+dfsg1"), or None when it does not answer within 10 s."""
        if shutil.which("docker") is None:
            return None
        try:
            result = self.docker("version", "--format", "{{.Server.Version}}", timeout_s=10, check=False)
        except subprocess.TimeoutExpired:
            return None
        return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else None


def last_line(text: str) -> str:
    """The last non-empty line of a command's output (its error), or "(no output)"."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def users_engine() -> Engine | None:
    """The user's own engine (DOCKER_HOST, else Docker's default socket) when one answers; else None."""
    engine = Engine(os.environ.get(DOCKER_HOST_ENV) or None)
    return engine if engine.version() else None


class PrivateEngine:
    """`dockerd` of the kit's own (module doc). `data_root`: the engine's image cache, kept between runs;
    the socket, exec root, pidfile and log go to a short folder of /tmp named after data_root (Unix socket
    paths are limited to 107 bytes), removed by stop().

        engine = PrivateEngine(Path("build/docker")).start()   # Engine(host="unix:///tmp/...", private=True)
        ...
        PrivateEngine(Path("build/docker")).stop()
    """

    def __init__(self, data_root: Path):
        self.data_root = data_root.resolve()
        tag = hashlib.sha256(str(self.data_root).encode()).hexdigest()[:10]
        self.run_dir = Path(tempfile.gettempdir()) / f"resnet18-kit-dockerd-{tag}"
        self.socket = self.run_dir / "docker.sock"
        self.pidfile = self.run_dir / "dockerd.pid"
        self.log_path = self.data_root.parent / "dockerd.log"
        self.engine = Engine(f"unix://{self.socket}", private=True)
        self._process: subprocess.Popen | None = None

    def pid(self) -> int | None:
        """The pid of this engine's dockerd while it runs, else None."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if process_alive(pid) else None

    def start(self, timeout_s: float = 60.0) -> Engine:
        """Start dockerd (or take the one already running on this data root) and wait until it answers.
        Raises EngineError: dockerd missing, not root, or no answer within timeout_s (the log's last line)."""
        if self.pid() is not None and self.engine.version():
            return self.engine
        binary = shutil.which("dockerd") or ("/usr/sbin/dockerd" if Path("/usr/sbin/dockerd").exists() else None)
        if binary is None:
            raise EngineError("no Docker engine answers and dockerd is not installed: run `scripts/setup.sh image` "
                              "as root (installs Debian's docker.io), or set DOCKER_HOST to an engine")
        if os.geteuid() != 0:
            raise EngineError("no Docker engine answers, and a private dockerd needs root: start Docker, or set "
                              "DOCKER_HOST to an engine you can use")
        self.data_root.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "exec").mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            process = subprocess.Popen(
                [binary, "--host", self.engine.host, "--data-root", str(self.data_root),
                 "--exec-root", str(self.run_dir / "exec"), "--pidfile", str(self.pidfile),
                 "--bridge=none", "--iptables=false", "--ip6tables=false", "--log-level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self._process = process
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise EngineError(f"dockerd exited with status {process.returncode}: "
                                  f"{last_line(self.log_path.read_text(errors='replace'))}")
            if self.socket.exists() and self.engine.version():
                return self.engine
            time.sleep(0.2)
        self.stop()
        raise EngineError(f"dockerd did not answer within {timeout_s:.0f} s (log: {self.log_path})")

    def stop(self, timeout_s: float = 60.0) -> bool:
        """SIGTERM dockerd by its pid (it stops its containers and containerd), SIGKILL after timeout_s, and
        remove the run folder. True when a dockerd was running."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and process_alive(pid):
                time.sleep(0.1)
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
            if self._process is not None and self._process.pid == pid:
                self._process.wait(10)  # started by this process: reap it
        # dockerd leaves its default network namespace bind-mounted in the exec root: unmount what is left.
        for mount_point in sorted(mounts_under(self.run_dir), reverse=True):
            subprocess.run(["umount", mount_point], capture_output=True, check=False)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return pid is not None


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below `folder` (from /proc/self/mounts)."""
    prefix = str(folder)
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]

