"""Processes on this machine, read from /proc (Linux): children, resident memory, liveness.

The embedded server finds its Python-backend stubs with these, the supervisor watches tritonserver, and the
reliability scenarios measure memory growth.
"""
from __future__ import annotations

import os
from pathlib import Path


def child_processes(parent_pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the live child processes of `parent_pid`, read from /proc (Linux): every process's
    stat, and the argv of the children. The supervisor lists tritonserver's stubs this way twice a second:
    with os-level reads rather than pathlib about 1 ms per call against 2.4 ms (117 processes, Zen 4)."""
    children = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat_file:
                stat = stat_file.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
            state, ppid = stat[stat.rindex(b")") + 2:].split(None, 2)[:2]
            if int(ppid) != parent_pid or state == b"Z":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as cmdline_file:
                argv = cmdline_file.read().decode(errors="replace").split("\0")
        except (OSError, ValueError):  # exited while we looked
            continue
        children.append((int(name), [a for a in argv if a]))
    return children


def rss_bytes(pid: int) -> int | None:
    """Resident set size of `pid` in bytes (VmRSS of /proc/<pid>/status), None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def listening_socket_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on `port` (any address, IPv4 and IPv6), from /proc/net/tcp
    and /proc/net/tcp6 (Linux; state 0A is LISTEN)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def port_listeners(port: int) -> list[tuple[int, str]]:
    """(pid, command name) of each process holding a TCP socket listening on `port`, read from
    /proc/<pid>/fd. Empty when nothing listens, or when the holder's /proc entries cannot be read
    (another user's process when this one is not root): the port may still be taken."""
    inodes = listening_socket_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{inode}]" for inode in inodes}
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
            if any(_link(fd) in wanted for fd in fds):
                holders.append((int(entry.name), (entry / "comm").read_text().strip()))
        except OSError:  # exited while we looked, or not ours to read
            continue
    return sorted(holders)


def _link(path: Path) -> str | None:
    """Where the symlink `path` points, None when it vanished (an fd closed while we looked)."""
    try:
        return os.readlink(path)
    except OSError:
        return None
