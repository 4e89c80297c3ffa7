"""Swapping the config of docker compose's `triton` container, both ways (docs/model-repository.md "Swapping
configs"): live, with `resnet18-kit swap` against its published gRPC port (TRITON_MODEL_CONTROL=explicit),
and by re-creating it with a new TRITON_MODEL_CONFIG_NAME. Load runs throughout from clients that never
retry; `pytest -s` prints the counts and times. The engine is conftest.py's `engine` fixture. The fleet
profile's swaps, replica by replica, are in tests/test_compose_live.py (on its one fleet).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from resnet18_kit.containers.compose import ComposePorts, ComposeProject
from resnet18_kit.contract import ONNX_MODEL
from resnet18_kit.tools.reliability.fleet_load import FleetLoad, Tally
from resnet18_kit.tools.reliability.loads import ensemble_load, onnx_load, reference_answers
from resnet18_kit.server.model_control import ModelControl, swap, variant_targets

KEY = "compose-swap-test-key"


def counts(tally: Tally) -> str:
    times = [at for at, _ in tally.answered_at]
    gap_s = max((b - a for a, b in zip(times, times[1:])), default=float("nan"))
    return (f"sent {tally.sent}, answered {tally.answered}, refused {tally.refused}, failed {tally.failed}, "
            f"lost {tally.lost}; longest time without an answer {gap_s:.1f} s")


def loads_with_both_answers(config, repository) -> list[FleetLoad]:
    """Photos through the ensemble over HTTP and tensors to resnet18_onnx over gRPC (the cache never answers
    those), each answer right under the default or the int8 config."""
    photos, tensors = reference_answers(config, ensemble_load()), reference_answers(config, onnx_load(4))
    with ModelControl(config.grpc_url, KEY) as control:
        swap(control, variant_targets(repository, "int8"))
        photos.also_expected = [reference_answers(config, ensemble_load()).expected]
        tensors.also_expected = [reference_answers(config, onnx_load(4)).expected]
        swap(control, variant_targets(repository, "default"))
    return [FleetLoad(config, "http", photos, workers=1, retry=False, pause_s=0.002),
            FleetLoad(config, "grpc", tensors, workers=2, retry=False, pause_s=0.002)]


def serving(config) -> str:
    with ModelControl(config.grpc_url, KEY) as control:
        return control.served_config(ONNX_MODEL).parameters["model_filename"].string_value


@pytest.mark.slow
def test_the_container_swaps_live_with_nothing_failed_and_a_re_create_costs_the_restart(engine, images, repository):
    project = ComposeProject(engine, f"r18test-swap-{os.getpid()}", ComposePorts.free(), KEY,
                             settings={"TRITON_MODEL_CONTROL": "explicit"})
    try:
        up_s = project.timed_up()
        config = project.server_config()
        loads = loads_with_both_answers(config, repository)
        for load in loads:
            load.start()
        time.sleep(2.0)
        swaps_s = []
        for variant in ("int8", "default"):
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "resnet18_kit", "swap", "--url", config.grpc_url,
                                   "--model-config-name", variant], capture_output=True, text=True, timeout=300,
                                  env=dict(os.environ, TRITON_ADMIN_KEY=KEY))
            swaps_s.append(time.monotonic() - started)
            assert done.returncode == 0, done.stderr
            assert serving(config) == ("model.int8.onnx" if variant == "int8" else "model.onnx")
        time.sleep(1.0)
        live = [load.stop() for load in loads]
        print(f"\ncompose, live swap default -> int8 -> default: up {up_s:.1f} s, swaps "
              f"{' / '.join(f'{s:.1f}' for s in swaps_s)} s (command included); "
              + "; ".join(f"{p}: {counts(t)}" for p, t in zip(("http", "grpc"), live)), flush=True)
        for tally in live:
            assert tally.answered > 10 and (tally.failed, tally.lost, tally.refused) == (0, 0, 0), tally.errors

        # The other way: a new TRITON_MODEL_CONFIG_NAME and `up` re-creates the container.
        recreate = ComposeProject(engine, project.name, project.ports, KEY,
                                  settings={"TRITON_MODEL_CONTROL": "explicit", "TRITON_MODEL_CONFIG_NAME": "int8"})
        loads = [FleetLoad(config, "grpc", reference_answers(config, onnx_load(4)), workers=2, retry=False,
                           pause_s=0.002)]
        loads[0].load.also_expected = []
        loads[0].load.expected = []  # the answers change with the config; the counts are what is measured
        loads[0].start()
        time.sleep(1.0)
        recreate_s = recreate.timed_up()
        time.sleep(1.0)
        recreated = loads[0].stop()
        print(f"compose, re-create with TRITON_MODEL_CONFIG_NAME=int8: up --wait {recreate_s:.1f} s; grpc: "
              f"{counts(recreated)}", flush=True)
        try:
            assert serving(config) == "model.int8.onnx"
        except Exception:
            print(engine.docker("logs", "--tail", "80", project.container("triton")).stdout, flush=True)
            raise
        assert recreated.lost == 0 and recreated.failed > 0  # the requests sent while it was down
    finally:
        project.down()
