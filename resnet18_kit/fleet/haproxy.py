"""HAProxy in front of the fleet: its configuration, its process and its runtime API.

The policy is one committed file, deploy/haproxy/haproxy.cfg (front ends, per-request balancing, active
checks on /v2/health/ready, retries); the servers are a second file written here for the replicas of this
machine (compose has its own, deploy/haproxy/servers-compose.cfg). HAProxy reads both: `haproxy -f
haproxy.cfg -f servers.cfg`, with the front ends' addresses and the runtime socket in its environment
(ENVIRONMENT names them).

The runtime API (a UNIX socket, HAProxy's management guide, "Unix Socket commands") is how the fleet
reads each replica's state (`show stat`: UP, DOWN, MAINT, DRAIN, with the last check's result) and takes
a replica out of the pool before stopping it (`set server <backend>/<server> state drain|maint|ready`).
"""
from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.server.config import ConfigurationError, ServerConfig, ServerStartError

#: The committed policy file.
HAPROXY_CONFIG = REPO_ROOT / "deploy" / "haproxy" / "haproxy.cfg"
#: protocol -> backend name, in the policy file and in every servers file.
BACKENDS = {"http": "triton_http", "grpc": "triton_grpc"}
#: What the policy file reads from the environment.
ENVIRONMENT = ("FLEET_HTTP_BIND", "FLEET_GRPC_BIND", "FLEET_RUNTIME_SOCKET")
#: Where Debian's package puts the binary (also looked up on PATH).
DEBIAN_BINARY = Path("/usr/sbin/haproxy")
#: The longest UNIX socket path HAProxy binds ("socket path ... too long (max 97)": sockaddr_un's 108 bytes
#: less its own suffix for the temporary name it binds first).
SOCKET_PATH_MAX_BYTES = 97


class HAProxyError(ConfigurationError):
    """HAProxy missing, its configuration invalid, or its front end not listening: one line, exit 2."""


def haproxy_binary(given: Path | None = None) -> Path:
    """The haproxy executable: `given` when set, else PATH, then Debian's /usr/sbin/haproxy; HAProxyError
    when there is none (or `given` is not an executable file)."""
    if given is not None:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise HAProxyError(f"--haproxy {given}: not an executable file")
        return Path(given)
    found = shutil.which("haproxy") or (str(DEBIAN_BINARY) if os.access(DEBIAN_BINARY, os.X_OK) else None)
    if found is None:
        raise HAProxyError("HAProxy is not installed (no haproxy on PATH or in /usr/sbin): `make setup` installs "
                           "Debian's package, or run `apt-get install --no-install-recommends haproxy`")
    return Path(found)


def runtime_socket_in(workdir: Path) -> Path:
    """The runtime API's UNIX socket for a fleet whose folder is `workdir`: workdir/haproxy.sock, or, when that
    path is over SOCKET_PATH_MAX_BYTES, <temp dir>/resnet18-kit-haproxy-<10 hex digits of the folder's
    SHA-1>.sock (the same for every command given that folder: `fleet swap` finds the running fleet's)."""
    workdir = Path(workdir).resolve()
    wanted = workdir / "haproxy.sock"
    if len(os.fsencode(str(wanted))) <= SOCKET_PATH_MAX_BYTES:
        return wanted
    digest = hashlib.sha1(os.fsencode(str(workdir))).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"resnet18-kit-haproxy-{digest}.sock"


def replica_name(index: int) -> str:
    """The server name of replica `index` (0-based) in both backends: replica1, replica2, ..."""
    return f"replica{index + 1}"


def servers_file(replicas: list[ServerConfig]) -> str:
    """The servers file for `replicas` (in order: replica1, replica2, ...): each replica's HTTP port in
    triton_http and its gRPC port in triton_grpc (HTTP/2 without TLS), both checked on its HTTP port's
    /v2/health/ready over HTTP/1.1."""
    lines = ["# Written by `resnet18-kit fleet` for the replicas it runs; read after deploy/haproxy/haproxy.cfg.", ""]
    for protocol, backend in BACKENDS.items():
        lines.append(f"backend {backend} from replicas")
        for index, replica in enumerate(replicas):
            if protocol == "http":
                lines.append(f"    server {replica_name(index)} {replica.http_url} check")
            else:
                lines.append(f"    server {replica_name(index)} {replica.grpc_url} proto h2 "
                             f"check port {replica.http_port} check-proto h1")
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class FrontEnd:
    """Where HAProxy listens: host, HTTP and gRPC ports; runtime_socket: its runtime API's UNIX socket."""

    host: str
    http_port: int
    grpc_port: int
    runtime_socket: Path

    def environment(self) -> dict[str, str]:
        """The variables of ENVIRONMENT for this front end."""
        return {"FLEET_HTTP_BIND": f"{self.host}:{self.http_port}", "FLEET_GRPC_BIND": f"{self.host}:{self.grpc_port}",
                "FLEET_RUNTIME_SOCKET": str(self.runtime_socket)}

    def server_config(self) -> ServerConfig:
        """A ServerConfig whose HTTP and gRPC addresses are the front end's (what clients of the fleet use;
        its metrics port is meaningless: each replica has its own)."""
        return ServerConfig(host=self.host, http_port=self.http_port, grpc_port=self.grpc_port, metrics_port=1)


def first_alert(output: str) -> str:
    """The first [ALERT] line of HAProxy's output without its "[ALERT] (pid) :" prefix (the reason a
    configuration is refused, with its file and line), else the last line of output."""
    for line in output.splitlines():
        found = re.match(r"\s*\[ALERT\]\s*\(\d+\)\s*:\s*(.*)", line)
        if found:
            return found.group(1).strip()
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def check_config(policy: Path, servers: Path, front: FrontEnd, binary: Path | None = None) -> None:
    """`haproxy -c` on the two files with the front end's environment; HAProxyError naming the first
    problem HAProxy reports (a missing file, an unknown keyword, a bad address). binary: as haproxy_binary's."""
    if not policy.is_file():
        raise HAProxyError(f"HAProxy configuration {policy}: no such file")
    result = subprocess.run([str(haproxy_binary(binary)), "-c", "-f", str(policy), "-f", str(servers)],
                            env=os.environ | front.environment(), capture_output=True, text=True)
    if result.returncode != 0:
        raise HAProxyError(f"HAProxy refuses {policy}: {first_alert(result.stdout + result.stderr)}")


class RuntimeAPI:
    """HAProxy's runtime API on `socket_path`: one command per connection (non-interactive mode)."""

    def __init__(self, socket_path: Path, timeout_s: float = 2.0):
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def command(self, text: str) -> str:
        """Send one command, return HAProxy's whole answer. OSError when the socket does not answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout_s)
            sock.connect(str(self.socket_path))
            sock.sendall(text.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def stat(self) -> list[dict[str, str]]:
        """`show stat` as rows (pxname, svname, status, check_status, scur, ...: HAProxy's CSV columns)."""
        text = self.command("show stat").lstrip("# ")
        return list(csv.DictReader(io.StringIO(text)))

    def states(self) -> dict[tuple[str, str], dict[str, str]]:
        """(backend, server) -> its `show stat` row, for the servers of BACKENDS."""
        return {(row["pxname"], row["svname"]): row for row in self.stat()
                if row["pxname"] in BACKENDS.values() and row["svname"] not in ("FRONTEND", "BACKEND")}

    def set_state(self, server: str, state: str) -> None:
        """`set server <backend>/<server> state <state>` in every backend (state: ready, drain or maint);
        RuntimeError with HAProxy's answer when it refuses."""
        for backend in BACKENDS.values():
            answer = self.command(f"set server {backend}/{server} state {state}").strip()
            if answer:
                raise RuntimeError(f"HAProxy: set server {backend}/{server} state {state}: {answer}")


class HAProxyProcess:
    """haproxy in the foreground (-db) with the policy and servers files; its log appended to `log_path`.
    Dies with this process (PR_SET_PDEATHSIG through setpriv, as the replicas' tritonservers)."""

    def __init__(self, policy: Path, servers: Path, front: FrontEnd, log_path: Path, binary: Path | None = None):
        self.policy, self.servers, self.front, self.log_path = policy, servers, front, log_path
        self.binary = binary
        self.process: subprocess.Popen | None = None
        self.api = RuntimeAPI(front.runtime_socket)

    def start(self, timeout_s: float = 10.0) -> None:
        """Check the configuration (HAProxyError), start haproxy and wait until its runtime API answers;
        ServerStartError when it exits or does not answer within `timeout_s` seconds."""
        check_config(self.policy, self.servers, self.front, self.binary)
        command = [str(haproxy_binary(self.binary)), "-db", "-f", str(self.policy), "-f", str(self.servers)]
        if shutil.which("setpriv"):
            command = ["setpriv", "--pdeathsig", "TERM", "--", *command]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, env=os.environ | self.front.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")
                raise HAProxyError(f"haproxy exited with status {self.process.returncode}: {first_alert(tail)}")
            try:
                self.api.command("show info")
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(f"haproxy's runtime API ({self.front.runtime_socket}) did not answer "
                                           f"within {timeout_s:.0f} s (log: {self.log_path})")
                time.sleep(0.05)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Soft stop (SIGUSR1: stop listening, finish the requests under way), SIGKILL after `timeout_s`
        seconds; returns haproxy's exit status (None if never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.front.runtime_socket.unlink(missing_ok=True)
        return self.process.returncode
