"""bench's bars and verdicts: the strongest in-process arrangement and pipeline, the one-line ratio per
config with its placement, the tensor targets, a perf_analyzer run that never exits, and a process that
measured OpenVINO in-process still handling a signal."""
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from resnet18_kit.contract import ONNX_MODEL
from resnet18_kit.observe.model_config import ModelConfigView


def test_inprocess_pipeline_on_two_photos_runs_the_variants_network_arranged_for_speed(repository, int8_twin_run):
    from resnet18_kit.tools.bench.inprocess import bar_batch_sizes

    returncode, stdout, stderr = int8_twin_run  # PipelineTwin(repository, "int8", choose_s=0.3) in a process
    assert returncode == 0, (returncode, stderr[-2000:])
    twin = json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))
    network = ModelConfigView.for_variant(repository, ONNX_MODEL, "int8")
    spec = repository.runtimes().RuntimeSpec.from_parameters(network.parameters, repository.onnx_path.parent)
    assert twin["spec"] == repr(spec) and twin["runtime"] == "openvino"  # the variant's file and runtime
    assert twin["batch_size"] in bar_batch_sizes(network.max_batch_size, True, quick=True)
    tried = twin["tried"]
    assert {row["arrangement"] for row in tried} == {"1 runner x all cores", "1 thread x N runners", "openvino streams"}
    assert twin["best"]["img_per_s"] == max(row["throughput"] for row in tried)
    assert twin["network_workers"] == twin["runners"] == twin["best"]["runners"]
    assert twin["decode_threads"] == len(os.sched_getaffinity(0)) + 1
    result = twin["measured"]  # twin.measure(rocket.jpg and chelsea.png, saturation_s=1.0, batch1_s=0.5)
    assert result["saturation_img_per_s"] > 0 and math.isfinite(result["saturation_img_per_s"])
    assert result["saturation_batches"] >= 3 and result["batch1_images"] >= 20
    assert 0 < result["batch1_p50_ms"] <= result["batch1_p99_ms"] < math.inf
    # CPU per image over the span the rate is measured on: rate x CPU is the cores the process kept busy,
    # which cannot exceed those it may use (5 %: os.times ticks). Counted over the whole window, the batches
    # still in progress at its end made it 12-15 % more than the cores.
    busy_ms_per_s = result["saturation_img_per_s"] * result["saturation_cpu_ms_per_image"]
    assert 0 < busy_ms_per_s <= 1.05 * 1000 * len(os.sched_getaffinity(0)), result


def test_a_process_that_measured_openvino_in_process_survives_a_signal_afterwards(int8_twin_run):
    """OpenVINO 2026.4 leaves the compiling thread's signal alternate stack pointing at freed memory once
    several compiled models have come and gone; a signal handled on that thread then crashed the process
    with SIGSEGV (exit -11). The fixture runs what `bench run` does in-process (the int8 pipeline twin: every
    arrangement compiled, measured, dropped), then sends itself SIGTERM; runtimes.py compiles on a
    short-lived thread, so the handler runs and the process exits 0."""
    returncode, stdout, stderr = int8_twin_run
    assert returncode == 0, (returncode, stderr[-2000:])
    assert stdout.strip().splitlines()[-1] == "handled [15]", stdout[-2000:]


class _FakeLoaders:
    """A runtimes module stand-in whose runners sleep: one runner on all cores takes 40 ms a batch
    whatever its size; a single-threaded one 10 ms per image; a stream 30 ms a batch."""

    @staticmethod
    def usable_cores() -> int:
        return 2

    @staticmethod
    def load(spec):
        return (lambda batch: time.sleep(0.04)) if spec.threads == 0 else (lambda batch: time.sleep(0.01 * len(batch)))

    @staticmethod
    def load_streams(spec):
        return [lambda batch: time.sleep(0.03)] * 3


def test_inprocess_bar_keeps_the_fastest_arrangement_and_batch():
    from resnet18_kit.tools.bench.inprocess import bar_batch_sizes, strongest

    @dataclass(frozen=True)
    class Spec:  # the fields of runtimes.RuntimeSpec that the bar reads
        path: Path
        runtime: str
        threads: int = 1
        precision: str = "f32"
        batched_threads: int | None = None

    bar = strongest(_FakeLoaders, Spec(Path("model.int8.onnx"), "openvino"), [4, 16], duration_s=0.3)
    # expected: streams at batch 16, 3 x 16 images per 30 ms = 1600 img/s (all cores: 400; per core: 200)
    assert (bar.best["arrangement"], bar.best["batch_size"], bar.best["runners"]) == ("openvino streams", 16, 3)
    assert 1200 < bar.best["img_per_s"] < 1700
    assert len(bar.tried) == 6 and "openvino streams x3, batch 16" in bar.label()
    ort = strongest(_FakeLoaders, Spec(Path("model.onnx"), "onnxruntime"), [16], duration_s=0.2)
    assert {row["arrangement"] for row in ort.tried} == {"1 runner x all cores", "1 thread x N runners"}
    assert ort.best["arrangement"] == "1 runner x all cores"  # 16 / 40 ms = 400 against 2 x 100
    assert bar_batch_sizes(16, True, quick=True) == [8, 16]
    assert bar_batch_sizes(32, True, quick=False) == [8, 16, 32]
    assert bar_batch_sizes(16, False, quick=False) == [1]  # no dynamic batcher: executions of one request


def test_bench_states_each_configs_ratio_in_one_line_with_its_placement(repository):
    from resnet18_kit.tools.bench.report import placement_phrase, ratio_lines

    loaders = repository.runtimes()
    phrases = {}
    for variant in ("int8", "default"):
        view = ModelConfigView.for_variant(repository, ONNX_MODEL, variant)
        spec = loaders.RuntimeSpec.from_parameters(view.parameters, repository.onnx_path.parent)
        phrases[variant] = placement_phrase(view, spec, {"resnet18_onnx_0_0": frozenset(), "resnet18_onnx_0_1": frozenset()}, 2)
    assert phrases["int8"] == "2 x 2 threads (openvino, 1 for a batch of several), unpinned"
    assert phrases["default"] == "2 x 2 threads (onnxruntime), 1 at a time (rate limiter), unpinned"
    pinned = {"resnet18_onnx_0_0": frozenset({0}), "resnet18_onnx_0_1": frozenset({0})}
    assert placement_phrase(view, spec, pinned, 2).endswith("pinned: resnet18_onnx_0_0 -> core 0; resnet18_onnx_0_1 -> core 0")
    config = {"efficiency": 0.931, "concurrency": [{"level": 1, "throughput": 50.0}, {"level": 64, "throughput": 210.0}],
              "inprocess_bar_img_per_s": 225.5, "placement": "2 x 1 thread (openvino), unpinned",
              "inprocess_bar": {"label": "openvino model.int8.onnx, openvino streams x2, batch 16"}}
    assert ratio_lines({"int8": config}) == [
        "int8 tensors: 0.93 of in-process (210.0 / 225.5 infer/s; served 2 x 1 thread (openvino), unpinned, "
        "concurrency 64; in-process openvino model.int8.onnx, openvino streams x2, batch 16)"]


def test_tensor_targets_read_the_sweeps_and_the_in_process_figures():
    from resnet18_kit.tools.bench.report import evaluate_targets

    def row(level, throughput, p50_ms, average_batch):
        return {"level": level, "throughput": throughput, "p50_us": p50_ms * 1e3, "server": {"average_batch": average_batch}}

    configs = {
        "throughput": {"efficiency": 0.96, "max_batch_size": 32, "inprocess_bar_img_per_s": 50.0,
                       "concurrency": [row(1, 20.0, 30.0, 1.0), row(64, 48.0, 900.0, 30.0)]},
        "latency": {"concurrency": [row(1, 40.0, 21.0, 1.0)], "inprocess_batch1": {"p50_ms": 19.5}},
    }
    identity = {"concurrency": [row(128, 7500.0, 10.0, 16.0)]}
    targets = evaluate_targets(configs, identity, cores=2)
    assert [t["met"] for t in targets] == [True, True, True, True]
    assert targets[0]["measured"] == "0.960 (48.0 / 50.0 infer/s)"
    assert targets[2]["measured"] == "21.0 vs 19.5 ms (+1.5 ms)"
    configs["latency"]["inprocess_batch1"]["p50_ms"] = 18.0
    assert evaluate_targets(configs, identity, cores=2)[2]["met"] is False  # +3.0 ms
    unmeasured = {"concurrency": [], "failed_levels": [{"level": 128, "error": "perf_analyzer killed: no exit"}]}
    last = evaluate_targets(configs, unmeasured, cores=2)[-1]
    assert last["met"] is False and last["measured"] == "not measured: concurrency 128: perf_analyzer killed: no exit"


def test_a_perf_analyzer_run_that_never_exits_is_killed_run_once_more_and_reported_as_failed(tmp_path):
    from resnet18_kit.tools.load.perf_analyzer import HUNG_EXIT, error_summary, run_perf_analyzer

    started = time.monotonic()
    result = run_perf_analyzer(["sh", "-c", "echo started >> " + str(tmp_path / "runs") + "; sleep 30"], tmp_path,
                               timeout_s=60, hang_s=1.0)
    assert result.returncode == HUNG_EXIT
    assert (tmp_path / "runs").read_text() == "started\nstarted\n"  # run once more, then given up
    assert time.monotonic() - started < 15
    assert error_summary((tmp_path / "perf_analyzer.log").read_text()) == "perf_analyzer killed: no exit after 1 s (twice)"


def test_quick_sweep_counts_requests_at_concurrency_1_and_measures_windows_above(tmp_path, repository, monkeypatch):
    """--quick: concurrency 1 a fixed request count (~2.5 s at the in-process batch-1 rate); concurrency 32 in
    stabilized windows, a count only as their fallback, since a count there would time the ramp and drain."""
    from resnet18_kit.tools.bench import pipeline

    loads = {}
    monkeypatch.setattr(pipeline, "measure_pipeline_level",
                        lambda server, load, level, out, protocol: loads.setdefault(level, load))
    options = pipeline.pipeline_options(repository, tmp_path, quick=True, variants=["default"])
    inprocess = {"batch1_p50_ms": 20.0, "saturation_img_per_s": 100.0}
    pipeline.sweep(None, tmp_path / "input.json", "http-shm", inprocess, tmp_path, options)
    assert options.levels == (1, 32) and options.measurement_ms == 1500
    assert loads[1].request_count == 125  # 2.5 s at the batch-1 rate, 1000 / 20 ms = 50 img/s
    assert loads[32].request_count == 0 and loads[32].measurement_ms == 1500
    assert loads[32].fallback_request_count == max(int(100 * 3.0), 6 * 32)  # two 1.5 s windows at 100 img/s


def test_each_saturating_level_is_compared_with_the_in_process_bar_measured_right_around_it(tmp_path, repository,
                                                                                          monkeypatch):
    """The machine's speed drifts within a minute, so a served level is compared with the twin's saturation
    measured right before and right after it (their mean), not with the photo set's figures from a sweep
    away; concurrency 1 is not bracketed (its figure is latency)."""
    from resnet18_kit.tools.bench import pipeline

    calls = []
    bars = iter([(100.0, 9, 20.0), (80.0, 9, 24.0)])  # before, after the saturating level

    def saturation():
        calls.append("bar")
        return next(bars)

    def level(server, load, level, out, protocol):
        calls.append(f"c={level}")
        return {"level": level, "throughput": 45.0 * level / 16, "p50_us": 1e4,
                "server_cpu_ms_per_inference": {"total": 23.1, "by_process": {"tritonserver": 1.1, "stubs": 22.0}}}

    monkeypatch.setattr(pipeline, "measure_pipeline_level", level)
    options = pipeline.pipeline_options(repository, tmp_path, quick=True, variants=["default"])
    set_figures = {"batch1_p50_ms": 20.0, "saturation_img_per_s": 200.0, "saturation_cpu_ms_per_image": 10.0}
    rows = pipeline.sweep(None, tmp_path / "input.json", "http-shm", set_figures, tmp_path, options,
                          saturation=saturation)
    assert calls == ["c=1", "bar", "c=32", "bar"]
    assert "inprocess_paired" not in rows[0]
    assert rows[1]["inprocess_paired"]["saturation_img_per_s"] == 90.0
    summary = pipeline.summarize_protocol(rows, set_figures)
    assert summary["bar"] == {"saturation_img_per_s": 90.0, "saturation_cpu_ms_per_image": 22.0, "paired": True}
    assert summary["efficiency"] == 1.0  # 90 / 90, not 90 / 200 against the set's figures
    entry = {"photos": "sample", "inprocess": set_figures}
    line = pipeline.ratio_lines({"variants": [{"variant": "int8", "inprocess_twin": {"network_label": "x"},
                                               "photo_sets": [{**entry, "protocols": [{"protocol": "http-shm",
                                                                                       **summary}]}]}]})[0]
    assert "(90.0 / 90.0 img/s" in line and "23.10 ms" in line and "22.00 ms = 1.05x" in line, line


def test_a_tensor_level_is_measured_between_two_in_process_measurements_of_the_bar():
    """inprocess.paired: bar, served level, bar, in that order; the level's row carries their means."""
    from resnet18_kit.tools.bench.inprocess import InProcessResult, paired, tensor_figures

    calls = []
    results = iter([InProcessResult("bar", 16, 200.0, 70.0, 70.0, 9, 80.0, 9.0),
                    InProcessResult("bar", 16, 150.0, 90.0, 90.0, 9, 99.0, 11.0)])

    def remeasure():
        calls.append("bar")
        return next(results)

    def measure():
        calls.append("level")
        return {"level": 64, "throughput": 160.0}

    row = paired(remeasure, measure, tensor_figures)
    assert calls == ["bar", "level", "bar"]
    assert row["inprocess_paired"] == {"img_per_s": 175.0, "cpu_ms_per_image": 10.0,
                                       "before": {"img_per_s": 200.0, "cpu_ms_per_image": 9.0},
                                       "after": {"img_per_s": 150.0, "cpu_ms_per_image": 11.0}}
