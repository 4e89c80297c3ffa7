"""The benchmark wrapper: perf_analyzer CSV parsing, the config switch, and a short real perf_analyzer run."""
from pathlib import Path

import numpy as np
import pytest

from bench.__main__ import levels_for, served_config
from bench.perf_analyzer import (EMPTY_EXPORT_ATTEMPTS, RESNET18_LOGITS_BYTES, LoadSpec, command, load_profile_export,
                                 parse_csv, perf_analyzer_binary, run_level)
from bench.server_stats import model_statistics, statistics_delta
from client.classifier import TritonClassifierClient
from export.artifacts import ONNX_MODEL
from server.embedded import EmbeddedTritonServer, config_on_free_ports

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


def test_config_switch_is_what_the_server_loaded(tmp_path):
    """--model-config-name=throughput really serves configs/throughput.pbtxt (read back from the server)."""
    config = config_on_free_ports(model_config_name="throughput")
    with EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log"):
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
    from bench.stub_profile import summarize

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
    import json

    from bench.perf_analyzer import latency_stats_us, load_profile_export

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
    from bench.server_stats import PeriodicSampler

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
