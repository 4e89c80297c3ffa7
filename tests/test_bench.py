"""The benchmark wrapper: perf_analyzer CSV parsing, the config switch, and a short real perf_analyzer run."""
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

from resnet18_kit.tools.bench.sweeps import config_names, levels_for, local_batching
from resnet18_kit.tools.load.perf_analyzer import (EMPTY_EXPORT_ATTEMPTS, RESNET18_LOGITS_BYTES, LoadSpec, command, load_profile_export,
                                 parse_csv, perf_analyzer_binary, run_level)
from resnet18_kit.observe.model_config import ModelConfigView, served_config
from resnet18_kit.observe.statistics import model_statistics, statistics_delta
from resnet18_kit.client import TritonClassifierClient
from resnet18_kit.contract import ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

DATA = Path(__file__).parent / "data"


def test_parse_recorded_concurrency_csv():
    """A real `-f --verbose-csv --collect-metrics` file (throughput config, concurrency 64, no GPU)."""
    (row,) = parse_csv(DATA / "perf_concurrency.csv")
    assert row.level == 64 and row.throughput == pytest.approx(41.7681)
    assert (row.p50_us, row.p90_us, row.p95_us, row.p99_us) == (1396829, 1849414, 2004585, 2619957)
    assert row.avg_us == 1497729 and row.server_queue_us == 786104 and row.server_compute_infer_us == 700430
    assert row.server_compute_input_us == 4177 and row.server_compute_output_us == 6190
    assert row.gpu_utilization is None  # the GPU columns are empty on a CPU-only machine


def test_parse_recorded_request_rate_csv():
    (row,) = parse_csv(DATA / "perf_request_rate.csv")
    assert row.level == pytest.approx(38.4) and row.throughput == pytest.approx(22.8261)
    assert row.p99_us == 609373 and row.network_us == 1059


def test_parse_rejects_a_csv_without_the_verbose_columns(tmp_path):
    bad = tmp_path / "short.csv"
    bad.write_text("Concurrency,Inferences/Second,p50 latency\n1,10,100\n")
    with pytest.raises(ValueError, match="lacks columns"):
        parse_csv(bad)


def test_command_line_names_the_load_and_the_outputs(tmp_path):
    load = LoadSpec("request_rate", (30.0,), shared_memory="system", output_shm_bytes=4000)
    cmd = command(ONNX_MODEL, "127.0.0.1:8001", "grpc", load, 30.0, tmp_path, "http://127.0.0.1:8002/metrics")
    assert cmd[0] == str(perf_analyzer_binary())
    joined = " ".join(cmd)
    for part in ("--request-rate-range 30:30", "--request-distribution poisson", "--verbose-csv",
                 f"-f {tmp_path / 'perf.csv'}", "--collect-metrics", "--shared-memory system",
                 "--output-shared-memory-size 4000", "--profile-export-file"):
        assert part in joined


def test_concurrency_levels_stop_at_twice_the_max_batch_and_the_queue():
    assert levels_for(32, 128, quick=False) == (1, 2, 4, 8, 16, 32, 64)
    assert levels_for(16, 16, quick=False) == (1, 2, 4, 8, 16)  # the latency config's queue holds 16
    assert levels_for(16, 64, quick=True) == (1, 32)
    assert levels_for(32, 128, quick=False, instances=2) == (1, 2, 4, 8, 16, 32, 64, 128)


def test_swept_configs_are_the_repositorys_cpu_variants(repository):
    """`bench run` sweeps "default", then the model's variants (ModelRepository.variant_names) but gpu."""
    names = config_names(repository, ONNX_MODEL)
    assert names[0] == "default" and set(names) == set(repository.variant_names(ONNX_MODEL)) - {"gpu"}
    assert local_batching(repository, ONNX_MODEL, "throughput").max_batch_size == 32


@pytest.mark.live
def test_config_switch_is_what_the_server_loaded(tmp_path, repository):
    """--model-config-name=throughput really serves configs/throughput.pbtxt (read back from the server)."""
    config = config_on_free_ports(model_config_name="throughput", model_repository=repository.root)
    with EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log", drain_on_exit=False):
        with TritonClassifierClient(config.http_url, "http") as client:
            served = served_config(client, ONNX_MODEL)
            default_of_other_model = client.model_config("resnet18_torchscript")["max_batch_size"]
    assert served["max_batch_size"] == 32 and served["preferred_batch_size"] == [32]
    assert served["max_queue_delay_us"] == 100000 and served["max_queue_size"] == 0  # no queue policy
    assert default_of_other_model == 16  # a model without that variant keeps its config.pbtxt


def test_short_real_perf_analyzer_run_is_consistent(triton_server, tmp_path):
    """Concurrency 2 for a few seconds: positive figures; Little's law from perf_analyzer's own
    per-request timestamps (sum of latencies / (last answer - first send) = requests in flight = 2);
    its summary's mean latency is that of the same requests; the server's statistics saw them all.
    (Not the summary throughput x mean latency: for a --request-count run of a second or two its
    throughput divides by a span that includes start-up, and reads 3-30% low.)"""
    config = triton_server.config
    before = model_statistics(config.http_url, ONNX_MODEL)
    # system shared memory: without it perf_analyzer 2.51 writes no export for a --request-count run
    load = LoadSpec("concurrency", (2,), request_count=60, shared_memory="system",
                    output_shm_bytes=RESNET18_LOGITS_BYTES)
    row = run_level(ONNX_MODEL, config.grpc_url, "grpc", load, 2, tmp_path, metrics_url=config.metrics_url,
                    export_attempts=EMPTY_EXPORT_ATTEMPTS)
    delta = statistics_delta(before, model_statistics(config.http_url, ONNX_MODEL))
    assert row.throughput > 0 and 0 < row.p50_us <= row.p90_us <= row.p99_us
    answered = [r for e in load_profile_export(tmp_path / "profile.json")["experiments"] for r in e["requests"]
                if r.get("response_timestamps")]
    assert len(answered) >= 60
    sends = np.array([r["timestamp"] for r in answered], dtype=float)
    answers = np.array([r["response_timestamps"][0] for r in answered], dtype=float)
    in_flight = (answers - sends).sum() / (answers.max() - sends.min())
    assert in_flight == pytest.approx(2, rel=0.1)
    assert row.avg_us == pytest.approx((answers - sends).mean() / 1e3, rel=0.1)
    assert delta["inference_count"] >= 60 and delta["execution_count"] >= 1
    assert delta["inference_count"] == sum(size * count for size, count in delta["batch_executions"].items())
    assert (tmp_path / "perf.csv").exists() and (tmp_path / "command.txt").read_text().startswith(
        str(perf_analyzer_binary()))


def test_stub_profile_classifies_py_spy_samples(tmp_path):
    """py-spy raw lines ("stack count") from a real `record --idle` of the throughput stub: empty stacks
    are the stub outside Python (waiting for a batch), Session.run is compute, the rest Python around it."""
    from resnet18_kit.tools.bench.stub_profile import summarize

    raw = tmp_path / "stub.txt"
    raw.write_text(
        " 3\n"
        "TritonPythonModel.execute (model.py:63);TritonPythonModel._response (model.py:73) 1\n"
        "TritonPythonModel.execute (model.py:59);load_onnxruntime.<locals>.<lambda> (model.py:25);"
        "Session.run (onnxruntime/capi/onnxruntime_inference_collection.py:395) 188\n"
        "TritonPythonModel.execute (model.py:59) 1\n")
    assert summarize(raw) == {"outside python": 3, "python": 2, "compute": 188}


def test_a_profile_export_cut_off_keeps_the_complete_requests(tmp_path):
    """perf_analyzer 2.51 can exit 0 with --profile-export-file cut at 64 KiB: the requests recorded
    whole before the cut are kept, the one cut in half is dropped, and the result says it was cut."""
    from resnet18_kit.tools.load.perf_analyzer import latency_stats_us

    requests = [{"timestamp": 1_000_000 * i, "request_inputs": {"INPUT": 0.5},
                 "response_timestamps": [1_000_000 * i + 2000], "response_outputs": [{"OUTPUT": 0.5}]}
                for i in range(50)]
    whole = json.dumps({"experiments": [{"experiment": {"mode": "concurrency", "value": 4},
                                         "requests": requests, "window_boundaries": [0, 1]}], "version": "x"})
    cut = whole[: whole.index('"timestamp": 30000000') + 20]  # in the middle of request 30
    path = tmp_path / "profile.json"
    path.write_text(cut)
    data = load_profile_export(path)
    assert data["truncated"] and len(data["experiments"][0]["requests"]) == 30
    assert latency_stats_us(path) == {4.0: {"mean_us": 2.0, "std_us": 0.0, "min_us": 2.0, "max_us": 2.0,
                                            "requests": 30}}
    path.write_text(whole)
    assert "truncated" not in load_profile_export(path) and latency_stats_us(path)[4.0]["requests"] == 50


def test_periodic_sampler_samples_at_the_interval_and_at_the_edges_and_drops_none():
    from resnet18_kit.observe.statistics import PeriodicSampler

    class Counter(PeriodicSampler):
        calls = 0

        def sample(self):
            self.calls += 1
            return None if self.calls == 2 else self.calls

    with Counter(0.05, at_edges=True) as edges:
        import time
        time.sleep(0.28)
    assert edges.samples[0] == 1 and 2 not in edges.samples and edges.samples[-1] == edges.calls
    assert 5 <= edges.calls <= 9  # entry, ~5 intervals, exit
    with Counter(10.0) as inner:
        pass
    assert inner.calls == 0 and inner.samples == []  # no interval elapsed, no edges asked for


# --- the end-to-end pipeline: encoded photos through the `resnet18` ensemble (resnet18_kit/tools/bench/pipeline.py) ---


def test_bytes_input_data_holds_each_photo_as_a_length_prefixed_serialized_tensor(tmp_path):
    """--input-data JSON: one entry per photo, in order; b64 decodes to a 4-byte little-endian length
    followed by exactly the file's bytes (Triton's serialized BYTES element); shape [1]."""
    import base64
    import struct

    from resnet18_kit.tools.load.photos import write_input_data

    payloads = [b"\xff\xd8 not really a jpeg", bytes(range(256)) * 300]  # the second is over 64 KiB
    paths = []
    for i, payload in enumerate(payloads):
        paths.append(tmp_path / f"photo{i}.bin")
        paths[-1].write_bytes(payload)
    data = json.loads(write_input_data(paths, tmp_path / "input.json").read_text())["data"]
    assert len(data) == len(payloads)
    for entry, payload in zip(data, payloads):
        assert set(entry) == {"image"} and entry["image"]["shape"] == [1]
        raw = base64.b64decode(entry["image"]["b64"])
        assert struct.unpack("<I", raw[:4])[0] == len(payload) and raw[4:] == payload


def test_command_line_with_input_data_and_without_export_or_shared_memory(tmp_path):
    data = tmp_path / "input.json"
    load = LoadSpec("concurrency", (4,), input_data=data, profile_export=False)
    cmd = command("resnet18", "127.0.0.1:8001", "grpc", load, 4, tmp_path, count=20)
    assert cmd[cmd.index("--input-data") + 1] == str(data)
    joined = " ".join(cmd)
    assert "-m resnet18" in joined and "--concurrency-range 4:4" in joined and "--request-count 20" in joined
    assert "--shared-memory" not in cmd and "--profile-export-file" not in cmd
    plain = command(ONNX_MODEL, "127.0.0.1:8001", "grpc", LoadSpec("concurrency", (4,)), 4, tmp_path)
    assert "--input-data" not in plain and "--profile-export-file" in plain  # unchanged without them


def test_12mp_photo_set_is_the_sample_photos_as_12_megapixel_jpegs_cached(tmp_path):
    from PIL import Image

    from resnet18_kit.tools.load.photos import photo_set
    from resnet18_kit.client.samples import sample_photos

    paths = photo_set("12mp", tmp_path)
    assert [p.stem for p in paths] == [p.stem for p in sample_photos()]
    for path, source in zip(paths, sample_photos()):
        assert path.parent == tmp_path / "photos" / "12mp"
        with Image.open(source) as original, Image.open(path) as image:
            portrait = original.height > original.width
            assert image.format == "JPEG" and image.mode == "RGB"
            assert image.size == ((3000, 4000) if portrait else (4000, 3000))
            image.load()  # decodes whole
    written = paths[0].stat().st_mtime_ns
    paths[1].unlink()
    again = photo_set("12mp", tmp_path)
    assert again == paths and paths[1].is_file() and paths[0].stat().st_mtime_ns == written  # only the missing one


def test_concurrent_executions_follow_the_rate_limiter():
    """Instances that each ask for all of a rate-limiter resource run one at a time; without one, all run."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from resnet18_kit.observe.model_config import concurrent_executions

    def config(groups: str):
        return text_format.Parse(groups, model_config_pb2.ModelConfig())

    shared = 'instance_group [{ count: 2, rate_limiter { resources [{ name: "cores", count: 2 }] } }]'
    assert concurrent_executions(config(shared)) == 1
    assert concurrent_executions(config("instance_group [{ count: 2 }, { count: 1 }]")) == 3
    mixed = ('instance_group [{ count: 2, rate_limiter { resources [{ name: "cores", count: 1 }] } }, '
             '{ count: 1, rate_limiter { resources [{ name: "cores", count: 2 }] } }]')
    assert concurrent_executions(config(mixed)) == 2  # 2 available: the two asking for 1 fit together


@pytest.mark.parametrize("transport", ["grpc", "http-shm"])
def test_short_real_perf_analyzer_run_through_the_ensemble_counts_every_image_on_both_steps(
        triton_server, tmp_path, transport):
    """12 photos as BYTES requests at concurrency 2 (over gRPC; over HTTP with the photos in system shared
    memory): perf_analyzer sent 12, and the statistics extension counted exactly 12 inferences on the
    ensemble and on each step, in the batches it reports."""
    import re

    from resnet18_kit.tools.load.photos import write_input_data
    from resnet18_kit.tools.bench.pipeline import STEP_MODELS, measure_pipeline_level
    from resnet18_kit.client.samples import sample_photos

    data = write_input_data(sample_photos(("rocket.jpg", "chelsea.png")), tmp_path / "input.json")
    load = LoadSpec("concurrency", (2,), request_count=12, input_data=data, profile_export=False)
    row = measure_pipeline_level(triton_server, load, 2, tmp_path / "c2", transport)
    log = (tmp_path / "c2" / "perf_analyzer.log").read_text()
    assert re.search(r"Client:\s+Request count: 12\b", log), log
    assert row["throughput"] > 0 and 0 < row["p50_us"] <= row["p99_us"]
    for model in ("resnet18", *STEP_MODELS):
        steps = row["steps"][model]
        assert steps["inference_count"] == 12, (model, steps)
        if model != "resnet18":
            assert sum(size * count for size, count in steps["batch_executions"].items()) == 12
            assert steps["compute_infer_us"] > 0 and steps["average_batch"] >= 1
    # the server's CPU over the run, per image: tritonserver and each step's stubs, from /proc
    cpu = row["server_cpu_ms_per_inference"]
    assert cpu["total"] > 0 and cpu["by_process"]["stub preprocess"] > 0 and cpu["by_process"]["tritonserver"] > 0, cpu
    assert cpu["by_process"]["stubs"] <= cpu["total"], cpu


def test_pipeline_report_and_targets_from_a_summary(tmp_path):
    """report.md and both plots from a summary with only the end-to-end part (--skip-tensor-sweeps);
    the targets take the fastest variant."""
    from resnet18_kit.tools.bench.pipeline import pipeline_targets, ratio_lines, summarize_protocol
    from resnet18_kit.tools.bench.report import write_report

    def level(c, img_per_s, p50_ms):
        step = {"queue_us": 1000.0 * c, "compute_infer_us": 8000.0, "average_batch": min(c, 4), "inference_count": 9}
        return {"level": c, "throughput": img_per_s, "p50_us": p50_ms * 1e3, "p99_us": p50_ms * 2e3,
                "steps": {"resnet18": step, "preprocess": step, "resnet18_onnx": step}, "cpu_utilization": 0.9}

    def variant(name, scale):
        entries = []
        for photos, rate in (("sample", 120.0), ("12mp", 70.0)):
            inproc = {"saturation_img_per_s": rate * scale * 1.05, "saturation_batches": 9,
                      "batch1_p50_ms": 10.0, "batch1_p99_ms": 12.0, "batch1_images": 50}
            rows = [level(1, 60.0, 13.0), level(16, rate * scale, 150.0)]
            entries.append({"photos": photos, "inprocess_before": inproc, "inprocess_after": inproc,
                            "inprocess": inproc, "protocols": [{"protocol": "grpc", "concurrency": rows,
                                                                **summarize_protocol(rows, inproc)}]})
        twin = {"variant": name, "model_file": "model.onnx", "runtime": "onnxruntime", "intra_op_threads": 0,
                "allow_spinning": False, "precision": "f32", "batch_size": 16, "decode_threads": 3,
                "network_workers": 1, "network_label": "onnxruntime model.onnx, 1 runner x all cores x1, batch 16"}
        return {"variant": name, "triton_version": "2.51.0", "inprocess_twin": twin, "photo_sets": entries}

    pipeline = {"options": {"request_window_s": 2.5, "measurement_ms": 2500},
                "photo_sets": {"sample": [{"file": "a.png", "bytes": 1000}],
                               "12mp": [{"file": "a.jpg", "bytes": 9000}]},
                "variants": [variant("default", 0.5), variant("int8", 1.0)], "elapsed_s": 1.0}
    pipeline["targets"] = targets = pipeline_targets(pipeline)
    assert [t["met"] for t in targets] == [True] * 6
    assert "int8" in targets[0]["measured"] and "120.0 img/s" in targets[0]["measured"]
    assert targets[3]["name"].startswith("12 MP JPEGs, served / in-process") and "0.95 (70.0 / 73.5" in targets[3]["measured"]
    assert "+3.0 ms" in targets[4]["measured"]
    lines = ratio_lines(pipeline)
    assert len(lines) == 4 and lines[3] == ("int8 main job, 12mp photos, grpc: 0.95 of in-process (70.0 / 73.5 img/s, "
                                            "concurrency 16; in-process onnxruntime model.onnx, 1 runner x all cores "
                                            "x1, batch 16)")
    machine = {"triton_version": "2.51.0", "cpu": "test", "cores": 2, "gpu": None, "python": "3", "onnxruntime": "1",
               "torch": "2", "cpu_during_run": {"busy": 0.5, "steal": 0.0}}
    (tmp_path / "summary.json").write_text(json.dumps({
        "command": "resnet18-kit bench run --skip-tensor-sweeps", "started_utc": "now", "elapsed_s": 1.0, "model": ONNX_MODEL,
        "machine": machine, "configs": [], "inprocess": [], "targets": [], "pipeline": pipeline}))
    report = write_report(tmp_path).read_text()
    assert "| int8 | 12mp | grpc | 16 | 70.0 | 150.0 | 300.0 | 16.0 | 8.0 | 4.0 | 16.0 | 8.0 | 4.0 | 90% |" in report
    assert "Tensor sweeps" not in report
    assert (tmp_path / "pipeline_throughput.png").stat().st_size > 0 and (tmp_path / "pipeline_steps.png").exists()


def _tensor_config(name: str, max_batch_size: int, levels: tuple[int, ...]) -> dict:
    """A config of summary.json's "configs" (resnet18_kit/tools/bench/sweeps.py run_config): per level perf_analyzer's
    breakdown (us), throughput rising with the level, the batch sizes the server formed."""
    rows = []
    for level in levels:
        batch = min(level, max_batch_size)
        rows.append({"level": level, "throughput": 10.0 * level, "server_queue_us": 1000.0 * level,
                     "server_compute_input_us": 100.0, "server_compute_infer_us": 5000.0 * batch,
                     "server_compute_output_us": 50.0, "network_us": 200.0, "client_send_us": 10.0,
                     "client_recv_us": 5.0, "server": {"batch_executions": {str(batch): 7, "1": 2},
                                                       "average_batch": batch * 0.9}})
    return {"name": name, "max_batch_size": max_batch_size, "concurrency": rows}


def test_report_batch_size_histograms_share_bins_and_x_limits():
    """Every config's histogram panel has the bins 1..the largest max_batch_size, on one shared x axis."""
    import matplotlib.pyplot as plt

    from resnet18_kit.tools.bench.report import batch_sizes_figure

    summary = {"configs": [_tensor_config("latency", 4, (1, 2, 4, 8)), _tensor_config("throughput", 32, (1, 32, 64)),
                           _tensor_config("no_batching", 1, (1, 16))]}
    fig = batch_sizes_figure(summary)
    try:
        axes = fig.axes
        assert len(axes) == 3
        assert {ax.get_xlim() for ax in axes} == {(0.5, 32.5)}
        assert all(axes[0].get_shared_x_axes().joined(axes[0], ax) for ax in axes[1:])
        bins = [[patch.get_x() + patch.get_width() / 2 for patch in ax.patches] for ax in axes]
        assert all(b == pytest.approx(list(range(1, 33))) for b in bins)
        heights = {size: patch.get_height() for size, patch in zip(range(1, 33), axes[1].patches)}
        assert heights[32] == 7 and heights[1] == 2 and sum(heights.values()) == 9  # throughput at c=64
    finally:
        plt.close(fig)


def test_report_latency_breakdown_draws_every_config_at_one_concurrency():
    """Full sweeps share 1..32: every bar at 32 (said in the title); --quick levels share none: each config's
    level nearest 32, written on its bar."""
    import matplotlib.pyplot as plt

    from resnet18_kit.tools.bench.report import BREAKDOWN, breakdown_levels, latency_breakdown_figure

    configs = [_tensor_config("default", 16, (1, 2, 4, 8, 16, 32, 64)),
               _tensor_config("latency", 16, (1, 2, 4, 8, 16, 32)),
               _tensor_config("throughput", 32, (1, 2, 4, 8, 16, 32, 64, 128))]
    assert breakdown_levels(configs) == ({"default": 32, "latency": 32, "throughput": 32}, True)
    fig = latency_breakdown_figure({"configs": configs})
    try:
        ax = fig.axes[0]
        assert "every config at concurrency 32" in ax.get_title()
        assert [t.get_text() for t in ax.texts] == ["c=32"] * 3
        # the stacked bars' tops are the breakdown of each config's concurrency-32 row
        tops = [max(p.get_y() + p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - i) < 0.01)
                for i in range(3)]
        row32 = [next(r for r in c["concurrency"] if r["level"] == 32) for c in configs]
        assert tops == pytest.approx([sum(r[key] for key, _ in BREAKDOWN) / 1000 for r in row32])
    finally:
        plt.close(fig)

    quick = [_tensor_config("latency", 16, (1,)), _tensor_config("throughput", 32, (64,)),
             _tensor_config("no_batching", 16, (16,)), _tensor_config("default", 16, (1, 32))]
    levels, common = breakdown_levels(quick)
    assert not common and levels == {"latency": 1, "throughput": 64, "no_batching": 16, "default": 32}
    fig = latency_breakdown_figure({"configs": quick})
    try:
        ax = fig.axes[0]
        assert "no concurrency common" in ax.get_title() and "nearest 32" in ax.get_title()
        assert [t.get_text() for t in ax.texts] == ["c=1", "c=64", "c=16", "c=32"]
    finally:
        plt.close(fig)
