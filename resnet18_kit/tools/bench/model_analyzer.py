"""resnet18-kit model-analyzer: Triton Model Analyzer on this kit's model repository and embedded server.

Model Analyzer (triton-model-analyzer 1.58.0) searches model-config space with perf_analyzer and reports the
best configs under constraints. It cannot live in the kit's venv (it brings tritonclient 2.73 and numpy 2),
so this command sets it up in a venv of its own (--venv, default <checkout>/.venv-model-analyzer, every
package pinned by constraints-model-analyzer.txt; about 600 MB, 40 s), then runs it in local launch mode
against the kit's tritonserver 2.51 (the binary of the nvidia-pytriton wheel, the kit's Python-backend
directory, the rate limiter on, the kit's perf_analyzer 2.51, CPU-only models, free ports):

  1. writes <out>/profile.yaml (Model Analyzer's config; the search below as model_config_parameters);
  2. `model-analyzer profile -f profile.yaml`: every config x every concurrency, measured by perf_analyzer;
  3. `model-analyzer report`: detailed reports of the best configs; their summary is printed here.

The search (Model Analyzer's manual search: its automatic search skips max_batch_size 1 candidates and
measures nothing else for these Python-backend models), per model:
  resnet18_onnx  instance count 1, 2 (each asks the rate limiter for both cores, as the shipped config);
                 max_batch_size 16, 32 (not below 16: the shipped warmup sends a batch of 16), preferred
                 size 8 (one size legal under both: Model Analyzer skips a config whose preferred size
                 exceeds its max_batch_size as illegal); max_queue_delay 0, 5000 us;
                 concurrency 4, 8, 16; random UINT8 pixel tensors
  resnet18       the ensemble as one model, its steps as configured; concurrency 4, 8, 16; the sample
                 photos as BYTES input data (resnet18-kit perf-analyzer --photos-input-data)
--quick: the shipped config of each model at concurrency 4 only (about 30 s a model).

The SLO (--p99-ms, Model Analyzer's `constraints: perf_latency_p99: max`): a measurement whose p99 latency
is above the model's budget does not count; the best config is the highest throughput within it. Defaults:
resnet18_onnx 200 ms (tensors in, as a gateway that preprocesses would send), resnet18 500 ms (photos in).

Files: <out>/profile.yaml, <out>/export/ (Model Analyzer's results/metrics-model-inference.csv and
reports/), <out>/model-analyzer.log. Exit status: 0; 2 for a missing or broken install with --no-install, a
model config that does not parse, an unknown model, a profile or report that fails, or a profile that
measured nothing for a model. --install-only sets up the venv and exits (`make test` runs it before the suite).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL, REPO_ROOT
from resnet18_kit.settings import Settings, shown

VERSION = "1.58.0"
CONSTRAINTS = REPO_ROOT / "constraints-model-analyzer.txt"
DEFAULT_VENV = REPO_ROOT / ".venv-model-analyzer"
RESULTS_NAME = "model-analyzer"
MODELS = (ONNX_MODEL, ENSEMBLE_MODEL)
CONCURRENCY = (4, 8, 16)
#: p99 budget (ms) per model: Model Analyzer's perf_latency_p99 constraint (module doc).
P99_BUDGET_MS = {ONNX_MODEL: 200.0, ENSEMBLE_MODEL: 500.0}
QUICK_CONCURRENCY = (4,)
#: Seconds Model Analyzer gets after SIGINT to stop its servers itself, before SIGKILL (run_model_analyzer).
STOP_GRACE_S = 20.0


class ModelAnalyzerError(RuntimeError):
    """One line naming what went wrong (exit status 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(MODELS), metavar="MODEL",
                        help=f"models to profile (default: {' '.join(MODELS)})")
    parser.add_argument("--quick", action="store_true", help="the shipped config of each model, concurrency 4 only")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                        help="Model Analyzer's own venv (default: the checkout's .venv-model-analyzer)")
    setup = parser.add_mutually_exclusive_group()
    setup.add_argument("--no-install", action="store_true",
                       help="use the venv as it is; a missing or different install is an error")
    setup.add_argument("--install-only", action="store_true",
                       help="set up the venv (nothing when it holds this version already) and exit: what "
                            "`make test` does before the suite")
    parser.add_argument("--out", type=Path, help=f"folder for the run (default <results>/{RESULTS_NAME}/<time>)")
    parser.add_argument("--p99-ms", nargs="+", default=[], metavar="MODEL=MS", type=budget,
                        help="p99 latency budget of a model in ms (default: "
                             + ", ".join(f"{m}={ms:g}" for m, ms in P99_BUDGET_MS.items()) + ")")


def budget(text: str) -> tuple[str, float]:
    """'MODEL=MS' -> (model, ms); argparse turns the ValueError into one line and exit status 2."""
    model, _, ms = text.partition("=")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if not model or not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want MODEL=MS with MS > 0, e.g. resnet18_onnx=200")
    return model, value


def installed_version(venv: Path) -> str | None:
    """Model Analyzer's version in `venv`, None when it does not run there."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "model-analyzer").is_file() or not python.is_file():
        return None
    result = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                             "print(m.version('triton-model-analyzer'))"], capture_output=True, text=True)
    return (result.stdout.strip() or None) if result.returncode == 0 else None


def base_python() -> str:
    """The interpreter the kit's venv was made from (its own Python, not the venv's)."""
    candidate = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(candidate) if candidate.is_file() else sys.executable


def ensure_installed(venv: Path, install: bool) -> Path:
    """The model-analyzer executable of `venv`, installed at VERSION with CONSTRAINTS first when `install`;
    ModelAnalyzerError when it is missing (no `install`) or the install fails."""
    version = installed_version(venv)
    if version == VERSION:
        return venv / "bin" / "model-analyzer"
    if not install:
        found = f"version {version}" if version else "no Model Analyzer"
        raise ModelAnalyzerError(f"{shown(venv)} has {found}, not triton-model-analyzer {VERSION}: run without "
                                 "--no-install to set it up, or give its venv with --venv")
    if not CONSTRAINTS.is_file():
        raise ModelAnalyzerError(f"{CONSTRAINTS} is missing: it pins Model Analyzer's dependencies")
    print(f"model-analyzer: setting up triton-model-analyzer {VERSION} in {shown(venv)} (about 600 MB)",
          file=sys.stderr, flush=True)
    steps = ([base_python(), "-m", "venv", "--clear", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
              "-c", str(CONSTRAINTS), f"triton-model-analyzer=={VERSION}"])
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelAnalyzerError(f"setting up Model Analyzer failed ({' '.join(step[:4])} ...): {last}")
    return venv / "bin" / "model-analyzer"


def search(model: str, quick: bool, p99_ms: float | None = None) -> dict:
    """The profile_models entry of `model`: CPU only, the concurrencies, its manual search (module doc), its
    p99 constraint (ms) and its perf_analyzer flags (the photos' input data for the ensemble, filled in by
    write_config)."""
    entry: dict = {"cpu_only": True, "parameters": {"concurrency": list(QUICK_CONCURRENCY if quick else CONCURRENCY),
                                                   "batch_sizes": [1]}}
    if p99_ms:
        entry["constraints"] = {"perf_latency_p99": {"max": int(p99_ms)}}
    if model == ONNX_MODEL and not quick:
        entry["model_config_parameters"] = {
            "max_batch_size": [16, 32],
            # One preferred size legal under both max sizes (module doc).
            "dynamic_batching": {"preferred_batch_size": [[8]], "max_queue_delay_microseconds": [0, 5000]},
            "instance_group": [[{"kind": "KIND_CPU", "count": 1,
                                 "rate_limiter": {"resources": [{"name": "cores", "count": 2}]}}],
                               [{"kind": "KIND_CPU", "count": 2,
                                 "rate_limiter": {"resources": [{"name": "cores", "count": 2}]}}]],
        }
    return entry


def write_config(repository: Path, out: Path, models: list[str], quick: bool, photos_input: Path | None,
                 budgets_ms: dict[str, float] | None = None) -> Path:
    """<out>/profile.yaml for local launch mode against the embedded tritonserver on free ports; returns it."""
    import yaml

    from resnet18_kit.tools.load.perf_analyzer import perf_analyzer_binary
    from resnet18_kit.server.config import free_ports
    from resnet18_kit.server.tritonserver import (backend_directory, library_path, server_environment,
                                              tritonserver_binary)

    http, grpc, metrics = free_ports(3)
    profile_models = {}
    for model in models:
        entry = search(model, quick, (budgets_ms or {}).get(model))
        if model == ENSEMBLE_MODEL and photos_input is not None:
            entry["perf_analyzer_flags"] = {"input-data": str(photos_input)}
        profile_models[model] = entry
    config = {
        "model_repository": str(repository),
        "output_model_repository_path": str(out / "output_models"),
        "override_output_model_repository": True,
        "export_path": str(out / "export"),
        "checkpoint_directory": str(out / "checkpoints"),
        "triton_launch_mode": "local",
        "triton_server_path": str(tritonserver_binary()),
        "triton_server_flags": {"backend_directory": str(backend_directory()), "rate_limit": "execution_count",
                                "backend_config": f"python,shm-region-prefix-name={shm_prefix(out)}"},
        "triton_server_environment": {"LD_LIBRARY_PATH": library_path(), "PATH": server_environment()["PATH"]},
        "perf_analyzer_path": str(perf_analyzer_binary()),
        "triton_http_endpoint": f"127.0.0.1:{http}",
        "triton_grpc_endpoint": f"127.0.0.1:{grpc}",
        "triton_metrics_url": f"http://127.0.0.1:{metrics}/metrics",
        "client_protocol": "grpc",
        "run_config_search_disable": True,
        "perf_output": False,
        "profile_models": profile_models,
    }
    path = out / "profile.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def shm_prefix(out: Path) -> str:
    """The Python-backend shared-memory prefix of this run's servers (removed at the end)."""
    return f"triton_python_backend_shm_region_ma{os.getpid()}_"


def summary(export: Path, models: list[str]) -> list[dict]:
    """Model Analyzer's rows (results/metrics-model-inference.csv); ModelAnalyzerError naming a model it
    measured nothing for."""
    path = export / "results" / "metrics-model-inference.csv"
    rows = list(csv.DictReader(path.open())) if path.is_file() else []
    missing = [m for m in models if not any(r["Model"] == m for r in rows)]
    if missing:
        raise ModelAnalyzerError(f"Model Analyzer measured nothing for {', '.join(missing)} (see its log)")
    return rows


def profile_one(binary: Path, repository: Path, out: Path, model: str, quick: bool, photos: Path | None,
                env: dict, p99_ms: float | None = None) -> tuple[list[dict], str | None, float]:
    """Profile then report `model` in <out>/<model>/; (its rows, its best config, profile seconds).
    Each model runs on its own: Model Analyzer searches an ensemble with its quick search only, and would
    switch the other models to it too. The best config is None when no measurement met the p99 budget
    (then no report is made)."""
    folder = out / model
    folder.mkdir(parents=True, exist_ok=True)
    config = write_config(repository, folder, [model], quick, photos, {model: p99_ms} if p99_ms else None)
    log_path = folder / "model-analyzer.log"
    print(f"model-analyzer: profiling {model} (log: {shown(log_path)})", file=sys.stderr, flush=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        status = run_model_analyzer([str(binary), "profile", "-f", str(config)], log, env)
    if status != 0:
        raise ModelAnalyzerError(f"model-analyzer profile of {model} failed (status {status}): {last_error(log_path)}")
    profile_s = time.monotonic() - started
    rows = summary(folder / "export", [model])
    best = best_configs(rows, {model: p99_ms} if p99_ms else None).get(model)
    if best is None:
        return rows, None, profile_s
    with log_path.open("a") as log:
        status = run_model_analyzer([str(binary), "report", "-e", str(folder / "export"), "--checkpoint-directory",
                                     str(folder / "checkpoints"), "--report-model-configs", best.split(":")[0]],
                                    log, env)
    if status != 0:
        raise ModelAnalyzerError(f"model-analyzer report of {model} failed (status {status}): {last_error(log_path)}")
    return rows, best, profile_s


def run_model_analyzer(command: list[str], log, env: dict) -> int:
    """Run a Model Analyzer step (its output to `log`) in a session of its own; its exit status. Model
    Analyzer starts tritonservers of its own: when this command is interrupted (Ctrl-C, or SIGTERM as
    resnet18_kit/cli.py turns it into one) it gets SIGINT and STOP_GRACE_S seconds to stop them itself,
    then its whole session gets SIGKILL; the interrupt goes on (its shared memory is removed by `run`)."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


def check_models(repository: Path, models: list[str]) -> None:
    """ModelAnalyzerError naming a model the repository lacks or whose config.pbtxt does not parse (Model
    Analyzer would spend minutes waiting for a server that cannot load it)."""
    from google.protobuf import text_format

    from resnet18_kit.observe.model_config import ModelConfigView

    for model in models:
        path = repository / model / "config.pbtxt"
        if not path.is_file():
            raise ModelAnalyzerError(f"--models: no {model} in {shown(repository)} (no {model}/config.pbtxt)")
        try:
            ModelConfigView.from_file(path)
        except text_format.ParseError as exc:
            raise ModelAnalyzerError(f"{shown(path)} is not a model config Triton can load: {exc}") from None


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Set up, profile, report, print the summary (module doc); the exit status."""
    from resnet18_kit.server.resources import remove_regions

    out = (args.out or settings.results_dir(RESULTS_NAME, time.strftime("%Y%m%d-%H%M%S"))).resolve()
    try:
        if args.install_only:
            ensure_installed(args.venv, install=True)
            print(f"model-analyzer: triton-model-analyzer {VERSION} is set up in {shown(args.venv)}", file=sys.stderr)
            return 0
        check_models(settings.model_repository, args.models)
        binary = ensure_installed(args.venv, install=not args.no_install)
        out.mkdir(parents=True, exist_ok=True)
        photos = None
        if ENSEMBLE_MODEL in args.models:
            from resnet18_kit.tools.load.photos import photo_set, write_input_data

            photos = write_input_data(photo_set("sample", settings.results), out / "photos.json")
        env = dict(os.environ, PATH=f"{binary.parent}:{os.environ.get('PATH', '')}")
        budgets_ms = {**P99_BUDGET_MS, **dict(args.p99_ms)}
        rows, best, seconds = [], {}, {}
        for model in args.models:
            model_rows, best[model], seconds[model] = profile_one(binary, settings.model_repository, out, model,
                                                                  args.quick, photos, env, budgets_ms.get(model))
            rows += model_rows
    except ModelAnalyzerError as exc:
        print(f"model-analyzer: {exc}", file=sys.stderr)
        return 2
    finally:
        remove_regions(shm_prefix(out))
    print(format_summary(rows, best, seconds, {m: budgets_ms.get(m) for m in args.models}))
    print(f"\nreports: {shown(out)}/<model>/export/reports/ (HTML)", file=sys.stderr)
    return 0


def last_error(log_path: Path) -> str:
    """The last line of Model Analyzer's log that says what failed."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    for line in lines:
        if "load failed" in line:
            return line.removeprefix("[Model Analyzer] ")[:300]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def best_configs(rows: list[dict], budgets_ms: dict[str, float] | None = None) -> dict[str, str]:
    """model -> the config of its best row (best_rows)."""
    return {model: row["Model Config Path"] for model, row in best_rows(rows, budgets_ms).items()}


def best_rows(rows: list[dict], budgets_ms: dict[str, float] | None = None) -> dict[str, dict]:
    """model -> the measurement (config and concurrency) with the highest throughput Model Analyzer measured
    for it, counting only rows whose p99 is within the model's budget (ms) where one is given; a model with
    no such row is left out."""
    best: dict[str, dict] = {}
    for row in rows:
        limit = (budgets_ms or {}).get(row["Model"])
        if limit and float(row["p99 Latency (ms)"]) > limit:
            continue
        current = best.get(row["Model"])
        if current is None or float(row["Throughput (infer/sec)"]) > float(current["Throughput (infer/sec)"]):
            best[row["Model"]] = row
    return best


def format_summary(rows: list[dict], best: dict[str, str | None], seconds: dict[str, float],
                   budgets_ms: dict[str, float | None] | None = None) -> str:
    """Model Analyzer's measurements as a table, the best config of each model (within its p99 budget, ms)
    marked; its wall times; a line for a model none of whose measurements met its budget."""
    took = ", ".join(f"{model} {s:.0f} s" for model, s in seconds.items())
    slo = ", ".join(f"{m} p99 <= {ms:g} ms" for m, ms in (budgets_ms or {}).items() if ms)
    lines = [f"Model Analyzer {VERSION}: {len(rows)} measurements; profile wall time {took}"
             + (f"; SLO {slo}" if slo else ""),
             "| model | config | instances | max batch | concurrency | infer/s | p99 ms | best |",
             "|---|---|---|---|---|---|---|---|"]
    marked = [id(row) for row in best_rows(rows, {m: ms for m, ms in (budgets_ms or {}).items() if ms}).values()]
    for row in rows:
        mark = "yes" if id(row) in marked else ""
        lines.append(f"| {row['Model']} | {row['Model Config Path']} | {row['Instance Group']} | {row['Max Batch Size']} "
                     f"| {row['Concurrency']} | {row['Throughput (infer/sec)']} | {row['p99 Latency (ms)']} | {mark} |")
    lines += [f"{model}: no measurement met its p99 budget" for model, config in best.items() if config is None]
    return "\n".join(lines)
