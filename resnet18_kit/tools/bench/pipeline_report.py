"""The end-to-end part of report.md (summary.json's "pipeline", resnet18_kit/tools/bench/pipeline.py) and its two plots."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from resnet18_kit.tools.bench.pipeline import STEP_MODELS, TRANSPORT_LINESTYLES, run_bar, served_runs  # noqa: E402

#: Per step, the two figures of the stacked bar and the tables: statistics_delta keys, per request, us.
STEP_PARTS = (("queue_us", "queue"), ("compute_infer_us", "compute"))
STEP_LABELS = {"preprocess": "preprocess", "resnet18_onnx": "network"}
PLOTS = {"throughput": "pipeline_throughput.png", "steps": "pipeline_steps.png"}


def plot_throughput(pipeline: dict, path: Path) -> None:
    """img/s vs concurrency, one panel per photo set, one colour per variant (solid gRPC, dotted HTTP,
    dash-dot gRPC with photos in shared memory);
    the variant's in-process saturation (mean of before and after) as a dashed line of its colour."""
    sets = list(pipeline["photo_sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.2), squeeze=False)
    colours = {v["variant"]: f"C{i}" for i, v in enumerate(pipeline["variants"])}
    for ax, name in zip(axes[0], sets):
        for variant, entry, run in served_runs(pipeline, name):
            rows = sorted(run["concurrency"], key=lambda r: r["level"])
            ax.plot([r["level"] for r in rows], [r["throughput"] for r in rows], marker="o",
                    color=colours[variant["variant"]], linestyle=TRANSPORT_LINESTYLES[run["protocol"]],
                    label=f"{variant['variant']} {run['protocol']}")
        for variant in pipeline["variants"]:
            for entry in variant["photo_sets"]:
                if entry["photos"] == name:
                    ax.axhline(entry["inprocess"]["saturation_img_per_s"], color=colours[variant["variant"]],
                               linestyle="--", linewidth=1, label=f"{variant['variant']} in-process")
        ax.set_xscale("log", base=2)
        levels = sorted({r["level"] for _, _, run in served_runs(pipeline, name) for r in run["concurrency"]})
        ax.set_xticks(levels, [f"{level:g}" for level in levels])
        ax.set_xlabel("concurrency (requests in flight, 1 image each)")
        ax.set_ylabel("img/s")
        ax.set_title(f"{name} photos through `resnet18`")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_steps(pipeline: dict, path: Path) -> None:
    """Stacked bar per (variant, photo set, protocol): per step (preprocess, network) the mean queue and
    compute (infer) ms per request, from the statistics extension, every bar at the same concurrency: the
    highest level every sweep measured (named in the title); without one, each sweep's highest level."""
    runs = list(served_runs(pipeline))
    common = set.intersection(*({r["level"] for r in run["concurrency"]} for _, _, run in runs)) if runs else set()
    bars = []
    for variant, entry, run in runs:
        top = max((r for r in run["concurrency"] if not common or r["level"] == max(common)),
                  key=lambda r: r["level"])
        bars.append((f"{variant['variant']}\n{entry['photos']} {run['protocol']}\nc={top['level']:g}", top["steps"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(bars)), 4.5))
    bottoms = [0.0] * len(bars)
    for model in STEP_MODELS:
        for key, part in STEP_PARTS:
            values = [steps[model][key] / 1000 for _, steps in bars]
            ax.bar([label for label, _ in bars], values, bottom=bottoms, label=f"{STEP_LABELS[model]} {part}")
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("mean ms per request")
    where = f"every sweep at concurrency {max(common):g}" if common else "each sweep at its highest concurrency"
    ax.set_title(f"server time per request by step, {where}\n(statistics extension)", fontsize=10)
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(pipeline: dict, run_dir: Path) -> dict[str, str]:
    """Both plots into run_dir; returns PLOTS (their file names)."""
    plot_throughput(pipeline, run_dir / PLOTS["throughput"])
    plot_steps(pipeline, run_dir / PLOTS["steps"])
    return PLOTS


def _ms(us: float) -> str:
    return f"{us / 1000:.1f}"


def _cpu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def targets_table(targets: list[dict]) -> list[str]:
    lines = ["| target | wanted | measured | verdict |", "|---|---|---|---|"]
    return lines + [f"| {t['name']} | {t['wanted']} | {t['measured']} | {'met' if t['met'] else 'MISSED'} |"
                    for t in targets]


def markdown(pipeline: dict, plots: dict[str, str]) -> list[str]:
    """The end-to-end section of report.md, as lines."""
    options = pipeline["options"]
    sets = ", ".join(f"{name} ({len(files)} files, {min(f['bytes'] for f in files) / 1e3:.0f}-"
                     f"{max(f['bytes'] for f in files) / 1e3:.0f} kB)"
                     for name, files in pipeline["photo_sets"].items())
    windows = f"{options['measurement_ms']} ms measurement windows (the served rate at steady state)"
    if options["request_window_s"]:
        windows += f", concurrency 1 a fixed request count of ~{options['request_window_s']:g} s at the in-process rate"
    out = ["## End to end: encoded photos -> `resnet18` ensemble (preprocess -> resnet18_onnx) -> logits", "",
           f"Photo sets: {sets}. perf_analyzer sends each photo as a real BYTES tensor (`--input-data`, one "
           f"image per request, cycled; in system shared memory over the `-shm` transports), {windows}; "
           f"the server restarted per variant "
           f"(`--model-config-name`). Per step, queue and compute (infer) are the statistics extension's "
           f"means per request, ms. In-process: the same decode/transform code and network runtime, no "
           f"server (resnet18_kit/tools/bench/pipeline_inprocess.py), measured before and after each photo set's sweeps "
           f"(batch-1 latency) and right before and after each saturating level (saturation: the machine's speed "
           f"drifts); efficiency = best served img/s / the in-process saturation img/s around that level; "
           f"c=1 gap = served p50 at concurrency 1 - in-process batch-1 p50. Took {pipeline['elapsed_s']:.0f} s.",
           "", "### End-to-end targets", ""] + targets_table(pipeline["targets"])
    out += ["", "### Served against in-process", "",
            "| variant | photos | protocol | best img/s (c) | in-process img/s around it (before / after) | efficiency | "
            "c=1 p50 ms | in-process batch-1 p50 ms | c=1 gap ms |", "|---|---|---|---|---|---|---|---|---|"]
    for variant, entry, run in served_runs(pipeline):
        inproc = entry["inprocess"]
        best = next(r for r in run["concurrency"] if r["level"] == run["best_level"])
        before, after = ((best["inprocess_paired"]["before"], best["inprocess_paired"]["after"])
                         if "inprocess_paired" in best else (entry["inprocess_before"], entry["inprocess_after"]))
        gap = "-" if run["c1_gap_ms"] is None else f"{run['c1_gap_ms']:+.1f}"
        c1 = "-" if run["c1_p50_ms"] is None else f"{run['c1_p50_ms']:.1f}"
        out.append(f"| {variant['variant']} | {entry['photos']} | {run['protocol']} | {run['best_img_per_s']:.1f} "
                   f"(c={run['best_level']:g}) | {run_bar(entry, run)['saturation_img_per_s']:.1f} "
                   f"({before['saturation_img_per_s']:.1f} / {after['saturation_img_per_s']:.1f}) | "
                   f"{run['efficiency']:.2f} | {c1} | {inproc['batch1_p50_ms']:.1f} | {gap} |")
    out += ["", f"![img/s vs concurrency]({plots['throughput']})", "",
            f"![per-step queue and compute]({plots['steps']})", "", "### Concurrency sweeps", "",
            "| variant | photos | protocol | concurrency | img/s | p50 ms | p99 ms | preprocess queue | "
            "preprocess compute | preprocess avg batch | network queue | network compute | network avg batch | "
            "server CPU |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant, entry, run in served_runs(pipeline):
        for r in sorted(run["concurrency"], key=lambda r: r["level"]):
            steps = [f"{_ms(r['steps'][m]['queue_us'])} | {_ms(r['steps'][m]['compute_infer_us'])} | "
                     f"{r['steps'][m]['average_batch']:.1f}" for m in STEP_MODELS]
            out.append(f"| {variant['variant']} | {entry['photos']} | {run['protocol']} | {r['level']:g} | "
                       f"{r['throughput']:.1f} | {_ms(r['p50_us'])} | {_ms(r['p99_us'])} | {' | '.join(steps)} | "
                       f"{_cpu(r.get('cpu_utilization'))} |")
    out += ["", "### In-process pipeline (no server)", "",
            "| variant | photos | network | batch | decode threads | network workers | saturation img/s "
            "(before / after) | batch-1 p50 ms (before / after) | batch-1 p99 ms (before / after) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for variant in pipeline["variants"]:
        twin = variant["inprocess_twin"]
        network = (f"{twin['runtime']} {twin['model_file']}, {twin['intra_op_threads'] or 'all'} thread(s)"
                   f"{', ' + twin['precision'] if twin['runtime'] == 'openvino' else ''}")
        for entry in variant["photo_sets"]:
            b, a = entry["inprocess_before"], entry["inprocess_after"]
            out.append(f"| {variant['variant']} | {entry['photos']} | {network} | {twin['batch_size']} | "
                       f"{twin['decode_threads']} | {twin['network_workers']} | "
                       f"{b['saturation_img_per_s']:.1f} / {a['saturation_img_per_s']:.1f} | "
                       f"{b['batch1_p50_ms']:.1f} / {a['batch1_p50_ms']:.1f} | "
                       f"{b['batch1_p99_ms']:.1f} / {a['batch1_p99_ms']:.1f} |")
    return out + [""]
