"""Python clients for the ResNet-18 model repository served by Triton (KServe v2 / Open Inference Protocol,
over HTTP or gRPC). Everything a user imports is here:

    from resnet18_kit.client import TritonClassifierClient

    with TritonClassifierClient("127.0.0.1:8000", protocol="http") as client:
        best = client.classify([open("cat.jpg", "rb").read()], top_k=1)[0][0]
        print(best.label, best.probability)

TritonClassifierClient (blocking) and AsyncTritonClassifierClient (asyncio) have the same methods and
arguments; their answers are Prediction rows; their failures are the InferenceError subclasses below;
RetryPolicy sets their backoff after a queue-full refusal and their default deadline. docs/usage.md
"Python API" walks through them.
"""
import importlib

#: Each public name -> the module of this package that defines it, imported on first use (__getattr__), so
#: that importing a module of its own (client.samples: the sample photos) needs no tritonclient.
_EXPORTS = {
    "TritonClassifierClient": "sync_client", "AsyncTritonClassifierClient": "async_client", "Prediction": "core",
    "RetryPolicy": "backoff", **{name: "errors" for name in (
        "InferenceError", "InvalidInputError", "ModelNotFoundError", "QueueFullError", "DeadlineExceededError",
        "RequestCancelledError", "ServerUnavailableError", "NotTritonError")},
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """A public name (_EXPORTS), imported from its module on first use; AttributeError for another."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
