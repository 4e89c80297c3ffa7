"""Fixtures: a real tritonserver on free ports for the whole session, clients for both protocols."""
from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch

from client.classifier import TritonClassifierClient
from export.artifacts import PROVENANCE_PATHS, missing_artifacts
from export.resnet18 import model_from_spec
from server.embedded import EmbeddedTritonServer, ServerConfig

PROTOCOLS = ("http", "grpc")


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now (held open together while chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    missing = missing_artifacts()
    if missing:
        pytest.fail(f"model files missing ({', '.join(map(str, missing))}): run `make export` first")
    http_port, grpc_port, metrics_port = free_ports(3)
    config = ServerConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    server = EmbeddedTritonServer(config, log_path=tmp_path_factory.mktemp("triton") / "tritonserver.log")
    server.start()
    yield server
    server.stop()


def url_for(server: EmbeddedTritonServer, protocol: str) -> str:
    return server.config.http_url if protocol == "http" else server.config.grpc_url


@pytest.fixture(params=PROTOCOLS)
def protocol(request) -> str:
    return request.param


@pytest.fixture
def client(triton_server, protocol):
    with TritonClassifierClient(url_for(triton_server, protocol), protocol) as c:
        yield c


@pytest.fixture(scope="session")
def eager_model() -> torch.nn.Module:
    """The eager torch model the exports were made from (same weights, per provenance.json)."""
    return model_from_spec(json.loads(PROVENANCE_PATHS[0].read_text())["weights"])


def eager_logits(model: torch.nn.Module, batch: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(batch)).numpy()


def assert_invalid_argument(exc, protocol: str) -> None:
    """HTTP 400 or gRPC INVALID_ARGUMENT, as Triton reports bad input."""
    expected = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    assert exc.status() == expected, f"status {exc.status()} (expected {expected}): {exc.message()}"
