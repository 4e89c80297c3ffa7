"""Typed errors of the client API, made from tritonclient's `InferenceServerException`.

Triton reports the same failure differently per protocol: HTTP gives the status code as a string ("400",
"503"), gRPC the code's name ("StatusCode.INVALID_ARGUMENT", "StatusCode.UNAVAILABLE"). `from_triton`
maps both to one exception class per failure kind, each carrying the protocol's status and the server's
message unchanged. `typed_error` maps every other failure of an exchange (timeouts, connections, answers
that are not the protocol) to the same classes, each message one line.
"""
from __future__ import annotations

import asyncio

from tritonclient.utils import InferenceServerException

from resnet18_kit.client.backoff import Deadline

#: Triton's message when a model's queue (dynamic_batching.default_queue_policy.max_queue_size) is full.
#: The request was refused before it was queued, so sending it again later is safe.
QUEUE_FULL_MESSAGE = "Exceeds maximum queue size"
#: Triton's message when a request's `timeout` expired while it waited in the queue.
QUEUE_TIMEOUT_MESSAGE = "Request timeout expired"
#: Triton's message (HTTP 404 / gRPC NOT_FOUND) for a model of its repository that is not loaded: a kit
#: server that is stopping unloads every model first (upstream.admission), so it refuses new requests this
#: way while it answers those it holds. Not run, so safe to send again, to another replica.
UNLOADED_MESSAGE = "has no available versions"

_INVALID = {"400", "StatusCode.INVALID_ARGUMENT"}
_UNAVAILABLE = {"503", "StatusCode.UNAVAILABLE"}
_DEADLINE = {"StatusCode.DEADLINE_EXCEEDED", "504"}
_NOT_FOUND = {"404", "StatusCode.NOT_FOUND"}
_CANCELLED = {"StatusCode.CANCELLED", "499"}


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


class RequestCancelledError(InferenceError):
    """The caller cancelled the request (its `cancel` event was set), or the server answered CANCELLED
    (HTTP 499 is not sent: the connection is gone; gRPC CANCELLED)."""


class ServerUnavailableError(InferenceError):
    """The server could not be reached, answered 503 / UNAVAILABLE for another reason, or refused with
    404 / NOT_FOUND "has no available versions" because it is stopping (the model is unloaded)."""


class NotTritonError(ServerUnavailableError):
    """Something answered at the address, but not as a Triton server speaking the client's protocol: the
    gRPC or metrics port spoken to over HTTP, the HTTP port over gRPC, another HTTP server."""


def from_triton(exc: InferenceServerException) -> InferenceError:
    """Map tritonclient's exception to the typed error of this module (message and status kept)."""
    status, message = exc.status(), exc.message() or str(exc)
    if status in _UNAVAILABLE and QUEUE_FULL_MESSAGE in message:
        return QueueFullError(message, status)
    if status in _CANCELLED:
        return RequestCancelledError(message, status)
    if status in _DEADLINE or QUEUE_TIMEOUT_MESSAGE in message:
        return DeadlineExceededError(message, status)
    if UNLOADED_MESSAGE in message:
        return ServerUnavailableError(message, status)
    if status in _NOT_FOUND or "unknown model" in message or "is not found" in message:
        return ModelNotFoundError(message, status)
    if status in _INVALID:
        return InvalidInputError(message, status)
    if status in _UNAVAILABLE or status is None:
        return ServerUnavailableError(message, status)
    return InferenceError(message, status)


def typed_error(exc: BaseException, url: str, protocol: str, deadline: Deadline | None = None,
                probe: bool = True) -> InferenceError:
    """The typed error (client.errors) for a failure of a Call to the server at `url`, one line; raises
    `exc` itself when it is not a failure of the exchange (a bug, KeyboardInterrupt, ...).

    Besides tritonclient's InferenceServerException (client.errors.from_triton): timeouts ->
    DeadlineExceededError; connection failures -> ServerUnavailableError "cannot connect"; an answer that
    is not the KServe v2 protocol over `protocol` (the gRPC or metrics port spoken to over HTTP, the HTTP
    port over gRPC, another HTTP server) -> NotTritonError; with probe=False (an inference, where a server
    going away can also close the socket) tritonclient's own errors keep from_triton's class and message,
    and only an unparsable answer is NotTritonError. A ServerUnavailableError without a status after the
    deadline passed becomes DeadlineExceededError."""
    if isinstance(exc, InferenceServerException):
        error = from_triton(exc)
        if probe and _garbled(error.message):
            error = _not_triton(url, protocol, _first_line(error.message))
    elif isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        error = DeadlineExceededError(f"no response within the deadline ({_first_line(str(exc)) or type(exc).__name__})")
    elif isinstance(exc, (ConnectionError, OSError)) or _is_lost_connection(exc):
        error = ServerUnavailableError(f"cannot connect to {url}: {_first_line(str(exc)) or type(exc).__name__}")
    elif _is_protocol_garbage(exc, generic=probe):
        error = _not_triton(url, protocol, f"{type(exc).__name__} {_first_line(str(exc))}")
    else:
        raise exc
    if deadline is not None and isinstance(error, ServerUnavailableError) and error.status is None \
            and deadline.expired():
        return DeadlineExceededError(f"no response within the deadline: {error.message}")
    return error


def _not_triton(url: str, protocol: str, detail: str) -> NotTritonError:
    others = "the gRPC or metrics port, or another server" if protocol == "http" else \
        "the HTTP or metrics port, or another server"
    name = {"http": "HTTP", "grpc": "gRPC"}.get(protocol, protocol)
    return NotTritonError(f"{url} does not answer as a Triton {name} endpoint ({others}?): {detail[:160]}")


#: Exceptions (by module prefix) an HTTP client raises when the answer is not HTTP/JSON it expects:
#: rapidjson's JSONDecodeError (the metrics port), geventhttpclient's HTTPParseError (module _parser; the
#: gRPC port), aiohttp's (the asyncio client); and a reply of another shape (KeyError, TypeError, ValueError).
_GARBAGE_MODULES = ("rapidjson", "geventhttpclient", "_parser", "http.client", "aiohttp", "json", "gevent")
#: Parts of tritonclient's messages when the answer was not its protocol: a body that is not JSON (HTTP),
#: an HTTP/1 server or a non-gRPC HTTP/2 answer (gRPC).
_GARBLED_MARKERS = ("decoding the response", "Parse error", "JSONDecodeError", "Socket closed",
                    "http2 header with status", "http1.x server", "Trying to connect an http1")


def _is_protocol_garbage(exc: BaseException, generic: bool) -> bool:
    """An HTTP library's parse error; with `generic`, also a ValueError / KeyError / TypeError (a reply of
    another shape to a health, metadata or config call)."""
    import http.client

    module = type(exc).__module__ or ""
    kinds = (http.client.HTTPException, ValueError, KeyError, TypeError) if generic else http.client.HTTPException
    return (module.startswith(_GARBAGE_MODULES) or isinstance(exc, kinds)) and not isinstance(exc, InferenceError)


def _is_lost_connection(exc: BaseException) -> bool:
    """aiohttp's connection failures that are not OSErrors (ServerDisconnectedError, ...)."""
    return any(kind.__name__ == "ClientConnectionError" for kind in type(exc).__mro__)


def _garbled(message: str) -> bool:
    return any(marker in message for marker in _GARBLED_MARKERS)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
