"""resnet18-kit model-analyzer: Triton Model Analyzer 1.58 in its own venv, against the embedded server.

One short profile proves the integration (resnet18_onnx's shipped config at one concurrency, about 30 s
once Model Analyzer is installed: `make test` sets it up first, `--install-only`; without it the first run
installs it, about 40 s); the bad inputs are one line each.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resnet18_kit.tools.bench.model_analyzer import DEFAULT_VENV, VERSION, installed_version
from resnet18_kit.server.resources import PYTHON_BACKEND_SHM_PREFIX, python_backend_regions

pytestmark = [pytest.mark.live, pytest.mark.slow]

KIT = Path(sys.executable).parent / "resnet18-kit"


def kit(*args: str, cwd: Path, timeout_s: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(KIT), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def test_model_analyzer_profiles_the_network_on_the_embedded_server(tmp_path):
    model_analyzers = PYTHON_BACKEND_SHM_PREFIX + "ma"  # its servers' regions (other tests' may come and go)
    regions_before = set(python_backend_regions(model_analyzers))
    # A budget no measurement misses: the report of the one config must exist; the constraint reaches
    # Model Analyzer's config.
    result = kit("model-analyzer", "--quick", "--models", "resnet18_onnx", "--p99-ms", "resnet18_onnx=60000",
                 "--out", str(tmp_path / "ma"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "perf_latency_p99:\n        max: 60000" in (tmp_path / "ma" / "resnet18_onnx" / "profile.yaml").read_text()
    assert installed_version(DEFAULT_VENV) == VERSION
    print("\n" + result.stdout, flush=True)
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("| resnet18_onnx ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "resnet18_onnx_config_default" and cells[4] == "4", row
    assert float(cells[5]) > 0 and float(cells[6]) > 0, row  # infer/s and p99 measured
    reports = tmp_path / "ma" / "resnet18_onnx" / "export" / "reports"
    assert (reports / "detailed" / "resnet18_onnx_config_default").is_dir(), sorted(reports.rglob("*"))
    assert (reports / "summaries" / "resnet18_onnx").is_dir()
    assert set(python_backend_regions(model_analyzers)) <= regions_before


def test_a_missing_install_is_one_line(tmp_path):
    result = kit("model-analyzer", "--no-install", "--venv", str(tmp_path / "nothing"), cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "no Model Analyzer" in line and "--no-install" in line, line


def test_an_unknown_model_is_one_line(tmp_path):
    result = kit("model-analyzer", "--models", "resnet99", cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "resnet99" in line, line


def test_a_config_model_analyzer_cannot_load_is_one_line(tmp_path):
    repository = tmp_path / "models"
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_size: [\n')
    result = kit("--model-repository", str(repository), "model-analyzer", "--quick", "--models", "broken",
                 "--out", str(tmp_path / "ma"), cwd=tmp_path, timeout_s=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "broken/config.pbtxt is not a model config Triton can load" in line, line


def test_the_best_config_is_the_highest_throughput_within_the_p99_budget():
    """Model Analyzer's rows: the 300 ms row is faster but outside a 200 ms budget, so the 100 ms row wins;
    a model whose rows all miss the budget has no best config and is named in the summary."""
    from resnet18_kit.tools.bench.model_analyzer import best_configs, format_summary

    def row(model, config, concurrency, throughput, p99):
        return {"Model": model, "Model Config Path": config, "Instance Group": "1:CPU", "Max Batch Size": "8",
                "Concurrency": concurrency, "Throughput (infer/sec)": throughput, "p99 Latency (ms)": p99}

    rows = [row("a", "a_config_0", "4", "40.0", "100.0"), row("a", "a_config_1", "16", "55.0", "300.0"),
            row("b", "b_config_0", "4", "30.0", "900.0")]
    assert best_configs(rows) == {"a": "a_config_1", "b": "b_config_0"}
    assert best_configs(rows, {"a": 200.0, "b": 500.0}) == {"a": "a_config_0"}
    text = format_summary(rows, {"a": "a_config_0", "b": None}, {"a": 1.0, "b": 1.0}, {"a": 200.0, "b": 500.0})
    marked = [line for line in text.splitlines() if line.endswith("| yes |")]
    assert len(marked) == 1 and "a_config_0 | 1:CPU | 8 | 4 | 40.0" in marked[0]
    assert "b: no measurement met its p99 budget" in text


def test_a_malformed_budget_is_one_line(tmp_path):
    result = kit("model-analyzer", "--p99-ms", "resnet18_onnx=fast", cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2
    assert "resnet18_onnx=fast" in result.stderr and "Traceback" not in result.stderr
