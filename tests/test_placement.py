"""No two instances of a served model (the network's or preprocess's) share a pinned core.

A runtime that pins its threads picks the same cores in every stub process (resnet18_onnx/1/runtimes.py,
"Placement"): OpenVINO put both single-threaded `int8` instances on core 0 of 2, ONNX Runtime with 0
intra-op threads pinned both default instances' workers to core 1. While each config serves a load, every
stub thread's affinity is read from /proc (observe.placement); any core pinned by two instances fails.
The load: tensors to the network from some clients, photos through the ensemble (preprocess too) from
the others.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from resnet18_kit.client import TritonClassifierClient
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.observe.placement import (PlacementSampler, describe, parse_cpu_list, shared_pinned_cores,
                                            thread_affinities)
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

LOAD_S = 3.0
CLIENTS = 4


def pinned_under_load(server: EmbeddedTritonServer) -> dict:
    """For LOAD_S seconds, batches of 4 tensors from half of CLIENTS threads and 2 photos a request
    through the ensemble from the others, while sampling the network's and preprocess's stubs."""
    stubs = {name: pid for name, pid in server.stub_processes().items()
             if name.startswith((ONNX_MODEL + "_", PREPROCESS_MODEL + "_"))}
    network = [name for name in stubs if name.startswith(ONNX_MODEL + "_")]
    assert len(network) == 2 and len(stubs) > 3, stubs  # both configs: 2 network instances, preprocess's
    usable = frozenset(os.sched_getaffinity(server.process.pid))
    stop, answered, errors = threading.Event(), [0], []
    batch = np.random.default_rng(0).integers(0, 256, (4, 3, 224, 224), dtype=np.uint8)
    photos = [path.read_bytes() for path in sample_photos(("rocket.jpg", "coffee.png"))]

    def load(photo_client: bool) -> None:
        try:
            with TritonClassifierClient(server.config.grpc_url, "grpc") as client:
                while not stop.is_set():
                    client.classify(photos) if photo_client else client.infer_tensor(batch)
                    answered[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i % 2 == 1,)) for i in range(CLIENTS)]
    with PlacementSampler(stubs, usable) as sampler:
        for thread in threads:
            thread.start()
        time.sleep(LOAD_S)
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors and answered[0] >= CLIENTS, (errors, answered)
    assert all(count > 1 for count in sampler.threads_seen.values()), sampler.threads_seen
    return sampler.pinned


def test_default_config_instances_share_no_pinned_core(triton_server):
    pinned = pinned_under_load(triton_server)
    assert shared_pinned_cores(pinned) == {}, describe(pinned)


@pytest.mark.live
def test_int8_instances_share_no_pinned_core(repository, tmp_path):
    config = config_on_free_ports(model_repository=repository.root, model_config_name="int8")
    with EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log", drain_on_exit=False) as server:
        pinned = pinned_under_load(server)
    assert shared_pinned_cores(pinned) == {}, describe(pinned)


def test_shared_pinned_cores_names_each_core_two_processes_pin():
    pinned = {"a_0": frozenset({0}), "a_1": frozenset({0, 1}), "b_0": frozenset({3}), "c_0": frozenset()}
    assert shared_pinned_cores(pinned) == {0: ["a_0", "a_1"]}
    assert describe({"a_0": frozenset(), "a_1": frozenset()}) == "unpinned"
    assert describe(pinned) == "pinned: a_0 -> core 0; a_1 -> core 0,1; b_0 -> core 3"


def test_affinities_are_read_per_thread_from_proc():
    assert parse_cpu_list("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}
    with pytest.raises(ValueError):
        parse_cpu_list("zero")
    mine = thread_affinities(os.getpid())
    assert threading.get_native_id() in mine
    assert mine[threading.get_native_id()] == os.sched_getaffinity(0)
    assert thread_affinities(2 ** 22 + 1) == {}  # above Linux's pid_max: no such process


def test_sampler_sees_a_thread_pinned_to_one_core_while_it_is():
    usable = os.sched_getaffinity(0)
    if len(usable) < 2:
        pytest.fail("this check needs 2 usable cores (the reference machine has 2)")
    core = min(usable)
    pinned, release = threading.Event(), threading.Event()

    def pin_then_wait() -> None:
        os.sched_setaffinity(0, {core})  # 0: the calling thread only
        pinned.set()
        release.wait()

    thread = threading.Thread(target=pin_then_wait)
    with PlacementSampler({"me": os.getpid()}, usable, interval_s=0.02) as sampler:
        thread.start()
        pinned.wait()
        time.sleep(0.1)
        release.set()
        thread.join()
    assert sampler.pinned == {"me": frozenset({core})}
    assert describe(sampler.pinned) == f"pinned: me -> core {core}"
