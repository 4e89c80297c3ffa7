"""The ensemble as two stages (resnet18_kit/tools/planner/ensemble.py): the tandem simulation, the capacity of
two stages sharing a device, the plan and its written configs, bad profiles. No server."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from resnet18_kit.tools.planner.batcher import BatcherConfig, QueuePolicy
from resnet18_kit.tools.planner.ensemble import (EnsembleProfile, Interference, StageConfig, format_ensemble_plan,
                                           plan_ensemble, simulate_ensemble)
from resnet18_kit.tools.planner.profile import BatchTiming, Profile
from resnet18_kit.tools.planner.search import SearchSpace, Slo

KIT = Path(sys.executable).parent / "resnet18-kit"


def ensemble_profile(pre_ms: float = 10.0, net_ms: float = 5.0, pre_factor: float = 1.0,
                     net_factor: float = 1.0, overhead_us: float = 0.0) -> EnsembleProfile:
    """preprocess: pre_ms per image with 1 or 2 instances (2 instances: the same time each); the network:
    net_ms per batch whatever its size up to 16 (1 instance); no noise."""
    pre = Profile("preprocess", {n: {1: BatchTiming(pre_ms)} for n in (1, 2)})
    net = Profile("resnet18_onnx", {1: {b: BatchTiming(net_ms) for b in (1, 2, 4, 8, 16)}})
    pairs = tuple(Interference(p, 1, pre_factor, net_factor) for p in (1, 2))
    return EnsembleProfile(pre, net, pairs, overhead_us)


PRE = BatcherConfig(max_batch_size=16, preferred_batch_sizes=(1,), queue=QueuePolicy(max_queue_size=64))


def test_a_regular_stream_below_both_stages_capacity_waits_nowhere():
    """Every 20 ms a photo; preprocess 10 ms then the network 5 ms, each alone: 15 ms end to end, plus the
    fixed overhead, for every request; the network receives what preprocess finished, in order."""
    profile = ensemble_profile(overhead_us=2000)
    arrivals = np.arange(200) * 0.020
    result = simulate_ensemble(arrivals, profile, StageConfig(PRE, 1),
                               StageConfig(BatcherConfig(max_batch_size=16), 1))
    assert result.refused == 0 and result.latencies_s.size == 180
    assert np.allclose(result.latencies_s, 0.017)
    assert result.stages[1].average_batch == 1.0


def test_interference_slows_both_stages_and_moves_the_bottleneck():
    """Preprocess at 10 ms is the bottleneck alone (100/s against the network's 16 x 200/s); slowed x1.6
    beside the network it runs at 62.5/s, so 70 photos/s overload one instance: latencies grow without
    bound; with two instances (125/s) the same load is served with a short queue."""
    slow = ensemble_profile(pre_factor=1.6)
    arrivals = np.cumsum(np.random.default_rng(3).exponential(1 / 70.0, 4000))
    network = StageConfig(BatcherConfig(max_batch_size=16), 1)
    one = simulate_ensemble(arrivals, slow, StageConfig(replace_queue(PRE, 0), 1), network)
    two = simulate_ensemble(arrivals, slow, StageConfig(replace_queue(PRE, 0), 2), network)
    assert one.throughput_rps < 0.95 * one.offered_rps and one.percentile_ms(99) > 5000
    assert two.throughput_rps > 0.97 * two.offered_rps and two.percentile_ms(99) < 300
    # A bounded preprocess queue refuses what one instance cannot take: counted as refused end to end.
    bounded = simulate_ensemble(arrivals, slow, StageConfig(PRE, 1), network)
    assert bounded.refused > 0 and bounded.percentile_ms(99) < 64 * 16 * 1.1 + 50


def replace_queue(batcher: BatcherConfig, size: int) -> BatcherConfig:
    from dataclasses import replace
    return replace(batcher, queue=QueuePolicy(max_queue_size=size))


def test_the_plan_takes_the_instances_the_load_needs_and_names_the_bottleneck():
    """70 photos/s, p99 <= 500 ms, 1 device: one preprocess instance (62.5/s beside the network) cannot,
    two can: the plan is 1 device with 2 preprocess instances, preprocess the bottleneck."""
    profile = ensemble_profile(pre_factor=1.6)
    result = plan_ensemble(70.0, Slo(99, 500), profile, SearchSpace(requests=4000, max_batch_sizes=(4, 16)), PRE)
    best = result.best
    assert best is not None and best.devices == 1
    assert best.preprocess.instances == 2 and best.bottleneck == "preprocess"
    assert best.capacity_rps == pytest.approx(2 / 0.016)
    assert best.result.percentile_ms(99) <= 500
    # 70 of 125/s: the printed plan says its p99 is a caution, from the validation's hit rates
    assert "p99 at 56% of capacity: CAUTION" in format_ensemble_plan(result, profile)


def test_a_profile_without_a_stage_or_pair_is_refused_by_name(tmp_path):
    data = ensemble_profile().to_json()
    del data["network"]
    path = tmp_path / "no-network.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks the network stage"):
        EnsembleProfile.load(path)
    data = ensemble_profile().to_json()
    data["interference"][0]["preprocess_instances"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="preprocess stage with 3 instance"):
        EnsembleProfile.load(path)
    result = subprocess.run([str(KIT), "plan", "ensemble", "--profile", str(path), "--qps", "40", "--budget-ms",
                             "500"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "preprocess stage with 3" in result.stderr


def test_the_plan_writes_both_stages_configs(tmp_path):
    """`plan ensemble` on a saved profile: both config.pbtxt files, each parsing as Triton's ModelConfig,
    with the planned instance counts."""
    from resnet18_kit.observe.model_config import ModelConfigView

    path = ensemble_profile(pre_factor=1.6).save(tmp_path / "profile.json")
    result = subprocess.run([str(KIT), "plan", "ensemble", "--profile", str(path), "--qps", "70", "--budget-ms",
                             "500", "--requests", "3000", "--max-batch-sizes", "4", "16", "--name", "planned70",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "bottleneck: preprocess" in result.stdout
    pre = ModelConfigView.from_file(tmp_path / "out" / "preprocess" / "configs" / "planned70.pbtxt")
    net = ModelConfigView.from_file(tmp_path / "out" / "resnet18_onnx" / "configs" / "planned70.pbtxt")
    assert pre.instance_count() == 2 and net.instance_count() == 1
    assert pre.name == "preprocess" and net.name == "resnet18_onnx"


def test_the_served_stages_of_a_config_name_as_tritonserver_picks_them(tmp_path):
    """validate-ensemble's scratch repository: the shipped configs plus a planned one; under "int8" the
    network runs its 2 instances at once and preprocess (no configs/int8.pbtxt) its config.pbtxt's
    3; under "default" the network has 2 instances and the rate limiter lets one run at a time; a planned
    name serves the planned files of both stages."""
    from resnet18_kit.tools.planner.validate_ensemble import scratch_repository, served_stages
    from resnet18_kit.settings import Settings

    source = Settings.build().repository
    path = ensemble_profile(pre_factor=1.6).save(tmp_path / "profile.json")
    subprocess.run([str(KIT), "plan", "ensemble", "--profile", str(path), "--qps", "70", "--budget-ms", "500",
                    "--requests", "3000", "--max-batch-sizes", "4", "--name", "p70", "--out", str(tmp_path / "out")],
                   check=True, capture_output=True, timeout=300)
    repository = scratch_repository(source, tmp_path / "out", tmp_path / "scratch")
    pre, net = served_stages(repository, "int8")
    assert (pre.instances, net.instances, net.slots) == (3, 2, 2)
    pre, net = served_stages(repository, "default")
    assert (pre.instances, net.instances, net.slots) == (3, 2, 1)
    pre, net = served_stages(repository, "p70")
    assert (pre.instances, net.instances) == (2, 1) and net.batcher.max_batch_size == 4
    assert (source.root / "resnet18_onnx" / "configs" / "p70.pbtxt").exists() is False


def test_the_validation_table_judges_both_targets():
    from resnet18_kit.tools.planner.validate_ensemble import format_table, met

    def row(throughput, p99):
        return {"config": "default", "fraction": 0.7, "rate_rps": 50.0, "measured": {
            "throughput": 50.0, "p50_ms": 40.0, "p99_ms": 200.0},
            "predicted": {"throughput": throughput, "p50_ms": 45.0, "p99_ms": p99}}
    assert met(row(52.0, 240.0)) and not met(row(56.0, 200.0)) and not met(row(50.0, 260.0))
    table = format_table([row(52.0, 240.0), row(50.0, 260.0), {**row(50.0, 200.0), "measured": None,
                                                               "error": "refused"}])
    assert "1 of 3 levels within both targets" in table and "perf_analyzer failed: refused" in table


def test_calibration_makes_the_model_capacity_the_closed_loop_throughput(tmp_path):
    """Preprocess 10 ms (2 instances: 200/s), the network 5 ms a batch (1 instance, batches of 1: 200/s); a
    closed-loop run that measured 80 images/s gives both stages x2.5, so the pair's capacity is 80; a run
    faster than the model changes nothing (the factor is at least 1)."""
    from dataclasses import replace

    from resnet18_kit.tools.planner.ensemble import calibrated
    from resnet18_kit.tools.planner.validate_ensemble import capacity_rps

    one_by_one = BatcherConfig(max_batch_size=1, dynamic_batching=False)
    base = ensemble_profile()
    pairs = tuple(replace(p, measured={"ensemble_throughput": 80.0 if p.preprocess_instances == 2 else 500.0})
                  for p in base.interference)
    profile = calibrated(replace(base, interference=pairs), PRE, one_by_one)
    assert profile.pair(2, 1).shared_factor == pytest.approx(2.5)
    assert profile.pair(1, 1).shared_factor == 1.0
    assert capacity_rps(profile, StageConfig(PRE, 2), StageConfig(one_by_one, 1)) == pytest.approx(80.0)
    saved = EnsembleProfile.load(profile.save(tmp_path / "p.json"))
    assert saved.pair(2, 1).shared_factor == pytest.approx(2.5)


def test_the_factors_count_in_proportion_to_the_load():
    """Measured at full load (the stages always overlap), a factor f counts as 1 + (f - 1) x load: not at
    all with no load, in full at capacity and beyond; the shared factor the same way, on both stages."""
    from dataclasses import replace

    profile = ensemble_profile(pre_factor=1.5, net_factor=2.0)
    pair = replace(profile.pair(1, 1), shared_factor=1.2)
    for load, pre_ms, net_ms in ((0.0, 10.0, 5.0), (0.5, 12.5 * 1.1, 7.5 * 1.1), (1.0, 18.0, 12.0),
                                 (3.0, 18.0, 12.0)):
        pre, net = profile.stage_profiles(pair, 4, load)
        assert pre.exec_s(1, 1) * 1e3 == pytest.approx(pre_ms), load
        assert pre.exec_s(4, 1) * 1e3 == pytest.approx(4 * pre_ms), load
        assert net.exec_s(4, 1) * 1e3 == pytest.approx(net_ms), load


def test_rate_limited_network_instances_execute_one_at_a_time_and_the_second_holds_a_batch():
    """The shipped network config: two instances, one executing at a time (the rate limiter). It runs on
    the pair measured with one instance executing (no (p, 2) pair needed), with that pair's capacity. Busy
    all the time (150 photos/s, 40 ms a batch), the idle instance takes what queued during the running
    execution, the batch one instance would form, and holds it until the slot frees: every request waits
    one execution more than with one instance (p50 and p99 + 40 ms)."""
    from resnet18_kit.tools.planner.validate_ensemble import capacity_rps

    profile = ensemble_profile(pre_ms=5.0, net_ms=40.0)
    network = BatcherConfig(max_batch_size=16)
    pre = StageConfig(replace_queue(PRE, 0), 2)
    arrivals = np.cumsum(np.random.default_rng(5).exponential(1 / 150.0, 6000))
    alone = simulate_ensemble(arrivals, profile, pre, StageConfig(network, 1))
    limited = simulate_ensemble(arrivals, profile, pre, StageConfig(network, 2, concurrent=1))
    assert StageConfig(network, 2, concurrent=1).slots == 1 and StageConfig(network, 2).slots == 2
    assert capacity_rps(profile, pre, StageConfig(network, 2, concurrent=1)) == pytest.approx(
        capacity_rps(profile, pre, StageConfig(network, 1)))
    for result in (alone, limited):
        assert result.refused == 0 and result.throughput_rps > 0.97 * result.offered_rps
    assert limited.stages[1].average_batch == pytest.approx(alone.stages[1].average_batch, rel=0.05)
    for p in (50, 99):
        assert limited.percentile_ms(p) - alone.percentile_ms(p) == pytest.approx(40.0, abs=5.0)
    with pytest.raises(KeyError, match="2 network"):
        simulate_ensemble(arrivals, profile, pre, StageConfig(network, 2))


def test_the_ensemble_level_throughput_comes_from_the_trace_of_the_requests_in_its_window(tmp_path):
    """Triton's trace as the server writes it (one entry per timestamp, the composing models' records
    beside the ensemble's, which has no COMPUTE_*): the ensemble's requests are read, the ones received
    inside the level's window counted, over the span from the first start to the last end."""
    from resnet18_kit.tools.planner.validate_analysis import read_traces
    from resnet18_kit.tools.planner.validate_ensemble import traced_throughput

    entries, ms = [], 1_000_000
    for i in range(10):  # 10 ensemble requests, one every 100 ms from t = 1 s, each answered 50 ms later
        start = 1000 * ms + i * 100 * ms
        ens, pre = 3 * i + 1, 3 * i + 2
        entries += [{"id": ens, "model_name": "resnet18", "model_version": 1},
                    {"id": pre, "model_name": "preprocess", "model_version": 1, "parent_id": ens}]
        for name, ns in (("REQUEST_START", start), ("QUEUE_START", start + ms), ("REQUEST_END", start + 50 * ms)):
            entries.append({"id": ens, "timestamps": [{"name": name, "ns": ns}]})
        for name in ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "REQUEST_END"):
            entries.append({"id": pre, "timestamps": [{"name": name, "ns": start + 2 * ms}]})
    (tmp_path / "trace.json.0").write_text(json.dumps(entries[: len(entries) // 2]))
    (tmp_path / "trace.json.1").write_text(json.dumps(entries[len(entries) // 2:]))
    trace = tmp_path / "trace.json"
    assert read_traces(trace, "resnet18") == []  # the default asks for COMPUTE_START: none in an ensemble's record
    ensemble = read_traces(trace, "resnet18", ("REQUEST_START", "QUEUE_START", "REQUEST_END"))
    assert len(ensemble) == 10 and len(read_traces(trace, "preprocess")) == 10
    # The window holds requests 2..6 (started 1.2 s to 1.6 s): 5 requests from 1.2 s to 1.65 s.
    throughput, count = traced_throughput(ensemble, 1150 * ms, 1620 * ms)
    assert count == 5 and throughput == pytest.approx(5 / 0.45)
    assert traced_throughput(ensemble, 0, 10 * ms) == (0.0, 0)
    # A new run at the same path starts from no pieces: an earlier run's would be merged into its records.
    from resnet18_kit.tools.planner.validate import trace_args
    (tmp_path / "trace.jsonl").write_text("not a piece of this trace")
    args = trace_args(trace)
    assert f"--trace-config=triton,file={trace}" in args and "--trace-config=level=TIMESTAMPS" in args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]
