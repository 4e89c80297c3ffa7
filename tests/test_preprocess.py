"""The preprocess transform equals torchvision's ImageNet eval transform within a stated tolerance per path,
for every image mode: full decode (fused resize+crop: float rounding of the crop box flips an 8-bit rounding
at a few pixels) and scaled decode of large JPEGs (libjpeg's DCT scaling)."""
import io
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.export.resnet18 import normalize, torchvision_eval_transform
from resnet18_kit.observe.process_cpu import process_tree


@pytest.fixture(scope="module")
def image_transform(repository):
    """The served transform: preprocess/1/image_transform.py of the model repository (the server imports
    it from there; ModelRepository loads the same file)."""
    return repository.image_transform()


#: Stated tolerance of the served transform against torchvision's, full-decode path, per normalized value:
#: none off by more than one 8-bit level (1 / (255 x the smallest std 0.224) = 0.0175) and mean |diff|
#: <= 0.005. Resizing only the crop box (one Pillow resize) places the filters where torchvision's
#: resize-then-crop does, but Pillow's filter coefficients computed from the box's float coordinates
#: differ in the last bits and flip the rounding to 8 bits at some pixels (measured on the sample and
#: held-out photos: 0 to 1% of values for landscape images, 20% for a portrait one whose crop is
#: vertical; each exactly one level, mean |diff| <= 0.0036).
FLOAT_TOLERANCE = 1e-5
ONE_LEVEL = 1 / (255 * 0.224) + FLOAT_TOLERANCE
MEAN_TOLERANCE = 0.005
#: Scaled-decode path (a JPEG at least twice the needed size, decoded at 1/2..1/8 scale by libjpeg),
#: against torchvision on the full decode, per normalized value: mean |diff| <= 0.025 (about 1.4 8-bit
#: levels; measured 0.005-0.015 on 12-megapixel re-encodings of the sample photos) and max <= 0.35
#: (about 20 levels, at sharp edges; measured 0.10-0.24).
SCALED_MEAN_TOLERANCE = 0.025
SCALED_MAX_TOLERANCE = 0.35


def normalized(pixels: np.ndarray) -> np.ndarray:
    """The transform's UINT8 pixels [3, 224, 224] as the exported graphs' head normalizes them (FP32)."""
    assert pixels.shape == (3, 224, 224) and pixels.dtype == np.uint8
    return normalize(pixels[None])[0]


def assert_matches_torchvision(pixels: np.ndarray, expected: np.ndarray) -> None:
    """The full-decode tolerance above, for UINT8 pixels normalized as the networks do."""
    actual = normalized(pixels)
    assert actual.shape == expected.shape == (3, 224, 224) and actual.dtype == np.float32
    diff = np.abs(actual - expected)
    assert diff.max() <= ONE_LEVEL, f"max |diff| {diff.max():.4f} > one 8-bit level"
    assert diff.mean() <= MEAN_TOLERANCE, f"mean |diff| {diff.mean():.4f}"
TORCHVISION_EVAL = torchvision_eval_transform()


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
def test_transform_matches_torchvision(name, data, expected_image, image_transform):
    assert_matches_torchvision(image_transform.preprocess(data), reference(expected_image))


@pytest.mark.parametrize("index", range(len(sample_photos())))
def test_sample_photos_match_torchvision(index, image_transform):
    path = sample_photos()[index]
    assert_matches_torchvision(image_transform.preprocess(path.read_bytes()), reference(Image.open(path)))


def test_exif_orientation_is_applied(image_transform):
    rgb = photo(0).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = encode(rgb, "JPEG", quality=95, exif=exif)
    upright = Image.open(io.BytesIO(data)).transpose(Image.Transpose.ROTATE_270)
    assert_matches_torchvision(image_transform.preprocess(data), reference(upright))


def large_jpeg(index: int, size=(4000, 3000), **options) -> bytes:
    """A sample photo re-encoded as a 12-megapixel JPEG (quality 90), as phone cameras send."""
    return encode(photo(index).convert("RGB").resize(size, Image.BICUBIC), "JPEG", quality=90, **options)


@pytest.mark.parametrize("index", [0, 2, 4])
def test_large_jpeg_is_decoded_scaled_within_its_tolerance(index, image_transform):
    data = large_jpeg(index)
    decoded = image_transform.decode_rgb(data, min_short_side=image_transform.RESIZE_SHORT_SIDE)
    assert decoded.size == (500, 375)  # 1/8 scale: the smallest whose short side is still >= 256
    expected = reference(Image.open(io.BytesIO(data)))
    scaled = normalized(image_transform.preprocess(data))
    diff = np.abs(scaled - expected)
    assert diff.mean() <= SCALED_MEAN_TOLERANCE and diff.max() <= SCALED_MAX_TOLERANCE, (diff.mean(), diff.max())
    assert_matches_torchvision(image_transform.preprocess(data, scaled_decode=False), expected)


def test_scaled_decode_keeps_the_exif_rotation_and_only_applies_to_large_jpegs(image_transform):
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = large_jpeg(0, exif=exif)
    upright = Image.open(io.BytesIO(data)).transpose(Image.Transpose.ROTATE_270)
    diff = np.abs(normalized(image_transform.preprocess(data)) - reference(upright))
    assert diff.mean() <= SCALED_MEAN_TOLERANCE
    small = encode(photo(0).convert("RGB"), "JPEG", quality=95)  # 451x300: less than 2 x 256, full decode
    assert image_transform.decode_rgb(small, min_short_side=256).size == (451, 300)
    png = encode(photo(0).convert("RGB").resize((1200, 800)), "PNG")  # not a JPEG: full decode
    assert image_transform.decode_rgb(png, min_short_side=256).size == (1200, 800)


def test_preprocess_writes_into_the_row_it_is_given(image_transform):
    batch = np.zeros((2, 3, 224, 224), np.uint8)
    returned = image_transform.preprocess(sample_photos()[0].read_bytes(), out=batch[1])
    assert returned is batch[1] or np.shares_memory(returned, batch)
    assert not batch[0].any() and batch[1].any() and returned.dtype == np.uint8


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
    ("truncated-12mp-jpeg", large_jpeg(1)[:300_000], "truncated"),
    ("bomb", png_claiming(50_000, 50_000), "too large"),
    ("aspect", encode(Image.new("RGB", (2000, 10)), "PNG"), "aspect ratio"),
]


@pytest.mark.parametrize("name,data,message", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_raise_a_decode_error_naming_the_problem(name, data, message, image_transform):
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
    assert_matches_torchvision(pixels[0], reference(Image.open(path)))


#: Run in a fresh process (the setting stays for the process's life): page faults per round of four 1 MiB
#: buffers alive together and freed, as a batch of photos' copies in a stub, before and after the served
#: models' allocator setting (preprocess/1/allocator.py).
FAULTS_SCRIPT = """
import resource, sys
import numpy as np
from pathlib import Path
from resnet18_kit.repository import ModelRepository

payload = np.frombuffer(bytes(1 << 20), np.uint8)
def faults_per_round(rounds=50):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        copies = [np.array(payload) for _ in range(4)]
        del copies
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds
default = faults_per_round()
kept = ModelRepository(Path(sys.argv[1])).served_module("allocator").keep_large_blocks()
print(default, kept, faults_per_round())
"""


def test_the_served_allocator_setting_spares_a_page_fault_per_page_of_each_request_buffer(repository):
    done = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, str(repository.root)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    default, kept, after = done.stdout.split()
    assert kept == "True"
    # 4 MiB in 4 KiB pages: glibc's defaults fault most pages in again each round; with blocks kept, almost none.
    assert float(default) > 500 and float(after) < 50, done.stdout


def minor_faults(pids) -> int:
    """Minor page faults so far of the processes `pids` (field 10 of /proc/<pid>/stat), summed."""
    total = 0
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        total += int(stat[stat.rindex(")") + 2:].split()[7])
    return total


def test_the_served_preprocess_stubs_fault_in_no_page_per_request(triton_server, client):
    """Live: requests of a 1.1 MB JPEG cost the served `preprocess` stubs almost no page fault (allocator.py,
    set in initialize()); with glibc's defaults they took 513-553 per request (measured, 30 requests)."""
    rng = np.random.default_rng(0)
    coarse = Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).resize((1600, 1200))
    grain = np.asarray(coarse, dtype=np.int16) + rng.integers(-20, 20, (1200, 1600, 3))
    encoded = io.BytesIO()
    Image.fromarray(grain.clip(0, 255).astype(np.uint8)).save(encoded, "JPEG", quality=90)
    module = client._module

    def send(count):
        for _ in range(count):
            request = module.InferInput("image", [1, 1], "BYTES")
            request.set_data_from_numpy(np.array([[encoded.getvalue()]], dtype=np.object_))
            client.raw.infer(PREPROCESS_MODEL, [request])
    stubs = [pid for pid, role in process_tree({"tritonserver": triton_server.process.pid}).items()
             if role == f"stub {PREPROCESS_MODEL}"]
    assert stubs and len(encoded.getvalue()) > 1_000_000
    send(10)  # every instance has run a few: its heap has grown to what a request needs
    before = minor_faults(stubs)
    send(30)
    assert (minor_faults(stubs) - before) / 30 < 50


def test_the_network_models_set_the_allocator_in_initialize(repository):
    """The network's stub gets the same setting (its batch copies are 150 KB per image); read from the
    source, as its inputs arrive in shared memory and a live fault count does not tell the two apart."""
    source = (repository.root / ONNX_MODEL / "1" / "model.py").read_text()  # resnet18_torchscript's links here
    initialize = source[source.index("def initialize"):source.index("def execute")]
    assert "keep_large_blocks()" in initialize
