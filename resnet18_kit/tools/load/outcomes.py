"""What became of each request a load generator sent, and the counts of a run.

Every request gets exactly one `Outcome`. Its kind comes from the client's typed errors
(`client.errors.from_triton`), so HTTP's status strings ("503") and gRPC's code names
("StatusCode.UNAVAILABLE") are told apart in one place:

    ANSWERED   a response with the right request id and the right values
    REFUSED    QueueFullError: 503 / UNAVAILABLE "Exceeds maximum queue size", never queued
    TIMED_OUT  DeadlineExceededError: 503 / UNAVAILABLE "Request timeout expired", left the queue
               unserved (or the client's own deadline passed first)
    INVALID    InvalidInputError: 400 / INVALID_ARGUMENT
    WRONG      a response, but not the answer to this request
    ERROR      any other failure (server unavailable or stopping, connection refused or reset, ...)
    LOST       no outcome within the sender's bound: the request hung
"""
from __future__ import annotations

from dataclasses import dataclass

from tritonclient.utils import InferenceServerException

from resnet18_kit.client.errors import (DeadlineExceededError, InferenceError, InvalidInputError, QueueFullError,
                                        from_triton)

ANSWERED = "answered"
REFUSED = "refused"
TIMED_OUT = "timed-out"
INVALID = "invalid"
WRONG = "wrong"
ERROR = "error"
LOST = "lost"
#: Every kind, in the order summaries list them.
KINDS = (ANSWERED, REFUSED, TIMED_OUT, INVALID, WRONG, ERROR, LOST)
#: The kinds whose latency percentiles `summarize` reports.
TIMED_KINDS = (ANSWERED, REFUSED, TIMED_OUT)
_KIND_OF_ERROR = ((QueueFullError, REFUSED), (DeadlineExceededError, TIMED_OUT), (InvalidInputError, INVALID))


@dataclass
class Outcome:
    """What one request got. index: the request's number (also its request id); kind: one of KINDS;
    latency_s: seconds from just before the send to the outcome; status: HTTP status ("503") or gRPC
    code ("StatusCode.UNAVAILABLE") of a failure, None otherwise; message: the failure's message."""

    index: int
    kind: str
    latency_s: float
    status: str | None = None
    message: str = ""


def classify_error(exc: InferenceServerException | InferenceError) -> tuple[str, str | None, str]:
    """(kind, status, message) of a failed request: REFUSED, TIMED_OUT or INVALID for the typed
    errors of that name (module doc), ERROR for any other; status and message as the server gave them."""
    error = from_triton(exc) if isinstance(exc, InferenceServerException) else exc
    kind = next((kind for error_type, kind in _KIND_OF_ERROR if isinstance(error, error_type)), ERROR)
    return kind, error.status, error.message


def failed(index: int, exc: Exception, latency_s: float) -> Outcome:
    """The outcome of request `index` that raised `exc` after `latency_s` seconds: classified
    (`classify_error`) for a Triton error, ERROR with the exception's type and text for any other
    (connection refused or reset)."""
    if isinstance(exc, (InferenceServerException, InferenceError)):
        kind, status, message = classify_error(exc)
        return Outcome(index, kind, latency_s, status, message)
    return Outcome(index, ERROR, latency_s, None, f"{type(exc).__name__}: {exc}")


def summarize(outcomes: list[Outcome], sent: int) -> dict:
    """{"sent": sent, <kind>: count for each of KINDS, "<kind>_ms": {"p50", "p99", "max"}} where LOST
    also counts the requests sent without any outcome (sent - len(outcomes)), and the latency
    percentiles (milliseconds, 0.1 ms) are given for each of TIMED_KINDS that occurred."""
    counts = {kind: sum(o.kind == kind for o in outcomes) for kind in KINDS}
    counts[LOST] += sent - len(outcomes)
    summary = {"sent": sent, **counts}
    for kind in TIMED_KINDS:
        latencies_ms = sorted(o.latency_s * 1000 for o in outcomes if o.kind == kind)
        if latencies_ms:
            summary[f"{kind}_ms"] = {"p50": round(percentile(latencies_ms, 50), 1),
                                     "p99": round(percentile(latencies_ms, 99), 1),
                                     "max": round(latencies_ms[-1], 1)}
    return summary


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0..100) of `sorted_values` (ascending); NaN when empty."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]
