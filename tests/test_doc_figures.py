"""The guides stay guides, and what they quote exists: each page and all of them together stay under their
size, a measured table is exactly what its backing file in docs/figures/ gives, every throughput a guide
quotes (infer/s, img/s) is a figure of a backing file, and every repository path and flag a guide names
exists. The records (docs/records/) are exempt: they keep how figures were obtained, with their dates."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from resnet18_kit.cli import COMMANDS, build_parser
from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.tools.bench.doc_tables import RENDERERS, TABLE_PAGES, marked_block
from resnet18_kit.tools.load.perf_analyzer import perf_analyzer_binary, perf_analyzer_env

DOCS = REPO_ROOT / "docs"
GUIDES = sorted(DOCS.glob("*.md"))
RECORDS = sorted((DOCS / "records").glob("*.md"))
PAGES = [REPO_ROOT / "README.md", *GUIDES]
FIGURES = DOCS / "figures"
#: Outputs of deterministic commands, committed as they print them: file -> the command's arguments.
COMMAND_OUTPUTS = {FIGURES / "plan-worked-example.txt": ["plan", "worked-example"]}
#: A guide page is read in one sitting; all of them together in an afternoon.
GUIDE_MAX_BYTES = 25_000
GUIDES_MAX_BYTES = 90_000
#: A quoted throughput: "412.5 infer/s", "1,204 img/s".
THROUGHPUT = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s*(?:infer/s|img/s|inferences/s)")
#: A backticked repository path: `resnet18_kit/server/supervisor.py`, `deploy/kubernetes/`.
REPO_PATH = re.compile(r"`((?:resnet18_kit|model_repository|deploy|docs|tests|scripts)/[^`\s]*|"
                       r"docker-compose[\w.]*\.yaml|Makefile|pyproject\.toml|constraints[\w-]*\.txt)`")
#: A backticked flag on its own: `--model-config-name`, `--max-restarts 5`.
FLAG = re.compile(r"`(--[a-z][a-z0-9-]*)(?:[ =][^`]*)?`")


def backed_numbers() -> set[float]:
    """Every number in the backing files docs/figures/*.json."""
    numbers: set[float] = set()

    def walk(value):
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            numbers.add(float(value))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
    for path in FIGURES.glob("*.json"):
        walk(json.loads(path.read_text()))
    for path in COMMAND_OUTPUTS:  # a command's whole output, kept as it printed it
        numbers.update(float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", path.read_text()))
    return numbers


def parser_flags() -> set[str]:
    """Every long option of resnet18-kit and its commands and sub-commands."""
    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser):
        for action in parser._actions:
            flags.update(option for option in action.option_strings if option.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
    for command in COMMANDS:
        walk(build_parser(command))
    return flags


def other_tools_flags() -> set[str]:
    """The long options of the tritonserver release the kit runs (deploy/triton/flags-*.txt) and of the
    bundled perf_analyzer (its --help)."""
    flags = set()
    for path in (REPO_ROOT / "deploy" / "triton").glob("flags-*.txt"):
        flags.update(line.strip() for line in path.read_text().splitlines() if line.startswith("--"))
    helped = subprocess.run([str(perf_analyzer_binary()), "--help"], capture_output=True, text=True,
                            env=perf_analyzer_env(), timeout=60)
    flags.update(re.findall(r"(--[a-z][a-z0-9-]*)", helped.stdout + helped.stderr))
    return flags


@pytest.mark.parametrize("path", COMMAND_OUTPUTS, ids=[path.name for path in COMMAND_OUTPUTS])
def test_a_committed_command_output_is_what_the_command_prints_today(path):
    printed = subprocess.run([sys.executable, "-m", "resnet18_kit", *COMMAND_OUTPUTS[path]], capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == path.read_text(), f"docs/figures/{path.name} is stale: run `resnet18-kit " \
                                               f"{' '.join(COMMAND_OUTPUTS[path])} > docs/figures/{path.name}`"


def test_each_guide_page_and_all_of_them_stay_readable():
    sizes = {page.name: len(page.read_bytes()) for page in GUIDES}
    too_big = {name: size for name, size in sizes.items() if size > GUIDE_MAX_BYTES}
    assert not too_big, f"guide pages over {GUIDE_MAX_BYTES} bytes: {too_big}; records go to docs/records/"
    sizes["README.md"] = len((REPO_ROOT / "README.md").read_bytes())
    assert sum(sizes.values()) <= GUIDES_MAX_BYTES, f"the guides and README total {sum(sizes.values())} bytes: {sizes}"


@pytest.mark.parametrize("marker, page", TABLE_PAGES.items())
def test_a_measured_table_is_what_its_backing_file_gives(marker, page):
    data = json.loads((FIGURES / "configs.json").read_text())
    block = marked_block((REPO_ROOT / page).read_text(), marker)
    assert block is not None, f"{page}: no <!-- {marker} --> table"
    assert block.group(1).strip() == RENDERERS[marker](data, block.group(1)).strip(), \
        f"{page}: the '{marker}' table differs from docs/figures/configs.json: run `resnet18-kit figures`"


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_throughput_a_guide_quotes_is_backed_by_a_results_file(page):
    backed = backed_numbers()
    unbacked = []
    for match in THROUGHPUT.finditer(page.read_text()):
        shown = match.group(1).replace(",", "")
        decimals = len(shown.split(".")[1]) if "." in shown else 0
        if not any(round(number, decimals) == float(shown) for number in backed):
            unbacked.append(match.group(0))
    assert not unbacked, f"{page.name} quotes throughputs that no docs/figures/*.json holds: {unbacked}"


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_repository_path_a_guide_names_exists(page):
    named = {path.rstrip(".,:;") for path in REPO_PATH.findall(page.read_text())}
    missing = sorted(path for path in named if not re.search(r"[<*{]", path) and not (REPO_ROOT / path).exists())
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_every_flag_a_guide_names_exists():
    known = parser_flags() | other_tools_flags()
    unknown = sorted({f"{page.name}: {flag}" for page in PAGES for flag in FLAG.findall(page.read_text())
                      if flag not in known})
    assert not unknown, f"flags no parser of the kit, tritonserver or perf_analyzer has: {unknown}"


@pytest.mark.parametrize("page", RECORDS, ids=[page.name for page in RECORDS])
def test_a_record_links_back_to_its_guide_and_every_link_leads_to_a_file(page):
    text = page.read_text()
    assert f"(../{page.name})" in text, f"records/{page.name} does not link its guide ../{page.name}"
    targets = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)
               if not re.match(r"^[a-z]+:", target) and not target.startswith("#")]
    missing = [target for target in targets if target and not (page.parent / target).exists()]
    assert not missing, f"records/{page.name} links to missing files: {missing}"
