"""Processes on this machine, read from /proc (Linux): children, resident memory, liveness.

The embedded server finds its Python-backend stubs with these, the supervisor watches tritonserver, and the
reliability scenarios measure memory growth.
"""
from __future__ import annotations

from pathlib import Path


def child_processes(parent_pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the live child processes of `parent_pid`, read from /proc (Linux)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            if int(ppid) != parent_pid or state == "Z":
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):  # exited while we looked
            continue
        children.append((int(entry.name), [a for a in argv if a]))
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
