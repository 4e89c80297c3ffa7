"""Decode an encoded image and apply the standard ImageNet evaluation transform, with numpy + Pillow.

The transform is torchvision's classification eval preset (references/classification/presets.py,
the one the IMAGENET1K_V1 weights were evaluated with), written out so the server needs no torchvision:

    Resize(256, bilinear) -> CenterCrop(224) -> ToTensor() -> Normalize(IMAGENET_MEAN, IMAGENET_STD)

Resize and crop use the same PIL calls torchvision makes on a PIL image, so the result equals
torchvision's within float32 rounding (tests/test_preprocess.py checks max |diff| <= 1e-5).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

RESIZE_SHORT_SIDE = 256
CROP_SIZE = 224
#: Per-channel mean and std of ImageNet-1k training images (RGB, [0, 1] scale), torchvision's values.
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

#: Pillow modes holding more than 8 bits per sample: scaled to 8 bits before the RGB conversion
#: (Pillow's own conversion clips them at 255, which turns most 16-bit photos white).
_WIDE_INTEGER_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N"}


class ImageDecodeError(ValueError):
    """The bytes are not an image this transform accepts; the message says why."""


@dataclass(frozen=True)
class ImageLimits:
    """Bounds that keep one request's memory and time small.

    max_image_bytes: largest encoded image accepted, in bytes.
    max_image_pixels: largest width x height accepted, checked from the header before decoding,
        so a decompression bomb (a small file claiming 50,000 x 50,000) is refused without allocating.
    max_aspect_ratio: longest side / shortest side; bounds the resized image (256 x 256*ratio pixels).
    """

    max_image_bytes: int = 20_000_000
    max_image_pixels: int = 50_000_000
    max_aspect_ratio: float = 20.0


def decode_rgb(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode JPEG/PNG/any Pillow format bytes into an 8-bit RGB image, upright per its EXIF tag.

    Accepts every Pillow mode (RGB, L, P, RGBA, LA, CMYK, 16-bit and 32-bit integer); alpha is dropped,
    16-bit samples are scaled to 8 bits, an animated image gives its first frame.
    Raises ImageDecodeError naming the problem: empty, too many bytes, not an image, truncated or
    corrupt, too many pixels, extreme aspect ratio.
    """
    if len(data) == 0:
        raise ImageDecodeError("empty image: 0 bytes")
    if len(data) > limits.max_image_bytes:
        raise ImageDecodeError(f"image too large: {len(data)} bytes > limit {limits.max_image_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageDecodeError(f"not an image in a known format ({len(data)} bytes)") from None
    except Image.DecompressionBombError as exc:  # Pillow's own bound (2 x 89 MP), above ours
        raise ImageDecodeError(f"image too large: {exc}") from None
    except Exception as exc:  # a known format with a broken header (see _describe)
        raise ImageDecodeError(f"corrupt or truncated image header: {_describe(exc)}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageDecodeError(f"image has no pixels: {width}x{height}")
    if width * height > limits.max_image_pixels:
        raise ImageDecodeError(
            f"image too large: {width}x{height} = {width * height} pixels > limit {limits.max_image_pixels}")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise ImageDecodeError(
            f"aspect ratio of {width}x{height} exceeds limit {limits.max_aspect_ratio}:1")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode in _WIDE_INTEGER_MODES:
            samples = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)  # 16-bit range
            image = Image.fromarray((samples >> 8).astype(np.uint8), "L")
        return image.convert("RGB")
    except Exception as exc:  # see _describe
        raise ImageDecodeError(f"corrupt or truncated {image.format} image: {_describe(exc)}") from None


def _describe(exc: Exception) -> str:
    """Pillow's parsers and decoders report malformed bytes with several exception types: a fuzz of
    30,000 corrupted JPEG, PNG, GIF, BMP, ICO, PPM, TIFF and WebP files raised OSError ("Truncated File
    Read", "could not create decoder object") and ValueError (PPM, TIFF headers) from Image.open as well
    as from load(), and Pillow's plugins also raise SyntaxError and EOFError. Each means that this
    request's bytes cannot be decoded: bad input (HTTP 400 / INVALID_ARG), not a server fault (500)."""
    return f"{type(exc).__name__}: {exc}"


def resize_and_crop(image: Image.Image) -> Image.Image:
    """Resize the shorter side to 256 (bilinear, aspect kept, torchvision's rounding), center crop 224."""
    width, height = image.size
    short_side, long_side = min(width, height), max(width, height)
    new_long = int(RESIZE_SHORT_SIDE * long_side / short_side)
    size = (RESIZE_SHORT_SIDE, new_long) if width <= height else (new_long, RESIZE_SHORT_SIDE)
    image = image.resize(size, Image.BILINEAR)
    left = int(round((size[0] - CROP_SIZE) / 2.0))
    top = int(round((size[1] - CROP_SIZE) / 2.0))
    return image.crop((left, top, left + CROP_SIZE, top + CROP_SIZE))


def to_normalized_chw(image: Image.Image) -> np.ndarray:
    """8-bit RGB image -> FP32 [3, H, W], scaled to [0, 1] then normalized with ImageNet mean/std."""
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    return ((pixels - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1).copy()


def preprocess(data: bytes, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    """Encoded image bytes -> FP32 [3, 224, 224] network input. Raises ImageDecodeError."""
    return to_normalized_chw(resize_and_crop(decode_rgb(data, limits)))
