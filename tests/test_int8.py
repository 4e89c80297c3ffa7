"""The INT8 model: calibration and agreement recorded in provenance, the runtimes that serve it, and the
agreement measure itself. With this repository's random-init weights the logits are nearly flat, so a
small change can flip the top-1 class: the tests bound the top-5 overlap and check every figure is
recorded; only a user with real weights can check top-1 accuracy (README "Accuracy and agreement")."""
import json

import numpy as np
import pytest

from resnet18_kit.client import samples
from resnet18_kit.client.samples import SAMPLE_PHOTO_NAMES, sample_photos
from resnet18_kit import cli
from resnet18_kit.contract import ONNX_MODEL
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.export import resnet18 as r18
from resnet18_kit.export.quantize import agreement, calibration_batch


@pytest.fixture(scope="module")
def runtimes(repository):
    """The served runtime loaders: resnet18_onnx/1/runtimes.py of the model repository."""
    return repository.runtimes()


@pytest.fixture
def export_main(repository):
    """`resnet18-kit --model-repository <the repository> export <argv>`: its exit status."""
    return lambda argv: cli.main(["--model-repository", str(repository.root), "export", *argv])


def softmax(logits: np.ndarray) -> np.ndarray:
    """Reference softmax over axis 1, in float64."""
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def test_agreement_on_crafted_logits():
    reference = np.array([[5.0, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5]])
    same_order = reference * 2.0  # same ranking, logits differ by up to 5
    result = agreement(reference, same_order)
    assert (result.top1_agreement, result.top5_overlap, result.max_abs_logit_diff, result.inputs) == (1.0, 1.0, 5.0, 2)
    swapped = reference.copy()
    swapped[0, [0, 5]] = swapped[0, [5, 0]]  # row 0: top-1 becomes class 5, class 0 leaves the top 5
    result = agreement(reference, swapped)
    assert result.top1_agreement == 0.5 and result.top5_overlap == pytest.approx((4 / 5 + 1) / 2)
    with pytest.raises(ValueError, match="shapes"):
        agreement(reference, reference[:1])


def test_provenance_records_the_calibration_set_and_the_agreement(repository):
    record = json.loads(repository.provenance_paths[0].read_text())["int8"]
    assert record["quantization"]["format"] == "QDQ" and "per channel" in record["quantization"]["weights"]
    calibration = record["calibration"]
    assert calibration["source"] == "sample photos" and sorted(calibration["files"]) == sorted(SAMPLE_PHOTO_NAMES)
    assert calibration["inputs"] == 2 * len(SAMPLE_PHOTO_NAMES)
    for figures in record["agreement_vs_fp32"].values():
        assert 0 <= figures["top1_agreement"] <= 1 and 0 <= figures["top5_overlap"] <= 1
        assert figures["max_abs_logit_diff"] > 0  # INT8 is not FP32: a zero would mean the same model
    digests = json.loads(repository.provenance_paths[0].read_text())["sha256"]
    assert digests["resnet18_onnx/1/model.int8.onnx"] == r18.sha256(repository.onnx_int8_path)


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_int8_model_keeps_the_fp32_top5_on_real_photos(runtime, repository, runtimes):
    batch = calibration_batch(repository, sample_photos())
    fp32, _ = runtimes.load(runtimes.RuntimeSpec(repository.onnx_path))(batch)
    int8, probabilities = runtimes.load(runtimes.RuntimeSpec(repository.onnx_int8_path, runtime, threads=1))(batch)
    result = agreement(fp32, int8)
    assert result.top5_overlap >= 0.8, result  # measured 1.0 on these inputs with both runtimes
    assert result.max_abs_logit_diff < 0.5 * np.abs(fp32).max(), result
    # The softmax is left in FP32: the INT8 model's probabilities are the softmax of its own logits.
    np.testing.assert_allclose(probabilities, softmax(int8), rtol=1e-4, atol=1e-7)


def test_every_runtime_of_the_fp32_network_agrees_with_onnxruntime(repository, runtimes):
    batch = r18.parity_batch(2)
    logits, probabilities = runtimes.load(runtimes.RuntimeSpec(repository.onnx_path))(batch)
    np.testing.assert_allclose(probabilities, softmax(logits), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    for spec in (runtimes.RuntimeSpec(repository.onnx_path, "openvino", threads=1),
                 runtimes.RuntimeSpec(repository.torchscript_path, "torchscript", threads=1)):
        other_logits, other_probabilities = runtimes.load(spec)(batch)
        np.testing.assert_allclose(other_logits, logits, atol=1e-3, err_msg=spec.runtime)
        np.testing.assert_allclose(other_probabilities, probabilities, atol=1e-5, err_msg=spec.runtime)


def test_runtime_spec_from_config_parameters(repository, runtimes):
    spec = runtimes.RuntimeSpec.from_parameters(
        {"model_filename": "model.int8.onnx", "runtime": "openvino", "intra_op_threads": "1",
         "allow_spinning": "0"}, repository.onnx_path.parent)
    assert (spec.path, spec.runtime, spec.threads, spec.allow_spinning) == (repository.onnx_int8_path, "openvino", 1, False)
    assert runtimes.RuntimeSpec.from_parameters({"model_filename": "model.pt"}, repository.onnx_path.parent).runtime == \
        "torchscript"
    with pytest.raises(ValueError, match="unknown runtime 'tensorrt'"):
        runtimes.RuntimeSpec.from_parameters({"model_filename": "model.onnx", "runtime": "tensorrt"}, ".")
    with pytest.raises(ValueError, match="unknown precision"):
        runtimes.RuntimeSpec.from_parameters({"model_filename": "model.onnx", "precision": "fp8"}, ".")
    with pytest.raises(ValueError, match="intra_op_threads_batched is read by the openvino runtime only"):
        runtimes.RuntimeSpec.from_parameters({"model_filename": "model.onnx", "intra_op_threads_batched": "1"}, ".")


def test_the_int8_config_runs_a_lone_image_on_every_core_and_a_batch_on_one_thread(repository, runtimes):
    """configs/int8.pbtxt: a batch of one on both threads, a larger batch on one (runtimes._openvino); the
    two compiled files give the same logits."""
    params = ModelConfigView.for_variant(repository, ONNX_MODEL, "int8").parameters
    run = runtimes.load(runtimes.RuntimeSpec.from_parameters(params, repository.onnx_path.parent))
    if runtimes.usable_cores() == 1:  # one core: nothing to choose between, one compiled file
        assert not isinstance(run, runtimes.BatchedThreads)
        return
    assert (run.threads, run.batched_threads) == (runtimes.usable_cores(), 1)
    assert [runner.compiled.get_property("INFERENCE_NUM_THREADS") for runner in (run.lone, run.batched)] == \
        [runtimes.usable_cores(), 1]
    batch = r18.parity_batch(3)
    batched_logits, _ = run(batch)
    lone_logits = np.concatenate([run(batch[i:i + 1])[0] for i in range(len(batch))])
    np.testing.assert_allclose(batched_logits, lone_logits, atol=1e-3)


def test_export_refuses_a_missing_or_empty_calibration_folder_in_one_line(tmp_path, capsys, export_main):
    assert export_main(["--calibration-dir", str(tmp_path / "missing")]) == 2
    assert export_main(["--calibration-dir", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"export: --calibration-dir: not a folder: {tmp_path / 'missing'}",
                     f"export: --calibration-dir: no image files ({', '.join(sorted(samples.IMAGE_SUFFIXES))}) "
                     f"under {tmp_path}"]


def test_export_refuses_a_corrupt_calibration_image_before_writing_anything(tmp_path, capsys, repository, export_main):
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    written = {p: p.stat().st_mtime_ns for p in repository.generated}
    assert export_main(["--calibration-dir", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"export: --calibration-dir: {tmp_path / 'broken.jpg'}: not an image")
    assert {p: p.stat().st_mtime_ns for p in repository.generated} == written  # nothing was rewritten


def test_lone_client_summary_counts_stalls():
    from resnet18_kit.tools.bench.lone_client import latency_summary_ms

    summary = latency_summary_ms(np.array([10.0] * 98 + [250.0, 530.0]))
    assert summary["requests"] == 100 and summary["over_200_ms"] == 2 and summary["max_ms"] == 530.0
    assert summary["p50_ms"] == 10.0 and summary["p99_ms"] > 250.0


def test_export_refuses_missing_or_foreign_weights_in_one_line(tmp_path, capsys, export_main):
    assert export_main(["--weights", str(tmp_path / "missing.pth")]) == 2
    foreign = tmp_path / "foreign.pth"
    import torch
    torch.save({"not_a_layer": torch.zeros(1)}, foreign)
    assert export_main(["--weights", str(foreign)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"export: --weights: no such file: {tmp_path / 'missing.pth'}"
    assert lines[1].startswith(f"export: --weights {foreign}: not a ResNet-18 state dict: RuntimeError")
    assert len(lines) == 2
