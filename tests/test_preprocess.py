"""The preprocess transform equals torchvision's ImageNet eval transform, for every image mode."""
import io
import sys
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from torchvision import transforms

from client.samples import sample_photos
from export.artifacts import MODEL_REPOSITORY, PREPROCESS_MODEL

# The transform lives beside the preprocess model's model.py (the server imports it from there).
sys.path.insert(0, str(MODEL_REPOSITORY / PREPROCESS_MODEL / "1"))
import image_transform  # noqa: E402

#: Stated tolerance of the served transform against torchvision's, per normalized value.
TOLERANCE = 1e-5
TORCHVISION_EVAL = transforms.Compose([
    transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
    transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def reference(image: Image.Image) -> np.ndarray:
    return TORCHVISION_EVAL(image.convert("RGB")).numpy()


def photo(index: int = 0) -> Image.Image:
    return Image.open(sample_photos()[index])


def variants():
    """(id, encoded bytes, the 8-bit image torchvision should see) for each mode and format."""
    rgb = photo(0).convert("RGB")
    gray = rgb.convert("L")
    sixteen = Image.fromarray(np.asarray(gray, dtype=np.uint16) * 257)  # full 16-bit range
    return [
        ("rgb-png", encode(rgb, "PNG"), rgb),
        ("rgb-jpeg", encode(rgb, "JPEG", quality=95), Image.open(io.BytesIO(encode(rgb, "JPEG", quality=95)))),
        ("gray-png", encode(gray, "PNG"), gray),
        ("rgba-png", encode(rgb.convert("RGBA"), "PNG"), rgb),
        ("palette-png", encode(rgb.quantize(64), "PNG"), rgb.quantize(64)),
        ("cmyk-jpeg", encode(rgb.convert("CMYK"), "JPEG", quality=95),
         Image.open(io.BytesIO(encode(rgb.convert("CMYK"), "JPEG", quality=95)))),
        ("16bit-png", encode(sixteen, "PNG"), gray),  # 16-bit samples >> 8 == the 8-bit gray image
        ("portrait", encode(rgb.rotate(90, expand=True), "PNG"), rgb.rotate(90, expand=True)),
        ("tiny", encode(rgb.resize((20, 12)), "PNG"), rgb.resize((20, 12))),
    ]


@pytest.mark.parametrize("name,data,expected_image", variants(), ids=[v[0] for v in variants()])
def test_transform_matches_torchvision(name, data, expected_image):
    actual = image_transform.preprocess(data)
    assert actual.shape == (3, 224, 224) and actual.dtype == np.float32
    assert np.max(np.abs(actual - reference(expected_image))) <= TOLERANCE


@pytest.mark.parametrize("index", range(len(sample_photos())))
def test_sample_photos_match_torchvision(index):
    path = sample_photos()[index]
    actual = image_transform.preprocess(path.read_bytes())
    assert np.max(np.abs(actual - reference(Image.open(path)))) <= TOLERANCE


def test_exif_orientation_is_applied():
    rgb = photo(0).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = encode(rgb, "JPEG", quality=95, exif=exif)
    upright = Image.open(io.BytesIO(data)).transpose(Image.Transpose.ROTATE_270)
    assert np.max(np.abs(image_transform.preprocess(data) - reference(upright))) <= TOLERANCE


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but carries almost no data (decompression bomb)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    ihdr = struct.pack(">I", len(header)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    idat_data = zlib.compress(b"\0" * 100)
    idat = struct.pack(">I", len(idat_data)) + b"IDAT" + idat_data + struct.pack(">I", zlib.crc32(b"IDAT" + idat_data))
    iend = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    return b"\x89PNG\r\n\x1a\n" + ihdr + idat + iend


BAD_IMAGES = [
    ("empty", b"", "empty image"),
    ("text", b"this is not an image", "not an image"),
    ("truncated-jpeg", encode(photo(0).convert("RGB"), "JPEG")[:2000], "truncated"),
    ("bomb", png_claiming(50_000, 50_000), "too large"),
    ("aspect", encode(Image.new("RGB", (2000, 10)), "PNG"), "aspect ratio"),
]


@pytest.mark.parametrize("name,data,message", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_raise_a_decode_error_naming_the_problem(name, data, message):
    with pytest.raises(image_transform.ImageDecodeError, match=message):
        image_transform.preprocess(data)


def test_preprocess_model_on_the_server_matches_torchvision(client):
    """The served `preprocess` model returns the same tensor as torchvision for a real photo."""
    path = sample_photos()[1]
    module = client._module
    request = module.InferInput("image", [1, 1], "BYTES")
    request.set_data_from_numpy(np.array([path.read_bytes()], dtype=np.object_).reshape(1, 1))
    result = client.raw.infer(PREPROCESS_MODEL, [request], outputs=[module.InferRequestedOutput("pixels")])
    pixels = result.as_numpy("pixels")
    assert pixels.shape == (1, 3, 224, 224)
    assert np.max(np.abs(pixels[0] - reference(Image.open(path)))) <= TOLERANCE
