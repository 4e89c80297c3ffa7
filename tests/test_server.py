"""Server and model health, metadata and configuration of every model, over HTTP and gRPC."""
import pytest

from export.artifacts import ALL_MODELS, ENSEMBLE_MODEL


def test_server_live_and_ready(client):
    assert client.raw.is_server_live()
    assert client.is_server_ready()


@pytest.mark.parametrize("model", ALL_MODELS)
def test_model_ready_with_metadata_and_config(client, model):
    assert client.is_model_ready(model)
    metadata = client.model_metadata(model)
    assert metadata["name"] == model and metadata["versions"] == ["1"]
    config = client.model_config(model)
    max_batch = config.get("max_batch_size", config.get("maxBatchSize"))
    assert int(max_batch) == 16
    inputs = {t["name"]: t for t in metadata["inputs"]}
    outputs = {t["name"]: t for t in metadata["outputs"]}
    if model == "preprocess" or model == ENSEMBLE_MODEL:
        assert inputs["image"]["datatype"] == "BYTES" and inputs["image"]["shape"] == [-1, 1]
    else:
        assert inputs["input"]["datatype"] == "FP32" and inputs["input"]["shape"] == [-1, 3, 224, 224]
    if model == "preprocess":
        assert outputs["pixels"]["datatype"] == "FP32" and outputs["pixels"]["shape"] == [-1, 3, 224, 224]
    else:
        assert outputs["logits"]["datatype"] == "FP32" and outputs["logits"]["shape"] == [-1, 1000]
    if model != ENSEMBLE_MODEL:
        batcher = config.get("dynamic_batching", config.get("dynamicBatching"))
        preferred = batcher.get("preferred_batch_size", batcher.get("preferredBatchSize"))
        # preprocess hands each request to the next free instance (its config.pbtxt says why)
        assert [int(b) for b in preferred] == ([1] if model == "preprocess" else [8, 16])


def test_unknown_model_is_an_error_not_a_crash(client):
    assert not client.is_model_ready("no_such_model")
    assert client.is_server_ready()
