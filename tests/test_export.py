"""The exported files: ONNX signature, TorchScript, provenance, labels, parity check (no server)."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torchvision

from resnet18_kit import contract
from resnet18_kit.export import resnet18 as r18


def test_onnx_signature_has_dynamic_batch_and_named_tensors():
    model = onnx.load(str(contract.ONNX_PATH))
    onnx.checker.check_model(model)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    (inp,), outputs = model.graph.input, model.graph.output
    assert inp.name == "input" and [out.name for out in outputs] == ["logits", "probabilities"]
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    in_dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert isinstance(in_dims[0], str) and in_dims[1:] == [3, 224, 224]
    for out in outputs:
        out_dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
        assert isinstance(out_dims[0], str) and out_dims[1:] == [1000], out.name
        assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT


@pytest.mark.parametrize("batch_size", [1, 3])
def test_exports_run_at_any_batch_size(batch_size):
    batch = r18.parity_batch(batch_size)
    session = ort.InferenceSession(str(contract.ONNX_PATH), providers=["CPUExecutionProvider"])
    logits, probabilities = session.run(None, {"input": batch})
    assert logits.shape == probabilities.shape == (batch_size, 1000)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert (probabilities.argmax(axis=1) == logits.argmax(axis=1)).all()
    scripted = torch.jit.load(str(contract.TORCHSCRIPT_PATH))
    assert [tuple(t.shape) for t in scripted(torch.from_numpy(batch))] == [(batch_size, 1000)] * 2


def test_provenance_records_source_versions_and_hashes():
    records = [json.loads(p.read_text()) for p in contract.PROVENANCE_PATHS]
    assert records[0] == records[1]
    record = records[0]
    assert record["weights"].split(":")[0] in ("torchvision", "file", "random")
    assert record["weights_meaningful"] == (not record["weights"].startswith("random:"))
    if not record["weights_meaningful"]:  # the reason is recorded, so the demo can say it first
        assert record["weights_unavailable_reason"]
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["torchvision"] == torchvision.__version__
    for relative, digest in record["sha256"].items():
        assert r18.sha256(contract.MODEL_REPOSITORY / relative) == digest, relative
    assert set(record["parity"]["max_abs_diff_vs_eager"]) == {"onnx", "torchscript"}


def test_labels_are_the_imagenet_category_names():
    labels = contract.LABELS_PATH.read_text().splitlines()
    assert len(labels) == 1000
    assert labels == r18.IMAGENET_WEIGHTS.meta["categories"]
    assert labels[281] == "tabby" and labels[0] == "tench"


def test_parity_check_fails_loudly_on_a_different_model(eager_model):
    other = r18.random_model(seed=12345)
    with pytest.raises(AssertionError, match="differs from eager torch"):
        r18.check_parity(other, contract.ONNX_PATH, contract.TORCHSCRIPT_PATH)
    diffs = r18.check_parity(eager_model, contract.ONNX_PATH, contract.TORCHSCRIPT_PATH)
    assert max(diffs.values()) < r18.PARITY_ATOL


def test_random_init_is_reproducible_from_its_seed():
    a, b = r18.random_model(7), r18.random_model(7)
    batch = torch.from_numpy(r18.parity_batch(2))
    with torch.inference_mode():
        np.testing.assert_array_equal(a(batch).numpy(), b(batch).numpy())


def test_exports_made_before_the_probabilities_output_are_re_exported(tmp_path, monkeypatch):
    assert contract.outdated_reason() is None  # this checkout's exports carry both outputs
    record = json.loads(contract.PROVENANCE_PATHS[0].read_text())
    del record["outputs"]  # as written by an export of the logits alone
    old = tmp_path / "provenance.json"
    old.write_text(json.dumps(record))
    monkeypatch.setattr(contract, "PROVENANCE_PATHS", (old,))
    assert contract.outdated_reason() == ("the exported files have outputs ['logits'], this code serves "
                                 "['logits', 'probabilities']")
