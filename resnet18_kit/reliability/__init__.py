"""Overload, queue timeouts, readiness, bad input, faults and shutdown against the real embedded
tritonserver, with every request accounted for (docs/reliability.md).

Each scenario sends requests, classifies every outcome (load.outcomes: answered, refused, timed out,
invalid, wrong, error, lost) and compares what the clients saw with what the server counted. The tests
(tests/test_reliability*.py) run the scenario functions with small numbers;
`python -m resnet18_kit.reliability` runs them bigger and prints the table of docs/reliability.md.

Scenarios, one module each (the `--scenario` name in brackets):
  burst            a burst far above capacity, and the server's counts of it       [burst]
  refusal          the server's own time to refuse a request that meets a full queue [refusal]
  queue_timeout    requests left in the queue past their timeout, and overrides     [timeout]
  readiness        what readiness and the queue gauge say while requests are refused [readiness]
  bad_input        the corpus of bad images, bad tensors and names that are not UTF-8 [bad-input]
  stub_kill        a Python-backend stub SIGKILLed under load, supervised            [stub-kill]
  crash_request    the HTTP/JSON request that aborts Triton 2.51, supervised         [crash-request]
  sigterm          SIGTERM to `python -m resnet18_kit.server` with requests in flight [sigterm]
  restricted_api   the admin key's restricted APIs, with and without the key          [security]
Shared:
  loads            what is sent (TensorLoad: onnx_load, ensemble_load, echo_load), reference answers,
                   judging an answer
  senders          how it is sent: all at once (asyncio), one at a time (SteadyLoad), on a fresh
                   connection, raw HTTP bodies and raw gRPC messages past the client library's checks
  server_counts    what the server counted: metrics endpoint and statistics extension
  table            the table's columns
  __main__         the command; soak: the 10-minute soak (`python -m resnet18_kit.reliability.soak`)
"""
from __future__ import annotations

from pathlib import Path

from resnet18_kit.contract import MODEL_REPOSITORY, results_dir

#: The scenarios' own models (beside this module): an echo with a short queue and a slow model with a queue timeout.
RELIABILITY_REPOSITORY = Path(__file__).parent / "model_repository"
ECHO_MODEL = "reliability_echo"        # model_repository/ here: y = x after 200 ms, queue of 8
TIMEOUT_MODEL = "reliability_timeout"  # model_repository/ here: 200 ms per request, 2 s queue timeout
RESULTS_DIR = results_dir("reliability")
__all__ = ["RELIABILITY_REPOSITORY", "ECHO_MODEL", "TIMEOUT_MODEL", "RESULTS_DIR", "repository_with"]


def repository_with(models: list[str], target: Path) -> Path:
    """A model repository in `target` holding links to `models` (from the shipped model_repository/
    or RELIABILITY_REPOSITORY), so a dedicated server loads only those; returns `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for model in models:
        source = MODEL_REPOSITORY / model
        if not source.is_dir():
            source = RELIABILITY_REPOSITORY / model
        (target / model).symlink_to(source)
    return target

