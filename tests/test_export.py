"""The exported files: ONNX signature, TorchScript, provenance, labels, parity check (no server)."""
import json
import shutil
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torchvision

from resnet18_kit.contract import PIXEL_MEAN, PIXEL_STD, TORCHSCRIPT_MODEL
from resnet18_kit.export import ensure_exported, export_command, export_needed
from resnet18_kit.export import resnet18 as r18
from resnet18_kit.repository import ModelRepository


def test_onnx_signature_has_dynamic_batch_and_named_tensors(repository):
    model = onnx.load(str(repository.onnx_path))
    onnx.checker.check_model(model)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    (inp,), outputs = model.graph.input, model.graph.output
    assert inp.name == "input" and [out.name for out in outputs] == ["logits", "probabilities"]
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.UINT8  # pixels, normalized in the graph
    in_dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert isinstance(in_dims[0], str) and in_dims[1:] == [3, 224, 224]
    for out in outputs:
        out_dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
        assert isinstance(out_dims[0], str) and out_dims[1:] == [1000], out.name
        assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT


@pytest.mark.parametrize("batch_size", [1, 3])
def test_exports_run_at_any_batch_size(batch_size, repository):
    batch = r18.parity_batch(batch_size)
    session = ort.InferenceSession(str(repository.onnx_path), providers=["CPUExecutionProvider"])
    logits, probabilities = session.run(None, {"input": batch})
    assert logits.shape == probabilities.shape == (batch_size, 1000)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert (probabilities.argmax(axis=1) == logits.argmax(axis=1)).all()
    scripted = torch.jit.load(str(repository.torchscript_path))
    assert [tuple(t.shape) for t in scripted(torch.from_numpy(batch))] == [(batch_size, 1000)] * 2


def test_provenance_records_source_versions_and_hashes(repository):
    records = [json.loads(p.read_text()) for p in repository.provenance_paths]
    assert records[0] == records[1]
    record = records[0]
    assert record["weights"].split(":")[0] in ("torchvision", "file", "random")
    assert record["weights_meaningful"] == (not record["weights"].startswith("random:"))
    if not record["weights_meaningful"]:  # the reason is recorded, so the demo can say it first
        assert record["weights_unavailable_reason"]
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["torchvision"] == torchvision.__version__
    for relative, digest in record["sha256"].items():
        assert r18.sha256(repository.root / relative) == digest, relative
    assert set(record["parity"]["max_abs_diff_vs_eager"]) == {"onnx", "torchscript"}


def test_labels_are_the_imagenet_category_names(repository):
    labels = repository.labels_path.read_text().splitlines()
    assert len(labels) == 1000
    assert labels == r18.IMAGENET_WEIGHTS.meta["categories"]
    assert labels[281] == "tabby" and labels[0] == "tench"


def test_parity_check_fails_loudly_on_a_different_model(eager_model, repository):
    other = r18.random_model(seed=12345)
    with pytest.raises(AssertionError, match="differs from eager torch"):
        r18.check_parity(other, repository.onnx_path, repository.torchscript_path)
    diffs = r18.check_parity(eager_model, repository.onnx_path, repository.torchscript_path)
    assert max(diffs.values()) < r18.PARITY_ATOL


def test_random_init_is_reproducible_from_its_seed():
    a, b = r18.random_model(7), r18.random_model(7)
    batch = torch.from_numpy(r18.normalize(r18.parity_batch(2)))
    with torch.inference_mode():
        np.testing.assert_array_equal(a(batch).numpy(), b(batch).numpy())


def test_exports_made_before_the_probabilities_output_are_re_exported(tmp_path, repository):
    assert repository.outdated_reason() is None  # this checkout's exports carry both outputs
    assert r18.OUTPUT_NAMES == repository.runtimes().OUTPUT_NAMES  # what the export writes is what is served
    record = repository.provenance()
    del record["outputs"]  # as written by an export of the logits alone
    old = ModelRepository(tmp_path)
    old.provenance_paths[0].parent.mkdir(parents=True)
    old.provenance_paths[0].write_text(json.dumps(record))
    shutil.copy(repository.root / "resnet18_onnx" / "1" / "runtimes.py", old.provenance_paths[0].parent)
    assert old.outdated_reason() == ("the exported files have outputs ['logits'], this code serves "
                                     "['logits', 'probabilities']")
    assert export_needed(old) is None  # not a repository of this kit's models: nothing to export into it
    record["outputs"] = list(r18.OUTPUT_NAMES)
    del record["input_dtype"]  # as written by an export whose files took normalized FP32
    old.provenance_paths[0].write_text(json.dumps(record))
    assert old.outdated_reason() == "the exported files take float32 input, this code serves uint8 pixels"


def test_ensure_exported_exports_into_the_repository_it_is_given(tmp_path, repository, monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: calls.append(command))
    ensure_exported(repository)  # complete and current: nothing to do
    assert calls == []
    other = ModelRepository(tmp_path / "models")
    shutil.copytree(repository.root, other.root, ignore=shutil.ignore_patterns(*(p.name for p in repository.generated)))
    assert export_needed(other) == f"{len(other.generated)} model files missing"
    ensure_exported(other)
    assert calls == [export_command(other)]
    assert calls[0][1:] == ["-m", "resnet18_kit", "--model-repository", str(other.root), "export"]
    echo_only = ModelRepository(tmp_path / "echo")  # another repository (test or reliability models): left as it is
    (echo_only.root / "reliability_echo").mkdir(parents=True)
    (echo_only.root / "reliability_echo" / "config.pbtxt").write_text('name: "reliability_echo"')
    ensure_exported(echo_only)
    assert len(calls) == 1


def test_a_repository_without_a_model_needs_none_of_its_files(tmp_path, repository):
    """A copy without the TorchScript model's folder (what a server of the ensemble alone needs) lacks no
    model.pt, so serve starts it as it is; remove the ONNX file too and that one is missing."""
    subset = ModelRepository(tmp_path / "models")
    shutil.copytree(repository.root, subset.root, ignore=lambda folder, names: (
        [TORCHSCRIPT_MODEL] if folder == str(repository.root) else []))
    assert subset.torchscript_path not in subset.generated and repository.torchscript_path in repository.generated
    assert export_needed(subset) is None and subset.missing_artifacts() == []
    subset.onnx_path.unlink()
    assert subset.missing_artifacts() == [subset.onnx_path]


def test_the_export_records_whether_the_weights_are_meaningful_in_the_ensemble_config(repository, tmp_path):
    """The ensemble's `weights_meaningful` parameter (what clients read from the server) follows the export:
    rewritten in place, the rest of the config untouched; the committed value is "false"."""
    import shutil

    from resnet18_kit.export.__main__ import record_weights_in_ensemble_config
    from resnet18_kit.observe.model_config import ModelConfigView
    from resnet18_kit.repository import ModelRepository

    assert ModelConfigView.for_variant(repository, "resnet18").parameters["weights_meaningful"] == "false"
    copy = ModelRepository(shutil.copytree(repository.root / "resnet18", tmp_path / "resnet18").parent)
    before = copy.config_path("resnet18").read_text()
    record_weights_in_ensemble_config(copy, True)
    after = copy.config_path("resnet18").read_text()
    assert ModelConfigView.for_variant(copy, "resnet18").parameters["weights_meaningful"] == "true"
    assert after.replace('"true"', '"false"') == before


def test_exported_graphs_normalize_the_pixels_as_torchvision_does(repository):
    """Both exports take UINT8 pixels and give the eager network's logits on torchvision's normalization of
    them (ToTensor + Normalize), which the head of each graph now does."""
    import onnxruntime as ort
    from torchvision.transforms import functional

    model = r18.model_from_spec(repository.provenance()["weights"])
    pixels = r18.parity_batch(2, seed=3)
    expected_input = torch.stack([functional.normalize(torch.from_numpy(row).float() / 255, mean=list(PIXEL_MEAN),
                                                       std=list(PIXEL_STD)) for row in pixels])
    with torch.inference_mode():
        expected = model(expected_input).numpy()
        scripted = torch.jit.load(str(repository.torchscript_path)).eval()(torch.from_numpy(pixels))[0].numpy()
    session = ort.InferenceSession(str(repository.onnx_path), providers=["CPUExecutionProvider"])
    from_onnx = session.run(["logits"], {"input": pixels})[0]
    for logits in (scripted, from_onnx):
        np.testing.assert_allclose(logits, expected, rtol=r18.PARITY_RTOL, atol=r18.PARITY_ATOL)
