"""`resnet18-kit figures` on small hand-made results folders, in the formats the commands write:
`resnet18-kit bench run` (summary.json), `resnet18-kit plan validate` (validation.json), `resnet18-kit
reliability soak` (soak-<time>/soak.json). No server."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from resnet18_kit.tools.bench import figures, plots

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


def perf_row(level: float, throughput: float, p99_ms: float) -> dict:
    """A bench.perf_analyzer.PerfRow as asdict() writes it (times in us)."""
    p99_us = p99_ms * 1e3
    return {"level": level, "throughput": throughput, "p50_us": p99_us / 2, "p90_us": p99_us * 0.8,
            "p95_us": p99_us * 0.9, "p99_us": p99_us, "avg_us": p99_us / 2, "client_send_us": 10.0,
            "network_us": 100.0, "server_queue_us": p99_us / 4, "server_compute_input_us": 50.0,
            "server_compute_infer_us": p99_us / 4, "server_compute_output_us": 20.0, "client_recv_us": 5.0,
            "mean_us": p99_us / 2, "std_us": 1.0, "min_us": 1.0, "max_us": p99_us * 1.1, "requests": 100,
            "gpu_utilization": None}


def write_bench(folder: Path, pipeline: bool = True, configs: bool = False) -> Path:
    """A `resnet18-kit bench run` results folder with the end-to-end part and/or the tensor sweeps."""
    step = {"queue_us": 1000.0, "compute_infer_us": 8000.0, "average_batch": 2.0, "inference_count": 9}
    summary = {"command": "resnet18-kit bench run", "started_utc": "2026-11-23T06:45:17+00:00", "elapsed_s": 1.0,
               "model": "resnet18_onnx", "configs": [], "inprocess": [], "targets": []}
    if pipeline:
        inproc = {"saturation_img_per_s": 100.0, "batch1_p50_ms": 10.0, "batch1_p99_ms": 12.0,
                  "saturation_cpu_ms_per_image": 20.0}
        variants = []
        for name, scale in (("default", 0.5), ("int8", 1.0)):
            entries = [{"photos": photos, "inprocess": inproc, "inprocess_before": inproc, "inprocess_after": inproc,
                        "protocols": [{"protocol": protocol, "concurrency": [
                            {**perf_row(c, 20 * c * scale, 30.0 * c), "steps": {"preprocess": step}}
                            for c in (1, 2, 4)], "best_server_cpu_ms_per_inference": {"total": 25.0}}
                            for protocol in ("grpc", "http-shm")]}
                       for photos in ("sample", "12mp")]
            variants.append({"variant": name, "photo_sets": entries})
        summary["pipeline"] = {"photo_sets": {"sample": [{"file": "a.png", "bytes": 1}],
                                              "12mp": [{"file": "a.jpg", "bytes": 2}]}, "variants": variants}
    if configs:
        summary["configs"] = [{"name": name, "max_batch_size": 16, "inprocess_bar": {"cpu_ms_per_image": 8.0},
                               "concurrency": [{**perf_row(c, 10.0 * c, 20.0 * c),
                                                "server_cpu_ms_per_inference": {"total": 10.0 * c / 16}}
                                               for c in (1, 4, 16)]}
                              for name in ("default", "latency")]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def validation_row(config: str, fraction: float, measured_p99_ms: float, predicted_p99_ms: float) -> dict:
    """One row of validation.json after add_predictions (resnet18_kit/tools/planner/validate_analysis.py)."""
    predicted = {"offered_rps": 10.0, "throughput_rps": 10.0, "p50_ms": predicted_p99_ms / 2, "p90_ms": 1.0,
                 "p95_ms": 1.0, "p99_ms": predicted_p99_ms, "utilization": fraction, "average_batch": 2.0,
                 "refused": 0, "timed_out": 0, "stalls": 0, "speed_utilization": 0.7, "speed_factor": 1.1,
                 "queue_p99_ms": 5.0}
    return {"config": config, "fraction": fraction, "rate_rps": 40 * fraction, "capacity_rps": 40.0,
            "requests": 400, "wall_s": 10.0, "measured": perf_row(40 * fraction, 40 * fraction, measured_p99_ms),
            "server": {"average_batch": 2.0}, "cpu": {"ours": 0.9, "foreign": 0.0, "steal": 0.0},
            "batcher": "dynamic", "instances": 1, "level_dir": "/nowhere", "predicted": predicted,
            "predicted_replay": predicted, "predicted_static": predicted, "predicted_replay_static": {}}


def write_validation(folder: Path) -> Path:
    rows = [validation_row("default", 0.3, 40.0, 42.0), validation_row("default", 0.7, 100.0, 140.0),
            validation_row("throughput", 0.95, 800.0, 700.0),
            {"config": "throughput", "fraction": 0.3, "rate_rps": 12.0, "error": "queue full", "cpu": {}, "server": {}}]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "validation.json").write_text(json.dumps(rows))
    (folder / "profile-resnet18_onnx.json").write_text(json.dumps({"measured_utc": "2026-11-23T08:12:00+00:00"}))
    return folder


def write_soak(folder: Path, minutes: int = 3) -> Path:
    """A `resnet18-kit reliability soak --out folder` output: folder/soak-<time>/soak.json."""
    samples = [[5.0 * i, {"tritonserver": 300 * MiB + i * 1024, "preprocess_0_0": 120 * MiB,
                          "resnet18_onnx_0_0": 200 * MiB}] for i in range(minutes * 12 + 1)]
    record = {"capacity_per_s": 50.0, "load": 0.8, "rate_per_s": 40.0, "minutes": minutes,
              "summary": {"sent": 100, "answered": 100}, "failed": 0, "sends_delayed_by_bound": 0,
              "per_minute": [{"minute": m + 1, "sent": 2400, "answered": 2400, "failed": 0, "p50_ms": 30.0,
                              "p99_ms": 90.0 + m} for m in range(minutes)],
              "memory": {"total": {"start_mib": 620.0, "end_mib": 620.1, "peak_mib": 620.1, "growth_mib": 0.1}},
              "memory_samples": samples, "cpu_steal_share": 0.0, "failures": []}
    run = folder / "soak-20261123-090000"
    run.mkdir(parents=True)
    (run / "soak.json").write_text(json.dumps(record, indent=1))
    return folder


def run_command(*args: str) -> subprocess.CompletedProcess:
    """`resnet18-kit figures ARGS` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "resnet18_kit", "figures", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_every_figure_written_small_from_hand_made_results(tmp_path):
    bench = write_bench(tmp_path / "bench", configs=True)
    out = tmp_path / "figures"
    written = figures.generate({"pipeline": bench, "tensor": bench, "validation": write_validation(tmp_path / "val"),
                                "soak": write_soak(tmp_path / "soak")}, out, tmp_path / "results")
    assert set(written) == {"pipeline", "tensor", "validation", "soak"}
    for name, path in written.items():
        assert path == out / figures.FIGURES[name]
        assert 0 < path.stat().st_size < 200_000, (name, path.stat().st_size)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tensor_sweeps_also_write_the_docs_tables_and_their_backing_file(tmp_path):
    """docs/figures/configs.json and the page's "Choosing a config" table come from the same summary; the
    hand-written "use it for" cells of the page are kept, the figures replaced."""
    checkout = tmp_path / "checkout"
    page = checkout / "docs" / "model-repository.md"
    page.parent.mkdir(parents=True)
    page.write_text("# x\n\n<!-- choosing-a-config -->\n| variant | use it for |\n|---|---|\n"
                    "| `gpu` | a GPU machine |\n<!-- /choosing-a-config -->\n\nafter\n")
    bench = write_bench(tmp_path / "bench", configs=True)
    figures.generate({"tensor": bench}, checkout / "docs" / "figures", tmp_path / "results", ("tensor",))
    data = json.loads((checkout / "docs" / "figures" / "configs.json").read_text())
    summary = json.loads((bench / "summary.json").read_text())
    assert [row["variant"] for row in data["rows"]] == [config["name"] for config in summary["configs"]]
    best = max(summary["configs"][0]["concurrency"], key=lambda row: row["throughput"])["throughput"]
    assert data["rows"][0]["infer_per_s"] == round(best, 1)
    # CPU per inference at the saturation level (16: 10 ms) over the bar's 8 ms; end to end 25 / 20 ms
    assert (data["rows"][0]["server_cpu_ms"], data["rows"][0]["cpu_ratio"]) == (10.0, 1.25)
    assert data["rows"][0]["end_to_end_cpu_ratio"] == 1.25 and data["rows"][1]["end_to_end_cpu_ratio"] is None
    text = page.read_text()
    assert "| `gpu` | a GPU machine | - | - | - |" in text and text.endswith("\n\nafter\n")
    assert f"{round(best, 1):g} (" in text


def test_the_command_skips_a_missing_input_with_a_line_and_writes_the_others(tmp_path):
    out = tmp_path / "figures"
    result = run_command("--pipeline", str(write_bench(tmp_path / "bench")), "--tensor", str(tmp_path / "bench"),
                         "--validation", str(tmp_path / "absent"), "--soak", str(write_soak(tmp_path / "soak")),
                         "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert any("planner_p99_predicted_vs_measured.png: skipped:" in line and "absent" in line for line in lines)
    assert any("tensor_throughput_vs_p99.png: skipped:" in line and "'configs'" in line for line in lines)
    assert sorted(p.name for p in out.iterdir()) == ["pipeline_throughput_vs_p99.png", "soak_p99_memory.png"]
    assert "Traceback" not in result.stderr


def test_validation_without_predictions_yet_is_skipped(tmp_path, caplog):
    folder = tmp_path / "val"
    folder.mkdir()
    row = validation_row("default", 0.3, 40.0, 42.0)
    del row["predicted"]
    (folder / "validation.json").write_text(json.dumps([row]))
    with caplog.at_level(logging.INFO, logger="resnet18_kit.tools.bench.figures"):
        assert figures.generate({"validation": folder}, tmp_path / "out", tmp_path, ("validation",)) == {}
    assert "no predicted level yet" in caplog.text and "--predict-only" in caplog.text


@pytest.mark.parametrize("figure, filename", [("validation", "validation.json"), ("pipeline", "summary.json")])
def test_malformed_json_is_one_error_line_and_exit_2(tmp_path, figure, filename):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / filename).write_text('{"rows": [1, 2')
    result = run_command(f"--{figure}", str(folder), "--only", figure, "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "error" in line and "not valid JSON" in line and filename in line
    assert not (tmp_path / "out").exists()


def test_a_missing_field_is_one_error_line_and_exit_2(tmp_path):
    folder = write_soak(tmp_path / "soak")
    path = next(folder.glob("soak-*/soak.json"))
    record = json.loads(path.read_text())
    del record["memory_samples"]
    path.write_text(json.dumps(record))
    result = run_command("--soak", str(folder), "--only", "soak", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "soak_p99_memory.png" in line and "memory_samples" in line


def test_validation_band_is_25_percent_either_side_of_measured(tmp_path):
    rows, failed, pending = plots.validation_rows(json.loads(
        (write_validation(tmp_path / "val") / "validation.json").read_text()))
    assert (len(rows), failed, pending) == (3, 1, 0)
    fig = plots.validation_figure(rows, "2026-11-23")
    try:
        ax = fig.axes[0]
        lines = {line.get_gid(): line for line in ax.get_lines()}
        for gid, factor in (("band_upper", 1.25), ("band_lower", 0.75), ("identity", 1.0)):
            x, y = lines[gid].get_xdata(), lines[gid].get_ydata()
            assert y == pytest.approx([v * factor for v in x]), gid
        (band,) = [c for c in ax.collections if c.get_gid() == "band"]
        vertices = band.get_paths()[0].vertices
        for x, y in vertices:
            assert y == pytest.approx(0.75 * x) or y == pytest.approx(1.25 * x)
        # one marker per measured level: measured p99 in ms on x, the prediction on y
        points = sorted(tuple(p) for c in ax.collections if str(c.get_gid()).startswith("config:")
                        for p in c.get_offsets())
        assert points == [(40.0, 42.0), (100.0, 140.0), (800.0, 700.0)]
        assert "2 of 3 levels within ±25%" in ax.get_title()
    finally:
        plt.close(fig)


def test_soak_panels_share_the_time_axis_in_minutes(tmp_path):
    record = json.loads(next(write_soak(tmp_path / "soak", minutes=3).glob("soak-*/soak.json")).read_text())
    fig = plots.soak_figure(record, "2026-11-23")
    try:
        top, bottom = fig.axes
        assert top.get_shared_x_axes().joined(top, bottom)
        assert list(top.get_lines()[0].get_xdata()) == [0.5, 1.5, 2.5]  # p99 at each minute's middle
        assert list(top.get_lines()[0].get_ydata()) == [90.0, 91.0, 92.0]
        assert bottom.get_xlim()[1] >= 3.0  # memory samples up to 180 s = 3 minutes
    finally:
        plt.close(fig)


def test_newest_soak_run_and_newest_full_bench_run_are_the_defaults(tmp_path):
    soak = write_soak(tmp_path / "soak")
    newer = soak / "soak-20261124-000000"
    newer.mkdir()
    (newer / "soak.json").write_text("{}")
    assert figures.soak_file(soak) == newer / "soak.json"
    write_bench(tmp_path / "results" / "bench-20261123-061617-quick")
    write_bench(tmp_path / "results" / "bench-20261122-141100")
    write_bench(tmp_path / "results" / "bench-20261124-000000", pipeline=False, configs=True)
    assert figures.newest_bench_folder(tmp_path / "results", "pipeline").name == "bench-20261122-141100"
    assert figures.newest_bench_folder(tmp_path / "results", "configs").name == "bench-20261124-000000"


def test_default_inputs_are_read_under_the_results_folder(tmp_path):
    """No input named: the newest <results>/bench-* for the pipeline, <results>/reliability for the soak."""
    write_bench(tmp_path / "results" / "bench-20261122-141100")
    written = figures.generate({}, tmp_path / "out", tmp_path / "results", ("pipeline", "soak"))
    assert set(written) == {"pipeline"}  # no <results>/reliability: the soak figure is skipped


def test_validation_folders_are_drawn_together(tmp_path):
    first = write_validation(tmp_path / "a")
    second = tmp_path / "b"
    second.mkdir()
    (second / "validation.json").write_text(json.dumps([validation_row("int8", 0.7, 200.0, 400.0)]))
    path, fig = figures.BUILDERS["validation"]([first, second], tmp_path)
    try:
        assert path == first / "validation.json"
        configs = {c.get_gid() for c in fig.axes[0].collections if str(c.get_gid()).startswith("config:")}
        assert configs == {"config:default", "config:throughput", "config:int8"}
        assert "2 of 4 levels within ±25%" in fig.axes[0].get_title()
    finally:
        plt.close(fig)
    written = figures.generate({"validation": [first, tmp_path / "absent"]}, tmp_path / "out", tmp_path,
                               ("validation",))
    assert written == {}  # a folder that is not there skips the figure, as with one folder


def test_validation_draws_the_rules_alone_and_the_range_the_planner_prints(tmp_path):
    """Each level: the model's p99 filled, the documented rules alone hollow on the same x, a line between;
    the title counts both and the levels whose range comes within 25% of the measured p99."""
    rows = [validation_row("default", 0.3, 100.0, 200.0), validation_row("default", 0.7, 100.0, 300.0)]
    rows[0]["predicted_static"] = {**rows[0]["predicted"], "p99_ms": 110.0}  # rules within, the model not
    rows[1]["predicted_static"] = {**rows[1]["predicted"], "p99_ms": 140.0}  # neither, nor the range
    fig = plots.validation_figure(rows, "2026-11-24")
    try:
        ax = fig.axes[0]
        (hollow,) = [c for c in ax.collections if c.get_gid() == "rules:default"]
        assert sorted(tuple(p) for p in hollow.get_offsets()) == [(100.0, 110.0), (100.0, 140.0)]
        segments = sorted(sorted(line.get_ydata()) for line in ax.get_lines() if line.get_gid() == "range:default")
        assert segments == [[110.0, 200.0], [140.0, 300.0]]
        title = ax.get_title()
        assert "0 of 2 levels within ±25%" in title and "rules alone, 1 of 2" in title and "on 1 of 2" in title
    finally:
        plt.close(fig)
    assert plots.in_band_of_range(100.0, 60.0, 70.0) is False and plots.in_band_of_range(100.0, 60.0, 400.0)
