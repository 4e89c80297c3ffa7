"""Photo sets for the end-to-end benchmark, and how perf_analyzer is given them as BYTES input data.

Photo sets (`photo_set(name, results_dir)` -> list of file paths, one encoded image each):
  * "sample": the 5 sample photos that ship in the scikit-image wheel (client.samples.sample_photos():
    four PNGs and one JPEG, 451x300 to 741x500 pixels, 112-792 kB);
  * "12mp": the same photos re-encoded as 12-megapixel JPEGs, what a phone camera sends: resized with
    Pillow's bicubic filter to 4000x3000 (3000x4000 when the photo is taller than wide; a square photo
    counts as landscape), RGB, JPEG quality 90. Written once into <results_dir>/photos/12mp/ and written
    again when a file is missing (each file is written under a temporary name, then renamed, so an
    interrupted run never leaves a partial JPEG behind).

perf_analyzer input data (`write_input_data`): a JSON file for `--input-data FILE` with one entry per
photo, which perf_analyzer sends in turn, cycling (one image per request, batch 1):

    {"data": [{"image": {"b64": "<base64 of the serialized tensor>", "shape": [1]}}, ...]}

For a BYTES input, perf_analyzer takes the decoded b64 bytes as the tensor's serialized form, Triton's
BYTES wire layout: per element a 4-byte little-endian unsigned length, then that many bytes
(`serialize_bytes_element`; the same layout resnet18_kit/export/__main__.py writes for the preprocess warmup file).
"shape" [1] is the input's dims without the batch dimension (model_repository/resnet18/config.pbtxt).
"""
from __future__ import annotations

import base64
import json
import os
import struct
from pathlib import Path

from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import IMAGE_INPUT

PHOTO_SETS = ("sample", "12mp")
#: The 12-megapixel re-encoding: (width, height) of a landscape photo in pixels, and the JPEG quality.
TWELVE_MP_LANDSCAPE = (4000, 3000)
TWELVE_MP_JPEG_QUALITY = 90
#: The ensemble's input, as perf_analyzer and the clients name it.
ENSEMBLE_INPUT = IMAGE_INPUT


def photo_cache_dir(results_dir: Path) -> Path:
    """Where generated photo sets live: <results_dir>/photos (shared by every run under results/)."""
    return Path(results_dir) / "photos"


def twelve_megapixel_photos(cache_dir: Path) -> list[Path]:
    """The sample photos as 12-megapixel JPEGs in cache_dir/12mp/<stem>.jpg, written when missing.

    Each: RGB, resized (bicubic) to TWELVE_MP_LANDSCAPE, or its transpose when height > width, JPEG
    quality TWELVE_MP_JPEG_QUALITY. Returns the paths in sample_photos() order."""
    from PIL import Image

    folder = Path(cache_dir) / "12mp"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in sample_photos():
        target = folder / f"{source.stem}.jpg"
        if not target.is_file():
            with Image.open(source) as image:
                image = image.convert("RGB")
                width, height = TWELVE_MP_LANDSCAPE
                size = (height, width) if image.height > image.width else (width, height)
                resized = image.resize(size, Image.BICUBIC)
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            resized.save(partial, "JPEG", quality=TWELVE_MP_JPEG_QUALITY)
            partial.replace(target)
        paths.append(target)
    return paths


def photo_set(name: str, results_dir: Path) -> list[Path]:
    """The files of photo set `name` (one of PHOTO_SETS). Raises ValueError for another name."""
    if name == "sample":
        return sample_photos()
    if name == "12mp":
        return twelve_megapixel_photos(photo_cache_dir(results_dir))
    raise ValueError(f"unknown photo set {name!r} (one of {', '.join(PHOTO_SETS)})")


def tagged(photo: bytes, tag: str) -> bytes:
    """`photo` (an encoded image) with `tag` appended: its decoder stops at the image's end marker, so it
    decodes to the same pixels, while Triton's response cache (a hash of the input bytes) sees a new input.
    How the load generators keep requests from being answered from the cache."""
    return photo + tag.encode()


def serialize_bytes_element(data: bytes) -> bytes:
    """One BYTES tensor element in Triton's serialized layout: 4-byte little-endian length, then data."""
    return struct.pack("<I", len(data)) + data


def input_data(photos: list[bytes], input_name: str = ENSEMBLE_INPUT) -> dict:
    """perf_analyzer --input-data content: one entry per photo, each a BYTES tensor of shape [1] holding
    the encoded file (see the module docstring)."""
    return {"data": [{input_name: {"b64": base64.b64encode(serialize_bytes_element(photo)).decode("ascii"),
                                   "shape": [1]}} for photo in photos]}


def write_input_data(paths: list[Path], target: Path, input_name: str = ENSEMBLE_INPUT) -> Path:
    """Write input_data() of the files at `paths` to `target` (JSON); return target."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(input_data([Path(p).read_bytes() for p in paths], input_name)))
    return target
