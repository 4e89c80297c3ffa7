"""`resnet18-kit evaluate`: scoring on crafted logits, class-folder labels, command-line errors, and one
end-to-end run (a served default server against the embedded default reference) on the sample photos.

Two tritonserver starts in the whole file: the module's `served` server, and the reference server that
the command starts itself.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from resnet18_kit.tools.bench.evaluate import (RANDOM_WEIGHTS_NOTE, class_of_folder, folder_labels, load_wnids, summarize,
                                         topk_accuracy, wnids_path)
from resnet18_kit.cli import main as kit_main
from resnet18_kit.client import TritonClassifierClient
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.server.config import config_on_free_ports, free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer


def main(argv: list[str]) -> int:
    """`resnet18-kit evaluate ARGV` in this process (its output captured by capsys)."""
    return kit_main(["evaluate", *argv])


def test_topk_accuracy_by_hand() -> None:
    logits = np.array([[0.1, 0.9, 0.0, 0.3, 0.2, 0.5, 0.4],   # ranking 1 5 6 3 4 | 0 2
                       [5, 4, 3, 2, 1, 0, -1],                 # ranking 0 1 2 3 4 | 5 6
                       [5, 4, 3, 2, 1, 0, -1],
                       [0, 1, 2, 3, 4, 5, 6]], dtype=np.float32)  # ranking 6 5 4 3 2 | 1 0
    labels = np.array([1, 4, 5, 0])
    # top-1 hits: row 0 only -> 1/4; top-5 hits: row 0, row 1 (4 is 5th) -> 2/4.
    assert topk_accuracy(logits, labels, 1) == 0.25
    assert topk_accuracy(logits, labels, 5) == 0.5


def test_summarize_leaves_out_refused_and_unlabelled(tmp_path: Path) -> None:
    files = [tmp_path / name for name in ("a.png", "b.png", "c.png", "d.png")]
    reference = np.zeros((4, 10), np.float32)
    reference[:, 3] = 1.0                                      # reference: class 3 everywhere
    logits = reference.copy()
    logits[1] = np.nan                                         # b.png refused by this variant
    logits[2, 7] = 2.5                                         # c.png: class 7 first, diff 2.5
    labels = np.array([3, 3, 7, -1])                           # d.png unlabelled
    row = summarize("v", logits, {1: "bad file"}, files, tmp_path, labels, (reference, {}))
    assert row["images"] == 3 and row["labelled"] == 2         # a, c scored; b refused; d unlabelled
    assert row["top1_accuracy"] == 1.0                         # a -> 3 right, c -> 7 right
    assert row["refused"] == [{"file": "b.png", "message": "bad file"}]
    assert row["compared"] == 3                                # a, c, d against the reference
    assert row["top1_agreement"] == pytest.approx(2 / 3)
    assert row["max_abs_logit_diff"] == 2.5


def test_wnids_file(repository) -> None:
    lines = wnids_path(repository).read_text().splitlines()
    assert len(lines) == 1000 and len(set(lines)) == 1000 and lines == sorted(lines)
    assert all(re.fullmatch(r"n\d{8}", line) for line in lines)
    assert lines[0] == "n01440764" and lines[281] == "n02123045"  # tench, tabby
    assert load_wnids(wnids_path(repository))["n02123045"] == 281


def test_folder_labels_by_index_and_by_wnid(tmp_path: Path, repository) -> None:
    for name in ("0", "281/sub", "999", "n01440764", "n02123045"):
        (tmp_path / name).mkdir(parents=True)
    files = [tmp_path / p for p in ("0/a.png", "281/sub/b.png", "999/c.png", "n01440764/d.png",
                                    "n02123045/e.png", "loose.png")]
    wnids_file = wnids_path(repository)
    assert folder_labels(tmp_path, files, wnids_file).tolist() == [0, 281, 999, 0, 281, -1]
    wnids = load_wnids(wnids_file)
    assert class_of_folder("1000", wnids) is None and class_of_folder("n99999999", wnids) is None
    (tmp_path / "__pycache__").mkdir()                        # no images in it: not a class folder
    assert folder_labels(tmp_path, files, wnids_file).tolist() == [0, 281, 999, 0, 281, -1]
    assert folder_labels(tmp_path, [tmp_path / "x.png"], wnids_file) is None  # no image in a subfolder: unlabelled


def _one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_bad_class_folder_exits_2(tmp_path: Path, capsys) -> None:
    for name in ("281", "cats"):
        (tmp_path / name).mkdir()
        shutil.copy(sample_photos()[0], tmp_path / name / "x.png")
    assert main([str(tmp_path), "--variants", "default"]) == 2
    assert "cats" in _one_line_error(capsys)


@pytest.mark.parametrize("args, expected", [
    (["{missing}"], "not a folder"),
    (["{empty}"], "no image files"),
    (["{photos}", "--variants", "no_such_variant"], "unknown variant 'no_such_variant'"),
    (["{photos}", "--url", "127.0.0.1:{port}"], "--url 127.0.0.1:"),
    (["{photos}", "--url", "127.0.0.1:{port}", "--protocol", "grpc"], "--url 127.0.0.1:"),
    (["{photos}", "--url", "127.0.0.1:{port}", "--variants", "int8"], "--variants and --url exclude each other"),
])
def test_command_line_errors_exit_2(tmp_path: Path, capsys, args: list[str], expected: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "photos").mkdir()
    shutil.copy(sample_photos()[0], tmp_path / "photos" / "x.png")
    values = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "photos": tmp_path / "photos",
              "port": free_ports(1)[0]}
    assert main([a.format(**values) for a in args]) == 2
    assert expected in _one_line_error(capsys)


@pytest.fixture(scope="module")
def served(tmp_path_factory, repository):
    """A running default server: the `--url` target (start 1 of 2)."""
    if repository.missing_artifacts():
        pytest.fail("model files missing: run `make export` first")
    config = config_on_free_ports(model_repository=repository.root)
    with EmbeddedTritonServer(config, log_path=tmp_path_factory.mktemp("served") / "tritonserver.log",
                              drain_on_exit=False) as server:
        yield server


@pytest.mark.live
def test_end_to_end_default_against_itself(served, repository, tmp_path: Path, capsys) -> None:
    photos = sample_photos()
    with TritonClassifierClient(served.config.http_url, "http") as client:
        top5 = [[p.class_index for p in row] for row in client.classify([p.read_bytes() for p in photos])]
    # Labels chosen from the server's own ranking, so the expected accuracy is known by hand:
    # photo 0 in its top-1 class (hit, index-named folder), photo 1 in its 3rd class (top-5 hit only,
    # wnid-named folder), photos 2.. in a class outside their top 5 (miss).
    wnids = wnids_path(repository).read_text().split()
    folders = [str(top5[0][0]), wnids[top5[1][2]]]
    folders += [str(next(c for c in range(1000) if c not in row)) for row in top5[2:]]
    folder = tmp_path / "labelled"
    for photo, name in zip(photos, folders):
        (folder / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(photo, folder / name / photo.name)
    (folder / folders[0] / "broken.jpg").write_bytes(b"not an image at all")
    report_path = tmp_path / "report.json"

    status = main([str(folder), "--url", served.config.grpc_url, "--protocol", "grpc",
                   "--batch-size", "4", "--json", str(report_path)])
    out, err = capsys.readouterr()
    assert status == 0
    report = json.loads(report_path.read_text())
    assert report["labelled"] is True
    # random weights (the export's seeded init): said once on stderr and in the report; else not at all
    random_weights = repository.weights_meaningful() is False
    assert report["weights_meaningful"] == repository.weights_meaningful()
    assert err.count(RANDOM_WEIGHTS_NOTE) == int(random_weights) and RANDOM_WEIGHTS_NOTE not in out
    assert report.get("note") == (RANDOM_WEIGHTS_NOTE if random_weights else None)
    reference, served_row = report["variants"]
    assert (reference["variant"], served_row["variant"]) == ("default", "served")
    for row in (reference, served_row):
        assert row["images"] == len(photos) and row["labelled"] == len(photos)  # broken.jpg not counted
        assert [r["file"] for r in row["refused"]] == [f"{folders[0]}/broken.jpg"]
        assert row["refused"][0]["message"]                                     # the server's reason
        assert 0.0 <= row["top1_accuracy"] <= 1.0 and 0.0 <= row["top5_accuracy"] <= 1.0
        assert row["top1_accuracy"] == pytest.approx(1 / len(photos))
        assert row["top5_accuracy"] == pytest.approx(2 / len(photos))
    # The same server code and config, the same requests in the same batches: bit-identical logits.
    assert served_row["compared"] == len(photos)
    assert served_row["top1_agreement"] == 1.0 and served_row["top5_overlap"] == 1.0
    assert served_row["max_abs_logit_diff"] == 0.0
    assert "served" in out and f"refused by served: {folders[0]}/broken.jpg" in out
