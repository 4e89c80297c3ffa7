"""The package's own rules: its layers (import-linter contracts in pyproject.toml), module sizes, tests that
import only public modules, extras pinned by constraints.txt, and console scripts that work from any folder."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from resnet18_kit import contract
from resnet18_kit.cli import COMMANDS, PROG, build_parser, main
from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.server.config import free_ports

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
BIN = Path(sys.executable).parent
#: No module (product, tools, tests, served model code) may grow past this many lines.
MAX_MODULE_LINES = 400


def python_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    return [REPO_ROOT / name for name in tracked if (REPO_ROOT / name).is_file()]


def test_the_layer_contracts_hold():
    result = subprocess.run([str(BIN / "lint-imports"), "--no-cache"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    contracts = [c["name"] for c in PYPROJECT["tool"]["importlinter"]["contracts"]]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in result.stdout, result.stdout[-2000:]


def test_a_broken_layer_is_reported(tmp_path):
    """The checker really fails: a copy of the config with the layers upside down breaks."""
    config = (REPO_ROOT / "pyproject.toml").read_text()
    start = config.index("[tool.importlinter]")
    upside_down = config[start:].replace('    "resnet18_kit.contract",\n]', ']').replace(
        'layers = [\n', 'layers = [\n    "resnet18_kit.contract",\n', 1)
    (tmp_path / "importlinter.toml").write_text(upside_down)
    result = subprocess.run([str(BIN / "lint-imports"), "--no-cache", "--config", str(tmp_path / "importlinter.toml")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "BROKEN" in result.stdout


def test_no_module_is_over_the_size_limit():
    sizes = {path.relative_to(REPO_ROOT): len(path.read_text().splitlines()) for path in python_files()}
    assert len(sizes) > 50
    over = {str(path): lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_tests_import_public_modules_only():
    tests = {path.stem for path in (REPO_ROOT / "tests").glob("*.py")}
    offenders = []
    for path in (REPO_ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] in tests]
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("resnet18_kit"):
                offenders += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                              if alias.name.startswith("_")]
    assert not offenders, offenders


#: Pairs of places sharing a run of DUPLICATE_MIN_LINES or more lines (pylint duplicate-code, imports,
#: docstrings and comments ignored) the package and its tests may hold: no more than today.
MAX_DUPLICATE_PAIRS = 0
DUPLICATE_MIN_LINES = 6


@pytest.mark.slow  # pylint compares every file with every other: 22-28 s on 2 cores
def test_no_more_repeated_code_than_today():
    files = [str(path) for path in python_files() if "model_repository" not in path.parts]
    result = subprocess.run([str(BIN / "pylint"), "--disable=all", "--enable=duplicate-code",
                             f"--min-similarity-lines={DUPLICATE_MIN_LINES}", "--ignore-imports=yes",
                             "--ignore-docstrings=yes", "--ignore-comments=yes", "--score=no", *files],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    pairs = result.stdout.count("Similar lines in")
    assert pairs <= MAX_DUPLICATE_PAIRS, result.stdout[-6000:]


def requirement_name(requirement: str) -> str:
    return re.split(r"[\[<>=~!; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_dependency_of_every_extra_is_pinned_in_constraints():
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO_ROOT / "constraints.txt").read_text(), re.M))
    pinned = {name.lower().replace("_", "-") for name in pins}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"client", "serve", "export", "bench", "test"} <= set(extras)
    own = PYPROJECT["project"]["name"]
    unpinned = {f"{extra}: {req}" for extra, reqs in extras.items() for req in reqs
                if requirement_name(req) != own and requirement_name(req) not in pinned}
    assert not unpinned, f"add exact pins to constraints.txt for {sorted(unpinned)}"
    client = {requirement_name(req) for req in extras["client"]}
    assert not client & {"torch", "torchvision", "nvidia-pytriton", "onnxruntime", "openvino"}, client


def test_one_command_is_installed_and_every_command_module_has_add_arguments_and_run():
    assert PYPROJECT["project"]["scripts"] == {PROG: "resnet18_kit.cli:main"}
    assert (BIN / PROG).is_file(), f"{PROG} is not installed in the venv: run `make setup`"
    import importlib

    for name, (module_name, extra, _) in COMMANDS.items():
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), name
        assert extra in PYPROJECT["project"]["optional-dependencies"], (name, extra)


#: Files that also run alone where the package is not installed (inside the Triton image): their
#: __main__ block is their only route there.
STANDALONE_SCRIPTS = {REPO_ROOT / "resnet18_kit" / "observe" / "probe.py"}


def test_no_old_route_is_left():
    """One route per command: no `if __name__ == "__main__"` outside resnet18_kit/__main__.py (and the
    STANDALONE_SCRIPTS, which import nothing of the package), no `python -m resnet18_kit.<module>`
    command lines, no console script but resnet18-kit."""
    for script in STANDALONE_SCRIPTS:
        assert "resnet18_kit" not in re.sub(r"#.*|\"\"\"[\s\S]*?\"\"\"", "", script.read_text()), script
    old = re.compile(r"python -m resnet18_kit\.|resnet18_kit\.[a-z_.]+ *--|\bresnet18-(?!kit\b)[a-z-]+")
    offenders = []
    for path in [*python_files(), REPO_ROOT / "Makefile", *REPO_ROOT.glob("scripts/*.sh")]:
        text = path.read_text()
        in_package = path.is_relative_to(REPO_ROOT / "resnet18_kit")
        if in_package and '__name__ == "__main__"' in text and path != REPO_ROOT / "resnet18_kit" / "__main__.py" \
                and path not in STANDALONE_SCRIPTS:
            offenders.append(f"{path.relative_to(REPO_ROOT)}: a __main__ block")
        offenders += [f"{path.relative_to(REPO_ROOT)}: {m.group(0)}" for m in old.finditer(text)
                      if path.name not in ("test_package.py", "test_docs.py")]  # the checkers name them
    assert not offenders, offenders


def test_the_contract_holds_constants_only():
    """No folder or file path computed at import besides REPO_ROOT (where the source sits): folders are settings."""
    paths = [name for name, value in vars(contract).items() if isinstance(value, Path) and name != "REPO_ROOT"]
    assert not paths, paths
    assert not [name for name in vars(contract) if name.endswith("_ENV")]


def kit(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / PROG), *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def test_the_command_works_from_any_folder(tmp_path):
    image = tmp_path / "photo.png"
    image.write_bytes(b"not a png")
    port = free_ports(1)[0]
    result = kit("classify", "--url", f"127.0.0.1:{port}", str(image), cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    plan = kit("plan", "--help", cwd=tmp_path)
    assert plan.returncode == 0 and plan.stdout.startswith(f"usage: {PROG} plan"), plan.stdout[:200]


@pytest.mark.parametrize("command", [[], ["serve"], ["classify"], ["bench"], ["plan"], ["reliability"]])
def test_help_names_the_command_the_user_typed(command, tmp_path):
    result = kit(*command, "--help", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith(f"usage: {' '.join([PROG, *command])}"), \
        result.stdout[:300]
    assert "python -m" not in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--model-repository", "/nonexistent/repository", "export"], "--model-repository: not a folder: /nonexistent/repository"),
    (["export", "--model-repository", "/nonexistent/repository"], "--model-repository: not a folder: /nonexistent/repository"),
    (["--log-level", "LOUD", "figures"], "--log-level 'LOUD': one of DEBUG, INFO, WARNING, ERROR"),
    (["classify", "--url", "https://127.0.0.1:8000", "x.png"], "--url: URL 'https://127.0.0.1:8000': scheme https://"),
    (["classify", "--url", "127.0.0.1", "x.png"], "--url: URL '127.0.0.1': give host:port"),
    (["grpc-guard", "--listen", "127.0.0.1:1", "--upstream", "127.0.0.1:1", "--cancel-marks", "/nonexistent/marks"],
     "--cancel-marks /nonexistent/marks: not a folder"),
])
def test_a_bad_setting_is_one_line(tmp_path, args, message):
    result = kit(*args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr


def test_no_option_is_abbreviated(tmp_path):
    """`--model` is classify's own option (the model name), never a prefix of --model-repository."""
    args = build_parser("classify").parse_args(["classify", "--model", "resnet18_onnx", "x.png"])
    assert args.model == "resnet18_onnx" and getattr(args, "model_repository", None) is None
    result = kit("export", "--model-repo", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and "unrecognized arguments: --model-repo" in result.stderr, result.stderr


def test_a_command_whose_extra_is_missing_says_which_to_install(tmp_path, monkeypatch, capsys):
    """A library a command imports that is not installed is one line naming the extra, exit status 2."""
    (tmp_path / "needs_a_missing_library.py").write_text("import no_such_library_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMANDS, "fake", ("needs_a_missing_library", "bench", "a command that cannot import"))
    assert main(["fake"]) == 2
    message = capsys.readouterr().err
    assert message.startswith(f"{PROG} fake: needs the 'bench' extra (no module 'no_such_library_here')")
    assert "pip install 'triton-resnet18-kit[bench]'" in message


def test_the_results_option_moves_the_results_folder(tmp_path):
    """--results sets where a command writes: the figures command reads the soak from <results>/reliability."""
    results = tmp_path / "elsewhere"
    result = kit("--results", str(results), "figures", "--only", "soak", "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"skipped: no {results / 'reliability'}" in result.stderr, result.stderr


def test_the_layout_page_names_every_folder_of_the_package():
    layout = (REPO_ROOT / "docs" / "layout.md").read_text()
    folders = sorted({path.parent.relative_to(REPO_ROOT / "resnet18_kit").parts[0]
                      for path in (REPO_ROOT / "resnet18_kit").glob("*/__init__.py")})
    assert len(folders) >= 7
    tools = sorted(path.parent.name for path in (REPO_ROOT / "resnet18_kit" / "tools").glob("*/__init__.py"))
    assert len(tools) >= 4
    missing = [folder for folder in folders if f"  {folder}/" not in layout]
    missing += [f"tools/{tool}" for tool in tools if f"    {tool}/ " not in layout]
    assert not missing, f"docs/layout.md has no line for {missing}"


def test_lines_written_from_several_threads_stay_whole(capfd):
    """serve's supervisor, its log follower and its signal notes write lines from different threads; a line
    must never run into another (print()'s separate writes of text and newline let them: a tritonserver
    log line would then swallow "serve: gave-up: ...", the line that says why serve exits)."""
    import threading

    from resnet18_kit.progress import stderr_line

    def write(tag: str) -> None:
        for i in range(2000):
            stderr_line(f"{tag} line {i} " + "x" * 40)
    threads = [threading.Thread(target=write, args=(f"t{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 8000
    assert all(re.fullmatch(r"t\d line \d+ x{40}", line) for line in lines), \
        next(line for line in lines if not re.fullmatch(r"t\d line \d+ x{40}", line))
