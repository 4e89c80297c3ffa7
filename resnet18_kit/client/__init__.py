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
from resnet18_kit.client.async_client import AsyncTritonClassifierClient
from resnet18_kit.client.backoff import RetryPolicy
from resnet18_kit.client.core import Prediction
from resnet18_kit.client.errors import (DeadlineExceededError, InferenceError, InvalidInputError, ModelNotFoundError,
                                        NotTritonError, QueueFullError, RequestCancelledError, ServerUnavailableError)
from resnet18_kit.client.sync_client import TritonClassifierClient

__all__ = [
    "TritonClassifierClient", "AsyncTritonClassifierClient", "Prediction", "RetryPolicy",
    "InferenceError", "InvalidInputError", "ModelNotFoundError", "QueueFullError", "DeadlineExceededError",
    "RequestCancelledError", "ServerUnavailableError", "NotTritonError",
]
