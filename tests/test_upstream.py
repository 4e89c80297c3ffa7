"""The upstream defects' registry (resnet18_kit.upstream): each workaround on only where the running release
lacks the fix, the registry and the docs' one table in step, and `serve`'s gRPC guard switched by it."""
from __future__ import annotations

import argparse
import re

import pytest

from resnet18_kit.contract import REPO_ROOT, TRITON_VERSION
from resnet18_kit.server.__main__ import add_server_arguments, config_from_args
from resnet18_kit.server.embedded import server_command
from resnet18_kit.upstream import DEFECTS, banner_line, needs, parse_version, workarounds


RELIABILITY = REPO_ROOT / "docs" / "reliability.md"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_workaround_is_on_for_251_and_only_the_unfixed_ones_on_a_later_release():
    assert [d.key for d in workarounds(TRITON_VERSION)] == [d.key for d in DEFECTS]
    later = workarounds("2.72.0")
    assert later and all(d.fixed_in is None for d in later)
    assert needs("grpc-cancellation", "2.58.1") and not needs("grpc-cancellation", "2.59.0")
    assert needs("numpy2-stub", "2.51") and not needs("numpy2-stub", "2.52.0")
    assert parse_version("2.72.0dev") == (2, 72, 0)
    with pytest.raises(ValueError, match="not a Triton version"):
        parse_version("latest")
    with pytest.raises(KeyError):
        needs("no-such-defect", TRITON_VERSION)


def test_the_registry_and_the_docs_table_agree():
    """Each defect has a row in reliability.md's table naming its upstream references and its fix release,
    and a test that exists."""
    table = RELIABILITY.read_text().split("## Triton 2.51 defects and what the kit does")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| defect")]
    for defect in DEFECTS:
        references = re.findall(r"#\d+", defect.upstream)
        row = next((r for r in rows if all(reference in r for reference in references)), None)
        assert references and row is not None, f"{defect.key}: no row of the table names all of {references}"
        fixed = defect.fixed_in_text if defect.fixed_in else "no"
        assert fixed in row or (defect.fixed_in is None and "in no release" in row), (defect.key, row)
        assert (REPO_ROOT / defect.reproduced_by).is_file(), defect.reproduced_by


def test_serve_puts_the_guard_in_front_only_where_the_release_lacks_the_fix(settings):
    old = config_from_args(settings, parse(), environ={}, triton_version="2.51.0")
    assert old.triton_grpc_port is not None and f"--grpc-port={old.triton_grpc_port}" in server_command(old, control_key="k" * 32)
    fixed = config_from_args(settings, parse(), environ={}, triton_version="2.72.0")
    assert fixed.triton_grpc_port is None  # no guard: tritonserver's own gRPC on the client-facing port
    assert f"--grpc-port={fixed.grpc_port}" in server_command(fixed, control_key="k" * 32) and fixed.triton_grpc_url == fixed.grpc_url
    assert config_from_args(settings, parse("--grpc-guard"), environ={}, triton_version="2.72.0").triton_grpc_port
    assert config_from_args(settings, parse("--no-grpc-guard"), environ={}, triton_version="2.51.0"
                            ).triton_grpc_port is None


def test_the_banner_names_the_workarounds_and_a_guard_turned_off():
    assert banner_line("2.51.0", guarded=True).startswith("2.51.0: workarounds on for grpc-cancellation, dead-stub")
    assert "grpc-cancellation (guard OFF: --no-grpc-guard)" in banner_line("2.51.0", guarded=False)
    assert "grpc-cancellation" not in banner_line("2.72.0", guarded=False)
