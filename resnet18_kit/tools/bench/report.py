"""Turn a benchmark run's summary.json into report.md and PNG plots (matplotlib, no display needed).

Sections: the tensor sweeps of resnet18_onnx per config (summary "configs", "inprocess", "identity";
absent with --skip-tensor-sweeps) and the end-to-end pipeline (summary "pipeline", resnet18_kit/tools/bench/pipeline_report.py;
absent with --skip-pipeline). Also what the run prints from the tensor sweeps: each config's placement
phrase, its one ratio line, and the targets met or missed."""
from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from resnet18_kit.tools.bench import pipeline_report  # noqa: E402
from resnet18_kit.observe.placement import describe  # noqa: E402
from resnet18_kit.observe.process_cpu import cpu_phrase  # noqa: E402

BREAKDOWN = (("server_queue_us", "server queue"), ("server_compute_input_us", "compute input"),
             ("server_compute_infer_us", "compute infer"), ("server_compute_output_us", "compute output"),
             ("network_us", "network + server send/recv"), ("client_send_us", "client send"),
             ("client_recv_us", "client recv"))


def saturation_row(config: dict) -> dict:
    """The concurrency level with the highest throughput of a config's sweep."""
    return max(config["concurrency"], key=lambda row: row["throughput"])


def throughput_vs_p99_figure(summary: dict, title: str | None = None) -> plt.Figure:
    """infer/s (y) against p99 latency (ms, log x) of each config's concurrency sweep, one line per config,
    each point labelled with its concurrency (perf_analyzer's figures from summary["configs"]: throughput,
    p99_us). The caller saves and closes the figure."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in summary["configs"]:
        rows = sorted(config["concurrency"], key=lambda r: r["level"])
        ax.plot([r["p99_us"] / 1000 for r in rows], [r["throughput"] for r in rows], marker="o",
                label=config["name"])
        for row in rows:
            ax.annotate(f"{row['level']:g}", (row["p99_us"] / 1000, row["throughput"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_xlabel("p99 latency (ms, log scale); labels: concurrency")
    ax.set_ylabel("throughput (infer/s)")
    ax.set_title(title or f"{summary['model']}: throughput vs p99 latency per config")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def save_png(fig: plt.Figure, path: Path) -> None:
    """Write `fig` as a PNG at `path` (120 dpi) and close it."""
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: The latency breakdown compares configs at one concurrency: the common level nearest this one (the
#: full sweeps all hold 1..32); without a level every config was measured at (--quick), each config's
#: level nearest it (log scale), written on its bar.
BREAKDOWN_TARGET_LEVEL = 32


def breakdown_levels(configs: list[dict], target: float = BREAKDOWN_TARGET_LEVEL) -> tuple[dict[str, float], bool]:
    """The concurrency each config's breakdown bar is drawn at: ({config name: level}, common).

    common is True when one level was measured for every config (then every name maps to it: the
    common level nearest `target`); otherwise each config gets its own level nearest `target`. "Nearest"
    is by ratio (|log(level / target)|), ties to the higher level."""
    def nearest(levels):
        return min(levels, key=lambda level: (abs(math.log(level / target)), -level))

    measured = [{row["level"] for row in c["concurrency"]} for c in configs]
    common = set.intersection(*measured) if measured else set()
    if common:
        level = nearest(common)
        return {c["name"]: level for c in configs}, True
    return {c["name"]: nearest(levels) for c, levels in zip(configs, measured)}, False


def latency_breakdown_figure(summary: dict, target: float = BREAKDOWN_TARGET_LEVEL) -> plt.Figure:
    """Stacked bars, one per config: perf_analyzer's mean latency per request split into BREAKDOWN's
    parts (ms), every config at the same concurrency (`breakdown_levels`, named in the title), or,
    when no level is common to all, each at its level nearest `target`, labelled on its bar. The
    caller saves and closes the figure."""
    configs = summary["configs"]
    levels, common = breakdown_levels(configs, target)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [c["name"] for c in configs]
    rows = [next(r for r in c["concurrency"] if r["level"] == levels[c["name"]]) for c in configs]
    bottoms = [0.0] * len(rows)
    for key, label in BREAKDOWN:
        values = [row[key] / 1000 for row in rows]
        ax.bar(names, values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, row in enumerate(rows):
        ax.annotate(f"c={row['level']:g}", (i, bottoms[i]), ha="center", fontsize=8,
                    textcoords="offset points", xytext=(0, 3))
    ax.set_ylabel("mean latency per request (ms)")
    where = (f"every config at concurrency {rows[0]['level']:g}" if common else
             f"no concurrency common to all configs: each at its level nearest {target:g} (c= on the bar)")
    ax.set_title(f"latency breakdown per config (perf_analyzer)\n{where}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def batch_sizes_figure(summary: dict) -> plt.Figure:
    """One panel per config at its saturation level: executions per batch size formed (statistics
    extension, row["server"]["batch_executions"]). Every panel has the same bins, batch sizes 1..the
    largest max_batch_size (or formed batch) of all configs, on one shared x axis, so the configs
    compare at a glance. The caller saves and closes the figure."""
    configs = summary["configs"]
    rows = [saturation_row(c) for c in configs]
    histograms = [{int(k): v for k, v in row["server"]["batch_executions"].items()} for row in rows]
    top = max([1] + [c.get("max_batch_size") or 1 for c in configs] + [max(h, default=1) for h in histograms])
    sizes = list(range(1, top + 1))
    fig, axes = plt.subplots(1, len(configs), figsize=(3.2 * len(configs), 3.6), squeeze=False, sharex=True)
    for ax, config, row, histogram in zip(axes[0], configs, rows, histograms):
        ax.bar(sizes, [histogram.get(size, 0) for size in sizes], width=0.8)
        ax.set_xlim(0.5, top + 0.5)
        ax.set_title(f"{config['name']} (c={row['level']:g})\naverage {row['server']['average_batch']:.1f}",
                     fontsize=9)
        ax.set_xlabel("batch size formed")
        ax.set_ylabel("executions")
    fig.suptitle("batch sizes the dynamic batcher formed, at each config's saturation (statistics extension)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _ms(us: float) -> str:
    return f"{us / 1000:.1f}"


def level_table(rows: list[dict], level_name: str) -> list[str]:
    lines = [f"| {level_name} | infer/s | mean ± std ms | min | max | p50 | p90 | p95 | p99 | queue | "
             "compute in | infer | out | avg batch | server CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = r.get("cpu_utilization")
        lines.append(
            f"| {r['level']:g} | {r['throughput']:.1f} | {_ms(r['mean_us'])} ± {_ms(r['std_us'])} | "
            f"{_ms(r['min_us'])} | {_ms(r['max_us'])} | {_ms(r['p50_us'])} | {_ms(r['p90_us'])} | "
            f"{_ms(r['p95_us'])} | {_ms(r['p99_us'])} | {_ms(r['server_queue_us'])} | "
            f"{_ms(r['server_compute_input_us'])} | {_ms(r['server_compute_infer_us'])} | "
            f"{_ms(r['server_compute_output_us'])} | {r['server']['average_batch']:.1f} | "
            f"{'n/a' if cpu is None else f'{cpu:.0%}'} |")
    return lines


def markdown(summary: dict, plots: dict[str, str]) -> str:
    machine = summary["machine"]
    out = [f"# Benchmark report: ResNet-18 on Triton {machine['triton_version']}", "",
           f"Command: `{summary['command']}`  ",
           f"Started {summary['started_utc']}, took {summary['elapsed_s']:.0f} s. Machine: {machine['cpu']}, "
           f"{machine['cores']} cores, GPU: {machine['gpu'] or 'none'}; Python {machine['python']}, "
           f"onnxruntime {machine['onnxruntime']}, torch {machine['torch']}. During the run the CPUs were "
           f"{machine['cpu_during_run']['busy']:.0%} busy and {machine['cpu_during_run']['steal']:.0%} stolen "
           f"by the hypervisor. Client and server on the same machine.", ""]
    if summary.get("pipeline"):
        out += pipeline_report.markdown(summary["pipeline"], plots)
    if summary.get("configs"):
        out += tensor_markdown(summary, plots)
    return "\n".join(out) + "\n"


def tensor_markdown(summary: dict, plots: dict[str, str]) -> list[str]:
    """The tensor sweeps' sections (UINT8 pixel tensors to the network model, per config), as lines."""
    machine = summary["machine"]
    out = [f"## Tensor sweeps: {summary['model']} per config", "",
           f"Load: perf_analyzer {summary['perf_analyzer']['protocol']}, shared memory "
           f"`{summary['perf_analyzer']['shared_memory']}`, measurement window "
           f"{summary['perf_analyzer']['measurement_ms']} ms. "
           f"Latencies in ms. Configs switched by restarting tritonserver with `--model-config-name`.", ""]
    out += ["### Targets", "", "| target | wanted | measured | verdict |", "|---|---|---|---|"]
    for t in summary["targets"]:
        out.append(f"| {t['name']} | {t['wanted']} | {t['measured']} | {'met' if t['met'] else 'MISSED'} |")
    out += ["", "### Configs", "", "| config | max batch | preferred | max queue delay µs | max queue | "
            "process start → ready s | first inference ms | placement (under load) | in-process bar infer/s (before / after "
            "the sweep; arrangement) | best served infer/s | efficiency |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in summary["configs"]:
        best = saturation_row(c)
        out.append(f"| {c['name']} | {c['max_batch_size']} | {c['preferred_batch_size'] or '-'} | "
                   f"{c['max_queue_delay_us'] if c['dynamic_batching'] else 'no batcher'} | "
                   f"{c['max_queue_size'] or '-'} | {c['cold_start']['process_to_ready_s']:.1f} | "
                   f"{c['cold_start']['first_inference_ms']:.1f} | {c['placement']} | {_ceiling(c)} | "
                   f"{best['throughput']:.1f} (c={best['level']:g}) | {c['efficiency']:.2f} |")
    out += ["", f"![throughput vs p99]({plots['throughput_vs_p99']})", "",
            f"![latency breakdown]({plots['latency_breakdown']})", "",
            f"![batch sizes]({plots['batch_sizes']})", ""]
    for c in summary["configs"]:
        out += [f"#### {c['name']}: concurrency sweep", ""] + level_table(c["concurrency"], "concurrency")
        if c["request_rate"] or c.get("request_rate_refused"):
            out += ["", f"#### {c['name']}: request-rate sweep (Poisson)", ""]
            out += level_table(c["request_rate"], "requests/s") if c["request_rate"] else []
            out += [f"\n{r['level']:g} requests/s: refused by the full queue ({r['error']}); higher rates skipped."
                    for r in c.get("request_rate_refused", [])]
        out.append("")
    out += [f"### In-process, no server (every arrangement tried for {summary['configs'][0]['name']}; TorchScript)",
            "", "| runtime, arrangement | batch | images/s | p50 ms per batch |",
            "|---|---|---|---|"]
    for r in summary["inprocess"]:
        out.append(f"| {r['runtime']} | {r['batch_size']} | {r['throughput']:.1f} | {r['p50_ms']:.1f} |")
    ident = summary["identity"]
    out += ["", f"### Batching-layer ceiling: `identity` (FP32 [16], Python backend, {ident['instances']} "
            f"instances, dynamic batcher, perf_analyzer {ident['protocol']} {ident['mode']})", "",
            "| concurrency | infer/s | infer/s per core | p50 ms | p99 ms | avg batch | server CPU |",
            "|---|---|---|---|---|---|---|"]
    for r in ident["concurrency"]:
        cpu = r.get("cpu_utilization")
        out.append(f"| {r['level']:g} | {r['throughput']:.0f} | {r['throughput'] / machine['cores']:.0f} | "
                   f"{_ms(r['p50_us'])} | {_ms(r['p99_us'])} | {r['server']['average_batch']:.1f} | "
                   f"{'n/a' if cpu is None else f'{cpu:.0%}'} |")
    return out + [""]


def _ceiling(config: dict) -> str:
    """The in-process bar cell: the mean, the measurements before / after the sweep, the arrangement."""
    bar = config["inprocess_bar"]
    return (f"{config['inprocess_bar_img_per_s']:.1f} ({bar['before_after'][0]:.1f} / {bar['before_after'][1]:.1f}; "
            f"{bar['label']})")


def write_report(run_dir: Path) -> Path:
    """Read run_dir/summary.json, write the plots of the parts it has (three for the tensor sweeps, two
    for the end-to-end pipeline) and report.md; return report.md's path."""
    summary = json.loads((run_dir / "summary.json").read_text())
    plots = {}
    if summary.get("configs"):
        plots = {"throughput_vs_p99": "throughput_vs_p99.png", "latency_breakdown": "latency_breakdown.png",
                 "batch_sizes": "batch_sizes.png"}
        figures = {"throughput_vs_p99": throughput_vs_p99_figure, "latency_breakdown": latency_breakdown_figure,
                   "batch_sizes": batch_sizes_figure}
        for key, figure in figures.items():
            save_png(figure(summary), run_dir / plots[key])
    if summary.get("pipeline"):
        plots.update(pipeline_report.write_plots(summary["pipeline"], run_dir))
    report = run_dir / "report.md"
    report.write_text(markdown(summary, plots))
    return report


def placement_phrase(view, spec, pinned: dict, cores: int) -> str:
    """The table's placement cell of a config: instances x intra-op threads, how many run at once (the
    rate limiter), and what the stubs' threads were pinned to under load (observe.placement.describe)."""
    instances, at_once = view.instance_count(), view.concurrent_executions()
    threads = spec.threads or cores
    together = "" if at_once >= instances else f", {at_once} at a time (rate limiter)"
    spinning = ", spinning" if spec.runtime == "onnxruntime" and spec.allow_spinning and threads > 1 else ""
    batched = spec.batched_threads
    per_batch = f", {batched} for a batch of several" if batched and batched != threads else ""
    return (f"{instances} x {threads} thread{'s' if threads > 1 else ''} ({spec.runtime}{per_batch}){together}"
            f"{spinning}, {describe(pinned)}")


def ratio_lines(configs: dict[str, dict]) -> list[str]:
    """One line per config: served / in-process infer/s, with both figures and both arrangements, then the
    CPU each side spends per inference at those levels (cpu_phrase)."""
    return [f"{name} tensors: {c['efficiency']:.2f} of in-process ({saturation_row(c)['throughput']:.1f} / "
            f"{c['inprocess_bar_img_per_s']:.1f} infer/s; served {c['placement']}, concurrency "
            f"{saturation_row(c)['level']:g}; in-process {c['inprocess_bar']['label']})"
            + cpu_phrase(saturation_row(c).get("server_cpu_ms_per_inference"), c["inprocess_bar"].get("cpu_ms_per_image"))
            for name, c in configs.items()]


def evaluate_targets(configs: dict[str, dict], identity: dict, cores: int) -> list[dict]:
    """The tensor sweeps' targets, each with what was measured and whether it was met."""
    targets = []
    if "throughput" in configs:
        c = configs["throughput"]
        targets.append({"name": "serving efficiency at saturation, throughput config", "wanted": ">= 0.95",
                        "measured": f"{c['efficiency']:.3f} ({saturation_row(c)['throughput']:.1f} / "
                                    f"{c['inprocess_bar_img_per_s']:.1f} infer/s)",
                        "met": c["efficiency"] >= 0.95})
        at = next(r for r in c["concurrency"] if r["level"] == 2 * c["max_batch_size"])
        ratio = at["server"]["average_batch"] / c["max_batch_size"]
        targets.append({"name": f"average batch at concurrency {at['level']:g} (2 x max_batch_size), "
                                "throughput config", "wanted": f">= 0.9 x {c['max_batch_size']}",
                        "measured": f"{at['server']['average_batch']:.1f} ({ratio:.2f} x)", "met": ratio >= 0.9})
    if "latency" in configs:
        c = configs["latency"]
        one = next(r for r in c["concurrency"] if r["level"] == 1)
        inproc = c["inprocess_batch1"]["p50_ms"]
        gap = one["p50_us"] / 1000 - inproc
        targets.append({"name": "latency config p50 at concurrency 1 vs in-process batch 1",
                        "wanted": "within 2 ms", "measured": f"{one['p50_us'] / 1000:.1f} vs {inproc:.1f} ms "
                                                             f"(+{gap:.1f} ms)", "met": gap <= 2.0})
    if identity["concurrency"]:
        best = max(identity["concurrency"], key=lambda r: r["throughput"])
        measured, met = (f"{best['throughput']:,.0f} infer/s at concurrency {best['level']:g} "
                         f"({best['throughput'] / cores:,.0f} per core)"), best["throughput"] > 7000
    else:
        measured, met = "not measured: " + "; ".join(
            f"concurrency {f['level']:g}: {f['error']}" for f in identity["failed_levels"]), False
    targets.append({"name": "trivial-model ceiling over gRPC", "wanted": "> 7,000 infer/s",
                    "measured": measured, "met": met})
    return targets
