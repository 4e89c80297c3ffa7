"""The measured tables of the docs, written from a `resnet18-kit bench run` results folder (resnet18-kit
figures): docs/figures/configs.json, the figures they quote, and each page's table between its markers
(`<!-- choosing-a-config -->` ... `<!-- /choosing-a-config -->`), rewritten in place.

One row per config variant of the tensor sweeps (summary.json "configs"):
  * p50 and p99 at concurrency 1 (ms): perf_analyzer's p50_us / p99_us / 1000 at the lowest level swept;
  * infer/s at saturation: perf_analyzer's highest throughput of the concurrency sweep, with its level and
    its p99 (ms);
  * of the in-process bar: that throughput / the config's in-process bar (summary "inprocess_bar_img_per_s":
    the same network file and runtime in its strongest arrangement, no server), a ratio;
  * end to end (img/s): the sample photos through the `resnet18` ensemble (decode, resize, network) over
    HTTP with each photo in system shared memory (pipeline.SHARED_MEMORY_TRANSPORT), the highest img/s of the end-to-end sweep (summary "pipeline"), where that variant was run;
  * CPU per inference (ms): what the server's processes spent (tritonserver, every stub, the gRPC guard
    where it runs; observe.process_cpu, read from /proc over the saturation level's window) per inference,
    against the in-process bar's CPU per image, and their ratio (`cpu_ratio`; None where a summary
    predates the measure); end to end the same for the sample photos (`end_to_end_cpu_ratio`).
The verdict line under the table names the variant with the lowest p50 at concurrency 1 and the one with
the most infer/s. tests/test_docs.py checks each page's table against docs/figures/configs.json.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from resnet18_kit.observe.machine import processor_line
from resnet18_kit.tools.bench.pipeline import SHARED_MEMORY_TRANSPORT, run_bar, served_runs
from resnet18_kit.tools.bench.report import saturation_row

#: The pages whose tables this module writes: marker name -> page (relative to the checkout); the renderer
#: of each marker is in RENDERERS (below).
TABLE_PAGES = {"choosing-a-config": "docs/model-repository.md", "bench-table": "docs/benchmarks.md",
               "readme-speed": "README.md"}
#: The command a reader runs to measure the table again (and then `resnet18-kit figures` to rewrite it).
MEASURE_COMMAND = "resnet18-kit bench run --quick"
#: The photo set and protocol of the end-to-end column.
PIPELINE_PHOTOS, PIPELINE_PROTOCOL = "sample", SHARED_MEMORY_TRANSPORT


def config_rows(summary: dict) -> list[dict]:
    """The table's rows from a bench summary (module doc); KeyError/ValueError when it has no tensor sweep."""
    if not summary.get("configs"):
        raise ValueError("summary.json has no tensor sweeps (\"configs\")")
    pipeline = _pipeline_img_per_s(summary.get("pipeline") or {})
    rows = []
    for config in summary["configs"]:
        levels = sorted(config["concurrency"], key=lambda row: row["level"])
        low, best = levels[0], saturation_row(config)
        bar = config.get("inprocess_bar_img_per_s")
        served_cpu = (best.get("server_cpu_ms_per_inference") or {}).get("total")
        bar_cpu = (config.get("inprocess_bar") or {}).get("cpu_ms_per_image")
        end_to_end = pipeline.get(config["name"], (None, None, None))
        rows.append({
            "variant": config["name"],
            "low_concurrency": low["level"], "p50_ms": round(low["p50_us"] / 1000, 1),
            "p99_ms": round(low["p99_us"] / 1000, 1),
            "saturation_concurrency": best["level"], "infer_per_s": round(best["throughput"], 1),
            "saturation_p99_ms": round(best["p99_us"] / 1000, 1),
            "inprocess_bar_infer_per_s": round(bar, 1) if bar else None,
            "of_inprocess_bar": round(best["throughput"] / bar, 2) if bar else None,
            "end_to_end_img_per_s": end_to_end[0], "end_to_end_inprocess_img_per_s": end_to_end[1],
            "server_cpu_ms": _rounded(served_cpu), "inprocess_cpu_ms": _rounded(bar_cpu),
            "cpu_ratio": _ratio(served_cpu, bar_cpu), "end_to_end_cpu_ratio": end_to_end[2],
        })
    return rows


def _rounded(value: float | None) -> float | None:
    return None if value is None or value != value else round(value, 2)


def _ratio(served: float | None, inprocess: float | None) -> float | None:
    return None if not served or not inprocess or inprocess != inprocess else round(served / inprocess, 2)


def _pipeline_img_per_s(pipeline: dict) -> dict[str, tuple[float, float | None, float | None]]:
    """variant -> (the highest img/s of the end-to-end sweep for the sample photos over gRPC, the same
    pipeline's in-process saturation img/s measured around that level (pipeline.run_bar), and the server's
    CPU per image at that level over the in-process pipeline's, None where not measured)."""
    best: dict[str, tuple[float, float | None, float | None]] = {}
    for variant, entry, run in served_runs(pipeline, PIPELINE_PHOTOS) if pipeline else ():
        name = variant["variant"]
        served = max((row["throughput"] for row in run["concurrency"]), default=0.0)
        if run["protocol"] == PIPELINE_PROTOCOL and served > best.get(name, (0.0, None, None))[0]:
            inprocess = run_bar(entry, run)
            img_per_s = inprocess.get("saturation_img_per_s")
            served_cpu = (run.get("best_server_cpu_ms_per_inference") or {}).get("total")
            best[name] = (round(served, 1), round(img_per_s, 1) if img_per_s else None,
                          _ratio(served_cpu, inprocess.get("saturation_cpu_ms_per_image")))
    return best


def backing(rows: list[dict], results: Path, machine: dict) -> dict:
    """What docs/figures/configs.json holds: the rows, the command, the results folder's name, the machine."""
    return {"command": MEASURE_COMMAND, "results": results.name,
            "machine": {key: machine[key] for key in ("cpu", "cores", "isa", "triton_version") if key in machine},
            "rows": rows}


def render(data: dict, uses: dict[str, str] | None = None) -> str:
    """The "Choosing a config" table and its verdict line (what sits between the page's markers). `uses`:
    variant -> the "use it for" cell, written by hand in the page and kept (parse_uses); a variant there
    that the sweeps did not measure (gpu on a CPU machine) keeps its row, with "-" as figures."""
    uses = uses or {}
    def cell(value, unit=""):
        return "-" if value is None else f"{value:g}{unit}"
    lines = ["| variant | use it for | p50 at concurrency 1 | infer/s at saturation (concurrency, p99) | "
             "end to end, photos |", "|---|---|---|---|---|"]
    measured = {row["variant"]: row for row in data["rows"]}
    for variant in [*measured, *(name for name in uses if name not in measured)]:
        row = measured.get(variant)
        if row is None:
            lines.append(f"| `{variant}` | {uses[variant]} | - | - | - |")
            continue
        low = "" if row["low_concurrency"] == 1 else f" (at concurrency {row['low_concurrency']:g})"
        lines.append(f"| `{variant}` | {uses.get(variant, '')} | {cell(row['p50_ms'], ' ms')}{low} | "
                     f"{cell(row['infer_per_s'])} ({row['saturation_concurrency']:g}, "
                     f"{cell(row['saturation_p99_ms'], ' ms')}) | {cell(row['end_to_end_img_per_s'], ' img/s')} |")
    fastest = min((row for row in data["rows"] if row["low_concurrency"] == 1), key=lambda row: row["p50_ms"],
                  default=min(data["rows"], key=lambda row: row["p50_ms"]))
    most = max(data["rows"], key=lambda row: row["infer_per_s"])
    where = processor_line(data.get("machine", {}))
    lines += ["", f"Lowest latency at low load: `{fastest['variant']}` ({fastest['p50_ms']:g} ms p50). Most "
                  f"throughput: `{most['variant']}` ({most['infer_per_s']:g} infer/s). Measured on {where} with "
                  f"`{data['command']}`: the network alone (resnet18_onnx over HTTP with system shared memory), "
                  f"and end to end the sample photos through the `resnet18` ensemble (HTTP, each photo in system "
                  f"shared memory, best concurrency); "
                  f"results folder {data['results']}. `resnet18-kit figures` rewrites the figures of this table."]
    return "\n".join(lines)


def parse_uses(block: str) -> dict[str, str]:
    """variant -> "use it for" cell of a "Choosing a config" table already in a page (render's format)."""
    uses = {}
    for line in block.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and cells[0].endswith("`"):
            uses[cells[0].strip("`")] = cells[1]
    return uses


def render_ratios(data: dict) -> str:
    """The benchmarks' table: each config's best served infer/s against its in-process bar."""
    def cell(value):
        return "-" if value is None else f"{value:g}"
    lines = ["| variant | served infer/s (concurrency) | in-process bar infer/s | served / in-process | "
             "CPU ms per inference, server / in-process | photos end to end: CPU ratio |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        cpu = "-" if row.get("cpu_ratio") is None else \
            f"{row['server_cpu_ms']:g} / {row['inprocess_cpu_ms']:g} = {row['cpu_ratio']:g}x"
        end_to_end = "-" if row.get("end_to_end_cpu_ratio") is None else f"{row['end_to_end_cpu_ratio']:g}x"
        lines.append(f"| `{row['variant']}` | {row['infer_per_s']:g} ({row['saturation_concurrency']:g}) | "
                     f"{cell(row['inprocess_bar_infer_per_s'])} | {cell(row['of_inprocess_bar'])} | {cpu} | "
                     f"{end_to_end} |")
    lines += ["", f"`{data['command']}` on {processor_line(data.get('machine', {}))}, results folder {data['results']}; "
                  "`resnet18-kit figures` rewrites this table."]
    return "\n".join(lines)


def render_headline(data: dict) -> str:
    """The front page's one paragraph: the fastest config's infer/s against its in-process bar, and its
    photos-in, labels-out img/s."""
    most = max(data["rows"], key=lambda row: row["infer_per_s"])
    end_to_end = [row for row in data["rows"] if row["end_to_end_img_per_s"] is not None]
    line = (f"On {processor_line(data.get('machine', {}))}: the fastest config (`{most['variant']}`) serves "
            f"{most['infer_per_s']:g} infer/s")
    if most["of_inprocess_bar"] is not None:
        line += f", {most['of_inprocess_bar']:g} of the same network in-process with every core busy"
    if most.get("cpu_ratio") is not None:
        line += f" (its CPU per inference {most['cpu_ratio']:g}x in-process)"
    if end_to_end:
        best = max(end_to_end, key=lambda row: row["end_to_end_img_per_s"])
        line += (f"; photos in, labels out, `{best['variant']}` answers {best['end_to_end_img_per_s']:g} img/s "
                 f"over HTTP with shared memory")
    return line + " ([docs/benchmarks.md](docs/benchmarks.md))."


#: marker -> the function that renders its block from configs.json's data and the block now in the page.
RENDERERS = {"choosing-a-config": lambda data, block: render(data, parse_uses(block)),
             "bench-table": lambda data, block: render_ratios(data),
             "readme-speed": lambda data, block: render_headline(data)}


def marked_block(text: str, marker: str) -> re.Match | None:
    """The span between `<!-- marker -->` and `<!-- /marker -->` (the closing one may be missing)."""
    return re.search(rf"<!-- {marker} -->\n(.*?)(?:<!-- /{marker} -->|\Z)", text, re.S) if \
        f"<!-- /{marker} -->" in text else re.search(rf"<!-- {marker} -->\n?()", text)


def fill(text: str, marker: str, table) -> str:
    """`text` with the block of `marker` replaced by table(the block now there); ValueError when the page has
    no marker."""
    match = marked_block(text, marker)
    if match is None:
        raise ValueError(f"no <!-- {marker} --> marker")
    return text[:match.start()] + f"<!-- {marker} -->\n{table(match.group(1))}\n<!-- /{marker} -->" + \
        text[match.end():]


def write_tables(summary_path: Path, checkout: Path, figures_dir: Path) -> list[str]:
    """Write figures_dir/configs.json and rewrite the tables of TABLE_PAGES under `checkout`; the lines
    to log. ValueError/KeyError for a summary without what the table needs."""
    summary = json.loads(summary_path.read_text())
    data = backing(config_rows(summary), summary_path.parent, summary.get("machine", {}))
    (figures_dir / "configs.json").write_text(json.dumps(data, indent=1) + "\n")
    said = [f"configs.json: {len(data['rows'])} configs from {summary_path.parent.name}"]
    for marker, page in TABLE_PAGES.items():
        path = checkout / page
        if path.exists():
            path.write_text(fill(path.read_text(), marker, lambda block, render=RENDERERS[marker]: render(data, block)))
            said.append(f"{page}: table '{marker}' rewritten")
    return said
