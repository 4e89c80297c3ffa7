"""The capacity planner's model (planner/): Triton's batching rules on hand-built queues, the simulator's
queue policy and timing, speed under load, the worked example, profiles and arrivals. No server needed.
Configs, the commands and the validation's trace reading: tests/test_planner_commands.py."""
from __future__ import annotations

import json
from collections import deque

import numpy as np
import pytest

from resnet18_kit.tools.planner.arrivals import Bursty, Poisson, Trace
from resnet18_kit.tools.planner.batcher import BatcherConfig, QueuePolicy, Request, form_batch
from resnet18_kit.tools.planner.profile import BatchTiming, Profile, constant_profile
from resnet18_kit.tools.planner.search import SearchSpace, Slo, capacity_bound, format_plan, p99_trust, plan, speed_for
from resnet18_kit.tools.planner.simulator import LostWakeup, simulate
from resnet18_kit.tools.planner.speed import SpeedTrace, window_factors


def queue_of(arrivals_s, sizes=None, deadlines_s=None) -> deque:
    sizes = sizes or [1] * len(arrivals_s)
    deadlines_s = deadlines_s or [float("inf")] * len(arrivals_s)
    return deque(Request(i, t, s, d) for i, (t, s, d) in enumerate(zip(arrivals_s, sizes, deadlines_s)))


DEFAULT_LIKE = BatcherConfig(max_batch_size=16, preferred_batch_sizes=(8, 16), max_queue_delay_us=5000)


# -- Triton's batch formation (GetDynamicBatch), on hand-built queues -----------------------------------

def test_largest_reachable_preferred_size_goes_out_at_once():
    assert form_batch(queue_of([0.0] * 10), 0.001, DEFAULT_LIKE).count == 8
    assert form_batch(queue_of([0.0] * 20), 0.001, DEFAULT_LIKE).count == 16


def test_below_preferred_waits_until_oldest_request_has_waited_the_delay():
    decision = form_batch(queue_of([0.0, 0.001, 0.002]), 0.003, DEFAULT_LIKE)
    assert decision.count == 0 and decision.wake_s == pytest.approx(0.005)
    assert form_batch(queue_of([0.0, 0.001, 0.002]), 0.005, DEFAULT_LIKE).count == 3


def test_delay_exceeded_sends_the_whole_pending_batch_not_just_the_preferred_size():
    assert form_batch(queue_of([0.0] * 10), 0.006, DEFAULT_LIKE).count == 10
    assert form_batch(queue_of([0.0] * 20), 0.006, DEFAULT_LIKE).count == 16  # capped by max_batch_size


def test_zero_delay_sends_whatever_is_queued():
    config = BatcherConfig(max_batch_size=16, preferred_batch_sizes=(8, 16), max_queue_delay_us=0)
    assert form_batch(queue_of([0.0] * 5), 0.0, config).count == 5


def test_no_preferred_sizes_means_max_batch_size():
    config = BatcherConfig(max_batch_size=4, max_queue_delay_us=1000)
    assert config.preferred == (4,)
    assert form_batch(queue_of([0.0] * 7), 0.0, config).count == 4
    assert form_batch(queue_of([0.0] * 3), 0.0, config).wake_s == pytest.approx(0.001)


def test_request_that_would_pass_the_largest_preferred_size_closes_the_batch():
    # Requests of 3 inferences, preferred [4], max 8: 3 + 3 > 4, so the best batch is the first request.
    config = BatcherConfig(max_batch_size=8, preferred_batch_sizes=(4,), max_queue_delay_us=1000)
    assert form_batch(queue_of([0.0, 0.0], sizes=[3, 3]), 0.0, config).count == 1
    # Once the delay is exceeded the pending batch goes whole (6 <= max_batch_size 8).
    assert form_batch(queue_of([0.0, 0.0], sizes=[3, 3]), 0.002, config).count == 2


def test_timed_out_requests_are_rejected_when_the_scan_reaches_them():
    queue = queue_of([0.0, 0.0, 0.0], deadlines_s=[0.5, 2.0, 0.5])
    decision = form_batch(queue, 1.0, BatcherConfig(max_batch_size=4))
    assert [r.index for r in decision.rejected] == [0, 2]
    assert decision.count == 1 and queue[0].index == 1


def test_closest_timeout_wakes_the_batcher_before_the_delay():
    config = BatcherConfig(max_batch_size=8, max_queue_delay_us=100_000)
    decision = form_batch(queue_of([0.0, 0.0], deadlines_s=[float("inf"), 0.03]), 0.01, config)
    assert decision.count == 0 and decision.wake_s == pytest.approx(0.03)


# -- the simulator: queue policy, timeouts, instances, timing ---------------------------------------------

ONE_SECOND = constant_profile(1000.0, 16)


def test_queue_full_refuses_at_once():
    config = BatcherConfig(max_batch_size=4, queue=QueuePolicy(max_queue_size=4))
    result = simulate(np.arange(10) * 0.001, config, ONE_SECOND, warmup_fraction=0.0)
    # The first request runs at once (alone); 4 wait; the other 5 find the queue full.
    assert (result.refused, result.completed) == (5, 5)
    assert result.batches == {1: 1, 4: 1}


def test_default_timeout_rejects_requests_still_queued():
    config = BatcherConfig(max_batch_size=1, queue=QueuePolicy(default_timeout_us=500_000))
    result = simulate(np.array([0.0, 0.1, 0.2]), config, ONE_SECOND, warmup_fraction=0.0)
    assert (result.completed, result.timed_out) == (1, 2)


def test_timeout_override_only_shortens():
    config = BatcherConfig(max_batch_size=1, queue=QueuePolicy(default_timeout_us=5_000_000,
                                                               allow_timeout_override=True))
    result = simulate(np.array([0.0, 0.1, 0.2]), config, ONE_SECOND, warmup_fraction=0.0,
                      timeouts_us=np.array([0, 300_000, 60_000_000]))
    assert (result.completed, result.timed_out) == (2, 1)  # 60 s asked: the default 5 s stays


def test_batch_forms_at_the_preferred_size_and_a_lone_request_waits_the_delay():
    profile = constant_profile(50.0, 4)
    config = BatcherConfig(max_batch_size=4, max_queue_delay_us=10_000)
    result = simulate(np.array([0.0, 0.001, 0.002, 0.003, 0.2]), config, profile, warmup_fraction=0.0,
                      exec_noise=False)
    assert result.batches == {1: 1, 4: 1}
    assert sorted(np.round(result.latencies_s * 1e3, 3)) == [50.0, 51.0, 52.0, 53.0, 60.0]


def test_no_dynamic_batching_runs_each_request_alone_on_any_free_instance():
    profile = Profile("m", {2: {1: BatchTiming(100.0), 8: BatchTiming(400.0)}})
    config = BatcherConfig(max_batch_size=8, dynamic_batching=False)
    result = simulate(np.array([0.0, 0.0, 0.0]), config, profile, instances=2, warmup_fraction=0.0,
                      exec_noise=False)
    assert result.batches == {1: 3}
    assert sorted(np.round(result.latencies_s * 1e3)) == [100, 100, 200]


def test_rate_limited_instances_hold_a_batch_until_their_turn():
    # Two instances, one executing at a time (the default config's rate limiter): the second instance takes
    # a batch when it is idle and runs it when the first finishes, with the one-execution table's times.
    profile = Profile("m", {1: {b: BatchTiming(100.0) for b in (1, 2, 4, 8)},
                            2: {b: BatchTiming(190.0) for b in (1, 2, 4, 8)}})
    config = BatcherConfig(max_batch_size=8, max_queue_delay_us=0)
    arrivals = np.array([0.0, 0.01, 0.02, 0.03])
    held = simulate(arrivals, config, profile, instances=2, concurrent=1, warmup_fraction=0.0, exec_noise=False)
    assert held.batches == {1: 2, 2: 1}  # [r0] runs, [r1] is held, [r2, r3] are taken when [r1] starts
    assert list(np.round(held.done_s * 1e3)) == [100, 200, 300, 300]
    one = simulate(arrivals, config, profile, instances=1, warmup_fraction=0.0, exec_noise=False)
    assert one.batches == {1: 1, 3: 1} and list(np.round(one.done_s * 1e3)) == [100, 200, 200, 200]
    both = simulate(arrivals, config, profile, instances=2, warmup_fraction=0.0, exec_noise=False)
    assert list(np.round(both.done_s * 1e3)) == [190, 200, 380, 380]  # two at once, each at its own table


def test_md1_queue_matches_pollaczek_khinchine():
    # One instance, no batching, deterministic 10 ms service, Poisson at 50/s (rho 0.5):
    # mean wait = rho x s / (2 (1 - rho)) = 5 ms.
    profile = constant_profile(10.0, 1)
    arrivals = Poisson(50.0).arrivals(60000, rng=np.random.default_rng(3))
    result = simulate(arrivals, BatcherConfig(max_batch_size=1, dynamic_batching=False), profile)
    assert result.queue_s.mean() * 1e3 == pytest.approx(5.0, rel=0.08)
    assert result.utilization == pytest.approx(0.5, abs=0.02)


def test_overhead_is_added_to_every_latency():
    profile = constant_profile(10.0, 1, overhead_us=700.0)
    result = simulate(np.array([0.0, 1.0]), BatcherConfig(max_batch_size=1), profile, warmup_fraction=0.0)
    assert np.allclose(result.latencies_s, 0.0107)


def test_lost_wakeup_model_holds_the_queue_until_the_next_arrival_or_500_ms():
    profile = constant_profile(100.0, 1)
    config = BatcherConfig(max_batch_size=1)
    arrivals = np.array([0.0, 0.05, 1.0, 1.05, 1.3])
    normal = simulate(arrivals, config, profile, warmup_fraction=0.0, exec_noise=False)
    stalled = simulate(arrivals, config, profile, warmup_fraction=0.0, exec_noise=False,
                       lost_wakeup=LostWakeup(1.0))
    assert np.round(normal.latencies_s * 1e3).tolist() == [100, 150, 100, 150, 100]
    # Request 1 waits through the first execution; the batcher misses the free instance at 0.1 s and
    # no request comes to wake it: its 500 ms wait ends at 0.6 s. Request 3 is rescued by the
    # arrival of request 4 at 1.3 s; request 4, queued when request 3 ends at 1.4 s, waits to 1.9 s.
    assert np.round(stalled.latencies_s * 1e3).tolist() == [100, 650, 100, 350, 700]
    assert stalled.stalls == 3


# -- speed under load (resnet18_kit/tools/planner/speed.py) -------------------------------------------------------------------

def test_window_factors_divide_each_windows_mean_execution_by_the_baseline():
    # cumulative (executions, compute ns): 10 x 20 ms, then 10 x 30 ms, then 2 executions (too few), then 5 x 40 ms
    samples = [(0, 0), (10, 200_000_000), (20, 500_000_000), (22, 560_000_000), (27, 760_000_000)]
    assert window_factors(samples, baseline_ms=20.0) == pytest.approx([1.0, 1.5, 2.0])


def test_speed_sampler_replays_measured_blocks_in_order():
    trace = SpeedTrace(0.5, 1.0, (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6))
    factor_at = trace.sampler(np.random.default_rng(0), block_windows=3)
    drawn = [factor_at(t + 0.5) for t in range(300)]
    assert set(drawn) <= set(trace.factors)
    for block in range(100):  # each block of 3 windows is 3 consecutive measured windows
        a, b, c = drawn[3 * block:3 * block + 3]
        assert b == pytest.approx(a + 0.1) and c == pytest.approx(b + 0.1)
    assert np.mean(drawn) == pytest.approx(1.3, abs=0.05)
    assert factor_at(0.2) == drawn[0]  # the same window gives the same factor


def test_speed_factor_stretches_every_execution():
    profile = constant_profile(50.0, 1)
    arrivals = np.array([0.0, 1.0, 2.0])
    slow = SpeedTrace(0.3, 1.0, (2.0,))
    result = simulate(arrivals, BatcherConfig(max_batch_size=1), profile, warmup_fraction=0.0, exec_noise=False,
                      speed=slow)
    assert np.round(result.latencies_s * 1e3).tolist() == [100, 100, 100]


def test_slow_stretches_build_queues_that_their_mean_does_not():
    """At 65% of the profiled capacity, executions slowed 1.4x on average: as a constant factor the
    queue stays stable (91% load); as 5 s stretches at 1.0x and 1.8x (117% load half the time) it
    builds a backlog in every slow stretch, and the p99 says so."""
    profile = Profile("m", {1: {1: BatchTiming(20.0, 1.0)}})
    arrivals = Poisson(0.65 * 50).arrivals(20000, rng=np.random.default_rng(5))
    config = BatcherConfig(max_batch_size=1, dynamic_batching=False)
    steady = simulate(arrivals, config, profile, speed=SpeedTrace(0.65, 1.0, (1.4,)))
    stretches = simulate(arrivals, config, profile, speed=SpeedTrace(0.65, 1.0, (1.0,) * 5 + (1.8,) * 5))
    assert stretches.percentile_ms(99) > 3 * steady.percentile_ms(99)


def test_profile_keeps_its_speed_traces_and_picks_the_nearest_load(tmp_path):
    traces = (SpeedTrace(0.25, 1.0, (1.3, 1.2)), SpeedTrace(0.75, 1.0, (1.1,)), SpeedTrace(1.0, 1.0, (1.0, 1.01)))
    profile = Profile("m", {1: {1: BatchTiming(20.0)}}, speed={1: traces})
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded.speed == profile.speed
    assert loaded.speed_trace(1, 0.3).utilization == 0.25
    assert loaded.speed_trace(1, 0.95).utilization == 1.0
    assert loaded.speed_trace(2, 0.3) is None
    # the load is offered requests/s over the config's capacity: 50/s here
    assert speed_for(loaded, BatcherConfig(max_batch_size=1), 1, 35.0).utilization == 0.75


# -- the worked example -----------------------------------------------------------------------------------

def test_worked_example_no_batching_2000_devices_batching_about_20():
    """20,000 QPS, a device running any batch of up to 100 in 100 ms, p99 <= 500 ms."""
    profile = constant_profile(100.0, 100)
    result = plan(20000.0, Slo(99, 500.0), profile, SearchSpace(requests=12000))
    assert result.no_batching.devices_at_full_load == 2000
    assert 2000 <= result.no_batching.devices <= 2010  # a queue needs load strictly below capacity
    assert result.no_batching.result.percentile_ms(99) <= 500.0
    best = result.best
    assert best.batcher.dynamic_batching and best.batcher.max_batch_size == 100
    assert best.devices_at_full_load == 20 and 20 <= best.devices <= 22
    assert best.result.percentile_ms(99) <= 500.0 and best.result.average_batch > 90
    # The planner says which queue delay it picked: one of the candidates, small enough for the budget.
    assert best.batcher.max_queue_delay_us in {int(f * 100_000) for f in SearchSpace().delay_fractions}
    assert best.batcher.max_queue_delay_us / 1000 + 100 <= 500


def test_worked_example_random_balancer_costs_unbatched_serving_far_more():
    profile = constant_profile(100.0, 100)
    result = plan(20000.0, Slo(99, 500.0), profile,
                  SearchSpace(requests=12000, balancer="random", delay_fractions=(0.0,)))
    assert result.no_batching.devices > 2400  # Poisson arrivals per device: M/D/1 needs headroom
    assert result.best.devices <= 22          # a batching device absorbs the same noise


def test_capacity_bound_is_strictly_below_full_load():
    assert capacity_bound(20000, 1000) == 21
    assert capacity_bound(20500, 1000) == 21
    assert capacity_bound(20000, 1000, max_utilization=0.5) == 41


# -- profiles, arrivals -----------------------------------------------------------------------------------

def test_profile_round_trips_and_interpolates(tmp_path):
    profile = Profile("m", {1: {1: BatchTiming(20.0, 2.0), 8: BatchTiming(90.0, 5.0)}}, overhead_us=800.0,
                      server_ceiling_rps=5000.0)
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded.to_json() == profile.to_json()
    assert loaded.timing(4, 1).mean_ms == pytest.approx(50.0)
    assert loaded.device_throughput(8, 1) == pytest.approx(8 / 0.09)
    with pytest.raises(ValueError):
        loaded.timing(9, 1)
    with pytest.raises(ValueError):
        Profile.from_json({**json.loads((tmp_path / "p.json").read_text()), "format": "other"})


def test_round_robin_split_gives_each_replica_its_share_and_smooths_it():
    times = Poisson(1000.0).arrivals(20000, replicas=100, balancer="round_robin", rng=np.random.default_rng(0))
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(0.1, rel=0.1)  # Gamma(100): CV = 1/sqrt(100)
    random = Poisson(1000.0).arrivals(20000, replicas=100, balancer="random", rng=np.random.default_rng(0))
    assert np.diff(random).std() / np.diff(random).mean() == pytest.approx(1.0, rel=0.05)


def test_bursty_keeps_the_mean_rate_and_is_burstier_than_poisson():
    times = Bursty(100.0, burst_factor=4.0, burst_fraction=0.2, burst_s=1.0).arrivals(
        60000, rng=np.random.default_rng(1))
    assert len(times) / times[-1] == pytest.approx(100.0, rel=0.1)
    counts = np.histogram(times, bins=np.arange(0, times[-1], 1.0))[0]
    assert counts.var() / counts.mean() > 5  # Poisson counts have variance = mean


def test_trace_loads_text_and_perf_analyzer_export(tmp_path):
    (tmp_path / "t.txt").write_text("# seconds\n10.0\n10.5\n11.0, extra\n12.0\n")
    trace = Trace.load(tmp_path / "t.txt")
    assert trace.times_s.tolist() == [0.0, 0.5, 1.0, 2.0]
    assert trace.scaled_to(3.0).rate_rps == pytest.approx(3.0)
    export = {"experiments": [{"requests": [{"timestamp": int(t * 1e9), "response_timestamps": []}
                                            for t in (5.0, 5.25, 5.5)]}]}
    (tmp_path / "p.json").write_text(json.dumps(export))
    assert Trace.load(tmp_path / "p.json").times_s.tolist() == [0.0, 0.25, 0.5]
    assert len(trace.arrivals(10, replicas=2)) == 10  # replayed as often as needed


def test_the_gpu_rows_are_on_paper_and_follow_the_published_figure():
    from resnet18_kit.tools.planner.scale import A100_RESNET50, GFLOPS, gpu_rows_on_paper

    rows = gpu_rows_on_paper((1_000, 20_000, 1_000_000), ceiling_rps=6_614)
    per_gpu = A100_RESNET50.infer_per_s * GFLOPS["resnet50"] / GFLOPS["resnet18"]
    assert 13_000 < per_gpu < 14_500  # 6,127 x 4.09 / 1.81
    replicas = [int(row.split("|")[4].strip().replace(",", "")) for row in rows[:3]]
    assert replicas == [1, 2, 73]
    assert all("NOT MEASURED" in row and "front end" in row for row in rows[:3])
    assert "DeepLearningExamples" in rows[-1] and "not measured here" in rows[-1]
    assert "GPU compute" in gpu_rows_on_paper((1_000,), ceiling_rps=20_000)[0]


def test_max_rate_is_the_highest_load_one_device_serves_within_the_slo():
    """The textbook device (any batch up to 100 in 100 ms: 1,000 infer/s): with batching one device meets
    p99 <= 500 ms up to just below 1,000/s; unbatched (10/s at most) far less; a 50 ms budget, shorter than
    one execution plus any wait for it, cannot be met at any load."""
    from resnet18_kit.tools.planner.search import max_rate

    device = constant_profile(100.0, 100)
    batched = max_rate(device, Slo(99, 500), SearchSpace(requests=4000, no_batching=False, max_batch_sizes=(100,),
                                                         delay_fractions=(0.0,)))
    assert 900 < batched < 1000
    unbatched = max_rate(constant_profile(100.0, 1), Slo(99, 500), SearchSpace(requests=4000))
    assert 3 < unbatched < 10
    assert max_rate(device, Slo(99, 50), SearchSpace(requests=2000, no_batching=False)) == 0.0


def test_a_p99_planned_near_capacity_is_marked_not_trusted():
    assert p99_trust(0.3)[0] and not p99_trust(0.6)[0] and not p99_trust(0.95)[0]
    assert "CAUTION" in p99_trust(0.79)[1] and "NOT TRUSTED" in p99_trust(0.8)[1]
    profile = constant_profile(100.0, 8)  # 80 infer/s per device
    near = plan(70.0, Slo(99, 2000.0), profile, SearchSpace(max_batch_sizes=(8,), instances=(1,)))
    assert near.best.devices == 1 and "NOT TRUSTED" in format_plan(near)
    roomy = plan(70.0, Slo(99, 2000.0), profile,
                 SearchSpace(max_batch_sizes=(8,), instances=(1,), max_utilization=0.5))
    assert roomy.best.devices == 2 and "p99 held at loads like this" in format_plan(roomy)
    # the other end of the p99 range: the same devices without slowdowns (none in this profile: equal)
    assert near.best.p99_static_ms == pytest.approx(near.best.result.percentile_ms(99))
    assert "without them: the measured p99 mostly falls in that range" in format_plan(near)
    static = plan(70.0, Slo(99, 2000.0), profile,
                  SearchSpace(max_batch_sizes=(8,), instances=(1,), speed_under_load=False))
    assert static.best.p99_static_ms is None and "without them" not in format_plan(static)
