"""Decode an encoded image and apply the standard ImageNet evaluation transform, with numpy + Pillow.

The transform is torchvision's classification eval preset (references/classification/presets.py,
the one the IMAGENET1K_V1 weights were evaluated with), written out so the server needs no torchvision:

    Resize(256, bilinear) -> CenterCrop(224) -> [ToTensor() -> Normalize(mean, std)]

This module does the part before the brackets and writes the 8-bit pixels, UINT8 [3, 224, 224] (CHW),
into the caller's batch; ToTensor + Normalize are one multiply-add at the head of the exported network
graphs (resnet18_kit/export/resnet18.py), so the tensor handed from this step to the network is a quarter
of the FP32 one. Resize and crop are one Pillow resize of the region the crop keeps, which places every
filter exactly where torchvision's resize-then-crop does: with a full decode, these pixels normalized
equal torchvision's tensor within float32 rounding (tests/test_preprocess.py checks max |diff| <= 1e-5).
A JPEG much larger than needed is decoded at a reduced scale by libjpeg (`decode_rgb`'s min_short_side),
which differs slightly (bound in the tests).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

RESIZE_SHORT_SIDE = 256
CROP_SIZE = 224

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


def decode_rgb(data: bytes, limits: ImageLimits = ImageLimits(), min_short_side: int | None = None) -> Image.Image:
    """Decode JPEG/PNG/any Pillow format bytes into an 8-bit RGB image, upright per its EXIF tag.

    min_short_side: when set and the image is a JPEG at least twice that size on its shorter side, decode
    it with libjpeg's DCT scaling (Pillow's `draft`) at 1/2, 1/4 or 1/8 of its size, the smallest scale
    whose shorter side is still >= min_short_side. A 12-megapixel photo then decodes in ~13 ms instead of
    ~120 ms, and after the resize to 256 differs from a full decode by ~0.5/255 per pixel on average
    (tests/test_preprocess.py states the bound). Limits are checked on the full size from the header.

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
    if min_short_side and image.format == "JPEG" and min(width, height) >= 2 * min_short_side:
        image.draft(image.mode, (min_short_side, min_short_side))  # keeps both sides >= min_short_side
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # no copy when there is no rotation to apply
        if image.mode in _WIDE_INTEGER_MODES:
            samples = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)  # 16-bit range
            image = Image.fromarray((samples >> 8).astype(np.uint8), "L")
        return image if image.mode == "RGB" else image.convert("RGB")  # convert() would copy an RGB image
    except Exception as exc:  # see _describe
        raise ImageDecodeError(f"corrupt or truncated {image.format} image: {_describe(exc)}") from None


def _describe(exc: Exception) -> str:
    """Pillow's parsers and decoders report malformed bytes with several exception types: a fuzz of
    30,000 corrupted JPEG, PNG, GIF, BMP, ICO, PPM, TIFF and WebP files raised OSError ("Truncated File
    Read", "could not create decoder object") and ValueError (PPM, TIFF headers) from Image.open as well
    as from load(), and Pillow's plugins also raise SyntaxError and EOFError. Each means that this
    request's bytes cannot be decoded: bad input (HTTP 400 / INVALID_ARG), not a server fault (500)."""
    return f"{type(exc).__name__}: {exc}"


def crop_box(width: int, height: int) -> tuple[float, float, float, float]:
    """The region of a width x height image that torchvision's Resize(256) + CenterCrop(224) keeps, in
    the image's own pixel coordinates (left, upper, right, lower; floats).

    torchvision resizes the shorter side to 256 with the longer side int(256 * long / short), then crops
    224 x 224 at int(round((resized - 224) / 2)). Resizing only this box straight to 224 x 224
    (Pillow's `resize(..., box=...)`) gives the same pixels: Pillow places each output pixel's filter at
    box_start + (i + 0.5) * box_size / 224 in the source and clips the filter to the whole image, which
    is where the full resize followed by the crop places it."""
    short_side, long_side = min(width, height), max(width, height)
    new_long = int(RESIZE_SHORT_SIDE * long_side / short_side)
    new_width, new_height = (RESIZE_SHORT_SIDE, new_long) if width <= height else (new_long, RESIZE_SHORT_SIDE)
    left = int(round((new_width - CROP_SIZE) / 2.0))
    top = int(round((new_height - CROP_SIZE) / 2.0))
    scale_x, scale_y = width / new_width, height / new_height
    return (left * scale_x, top * scale_y, (left + CROP_SIZE) * scale_x, (top + CROP_SIZE) * scale_y)


def resize_and_crop(image: Image.Image) -> Image.Image:
    """Resize the shorter side to 256 (bilinear, antialiased as torchvision does on PIL images) and
    center crop 224, in one resize of the kept region only (see `crop_box`). Returns 224 x 224."""
    return image.resize((CROP_SIZE, CROP_SIZE), Image.BILINEAR, box=crop_box(*image.size))


def to_chw(image: Image.Image, out: np.ndarray | None = None) -> np.ndarray:
    """8-bit RGB image [H, W] -> UINT8 [3, H, W] (channels first, as the networks take them).

    out: a UINT8 [3, H, W] array to write into (e.g. one row of a batch), so no intermediate copy is
    made; a new array when None. Returns the array written."""
    pixels = np.asarray(image).transpose(2, 0, 1)  # uint8 CHW view, no copy
    if out is None:
        return np.ascontiguousarray(pixels)
    out[...] = pixels
    return out


def preprocess(data: bytes, limits: ImageLimits = ImageLimits(), out: np.ndarray | None = None,
               scaled_decode: bool = True) -> np.ndarray:
    """Encoded image bytes -> UINT8 [3, 224, 224] network input, RGB pixels (written into `out` when given).

    scaled_decode: decode a large JPEG at 1/2, 1/4 or 1/8 scale (see `decode_rgb`); False decodes every
    image at full size, which is torchvision's transform exactly. Raises ImageDecodeError."""
    image = decode_rgb(data, limits, min_short_side=RESIZE_SHORT_SIDE if scaled_decode else None)
    return to_chw(resize_and_crop(image), out)
