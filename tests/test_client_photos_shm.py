"""Encoded photos through system shared memory (`classify(..., shared_memory=True)`, `resnet18-kit classify
--shared-memory`): the same answers as over the socket, a region that grows when a request outgrows it, and
nothing left registered or in /dev/shm after close."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from resnet18_kit.client import AsyncTritonClassifierClient, TritonClassifierClient
from resnet18_kit.client import shared_memory
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import ENSEMBLE_MODEL, PROTOCOLS

pytestmark = pytest.mark.live


def registered(server) -> set[str]:
    with TritonClassifierClient(server.config.http_url, "http") as client:
        return {region["name"] for region in client.raw.get_system_shared_memory_status()}


def rows(predictions) -> list[list[tuple[int, float]]]:
    return [[(p.class_index, round(p.probability, 6)) for p in row] for row in predictions]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_photos_through_shared_memory_equal_the_socket_and_the_region_grows(triton_server, protocol, monkeypatch):
    photos = [path.read_bytes() for path in sample_photos()]
    small = min(photos, key=len)
    monkeypatch.setattr(shared_memory, "MIN_PHOTO_REGION_BYTES", len(small) + 4)  # the first request fills it
    url = triton_server.config.url(protocol)
    with TritonClassifierClient(url, protocol) as plain:
        expected = rows(plain.classify(photos))
        expected_small = rows(plain.classify([small]))
    shared = TritonClassifierClient(url, protocol, shared_memory=True)
    try:
        assert rows(shared.classify([small])) == expected_small
        first = shared._regions[f"{ENSEMBLE_MODEL} photos"]
        assert first.input_bytes == len(small) + 4 and first.input_name in registered(triton_server)
        assert rows(shared.classify(photos)) == expected  # outgrows it: replaced by a larger one
        grown = shared._regions[f"{ENSEMBLE_MODEL} photos"]
        assert grown.input_bytes >= sum(4 + len(p) for p in photos) > first.input_bytes
        names = registered(triton_server)
        assert grown.input_name in names and first.input_name not in names
        assert not (Path("/dev/shm") / first.input_key.lstrip("/")).exists()
    finally:
        shared.close()
    assert grown.input_name not in registered(triton_server)
    assert not (Path("/dev/shm") / grown.input_key.lstrip("/")).exists()


def test_the_asyncio_client_sends_photos_through_shared_memory_too(triton_server):
    photos = [path.read_bytes() for path in sample_photos()]
    url = triton_server.config.grpc_url
    with TritonClassifierClient(url, "grpc") as plain:
        expected = rows(plain.classify(photos))

    async def both() -> tuple[list, list]:
        async with AsyncTritonClassifierClient(url, "grpc", shared_memory=True) as client:
            together = await asyncio.gather(*(client.classify([photo]) for photo in photos))  # one at a time
            return [row for answer in together for row in rows(answer)], list(client._regions)
    answers, regions = asyncio.run(both())
    assert answers == expected and regions == [f"{ENSEMBLE_MODEL} photos"]


def test_the_command_classifies_through_shared_memory(triton_server, tmp_path):
    done = subprocess.run([sys.executable, "-m", "resnet18_kit", "classify", "--url", triton_server.config.grpc_url,
                           "--protocol", "grpc", "--shared-memory", "--json", "--top-k", "1",
                           *map(str, sample_photos())], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == len(sample_photos()) and all(len(line["predictions"]) == 1 for line in lines)
    assert not [region for region in registered(triton_server) if "resnet18_" in region]
