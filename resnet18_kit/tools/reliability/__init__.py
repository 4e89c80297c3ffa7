"""Overload, queue timeouts, readiness, bad input, faults and shutdown against the real embedded
tritonserver, with every request accounted for (docs/reliability.md).

Each scenario sends requests, classifies every outcome (load.outcomes: answered, refused, timed out,
invalid, wrong, error, lost) and compares what the clients saw with what the server counted. The tests
(tests/test_reliability*.py) run the scenario functions with small numbers;
`resnet18-kit reliability run` runs them bigger and prints the table of docs/records/reliability.md.

Scenarios, one module each (the `--scenario` name in brackets):
  burst            a burst far above capacity, and the server's counts of it       [burst]
  refusal          the server's own time to refuse a request that meets a full queue [refusal]
  queue_timeout    requests left in the queue past their timeout, and overrides     [timeout]
  readiness        what readiness and the queue gauge say while requests are refused [readiness]
  bad_input        the corpus of bad images, bad tensors and names that are not UTF-8 [bad-input]
  stub_kill        a Python-backend stub SIGKILLed under load, supervised            [stub-kill]
  crash_request    the HTTP/JSON request that aborts Triton 2.51, supervised         [crash-request]
  sigterm          SIGTERM to `resnet18-kit serve` with requests in flight         [sigterm]
  restricted_api   the admin key's restricted APIs, with and without the key          [security]
Shared:
  loads            what is sent (TensorLoad: onnx_load, ensemble_load, echo_load), reference answers,
                   judging an answer
  senders          how it is sent: all at once (asyncio), one at a time (SteadyLoad), on a fresh
                   connection, raw HTTP bodies and raw gRPC messages past the client library's checks
  server_counts    what the server counted: metrics endpoint and statistics extension
  table            the table's columns
  __main__         the command (`resnet18-kit reliability run|soak`); soak: the 10-minute soak
"""
from __future__ import annotations

from pathlib import Path

#: The scenarios' own models (beside this module): an echo with a short queue and a slow model with a queue timeout.
RELIABILITY_REPOSITORY = Path(__file__).parent / "model_repository"
ECHO_MODEL = "reliability_echo"        # model_repository/ here: y = x after 200 ms, queue of 8
TIMEOUT_MODEL = "reliability_timeout"  # model_repository/ here: 200 ms per request, 2 s queue timeout
#: The folder under the results folder (Settings.results_dir) where the command writes.
RESULTS_NAME = "reliability"
__all__ = ["RELIABILITY_REPOSITORY", "ECHO_MODEL", "TIMEOUT_MODEL", "RESULTS_NAME", "repository_with"]


def repository_with(models: list[str], target: Path, shipped: Path | None = None) -> Path:
    """A model repository in `target` holding links to `models`, each from `shipped` (the shipped model
    repository's root, Settings.model_repository) where it has it, else from RELIABILITY_REPOSITORY, so a
    dedicated server loads only those; returns `target`. FileNotFoundError naming a model neither has."""
    target.mkdir(parents=True, exist_ok=True)
    for model in models:
        sources = ([Path(shipped) / model] if shipped is not None else []) + [RELIABILITY_REPOSITORY / model]
        source = next((path for path in sources if path.is_dir()), None)
        if source is None:
            raise FileNotFoundError(f"no model {model!r} in {' or '.join(str(p.parent) for p in sources)}")
        (target / model).symlink_to(source)
    return target

