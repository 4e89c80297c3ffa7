"""Bad input gets HTTP 400 / gRPC INVALID_ARGUMENT with a message naming the problem, fails only its own
request, and the server stays ready and answers the next request correctly."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from resnet18_kit.client import TritonClassifierClient
from resnet18_kit.client.core import protocol_module
from resnet18_kit.client.errors import InvalidInputError, from_triton
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import ONNX_MODEL, TORCHSCRIPT_MODEL
from resnet18_kit.export.resnet18 import PARITY_ATOL, PARITY_RTOL, eager_logits, parity_batch


BAD_IMAGES = [
    ("empty", lambda: b"", "empty image"),
    ("not-an-image", lambda: b"plain text, not an image\n" * 10, "not an image"),
    ("truncated-jpeg", lambda: sample_photos()[3].read_bytes()[:3000], "truncated"),
]


def assert_still_serving(client, eager_model) -> None:
    """Server ready and a good tensor request gets the eager-torch answer."""
    assert client.is_server_ready()
    batch = parity_batch(2, seed=5)
    np.testing.assert_allclose(client.infer_tensor(batch), eager_logits(eager_model, batch),
                               rtol=PARITY_RTOL, atol=PARITY_ATOL)


@pytest.mark.parametrize("name,make_data,message", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_image_is_invalid_argument_naming_the_problem(client, eager_model, name, make_data, message,
                                                          assert_invalid_argument):
    with pytest.raises(InvalidInputError) as info:
        client.classify([make_data()])
    assert_invalid_argument(info.value, client.protocol)
    assert message in info.value.message and "input 'image'" in info.value.message
    assert_still_serving(client, eager_model)


def raw_tensor_request(client, model: str, array: np.ndarray, datatype: str):
    """Send `array` as it is (no client-side checks or casts); tritonclient's error as a typed one."""
    module = protocol_module(client.protocol)
    request = module.InferInput("input", list(array.shape), datatype)
    request.set_data_from_numpy(array)
    try:
        return client.raw.infer(model, [request], outputs=[module.InferRequestedOutput("logits")])
    except InferenceServerException as exc:
        raise from_triton(exc) from None


BAD_TENSORS = [
    ("wrong-shape", np.zeros((1, 3, 100, 100), np.uint8), "UINT8", "unexpected shape"),
    ("missing-batch-dim", np.zeros((3, 224, 224), np.uint8), "UINT8", "unexpected shape"),
    ("wrong-dtype", np.zeros((1, 3, 224, 224), np.float32), "FP32", "data-type"),  # normalized FP32: refused
    ("batch-over-max", np.zeros((17, 3, 224, 224), np.uint8), "UINT8", "batch-size must be <= 16"),
]


@pytest.mark.parametrize("model", [ONNX_MODEL, TORCHSCRIPT_MODEL])
@pytest.mark.parametrize("name,array,datatype,message", BAD_TENSORS, ids=[b[0] for b in BAD_TENSORS])
def test_bad_tensor_is_invalid_argument_naming_the_problem(client, eager_model, model, name, array,
                                                           datatype, message, assert_invalid_argument):
    with pytest.raises(InvalidInputError) as info:
        raw_tensor_request(client, model, array, datatype)
    assert_invalid_argument(info.value, client.protocol)
    assert message in info.value.message, info.value.message
    assert_still_serving(client, eager_model)


def test_corrupt_image_fails_only_its_own_request_in_a_batch(triton_server, protocol, assert_invalid_argument):
    """One corrupt image among concurrent good ones: the dynamic batcher puts them in the same
    execute() calls, and only the corrupt request fails."""
    url = triton_server.config.url(protocol)
    good = [p.read_bytes() for p in sample_photos()]
    payloads = good + [b"\xff\xd8\xff corrupt"] + good  # the bad one in the middle of the burst
    with TritonClassifierClient(url, protocol) as reference:
        expected = reference.classify(good[:1], top_k=3)[0]

    def classify_one(data):
        with TritonClassifierClient(url, protocol) as c:
            try:
                return c.classify([data], top_k=3)[0]
            except InvalidInputError as exc:
                return exc

    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        results = list(pool.map(classify_one, payloads))
    bad_index = len(good)
    assert_invalid_argument(results[bad_index], protocol)
    failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
    assert failed == [bad_index], [results[i] for i in failed]
    for result in (results[0], results[bad_index + 1]):  # the same photo before and after the bad one
        assert [p.class_index for p in result] == [p.class_index for p in expected]
