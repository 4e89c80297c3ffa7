"""What a server of ours holds on this machine and must give back: its TCP ports and its Python-backend
shared-memory regions in /dev/shm.

Each Python-backend stub of Triton 2.51 has one region of `shm-default-byte-size` (16 MiB here), named
`<prefix><uuid>`; the prefix is tritonserver's `--backend-config=python,shm-region-prefix-name=...`
(default "triton_python_backend_shm_region_"). Triton unlinks them on a clean exit, but leaves the region
of a stub that was killed, and all of them when tritonserver itself is killed or fails to start; so each
server of ours gets a prefix of its own and removes what is left under it (EmbeddedTritonServer.stop).
"""
from __future__ import annotations

import errno
import socket
from pathlib import Path

from resnet18_kit.observe.processes import port_listeners

#: Where POSIX shared memory lives on Linux.
SHM_DIR = Path("/dev/shm")
#: The Python backend's default region prefix; ours add a per-server token after it.
PYTHON_BACKEND_SHM_PREFIX = "triton_python_backend_shm_region_"


def python_backend_regions(prefix: str = PYTHON_BACKEND_SHM_PREFIX) -> list[Path]:
    """The regions in /dev/shm whose names start with `prefix`, sorted."""
    return sorted(SHM_DIR.glob(f"{prefix}*"))


def remove_regions(prefix: str) -> list[Path]:
    """Unlink the regions whose names start with `prefix` (call once the processes using them are gone);
    returns those removed. Regions under any other prefix are never touched."""
    removed = []
    for region in python_backend_regions(prefix):
        try:
            region.unlink()
            removed.append(region)
        except FileNotFoundError:
            pass
    return removed


def busy_port(host: str, ports: tuple[tuple[str, str, int], ...]) -> str | None:
    """The first of `ports` ((label, flag, port): e.g. ("HTTP", "--http-port", 8000)) that cannot be bound
    on `host` now, as one line naming it and its holder where /proc tells ("HTTP port 8000 on 127.0.0.1
    is taken by pid 4242 (tritonserver); ..."); None when all are free. Binds with SO_REUSEADDR, as
    servers do, so a port with only closed connections in TIME_WAIT counts as free."""
    for label, flag, port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                holders = ", ".join(f"pid {pid} ({command})" for pid, command in port_listeners(port))
                who = holders or ("another process" if exc.errno == errno.EADDRINUSE else exc.strerror)
                return f"{label} port {port} on {host} is taken by {who}; stop it or choose another port with {flag}"
    return None
