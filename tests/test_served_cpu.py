"""The server's CPU per inference against the in-process bar's, measured in one test (a ratio, not a time):
`int8` tensors over HTTP with system shared memory, as `bench run` measures them. It fails when what the
server spends per inference around the network (gRPC, the batcher, the copies into and out of the stub, the
stub's round trip) grows beyond the stated margin of the network's own cost in-process.

Margins: the INT8 network's CPU per image sets the scale. Without AMX it is about 9 ms on the 2-core
reference machine, and the server measured 1.17x in-process (AMD EPYC, Zen 4, AVX-512 VNNI, 2026-11-27); with
AMX it is about 2 ms, so the same fixed cost per request weighs more: 2.0x measured by `bench run` on a
2-core Xeon with AMX. Each margin leaves room for a shared machine's noise, and fails on a doubled cost.
"""
from __future__ import annotations

import pytest

from resnet18_kit.contract import ONNX_MODEL
from resnet18_kit.observe.machine import cpu_isa
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.tools.bench import inprocess
from resnet18_kit.tools.bench.sweeps import measure_level
from resnet18_kit.tools.load.perf_analyzer import RESNET18_LOGITS_BYTES, LoadSpec

VARIANT = "int8"
#: Server CPU per inference / in-process CPU per image that fails the test, by whether the CPU has AMX.
MARGIN = {"AMX": 3.0, "no AMX": 1.6}
CONCURRENCY = 32


@pytest.mark.live
@pytest.mark.slow
def test_int8_tensors_cost_the_server_little_more_cpu_than_in_process(repository, tmp_path):
    view = ModelConfigView.for_variant(repository, ONNX_MODEL, VARIANT)
    loaders = repository.runtimes()
    assert inprocess.allocate_as_served(repository)  # malloc as the served stubs set it (allocator.py)
    spec = loaders.RuntimeSpec.from_parameters(view.parameters, repository.root / ONNX_MODEL / "1")
    bar = inprocess.strongest(loaders, spec, [view.max_batch_size], duration_s=3.0)
    inprocess_ms = bar.best["cpu_ms_per_image"]

    config = config_on_free_ports(model_repository=repository.root, model_config_name=VARIANT)
    server = EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log")
    server.start()
    try:
        load = LoadSpec("concurrency", (CONCURRENCY,), shared_memory="system", output_shm_bytes=RESNET18_LOGITS_BYTES,
                        request_count=max(200, int(bar.best["img_per_s"] * 4)))
        level = measure_level(server, ONNX_MODEL, load, CONCURRENCY, tmp_path / "level", "http")
    finally:
        server.stop(drain_s=0)  # measured: what it still holds no longer matters
    served = level["server_cpu_ms_per_inference"]
    assert level["server"]["inference_count"] >= load.request_count and served["total"] is not None, level
    assert set(served["by_process"]) >= {"tritonserver", "stub resnet18_onnx", "stubs"}, served
    margin = MARGIN["AMX" if "AMX" in cpu_isa() else "no AMX"]
    ratio = served["total"] / inprocess_ms
    assert ratio <= margin, (f"server {served['total']:.2f} ms per inference ({served['by_process']}) / in-process "
                             f"{inprocess_ms:.2f} ms ({bar.label()}) = {ratio:.2f}x, over {margin}x")
    # the network's own stub does the network's work: at least what in-process spends, less the noise
    assert served["by_process"]["stub resnet18_onnx"] >= 0.7 * inprocess_ms, (served, inprocess_ms)
