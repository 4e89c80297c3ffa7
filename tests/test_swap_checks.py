"""What `resnet18-kit swap` refuses before anything is sent (model_control), without a server: the
configs an ensemble could not use (Triton 2.51 would load them and unload the ensemble), unknown variants and
unreadable files; and what each variant gives every model."""
from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2

from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.observe.model_config import read_config
from resnet18_kit.model_control import SwapError, SwapTarget, check_fit, describe, file_target, variant_targets


@pytest.fixture
def served(repository) -> dict:
    """The configs a default server runs, as read from the files (names filled in)."""
    configs = {}
    for model in (PREPROCESS_MODEL, ONNX_MODEL, ENSEMBLE_MODEL):
        config = read_config(repository.config_path(model))
        config.name = config.name or model
        configs[model] = config
    return configs


def changed(served: dict, change) -> SwapTarget:
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(served[ONNX_MODEL])
    change(config)
    return SwapTarget(ONNX_MODEL, config, "edited.pbtxt")


def test_every_shipped_variant_fits_the_ensemble(repository, served):
    for variant in repository.variant_names():
        for target in variant_targets(repository, variant):
            check_fit(target, served)


@pytest.mark.parametrize("change, named", [
    (lambda c: setattr(c, "max_batch_size", 8), "max_batch_size 8, but ensemble 'resnet18'"),
    (lambda c: setattr(c.output[0], "name", "scores"), "output 'logits', which this config lacks"),
    (lambda c: setattr(c.input[0], "name", "pixels"), "input 'input', which this config lacks"),
    (lambda c: setattr(c.input[0], "data_type", model_config_pb2.TYPE_FP16), "TYPE_UINT8 [3, 224, 224]; this config makes it TYPE_FP16"),
    (lambda c: c.input[0].dims.__setitem__(1, 256), "this config makes it TYPE_UINT8 [3, 256, 224]"),
])
def test_a_config_the_ensemble_cannot_use_is_refused_naming_why(served, change, named):
    with pytest.raises(SwapError) as raised:
        check_fit(changed(served, change), served)
    assert named in str(raised.value) and raised.value.exit_status == 2


def test_a_model_no_ensemble_uses_is_not_checked_against_one(served):
    config = model_config_pb2.ModelConfig(name="standalone", max_batch_size=1)
    check_fit(SwapTarget("standalone", config, "standalone.pbtxt"), served)


def test_variants_give_each_model_its_file_or_config_pbtxt(repository):
    targets = {t.model: t for t in variant_targets(repository, "int8")}
    assert targets[ONNX_MODEL].source.endswith("configs/int8.pbtxt")
    assert targets[PREPROCESS_MODEL].source.endswith("preprocess/config.pbtxt")
    assert "model.int8.onnx" in describe(targets[ONNX_MODEL].config)
    assert [t.model for t in variant_targets(repository, "default", [ONNX_MODEL])] == [ONNX_MODEL]
    with pytest.raises(SwapError, match="no model in .* has configs/nope.pbtxt; known names: default"):
        variant_targets(repository, "nope")
    with pytest.raises(SwapError, match="nosuch: no such model"):
        variant_targets(repository, "default", ["nosuch"])


def test_a_config_file_must_parse_and_name_its_model(tmp_path, repository):
    broken = tmp_path / "broken.pbtxt"
    broken.write_text("max_batch_size: sixteen")
    with pytest.raises(SwapError, match="not a model config"):
        file_target(broken)
    nameless = tmp_path / "nameless.pbtxt"
    nameless.write_text("max_batch_size: 16")
    with pytest.raises(SwapError, match="has no `name`; give the model with --model"):
        file_target(nameless)
    assert file_target(nameless, ONNX_MODEL).model == ONNX_MODEL
    with pytest.raises(SwapError, match="is for model 'resnet18_onnx', not 'preprocess'"):
        file_target(repository.config_path(ONNX_MODEL), PREPROCESS_MODEL)
    with pytest.raises(SwapError, match="No such file"):
        file_target(tmp_path / "absent.pbtxt")
