"""The table `resnet18-kit reliability run` prints (docs/records/reliability.md): one row per case, the
columns below; each scenario module makes its own rows with `table_row`."""
from __future__ import annotations

from resnet18_kit.tools.load.outcomes import ERROR, LOST, WRONG

COLUMNS = ("case", "`resnet18-kit reliability run` ...", "sent", "answered", "refused / failed", "lost",
           "time to refuse / recover", "also")


def ms_cell(figures: dict | None, key: str = "p50") -> str:
    """One latency figure of a summary's "<kind>_ms" (milliseconds, whole), "-" when there is none."""
    return "-" if not figures else f"{figures[key]:.0f}"


def unaccounted(summary: dict) -> int:
    """The "lost" column of a summary (load.outcomes.summarize): lost, wrong and unexpected errors."""
    return summary[LOST] + summary[WRONG] + summary[ERROR]


def markdown_table(rows: list[list], columns: tuple[str, ...] = COLUMNS) -> str:
    """`rows` (one list of len(columns) cells each) as a Markdown table under `columns`."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
