"""Results: tensors through both ResNet-18 models and photos through the ensemble match eager torch;
concurrent requests are batched by the dynamic batcher."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from resnet18_kit.client import TritonClassifierClient
from resnet18_kit.client.core import protocol_module
from resnet18_kit.observe.metrics import counters_by_model, model_counters
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL, TORCHSCRIPT_MODEL
from resnet18_kit.export.resnet18 import PARITY_ATOL, PARITY_RTOL, eager_logits, parity_batch, torchvision_eval_transform


#: torchvision's ImageNet eval transform, the reference the served pipeline must reproduce.
TORCHVISION_EVAL = torchvision_eval_transform()


@pytest.mark.parametrize("model", [ONNX_MODEL, TORCHSCRIPT_MODEL])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_tensor_inference_matches_eager_torch(client, eager_model, model, batch_size):
    batch = parity_batch(batch_size, seed=batch_size)
    served = client.infer_tensor(batch, model=model)
    assert served.shape == (batch_size, 1000) and served.dtype == np.float32
    np.testing.assert_allclose(served, eager_logits(eager_model, batch), rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_photos_through_the_ensemble_give_eager_top5(client, eager_model):
    photos = sample_photos()
    served = client.classify([p.read_bytes() for p in photos], top_k=5)
    batch = torch.stack([TORCHVISION_EVAL(Image.open(p).convert("RGB")) for p in photos]).numpy()
    expected = eager_logits(eager_model, batch)
    for photo, predictions, logits in zip(photos, served, expected):
        top5 = np.argsort(-logits)[:5]
        assert [p.class_index for p in predictions] == top5.tolist(), photo.name
        np.testing.assert_allclose([p.logit for p in predictions], logits[top5], rtol=1e-3, atol=1e-3)
        probabilities = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose([p.probability for p in predictions], probabilities[top5], rtol=1e-3, atol=1e-6)
        assert all(p.label for p in predictions)


def test_concurrent_single_image_requests_are_batched(triton_server, eager_model):
    url = triton_server.config.url("grpc")
    before = model_counters(triton_server.config.metrics_url, ONNX_MODEL)
    images = parity_batch(32, seed=99)

    def infer_one(i):
        with TritonClassifierClient(url, "grpc") as c:
            return c.infer_tensor(images[i:i + 1])

    with ThreadPoolExecutor(max_workers=16) as pool:
        served = np.concatenate(list(pool.map(infer_one, range(len(images)))))
    after = model_counters(triton_server.config.metrics_url, ONNX_MODEL)
    inferences = after["nv_inference_count"] - before["nv_inference_count"]
    executions = after["nv_inference_exec_count"] - before["nv_inference_exec_count"]
    assert inferences == 32
    assert executions < inferences, f"{executions} executions for {inferences} inferences: no batching"
    np.testing.assert_allclose(served, eager_logits(eager_model, images), rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_a_read_of_named_metrics_gives_what_the_whole_read_gives_for_them(triton_server):
    """counters_by_model(names=...) hands only those families to the parser: a gauge and a counter read so
    equal the same metrics of a whole read (the server idle between the two reads), and nothing else comes."""
    url, names = triton_server.config.metrics_url, ("nv_inference_pending_request_count", "nv_inference_count")
    whole = counters_by_model(url)
    named = counters_by_model(url, names=names)
    assert ONNX_MODEL in named and all(set(counters) == set(names) for counters in named.values())
    assert named == {model: {name: counters[name] for name in names} for model, counters in whole.items()}


@pytest.mark.parametrize("model", [ENSEMBLE_MODEL, ONNX_MODEL, TORCHSCRIPT_MODEL])
def test_probabilities_output_is_the_softmax_of_the_logits(client, model):
    """Both outputs in full from one request: each probability row sums to 1 and is softmax(logits)."""
    module = protocol_module(client.protocol)
    if model == ENSEMBLE_MODEL:
        images = np.array([p.read_bytes() for p in sample_photos()[:3]], dtype=np.object_).reshape(-1, 1)
        request = module.InferInput("image", list(images.shape), "BYTES")
        request.set_data_from_numpy(images)
    else:
        request = module.InferInput("input", [3, 3, 224, 224], "UINT8")
        request.set_data_from_numpy(parity_batch(3, seed=5))
    outputs = [module.InferRequestedOutput(name) for name in ("logits", "probabilities")]
    result = client.raw.infer(model, [request], outputs=outputs)
    logits, probabilities = result.as_numpy("logits"), result.as_numpy("probabilities")
    assert probabilities.shape == logits.shape == (3, 1000) and probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(probabilities, shifted / shifted.sum(axis=1, keepdims=True), rtol=1e-3, atol=1e-7)
