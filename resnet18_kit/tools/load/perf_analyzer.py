"""Triton's perf_analyzer 2.51, bundled: `resnet18-kit perf-analyzer <its arguments>`.

Everything after `perf-analyzer` goes to the binary untouched, and its exit status is the command's:

    resnet18-kit perf-analyzer -m resnet18_onnx -u 127.0.0.1:8001 -i grpc --concurrency-range 1:4
    resnet18-kit perf-analyzer --help                    # perf_analyzer's own options

The binary is the one shipped in the `tritonclient[all]==2.51.0` wheel (it lands in the venv's bin/); it
needs libb64 (Debian `libb64-0d`, installed by scripts/setup.sh) and libcudart.so.12 (PyPI
`nvidia-cuda-runtime-cu12`). Run by hand, `.venv/bin/perf_analyzer` exits 127 ("libcudart.so.12: cannot
open shared object file"): this command sets LD_LIBRARY_PATH to the wheels' libraries first
(server.tritonserver.library_path()). A missing binary is one line and exit 2.

Real photos for the `resnet18` ensemble (its input `image` is BYTES, one encoded file per request;
perf_analyzer's random data would not decode). Write the --input-data file, then use it:

    resnet18-kit perf-analyzer --photos-input-data photos.json          # the 5 sample photos
    resnet18-kit perf-analyzer --photos-input-data photos-12mp.json 12mp  # the same as 12-megapixel JPEGs
    resnet18-kit perf-analyzer -m resnet18 -u 127.0.0.1:8000 --input-data photos.json --concurrency-range 2

(`--photos-input-data FILE [sample|12mp]` as the first argument writes FILE and runs nothing: one entry
per photo, each the file's bytes as a serialized BYTES tensor, resnet18_kit/tools/load/photos.py.) Run with no
arguments, this text is printed.

As a library, the one place that builds perf_analyzer command lines for the benchmarks and the planner.
Each run writes, into its own folder:
  * `perf.csv`: `-f` with `--verbose-csv` (and `--collect-metrics`): one row per load level, latencies in
    microseconds, the client/server breakdown perf_analyzer measured;
  * `profile.json`: `--profile-export-file`: the send and response timestamps (ns) of every request of
    the measurement windows, from which mean, std, min and max latency are computed;
  * `perf_analyzer.log`: its stdout and stderr.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from argparse import ArgumentParser, Namespace
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from resnet18_kit.contract import LOGITS_BYTES

from resnet18_kit.server.tritonserver import library_path


def perf_analyzer_binary() -> Path:
    """The venv's perf_analyzer (from the tritonclient wheel). Raises FileNotFoundError when absent."""
    candidate = Path(sys.executable).parent / "perf_analyzer"
    found = candidate if candidate.is_file() else shutil.which("perf_analyzer")
    if not found:
        raise FileNotFoundError(f"perf_analyzer not found in {candidate.parent} nor on PATH: it comes with "
                                "tritonclient[all]==2.51.0 (make setup)")
    return Path(found)


def perf_analyzer_env() -> dict[str, str]:
    """The environment perf_analyzer runs in: this one, with LD_LIBRARY_PATH naming the wheels' libraries."""
    return dict(os.environ, LD_LIBRARY_PATH=library_path())


#: `resnet18-kit perf-analyzer --photos-input-data FILE [SET]`: write FILE, run nothing (module doc).
PHOTOS_INPUT_DATA = "--photos-input-data"


def add_arguments(parser: ArgumentParser) -> None:
    """No options of its own: the command line hands everything after `perf-analyzer` to `run` as
    args.arguments (module doc)."""


def run(settings, args: Namespace) -> int:
    """`resnet18-kit perf-analyzer ARGS`: perf_analyzer's exit status (128 + N when killed by signal N);
    `--photos-input-data FILE [SET]` writes FILE instead; 2 with no arguments or no binary."""
    arguments = list(getattr(args, "arguments", None) or [])
    if not arguments:
        print(__doc__.split("\n\nAs a library")[0], file=sys.stderr)
        return 2
    if arguments[0] == PHOTOS_INPUT_DATA:
        return write_photos_input_data(settings.results, arguments[1:])
    try:
        binary = perf_analyzer_binary()
    except FileNotFoundError as exc:
        print(f"resnet18-kit perf-analyzer: {exc}", file=sys.stderr)
        return 2
    status = subprocess.run([str(binary), *arguments], env=perf_analyzer_env()).returncode
    return 128 - status if status < 0 else status


def write_photos_input_data(results: Path, words: list[str]) -> int:
    """`--photos-input-data FILE [SET]`: write perf_analyzer --input-data for the ensemble's `image` input
    from photo set SET (load.photos.PHOTO_SETS; default sample; 12mp is cached under `results`)."""
    from resnet18_kit.tools.load.photos import PHOTO_SETS, photo_set, write_input_data

    set_name = words[1] if len(words) == 2 else "sample"
    if not 1 <= len(words) <= 2 or words[0].startswith("-") or set_name not in PHOTO_SETS:
        print(f"resnet18-kit perf-analyzer: usage: {PHOTOS_INPUT_DATA} FILE [{'|'.join(PHOTO_SETS)}]",
              file=sys.stderr)
        return 2
    try:
        paths = photo_set(set_name, results)
        target = write_input_data(paths, Path(words[0]))
    except (OSError, ValueError) as exc:
        print(f"resnet18-kit perf-analyzer: {PHOTOS_INPUT_DATA}: {exc}", file=sys.stderr)
        return 2
    print(f"{target}: {len(paths)} photos as BYTES input `image` ({target.stat().st_size:,} bytes); use it with "
          f"resnet18-kit perf-analyzer -m resnet18 --input-data {target} ...", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class LoadSpec:
    """One perf_analyzer invocation's load.

    mode: "concurrency" (closed loop: N requests outstanding) or "request_rate" (open loop, requests/s,
        Poisson arrivals).
    levels: the concurrency values or request rates to sweep, in order (one perf_analyzer run each, so
        the server's statistics can be read between levels).
    shapes: --shape per input for variable dims, e.g. {"INPUT": "16"}.
    shared_memory: "none" or "system" (tensors through /dev/shm: same host only).
    output_shm_bytes: --output-shared-memory-size, bytes per output tensor (with shared_memory).
    measurement_ms: the measurement window (-p); stability_pct: -s; max_trials: -r.
    async_mode: --async (fewer client threads for high concurrency).
    fallback_request_count: when no stable windows come (see run_level), measure exactly this many
        requests instead (--request-count: one measurement, no stability check); 0 = fail instead.
    request_count: > 0 = skip the stabilized windows and measure exactly this many requests (--quick).
    input_data: a JSON file for --input-data (real inputs, e.g. encoded photos as BYTES: resnet18_kit/tools/load/photos.py);
        None = perf_analyzer's random data.
    profile_export: write --profile-export-file (profile.json: per-request timestamps, for latency mean,
        std, min, max). False for real BYTES inputs: perf_analyzer 2.51 also records every request's input
        in it, raw (the encoded photo itself, not valid UTF-8): 10 MB for 10 requests of the sample photos.
    """

    mode: str
    levels: tuple[float, ...]
    shapes: dict[str, str] = field(default_factory=dict)
    shared_memory: str = "none"
    output_shm_bytes: int = 0
    measurement_ms: int = 3000
    stability_pct: int = 20
    max_trials: int = 5
    async_mode: bool = False
    fallback_request_count: int = 0
    request_count: int = 0
    input_data: Path | None = None
    profile_export: bool = True


@dataclass
class PerfRow:
    """One load level as perf_analyzer measured it. Times in microseconds, throughput in infer/s."""

    level: float
    throughput: float
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    avg_us: float
    client_send_us: float
    network_us: float
    server_queue_us: float
    server_compute_input_us: float
    server_compute_infer_us: float
    server_compute_output_us: float
    client_recv_us: float
    #: From profile.json (all requests of the measurement windows): mean, std, min, max latency.
    mean_us: float = float("nan")
    std_us: float = float("nan")
    min_us: float = float("nan")
    max_us: float = float("nan")
    requests: int = 0
    #: --collect-metrics: average GPU utilization (0..1) over the level; None without a GPU.
    gpu_utilization: float | None = None


_CSV_COLUMNS = {
    "throughput": "Inferences/Second", "p50_us": "p50 latency", "p90_us": "p90 latency",
    "p95_us": "p95 latency", "p99_us": "p99 latency", "avg_us": "Avg latency",
    "client_send_us": "Client Send", "network_us": "Network+Server Send/Recv",
    "server_queue_us": "Server Queue", "server_compute_input_us": "Server Compute Input",
    "server_compute_infer_us": "Server Compute Infer", "server_compute_output_us": "Server Compute Output",
    "client_recv_us": "Client Recv",
}


def parse_csv(path: Path) -> list[PerfRow]:
    """Rows of a `-f ... --verbose-csv` file, in load order. The first column is "Concurrency" or
    "Request Rate". Raises ValueError when a needed column is missing."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    level_column = next(c for c in rows[0] if c in ("Concurrency", "Request Rate"))
    missing = [c for c in _CSV_COLUMNS.values() if c not in rows[0]]
    if missing:
        raise ValueError(f"{path}: perf_analyzer CSV lacks columns {missing}")
    parsed = [PerfRow(level=float(row[level_column]), gpu_utilization=_gpu_utilization(row),
                      **{name: float(row[column]) for name, column in _CSV_COLUMNS.items()}) for row in rows]
    return sorted(parsed, key=lambda r: r.level)


def _gpu_utilization(row: dict) -> float | None:
    """"Avg GPU Utilization" of a --collect-metrics row: "gpu_uuid:fraction;..." averaged; None if empty."""
    cell = (row.get("Avg GPU Utilization") or "").strip()
    values = [float(part.rsplit(":", 1)[1]) for part in cell.split(";") if ":" in part]
    return sum(values) / len(values) if values else None


def load_profile_export(profile_path: Path) -> dict:
    """perf_analyzer's --profile-export-file as a dict ({"experiments": [...]}); {"experiments": []} when
    the file is missing or empty. perf_analyzer 2.51 sometimes exits 0 with the file cut off at exactly
    64 KiB or 128 KiB (seen with `-b 1` runs of a few thousand requests, and request-rate runs of 1,000
    and 1,500 requests; the requests kept are then not the first N): the requests recorded completely
    before the cut are kept (one experiment; its "experiment" entry, written first, is kept when whole),
    and the result carries "truncated": True."""
    text = Path(profile_path).read_text() if Path(profile_path).exists() else ""
    if not text.strip():
        return {"experiments": []}
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    decoder = json.JSONDecoder()
    experiment: dict = {"requests": []}
    head = text.find('"experiment":')
    if head >= 0:
        try:
            experiment["experiment"] = decoder.raw_decode(text, text.index("{", head))[0]
        except (ValueError, json.JSONDecodeError):
            pass
    position = text.find('"requests":')
    position = text.find("[", position) + 1 if position >= 0 else len(text)
    while position < len(text):
        start = text.find("{", position)
        if start < 0:
            break
        try:
            record, position = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            break  # the record the file was cut in
        experiment["requests"].append(record)
    return {"experiments": [experiment], "truncated": True}


def latency_stats_us(profile_path: Path) -> dict[float, dict[str, float]]:
    """Per load level: mean, std, min, max latency (us) and request count, from --profile-export-file
    (latency = first response timestamp - send timestamp, for every request perf_analyzer recorded).
    Empty when perf_analyzer left the file empty (2.51 always does for --request-count without shared
    memory, see EMPTY_EXPORT_ATTEMPTS)."""
    stats = {}
    for experiment in load_profile_export(profile_path)["experiments"]:
        if "experiment" not in experiment:
            continue
        latencies = np.array([(r["response_timestamps"][0] - r["timestamp"]) / 1000.0
                              for r in experiment["requests"] if r.get("response_timestamps")])
        if latencies.size:
            stats[float(experiment["experiment"]["value"])] = {
                "mean_us": float(latencies.mean()), "std_us": float(latencies.std()),
                "min_us": float(latencies.min()), "max_us": float(latencies.max()),
                "requests": int(latencies.size)}
    return stats


def command(model: str, url: str, protocol: str, load: LoadSpec, level: float, out_dir: Path,
            metrics_url: str | None = None, count: int = 0, binary: Path | None = None) -> list[str]:
    """The perf_analyzer command line for one `level` of `load` (a list of arguments, no shell): stabilized
    time windows, or exactly `count` requests when count > 0; `binary` default perf_analyzer_binary()."""
    flag = "--concurrency-range" if load.mode == "concurrency" else "--request-rate-range"
    cmd = [str(binary or perf_analyzer_binary()), "-m", model, "-u", url, "-i", protocol,
           "-f", str(out_dir / "perf.csv"), "--verbose-csv"]
    if load.profile_export:
        cmd += ["--profile-export-file", str(out_dir / "profile.json")]
    cmd += [flag, f"{level:g}:{level:g}"]
    if count:
        cmd += ["--request-count", str(count)]
    else:
        cmd += ["-p", str(load.measurement_ms), "-s", str(load.stability_pct), "-r", str(load.max_trials)]
    if load.mode == "request_rate":
        cmd += ["--request-distribution", "poisson"]
    for name, shape in load.shapes.items():
        cmd += ["--shape", f"{name}:{shape}"]
    if load.input_data is not None:
        cmd += ["--input-data", str(load.input_data)]
    if load.shared_memory != "none":
        cmd += ["--shared-memory", load.shared_memory]
        if load.output_shm_bytes:
            cmd += ["--output-shared-memory-size", str(load.output_shm_bytes)]
    if load.async_mode:
        cmd.append("--async")
    if metrics_url:
        cmd += ["--collect-metrics", "--metrics-url", metrics_url, "--metrics-interval", "1000"]
    return cmd


#: When perf_analyzer finds no 3 consecutive windows within `stability_pct` of each other in max_trials
#: (a noisy machine: CPU steal on a shared VM stalls single requests for 0.5 s), the level is measured
#: again as a fixed count of requests (`fallback_request_count`); command.txt records which it used.
#: A fixed-request-count run that has not exited after HANG_S seconds is taken as hung and started again
#: once: perf_analyzer 2.51 in --async mode can stay idle and never exit after the server answered every
#: request (seen at high concurrency; docs/records/benchmarks.md). HANG_S is far above any level's run here. A run
#: killed for the last time exits HUNG_EXIT (as timeout(1)), its log saying so.
HANG_S = 120.0
HUNG_EXIT = 124


def _run_once_more_if_hung(cmd: list[str], log_path: Path, env: dict, timeout_s: float,
                           hang_s: float | None) -> subprocess.CompletedProcess:
    """cmd into log_path; killed past hang_s, run once more; killed again (or past timeout_s): HUNG_EXIT."""
    limit_s = hang_s or timeout_s
    for attempt in (1, 2):
        with open(log_path, "w") as log:
            try:
                return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit_s)
            except subprocess.TimeoutExpired:  # subprocess.run has killed it
                pass
        if hang_s is None or attempt == 2:
            break
        print(f"perf_analyzer: no exit after {hang_s:.0f} s with a fixed request count; running it again",
              file=sys.stderr)
    with open(log_path, "a") as log:
        log.write(f"\nperf_analyzer killed: no exit after {limit_s:.0f} s{'' if hang_s is None else ' (twice)'}\n")
    return subprocess.CompletedProcess(cmd, HUNG_EXIT)


#: perf_analyzer 2.51 leaves --profile-export-file empty (exit 0) for every --request-count run without
#: shared memory, and for an occasional run otherwise. Callers that need the per-request data ask for this
#: many runs in all.
EMPTY_EXPORT_ATTEMPTS = 3


def run_perf_analyzer(cmd: list[str], out_dir: Path, timeout_s: float, hang_s: float | None = None,
                      env: dict | None = None, export_attempts: int = 1) -> subprocess.CompletedProcess:
    """Run one perf_analyzer command line that writes into out_dir (log: out_dir/perf_analyzer.log,
    export: out_dir/profile.json): once more when a fixed-count run hangs past hang_s (HANG_S), and
    again, up to export_attempts runs in all, when it exits 0 with an empty profile export."""
    env = env or perf_analyzer_env()
    for attempt in range(1, export_attempts + 1):
        (out_dir / "profile.json").unlink(missing_ok=True)  # perf_analyzer refuses an existing path
        result = _run_once_more_if_hung(cmd, out_dir / "perf_analyzer.log", env, timeout_s, hang_s)
        if result.returncode != 0 or load_profile_export(out_dir / "profile.json")["experiments"]:
            break
        if attempt < export_attempts:
            print(f"perf_analyzer: empty profile export (run {attempt}); running it again", file=sys.stderr)
    return result


#: --output-shared-memory-size for one row of resnet18_onnx's output: FP32 logits [1000], bytes.
RESNET18_LOGITS_BYTES = LOGITS_BYTES  # one row of the network's output, FP32 x 1000


def error_summary(message: str) -> str:
    """One line for a perf_analyzer failure: the message's last non-blank line (perf_analyzer's own last
    error, e.g. "Thread [3] had error: ... Exceeds maximum queue size" when Triton refused requests; its
    log ends in blank lines), or "" for an empty message."""
    return next((line.strip() for line in reversed(message.splitlines()) if line.strip()), "")


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer exited non-zero (e.g. no stable measurement, requests refused); the message carries
    its log tail, `summary` its last error line."""

    @property
    def summary(self) -> str:
        return error_summary(str(self))


def run_level(model: str, url: str, protocol: str, load: LoadSpec, level: float, out_dir: Path,
              metrics_url: str | None = None, timeout_s: float = 900.0, export_attempts: int = 1,
              binary: Path | None = None) -> PerfRow:
    """One perf_analyzer process measuring `model` at `url` ("host:port") over `protocol` ("grpc" or
    "http") at one load level (a concurrency or a request rate). Writes its files into `out_dir`.
    export_attempts: runs in all while the profile export comes back empty (EMPTY_EXPORT_ATTEMPTS for
    callers that need the per-request data; the bench only takes latency mean/std from it). binary: as command().

    Returns the level's PerfRow with profile.json's latency statistics merged in. Raises
    PerfAnalyzerError when perf_analyzer fails (after the fallback to a request count, see above).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = perf_analyzer_env()
    log_path = out_dir / "perf_analyzer.log"
    for count in ((load.request_count,) if load.request_count else (0, load.fallback_request_count)):
        cmd = command(model, url, protocol, load, level, out_dir, metrics_url, count, binary)
        (out_dir / "command.txt").write_text(" ".join(cmd) + "\n")
        result = run_perf_analyzer(cmd, out_dir, timeout_s, hang_s=HANG_S if count else None, env=env,
                                   export_attempts=export_attempts)
        if result.returncode == 0 or "stable measurement" not in log_path.read_text() or not (
                load.fallback_request_count):
            break
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-8:])
        raise PerfAnalyzerError(f"perf_analyzer exited {result.returncode} for {model} {load.mode} {level:g}:\n{tail}")
    (row,) = parse_csv(out_dir / "perf.csv")
    for key, value in latency_stats_us(out_dir / "profile.json").get(row.level, {}).items():
        setattr(row, key, value)
    return row
