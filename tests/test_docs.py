"""The documentation cannot drift from the code: every command quoted in a code block of README.md or
docs/*.md is accepted by the real parser of `resnet18-kit` (or is a target of the Makefile, whose ARGS
the command behind that target accepts), no page quotes a removed route (the old console scripts
`resnet18-<name>`, `python -m resnet18_kit.<module>`), and every relative link leads to a file.

No server is started: a command line is only parsed (`build_parser(command).parse_args(argv)`, as
`resnet18_kit.cli.main` does), never run."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from resnet18_kit.cli import COMMANDS, build_parser, command_name
from resnet18_kit.contract import REPO_ROOT

README = REPO_ROOT / "README.md"
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
#: The front page fits on a screen or two; the rest lives in docs/.
README_MAX_CHARS = 8000

#: `resnet18-kit`, `.venv/bin/resnet18-kit`, `~/venv/bin/resnet18-kit`, `python -m resnet18_kit`, ...
KIT = re.compile(r"^(?:\S*/)?resnet18-kit(?=\s|$)|^(?:\S*/)?python[\d.]*\s+-m\s+resnet18_kit(?=\s|$)")
MAKE = re.compile(r"^make(?=\s|$)")
#: Old routes: a console script other than resnet18-kit (the weights file resnet18-f37072fd.pth is not one),
#: and a module run with -m.
REMOVED_SCRIPT = re.compile(r"(?<![\w-])resnet18-(?!kit(?![\w-]))[a-z]+(?:-[a-z]+)*(?![\w.])")
REMOVED_MODULE = re.compile(r"-m\s+resnet18_kit\.\w")
#: Optional parts of a synopsis: `[--percentile 99]`.
OPTIONAL = re.compile(r"\[[^\[\]]*\]")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block, continuation lines (ending in `\\`)
    joined to the first, a shell prompt `$ ` dropped."""
    lines, fenced, pending = [], False, None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, None
            continue
        if not fenced:
            continue
        text = line.strip()
        if pending is not None:
            pending = (pending[0], pending[1] + " " + text)
        else:
            pending = (number, text[2:] if text.startswith("$ ") else text)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        lines.append(pending)
        pending = None
    return lines


def without_comment(text: str) -> str:
    """The line up to a shell comment (` #`)."""
    return re.split(r"\s#", " " + text, maxsplit=1)[0].strip()


def segments(text: str) -> list[str]:
    """The simple commands of a shell line (`a && b; c | d`)."""
    return [part.strip() for part in re.split(r"\s*(?:&&|\|\||;|\s\|\s)\s*", text) if part.strip()]


def quoted_commands() -> list[tuple[str, str, str]]:
    """(where, kind, command) for every kit or make command in the code blocks of the pages."""
    found = []
    for path in PAGES:
        for number, line in code_lines(path):
            for segment in segments(without_comment(line)):
                words = segment.split()
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # PYTHON=python3.11 make setup
                    words.pop(0)
                segment = " ".join(words)
                kind = "kit" if KIT.match(segment) else "make" if MAKE.match(segment) else None
                if kind:
                    found.append((f"{path.relative_to(REPO_ROOT)}:{number}", kind, segment))
    return found


def make_targets() -> dict[str, str | None]:
    """Makefile target -> the resnet18-kit command its recipe runs with $(ARGS) (None: no such command)."""
    targets, current = {}, None
    for line in (REPO_ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z][\w-]*)\s*:(?!=)", line)
        if match:
            current = match.group(1)
            targets[current] = None
        elif current and line.startswith("\t"):
            recipe = re.search(r"\$\(KIT\)\s+(\S+).*\$\(ARGS\)", line)
            if recipe:
                targets[current] = recipe.group(1)
    return targets


def kit_arguments(segment: str) -> list[str]:
    """The arguments after the program (`resnet18-kit` or `python -m resnet18_kit`)."""
    words = shlex.split(segment)
    if words[0].endswith("resnet18-kit"):
        return words[1:]
    return words[words.index("resnet18_kit") + 1:]


def parse_error(argv: list[str]) -> str | None:
    """None when `resnet18-kit <argv>` parses as cli.main parses it; else why not."""
    command = command_name(argv)
    if command is None and not {"-h", "--help"} & set(argv):
        return f"no command of {sorted(COMMANDS)} in {argv}"
    stderr = io.StringIO()
    try:
        parser = build_parser(command)
        if {"-h", "--help"} & set(argv[:argv.index(command) + 1] if command == "perf-analyzer" else argv):
            return None  # --help lines only need the command to exist and its parser to build
        if command == "perf-analyzer":  # the rest goes to perf_analyzer untouched
            argv = argv[:argv.index(command) + 1]
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(argv)
    except SystemExit as exc:
        return f"exit {exc.code}: {stderr.getvalue().strip().splitlines()[-1:] or ''}"
    except Exception as exc:  # the command's module does not import, or has no add_arguments yet
        return f"{type(exc).__name__}: {exc}"
    return None


COMMAND_LINES = quoted_commands()


def test_the_pages_quote_commands():
    kinds = {kind for _, kind, _ in COMMAND_LINES}
    assert kinds == {"kit", "make"}, kinds
    assert any(where.startswith("README.md") for where, _, _ in COMMAND_LINES)


@pytest.mark.parametrize("where, segment", [(w, s) for w, kind, s in COMMAND_LINES if kind == "kit"],
                         ids=[w for w, kind, _ in COMMAND_LINES if kind == "kit"])
def test_every_quoted_kit_command_is_accepted_by_its_parser(where, segment):
    synopsis = OPTIONAL.sub("", segment)
    argv = kit_arguments(synopsis)
    if "<" in synopsis or "..." in synopsis:  # a synopsis with placeholders: only the command must exist
        named = [word for word in argv if not word.startswith("-")]
        assert not named or named[0].startswith("<") or named[0] in COMMANDS or command_name(argv), \
            f"{where}: {segment!r} names no command of {sorted(COMMANDS)}"
        return
    error = parse_error(argv)
    assert error is None, f"{where}: {segment!r}: {error}"


@pytest.mark.parametrize("where, segment", [(w, s) for w, kind, s in COMMAND_LINES if kind == "make"],
                         ids=[w for w, kind, _ in COMMAND_LINES if kind == "make"])
def test_every_quoted_make_command_names_a_target_and_arguments_its_command_accepts(where, segment):
    targets = make_targets()
    words = shlex.split(segment)[1:]
    variables = dict(word.split("=", 1) for word in words if "=" in word)
    named = [word for word in words if "=" not in word]
    assert named, f"{where}: {segment!r} names no target"
    unknown = [target for target in named if target not in targets]
    assert not unknown, f"{where}: {segment!r}: no Makefile target {unknown} (targets: {sorted(targets)})"
    arguments = variables.get("ARGS", "")
    if "<" in arguments or "..." in arguments:
        return
    for target in named:
        command = targets[target]
        if command and arguments:
            error = parse_error([command, *shlex.split(arguments)])
            assert error is None, f"{where}: {segment!r} runs `resnet18-kit {command} {arguments}`: {error}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO_ROOT)) for p in PAGES])
def test_no_page_quotes_a_removed_route(page):
    text = page.read_text()
    old = [(text.count("\n", 0, m.start()) + 1, m.group(0))
           for pattern in (REMOVED_SCRIPT, REMOVED_MODULE) for m in pattern.finditer(text)]
    assert not old, f"{page.relative_to(REPO_ROOT)} quotes removed routes (line, text): {old}; " \
                    "the one command is `resnet18-kit <command>` (python -m resnet18_kit <command>)"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO_ROOT)) for p in PAGES])
def test_every_relative_link_leads_to_a_file(page):
    targets = [target.split("#")[0] for target in LINK.findall(page.read_text())
               if not re.match(r"^[a-z]+:", target) and not target.startswith("#")]
    missing = [target for target in targets if target and not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(REPO_ROOT)} links to missing files: {missing}"


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    text = README.read_text()
    assert len(text) <= README_MAX_CHARS, f"README.md has {len(text)} characters: move details into docs/"
    for command in ("make demo", "make test"):
        assert command in text
    unlinked = [page.name for page in PAGES[1:] if f"(docs/{page.name})" not in text]
    assert not unlinked, f"README.md's table of docs/ pages lacks {unlinked}"
