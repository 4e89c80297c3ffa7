"""The registry of Triton defects the kit works around: one `Defect` each, keyed by name.

`fixed_in` is the first Triton release with the whole fix, as read from the upstream pull requests and
release notes (None: no release known to the kit has it); a workaround is on while the running release
is older: $TRITON_SERVER_VERSION (NVIDIA's images set it), else the release `serve --tritonserver` reads
from that server's metadata, else the PyPI wheel's contract.TRITON_VERSION (server.__main__.config_from_args).
`reproduced_by` names the test that shows the defect on 2.51 or the kit's answer to it.
"""
from __future__ import annotations

from dataclasses import dataclass

from resnet18_kit.contract import parse_version


@dataclass(frozen=True)
class Defect:
    """One upstream defect: `key` (what the product asks `needs` for), `upstream` (issue or PR numbers),
    `symptom`, `fixed_in` ((major, minor, patch) or None), `kit` (what the kit does while it is unfixed),
    `reproduced_by` (a test file of this repository)."""

    key: str
    upstream: str
    symptom: str
    fixed_in: tuple[int, int, int] | None
    kit: str
    reproduced_by: str

    @property
    def fixed_in_text(self) -> str:
        return ".".join(map(str, self.fixed_in)) if self.fixed_in else "no release known"


DEFECTS: tuple[Defect, ...] = (
    Defect("grpc-cancellation", "server #7368; PRs #7840, #8078, #8220",
           "a gRPC deadline or cancellation under a full queue crashes or wedges the server", (2, 59, 0),
           "the gRPC guard (serve --grpc-guard), clients that never cancel, wedge restarts",
           "tests/test_deadlines.py"),
    Defect("dead-stub", "server #8604; python_backend #423, core #461, #473",
           "a killed Python-backend stub is not restarted and its model stays READY", (2, 68, 0),
           "the supervisor restarts the server", "tests/test_reliability_faults.py"),
    Defect("http-shape-abort", "server #8182, #8174, #8676",
           "one HTTP/JSON request (shape [10^12, 4]) aborts the server", (2, 68, 0),
           "the supervisor restarts it; HTTP stays on loopback unless an admin key is set",
           "tests/test_reliability_faults.py"),
    Defect("http-body-limit", "server #8174, #8432, #8570", "no limit on the HTTP body", (2, 65, 0),
           "only the 20 MB image limit, after the body is read", "tests/test_bad_input.py"),
    Defect("queue-timeout-late", "server #7512", "a queue timeout is refused late, at the next scheduling point",
           None, "the kit's clients stop waiting at their own deadline", "tests/test_deadlines.py"),
    Defect("keep-alive-stop", "server PR #6986, core PR #335 (2.45)",
           "on SIGTERM open keep-alive HTTP connections are served until the exit timeout, then what the server "
           "holds is abandoned", None, "serve unloads the models first (upstream.admission; --no-refuse-first)",
           "tests/test_lifecycle.py"),
    Defect("http-load-holds", "server #8117, #8958; PR #8737",
           "a model load over HTTP holds that thread's HTTP requests", None, "swap loads over gRPC",
           "tests/test_swap_live.py"),
    Defect("numpy2-stub", "python_backend #384 (pybind11 2.12)",
           "the Python-backend stub misreads numpy 2 arrays (each element the tensor's first byte)", (2, 52, 0),
           "numpy<2; bench gpu brings numpy 1.26 for its stubs", "tests/test_gpu_run.py"),
)
_BY_KEY = {defect.key: defect for defect in DEFECTS}


def needs(key: str, version: str) -> bool:
    """Whether Triton `version` lacks the fix of defect `key` (so its workaround belongs on). KeyError for an
    unknown key, ValueError for a malformed version."""
    fixed_in = _BY_KEY[key].fixed_in
    return fixed_in is None or parse_version(version) < fixed_in


def workarounds(version: str) -> tuple[Defect, ...]:
    """The defects whose workaround is on for Triton `version`, in DEFECTS' order."""
    return tuple(defect for defect in DEFECTS if needs(defect.key, version))


def banner_line(version: str, guarded: bool) -> str:
    """What `serve`'s ready banner says after "Triton": the version and the workarounds on for it, the gRPC
    guard marked OFF when --no-grpc-guard turned it off."""
    keys = [defect.key for defect in workarounds(version)]
    if "grpc-cancellation" in keys and not guarded:
        keys[keys.index("grpc-cancellation")] = "grpc-cancellation (guard OFF: --no-grpc-guard)"
    return f"{version}: workarounds on for {', '.join(keys) or 'nothing'} (docs/reliability.md)"
