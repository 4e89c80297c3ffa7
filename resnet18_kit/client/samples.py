"""Images to send: real sample photographs that ship inside the scikit-image wheel (usable offline), and
the image files of folders a user names."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

#: Photos of everyday ImageNet-like subjects, in skimage/data/.
SAMPLE_PHOTO_NAMES = ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg", "motorcycle_left.png")
#: Other real photos of the same wheel, never used to calibrate the INT8 model: the held-out inputs its
#: agreement with FP32 is measured on (resnet18_kit/export/quantize.py).
HELD_OUT_PHOTO_NAMES = ("motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "camera.png",
                        "coins.png", "brick.png", "grass.png", "gravel.png", "moon.png", "ihc.png")


def sample_photos(names: tuple[str, ...] = SAMPLE_PHOTO_NAMES) -> list[Path]:
    """Paths of the sample photos (or of `names` in the same folder, e.g. HELD_OUT_PHOTO_NAMES).
    Raises FileNotFoundError when scikit-image is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("no sample photos: scikit-image, which carries them, is not installed "
                                "(make setup, or pip install scikit-image); or name image files")
    data = Path(spec.origin).parent / "data"
    return [data / name for name in names]


#: Image files taken from a folder (Pillow decodes all of them).
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"}


def expand_paths(paths: Iterable[Path]) -> list[Path]:
    """Files as given; folders replaced by the image files under them (recursively, sorted)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()))
        else:
            files.append(path)
    return files
