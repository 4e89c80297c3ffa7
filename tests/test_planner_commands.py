"""The capacity planner's configs and commands (planner/): reading the repository's configs into a
BatcherConfig, writing planned configs, the command lines, reading Triton's request trace (validation),
progress of the long commands, bad inputs. No server needed."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from resnet18_kit.cli import main as cli_main
from resnet18_kit.observe.model_config import ModelConfigView, read_config
from resnet18_kit.tools.planner.batcher import BatcherConfig, QueuePolicy, batcher_from_config
from resnet18_kit.tools.planner.pbtxt import planned_config, write_config
from resnet18_kit.tools.planner.profile import BatchTiming, Profile


# -- configs in and out -------------------------------------------------------------------------------------

def test_batcher_read_from_the_repositorys_configs(repository):
    base = ModelConfigView.for_variant(repository, "resnet18_onnx")
    assert batcher_from_config(base) == BatcherConfig(16, True, (8, 16), 0, QueuePolicy(64, 60_000_000, True))
    throughput = batcher_from_config(ModelConfigView.for_variant(repository, "resnet18_onnx", "throughput"))
    assert (throughput.max_batch_size, throughput.preferred, throughput.max_queue_delay_us) == (32, (32,), 100_000)
    assert not batcher_from_config(ModelConfigView.for_variant(repository, "resnet18_onnx", "no_batching")
                                   ).dynamic_batching
    assert base.instance_count() == 2
    with pytest.raises(TypeError):  # a parsed proto is not read twice: the view is the one reader
        batcher_from_config(base.proto)


def test_planned_config_is_the_base_config_with_the_plan_and_parses_back(tmp_path, repository):
    base = read_config(repository.config_path("resnet18_onnx"))
    batcher = BatcherConfig(8, max_queue_delay_us=20_000, queue=QueuePolicy(48, 0, True))
    written = write_config(planned_config(base, batcher, 2, {"intra_op_threads": "1"}), tmp_path / "p.pbtxt",
                           header="planned\nby a test")
    again = read_config(written)
    assert written.read_text().startswith("# planned\n# by a test\n")
    assert (again.name, again.backend, again.input[0].dims) == (base.name, base.backend, base.input[0].dims)
    # no preferred size written: Triton (and so the reader) prefers max_batch_size
    assert batcher_from_config(ModelConfigView.of(again)) == replace(batcher, preferred_batch_sizes=(8,))
    assert again.instance_group[0].count == 2 and again.parameters["intra_op_threads"].string_value == "1"
    assert base.instance_group[0].rate_limiter.resources  # the default serializes its instances ...
    assert not again.instance_group[0].HasField("rate_limiter")  # ... a plan runs them side by side
    assert all(w.batch_size <= 8 for w in again.model_warmup)
    unbatched = planned_config(base, BatcherConfig(16, dynamic_batching=False), 1)
    assert not unbatched.HasField("dynamic_batching")


def test_plan_command_writes_a_servable_config_outside_the_model_repository(tmp_path, capsys, repository):
    profile = Profile("resnet18_onnx", {1: {1: BatchTiming(20.0, 1.0), 8: BatchTiming(120.0, 5.0),
                                            16: BatchTiming(230.0, 8.0)}}, overhead_us=1000.0)
    path = profile.save(tmp_path / "profile.json")
    code = cli_main(["plan", "plan", "--profile", str(path), "--qps", "100", "--budget-ms", "600", "--requests",
                     "4000", "--out", str(tmp_path / "out"), "--name", "planned_test"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "BEST:" in printed and "queue delay chosen" in printed
    written = tmp_path / "out" / "resnet18_onnx" / "configs" / "planned_test.pbtxt"
    config = read_config(written)
    assert config.name == "resnet18_onnx" and config.max_batch_size in (8, 16)
    assert not (repository.root / "resnet18_onnx" / "configs" / "planned_test.pbtxt").exists()
    assert written.read_text().startswith("# resnet18_onnx, variant")
    assert config.dynamic_batching.default_queue_policy.max_queue_size > 0  # bounded by default

    code = cli_main(["plan", "plan", "--profile", str(path), "--qps", "100", "--budget-ms", "600", "--requests",
                     "4000", "--out", str(tmp_path / "out"), "--name", "unbounded", "--unbounded-queue"])
    unbounded = read_config(tmp_path / "out" / "resnet18_onnx" / "configs" / "unbounded.pbtxt")
    assert code == 0 and unbounded.HasField("dynamic_batching")
    assert not unbounded.dynamic_batching.HasField("default_queue_policy")  # Triton then prefetches


# -- reading Triton's request trace (validation) ------------------------------------------------------------

def test_trace_summary_finds_requests_left_waiting_by_a_missed_wakeup(tmp_path):
    from resnet18_kit.tools.planner.validate_analysis import read_traces, split_levels, trace_summary

    ms = 1_000_000
    # (queue start, compute start, compute end) in ms; one instance, no queue delay, batches of up to 4.
    requests = [(0, 0, 100), (50, 100, 200),       # queued during an execution, started at its end
                (150, 700, 800),                   # queued at 150, instance free at 200, started 700: stall
                (900, 900, 1000), (950, 1201, 1300), (1200, 1201, 1300)]  # stall rescued by an arrival
    entries = []
    for i, (q, c, e) in enumerate(requests, start=1):
        entries.append({"id": i, "model_name": "m", "model_version": 1})
        entries.append({"id": i, "timestamps": [{"name": "QUEUE_START", "ns": q * ms},
                                                {"name": "COMPUTE_START", "ns": c * ms},
                                                {"name": "COMPUTE_END", "ns": e * ms}]})
    (tmp_path / "trace.json.0").write_text(json.dumps(entries))
    traced = read_traces(tmp_path / "trace.json", "m")
    assert len(traced) == 6
    (level,) = split_levels(traced, [6])
    summary = trace_summary(level, BatcherConfig(max_batch_size=4))
    assert summary["stalled"] == 1 and summary["stalled_idle"] == 1  # the 550 ms wait, 500 ms of it idle
    missed = summary["missed_wakeups"]
    assert (missed["busy_completions"], missed["missed"], missed["rescued_by_arrival"]) == (3, 2, 1)
    assert missed["extra_wait_ms_max"] == pytest.approx(500.0)


# -- progress of the long commands (resnet18_kit/progress.py, planner profile/validate) -------------------

def test_progress_counts_steps_and_logs_each_with_its_eta(caplog):
    import logging

    from resnet18_kit.progress import Progress

    from resnet18_kit.tools.planner.__main__ import log

    assert log.name.startswith("resnet18_kit.")  # under the tree cli's setup_logging configures
    caplog.set_level(logging.INFO, logger=log.name)
    with Progress(4, "level", "validate", log, disable=True) as progress:
        progress("default: capacity 49.0 infer/s")
        progress("default 30% = 14.7 req/s: 14.6 infer/s", step=True)
        progress("default 70%: other processes took 30% of the cores; measuring again", warning=True)
        progress.update()
        assert progress.done == 2 and progress.eta_s() is not None
        assert progress.status().startswith("2/4 levels, ") and "ETA " in progress.status()
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert records[0] == ("INFO", "default: capacity 49.0 infer/s")
    assert records[1][0] == "INFO" and records[1][1].startswith("default 30% = 14.7 req/s: 14.6 infer/s; 1/4 levels")
    assert records[2][0] == "WARNING"
    assert records[3][1].startswith("validate: 2/4 levels, ")


def test_profile_progress_counts_the_measurements_measure_profile_reports():
    from resnet18_kit.progress import Progress
    import inspect

    from resnet18_kit.tools.planner import measure
    from resnet18_kit.tools.planner.__main__ import profile_runs

    # 6 batch sizes + the lone request + speed at 25/50/75% + the closed loop: the 11 lines of a default run
    assert profile_runs([1, 2, 4, 8, 16, 32], [1], speed_under_load=True) == 11
    assert profile_runs([1, 2, 4, 8, 16, 32], [1, 2], speed_under_load=False) == 13
    # measure_profile and measure_speed report each finished measurement as a step (the batch sizes, the
    # lone request; each speed level and the closed loop), a repeated one as a warning, the start plain.
    source = inspect.getsource(measure.measure_profile) + inspect.getsource(measure.measure_speed)
    assert source.count("step=True") == 4 and source.count("warning=True") == 1
    with Progress(3, "run", "profile", disable=True) as progress:
        progress("profile: 1 instance(s): starting tritonserver")
        progress("profile: batch 2: other processes took 40% of the cores; measuring again (attempt 2)", warning=True)
        progress("profile: 1 instance(s), batch 2: cycle 45.2 ms (server compute 45.6 ms)", step=True)
        progress("profile: lone batch-1 request p50 20.2 ms -> overhead 0 us", step=True)
        assert progress.done == 2


def test_plan_is_a_command_of_resnet18_kit_with_the_global_options_and_no_abbreviations(capsys):
    out = subprocess.run([sys.executable, "-m", "resnet18_kit", "plan", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("usage: resnet18-kit plan") and "worked-example" in out and "python -m" not in out
    with pytest.raises(SystemExit):
        cli_main(["plan", "validate", "--help"])
    out = capsys.readouterr().out
    assert "--log-level" in out and "--model-repository" in out and "-v, --verbose" not in out
    # --model is profile's own option, never taken for the global --model-repository: a model the
    # repository lacks is named (before any server starts), the global options go after it too
    assert cli_main(["plan", "profile", "--model", "nosuch_model", "--log-level", "WARNING"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model nosuch_model" in err, err
    with pytest.raises(SystemExit):
        cli_main(["plan", "profile", "--mod", "resnet18_onnx"])  # no prefix matching


def test_validate_profiles_the_instance_counts_of_the_configs_it_validates(repository):
    from resnet18_kit.tools.planner.__main__ import configs_instance_counts

    # config.pbtxt runs 2 instances of which the rate limiter lets one execute (each with both cores: the
    # one-instance table), latency 1, throughput 2 at once (one core each): a profile of 1 alone could not
    # predict throughput (validate used to stop with a KeyError after its profile).
    assert configs_instance_counts(repository, "resnet18_onnx", ["default"]) == [1]
    assert configs_instance_counts(repository, "resnet18_onnx", ["default", "throughput"]) == [1, 2]
    assert configs_instance_counts(repository, "resnet18_onnx", ["latency", "throughput", "default"]) == [1, 2]


@pytest.mark.parametrize("args, named", [
    (["validate", "--configs", "nosuch"], "nosuch.pbtxt"),
    (["validate", "--configs-from", "{missing}", "--configs", "default"], "--configs-from"),
    (["simulate", "--profile", "{missing}", "--rate", "10"], "missing.json"),
    (["simulate", "--profile", "{not_json}", "--rate", "10"], "not_json.json: not a profile JSON file"),
    (["plan", "--worked-example", "--arrivals", "trace"], "--arrivals trace needs --trace FILE"),
    (["plan", "--qps", "10"], "give --profile FILE or --worked-example"),
])
def test_bad_inputs_are_one_line_and_exit_2(args, named, tmp_path, capsys):
    (tmp_path / "not_json.json").write_text("{")
    args = [a.format(missing=tmp_path / "missing.json", not_json=tmp_path / "not_json.json") for a in args]
    assert cli_main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
