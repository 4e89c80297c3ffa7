"""tritonserver's log on a console: its CUDA messages on a machine without a usable GPU, explained once.

The tritonserver of the nvidia-pytriton wheel is built with CUDA. On a machine without a GPU or CUDA
driver it logs, at every start, that the driver is missing or too old, that it has no pinned memory
pool, that the ensemble gets no CUDA stream, and so on, some of them as errors (E). They are expected:
this kit's models run on the CPU (KIND_CPU instances), and Triton falls back to ordinary system memory.
`CudaNoticeFilter` replaces them on a console with one line that says so; the log file keeps every line.
Lines about a model that failed to load always pass, whatever they say about CUDA.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Callable, Iterable

#: The texts of tritonserver's messages (2.51, CPU-only machine) that mean "no usable GPU / CUDA driver".
CUDA_NOTICE_PATTERNS = (
    r"CUDA driver version is insufficient for CUDA runtime version",
    r"no CUDA-capable device is detected",
    r"unable to get number of CUDA devices",
    r"(unable|failed) to allocate pinned (system )?memory",
    r"pinned memory pool will not be available",
    r"CUDA memory pool disabled",
    r"CudaDriverHelper has not been initialized",
    r"Failed to initialize NVML",
)
CUDA_NOTICE = re.compile("|".join(CUDA_NOTICE_PATTERNS), re.IGNORECASE)
#: Lines shown even when they mention CUDA: a model that did not load is never expected.
NEVER_HIDDEN = re.compile(r"failed to load|unable to load|error loading", re.IGNORECASE)


def is_cuda_notice(line: str) -> bool:
    """True for a tritonserver log line that only says there is no usable GPU / CUDA driver."""
    return bool(CUDA_NOTICE.search(line)) and not NEVER_HIDDEN.search(line)


def cpu_only_explanation(log_path: Path | str | None) -> str:
    """The one line that stands for every hidden CUDA message."""
    where = f" (full log: {log_path})" if log_path else ""
    return ("no usable GPU/CUDA driver: tritonserver runs on the CPU; its CUDA messages are expected and "
            f"hidden{where}")


class CudaNoticeFilter:
    """Console filter of tritonserver log lines: `filter(line)` returns the lines to show for it: the
    line itself; or, for the first CUDA notice, `prefix` + the explanation; or nothing for later ones."""

    def __init__(self, log_path: Path | str | None = None, prefix: str = ""):
        self.log_path, self.prefix = log_path, prefix
        self.explained = False
        self.hidden = 0  # CUDA notice lines seen and not shown

    def __call__(self, line: str) -> list[str]:
        if not is_cuda_notice(line):
            return [line]
        self.hidden += 1
        if self.explained:
            return []
        self.explained = True
        return [self.prefix + cpu_only_explanation(self.log_path)]

    def lines(self, lines: Iterable[str]) -> list[str]:
        """Every line of `lines` through the filter, in order."""
        return [shown for line in lines for shown in self(line)]


class LogFollower:
    """Shows a log file as it grows (tail -f) on a thread: each new complete line goes through
    `line_filter` (default: none) to `show`. Starts at the file's current end; stop() shows what is left
    (a last line without a newline too). The file may not exist yet; it is reopened if it shrinks."""

    def __init__(self, path: Path, show: Callable[[str], None],
                 line_filter: Callable[[str], list[str]] | None = None, poll_s: float = 0.2):
        self.path, self.show, self.poll_s = Path(path), show, poll_s
        self.line_filter = line_filter or (lambda line: [line])
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self._pending = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-log", daemon=True)

    def _read(self, final: bool = False) -> None:
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size < self.offset:  # truncated or replaced: start over
            self.offset, self._pending = 0, b""
        if size == self.offset and not (final and self._pending):
            return
        with open(self.path, "rb") as log_file:
            log_file.seek(self.offset)
            data = log_file.read()
        self.offset += len(data)
        *lines, self._pending = (self._pending + data).split(b"\n")
        if final and self._pending:
            lines, self._pending = lines + [self._pending], b""
        for raw in lines:
            for shown in self.line_filter(raw.decode(errors="replace").rstrip("\r")):
                self.show(shown)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._read()

    def start(self) -> "LogFollower":
        """Start following on a thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following and show the lines written since the last poll."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._read(final=True)

    def __enter__(self) -> "LogFollower":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def first_error_line(log_path: Path | None) -> str:
    """The first error line of a tritonserver log (Triton's "E<mmdd> ..." lines; CUDA notices of a
    machine without a GPU left out), without its prefix; a pointer to the log when it has none."""
    if log_path is None or not Path(log_path).exists():
        return "its log went to this terminal"
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if line[:1] == "E" and line[1:5].isdigit() and not is_cuda_notice(line):
            return line.split("] ", 1)[-1].strip()
    return f"no error line in its log ({log_path})"


def log_tail(log_path: Path | None, lines: int = 40) -> str:
    """"; server log tail:" and the last `lines` lines of a tritonserver log, for an error message; CUDA
    notices of a machine without a usable GPU left out and explained in one line instead ("" without a log)."""
    if log_path is None or not Path(log_path).exists():
        return ""
    text = Path(log_path).read_text(errors="replace").splitlines()
    kept = [line for line in text if not is_cuda_notice(line)]
    tail = kept[-lines:]
    if len(kept) < len(text):  # some CUDA notices were left out
        tail.insert(0, f"({cpu_only_explanation(log_path)})")
    return "; server log tail:\n" + "\n".join(tail)
