"""Bad input: a fixed corpus of bad images, odd but valid images, bad tensors and names that are not
UTF-8, over HTTP or gRPC; each bad request must be refused as invalid, with a message naming the
problem, and each valid one answered."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from tritonclient.utils import InferenceServerException

from resnet18_kit.client.core import protocol_module
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL
from resnet18_kit.tools.load.outcomes import ANSWERED, INVALID, classify_error
from resnet18_kit.observe.process_memory import MemorySampler
from resnet18_kit.tools.reliability import ECHO_MODEL
from resnet18_kit.tools.reliability.senders import grpc_raw_infer, http_raw
from resnet18_kit.server.config import MiB, ServerConfig


def encode(image, fmt: str, **options) -> bytes:
    """A PIL `image` encoded as `fmt` ("PNG", "JPEG", ...) with Pillow's save `options`."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height with almost no pixel data: a decompression bomb."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


def odd_images() -> dict[str, bytes]:
    """Valid images in every awkward mode and container, by name; each must be answered, not refused."""
    from PIL import Image

    from resnet18_kit.client.samples import sample_photos

    rgb = Image.open(sample_photos()[0]).convert("RGB")
    gray = rgb.convert("L")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    frames = [rgb.quantize(64), rgb.rotate(180).quantize(64)]
    animated = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return {
        "grayscale-png": encode(gray, "PNG"),
        "rgba-png": encode(rgb.convert("RGBA"), "PNG"),
        "palette-png": encode(rgb.quantize(64), "PNG"),
        "cmyk-jpeg": encode(rgb.convert("CMYK"), "JPEG", quality=90),
        "16bit-png": encode(Image.fromarray(np.asarray(gray, dtype=np.uint16) * 257), "PNG"),
        "animated-gif": animated,
        "exif-rotated-jpeg": encode(rgb, "JPEG", quality=90, exif=exif),
        "tiny-1x1-png": encode(rgb.resize((1, 1)), "PNG"),
    }


@dataclass(frozen=True)
class BadImage:
    name: str
    data: bytes
    message: str  # a fragment the error message must contain


def bad_images(max_image_bytes: int = 20_000_000) -> list[BadImage]:
    """Encoded images the `resnet18` ensemble must refuse with 400 / INVALID_ARGUMENT; max_image_bytes:
    the preprocess config's limit (bytes), exceeded by one case."""
    from PIL import Image

    from resnet18_kit.client.samples import sample_photos

    photo = sample_photos()[0].read_bytes()
    rng = np.random.default_rng(7)
    return [
        BadImage("zero-byte", b"", "empty image"),
        BadImage("truncated-png", photo[: len(photo) * 6 // 10], "truncated"),
        BadImage("random-bytes", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not an image"),
        BadImage("bomb-png-50000x50000", png_claiming(50_000, 50_000), "too large"),
        BadImage("over-max-image-bytes", b"\xff\xd8\xff\xe0" + bytes(max_image_bytes), "too large"),
        BadImage("aspect-ratio-200:1", encode(Image.new("RGB", (2000, 10)), "PNG"), "aspect ratio"),
        BadImage("corrupt-ppm-header", b"P6\n2t5 80\n255\n" + bytes(64), "corrupt or truncated"),
    ]


@dataclass(frozen=True)
class BadTensor:
    """A tensor request tritonclient can build: `array` sent as `datatype`, then declared as `shape`."""

    name: str
    model: str
    input_name: str
    array: np.ndarray
    datatype: str
    message: str
    shape: tuple[int, ...] | None = None  # declared shape, when it differs from the array's


def bad_tensors() -> list[BadTensor]:
    """Tensor requests resnet18_onnx or the ensemble must refuse with 400 / INVALID_ARGUMENT."""
    images = np.array([[b"x"]] * 17, dtype=np.object_)
    return [
        BadTensor("wrong-dtype", ONNX_MODEL, "input", np.zeros((1, 3, 224, 224), np.float64), "FP64", "data-type"),
        BadTensor("wrong-shape", ONNX_MODEL, "input", np.zeros((1, 3, 100, 100), np.uint8), "UINT8", "unexpected shape"),
        BadTensor("too-many-elements", ONNX_MODEL, "input", np.zeros((2, 3, 224, 224), np.uint8), "UINT8",
                  "byte size mismatch", shape=(1, 3, 224, 224)),
        BadTensor("batch-over-max", ENSEMBLE_MODEL, "image", images, "BYTES", "batch-size must be <= 16"),
        BadTensor("image-as-fp32", ENSEMBLE_MODEL, "image", np.zeros((1, 1), np.float32), "FP32", "data-type"),
        BadTensor("unknown-input-name", ONNX_MODEL, "inputt", np.zeros((1, 3, 224, 224), np.uint8), "UINT8",
                  "unexpected inference input"),
    ]


def send_image(client, module, model: str, data: bytes, output: str = "logits"):
    """Send encoded image `data` as input "image" (BYTES [1, 1]) to `model` on the synchronous `client`
    of tritonclient's `module`, asking for `output`; the InferResult. Raises InferenceServerException."""
    request = module.InferInput("image", [1, 1], "BYTES")
    request.set_data_from_numpy(np.array([[data]], dtype=np.object_))
    return client.infer(model, [request], outputs=[module.InferRequestedOutput(output)])


def send_tensor(client, module, case: BadTensor):
    """Send `case`'s tensor as it declares it; the InferResult. Raises InferenceServerException."""
    request = module.InferInput(case.input_name, list(case.array.shape), case.datatype)
    request.set_data_from_numpy(case.array)
    if case.shape is not None:
        request.set_shape(list(case.shape))
    return client.infer(case.model, [request])


def non_utf8_requests(config: ServerConfig, protocol: str) -> list[tuple[str, str, str, str]]:
    """Names that are not UTF-8, sent raw (senders.http_raw, grpc_raw_infer): (case, status, message,
    expected fragment) per request."""
    from tritonclient.grpc import service_pb2

    if protocol == "http":
        body = b'{"inputs":[{"name":"\xff\xfe","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
        status, text = http_raw(config, f"/v2/models/{ECHO_MODEL}/infer", body)
        model_status, model_text = http_raw(config, "/v2/models/%FF%FE/infer", b"{}")
        return [("input-name-0xFFFE", str(status), text, "unexpected inference input"),
                ("model-name-%FF%FE", str(model_status), model_text, "unknown model")]
    request = service_pb2.ModelInferRequest(model_name=ECHO_MODEL)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "Q", "FP32"
    tensor.shape.extend([1, 4])
    request.raw_input_contents.append(np.zeros((1, 4), np.float32).tobytes())
    good = request.SerializeToString()
    bad_input = good.replace(b"\x0a\x01Q", b"\x0a\x01\xff")  # field 1 (name), length 1: the byte 0xFF
    bad_model = good.replace(ECHO_MODEL.encode(), ECHO_MODEL[:-1].encode() + b"\xff")
    return [("input-name-0xFF", *grpc_raw_infer(config, bad_input), ""),
            ("model-name-0xFF", *grpc_raw_infer(config, bad_model), "")]


@dataclass
class CaseResult:
    case: str
    expected: str        # ANSWERED or INVALID
    kind: str
    status: str | None
    message: str
    latency_s: float
    ok: bool             # the outcome is the expected one, with the expected message fragment


def _run_case(name: str, expected: str, fragment: str, send) -> CaseResult:
    started = time.perf_counter()
    try:
        send()
        kind, status, message = ANSWERED, None, ""
    except InferenceServerException as exc:
        kind, status, message = classify_error(exc)
    latency_s = time.perf_counter() - started
    ok = kind == expected and (expected == ANSWERED or fragment in message)
    return CaseResult(name, expected, kind, status, message[:300], latency_s, ok)


def bad_input_corpus(config: ServerConfig, protocol: str) -> list[CaseResult]:
    """Every fixed case once over `protocol`: bad images to the ensemble, odd valid images to the
    ensemble, bad tensors, names that are not UTF-8; one CaseResult each, in that order."""
    module = protocol_module(protocol)
    client = module.InferenceServerClient(config.url(protocol))
    results = []
    try:
        for case in bad_images():
            results.append(_run_case(f"image: {case.name}", INVALID, case.message,
                                     lambda c=case: send_image(client, module, ENSEMBLE_MODEL, c.data)))
        for name, data in odd_images().items():
            results.append(_run_case(f"valid image: {name}", ANSWERED, "",
                                     lambda d=data: send_image(client, module, ENSEMBLE_MODEL, d)))
        for case in bad_tensors():
            results.append(_run_case(f"tensor: {case.name}", INVALID, case.message,
                                     lambda c=case: send_tensor(client, module, c)))
    finally:
        client.close()
    for name, status, message, fragment in non_utf8_requests(config, protocol):
        refused = status.startswith("4") or status in ("INVALID_ARGUMENT", "NOT_FOUND", "INTERNAL")
        results.append(CaseResult(f"non-UTF-8: {name}", INVALID, INVALID if refused else ANSWERED, status,
                                  message[:300], 0.0, refused and fragment in message))
    return results


def table_row(protocol: str, results: list[CaseResult], memory: MemorySampler) -> list:
    """The table's row of one bad_input_corpus run, with the server's memory sampled around it."""
    answered = sum(r.kind == ANSWERED for r in results)
    return [f"bad-input corpus ({len(results)} cases), {protocol}", "--scenario bad-input", len(results),
            f"{answered} (valid odd images)", f"{len(results) - answered} as 4xx", sum(not r.ok for r in results),
            f"slowest {max(r.latency_s for r in results) * 1000:.0f} ms",
            f"RSS server+stubs {memory.start / MiB:.0f} -> peak {memory.peak / MiB:.0f} -> {memory.end / MiB:.0f} MiB"]
