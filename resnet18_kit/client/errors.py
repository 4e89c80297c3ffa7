"""Typed errors of the client API, made from tritonclient's `InferenceServerException`.

Triton reports the same failure differently per protocol: HTTP gives the status code as a string ("400",
"503"), gRPC the code's name ("StatusCode.INVALID_ARGUMENT", "StatusCode.UNAVAILABLE"). `from_triton`
maps both to one exception class per failure kind, each carrying the protocol's status and the server's
message unchanged.
"""
from __future__ import annotations

from tritonclient.utils import InferenceServerException

#: Triton's message when a model's queue (dynamic_batching.default_queue_policy.max_queue_size) is full.
#: The request was refused before it was queued, so sending it again later is safe.
QUEUE_FULL_MESSAGE = "Exceeds maximum queue size"
#: Triton's message when a request's `timeout` expired while it waited in the queue.
QUEUE_TIMEOUT_MESSAGE = "Request timeout expired"

_INVALID = {"400", "StatusCode.INVALID_ARGUMENT"}
_UNAVAILABLE = {"503", "StatusCode.UNAVAILABLE"}
_DEADLINE = {"StatusCode.DEADLINE_EXCEEDED", "504"}
_NOT_FOUND = {"404", "StatusCode.NOT_FOUND"}


class InferenceError(Exception):
    """A request failed. `status`: HTTP status ("400") or gRPC code ("StatusCode.UNAVAILABLE"),
    None when the failure happened before a response (connection refused, client-side timeout);
    `message`: the server's message (or the client library's)."""

    def __init__(self, message: str, status: str | None = None, retries: int = 0):
        super().__init__(f"{message} (status {status})" if status else message)
        self.status = status
        self.message = message
        #: Queue-full refusals retried before this error was raised.
        self.retries = retries


class InvalidInputError(InferenceError):
    """HTTP 400 / gRPC INVALID_ARGUMENT: the request itself is wrong; sending it again cannot help."""


class ModelNotFoundError(InferenceError):
    """HTTP 404 / gRPC NOT_FOUND, or HTTP 400 naming an unknown model."""


class QueueFullError(InferenceError):
    """HTTP 503 / gRPC UNAVAILABLE "Exceeds maximum queue size": back-pressure, retried by the client
    until its deadline; raised only when the deadline leaves no time for another try."""


class DeadlineExceededError(InferenceError):
    """The caller's deadline passed: client-side (no answer in time) or server-side (the request's
    `timeout` expired in the model's queue)."""


class ServerUnavailableError(InferenceError):
    """The server could not be reached, or answered 503 / UNAVAILABLE for another reason."""


def from_triton(exc: InferenceServerException) -> InferenceError:
    """Map tritonclient's exception to the typed error of this module (message and status kept)."""
    status, message = exc.status(), exc.message() or str(exc)
    if status in _UNAVAILABLE and QUEUE_FULL_MESSAGE in message:
        return QueueFullError(message, status)
    if status in _DEADLINE or QUEUE_TIMEOUT_MESSAGE in message:
        return DeadlineExceededError(message, status)
    if status in _NOT_FOUND or "unknown model" in message or "is not found" in message:
        return ModelNotFoundError(message, status)
    if status in _INVALID:
        return InvalidInputError(message, status)
    if status in _UNAVAILABLE or status is None:
        return ServerUnavailableError(message, status)
    return InferenceError(message, status)
