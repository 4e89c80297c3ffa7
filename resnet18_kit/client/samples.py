"""Images to send: real sample photographs that ship inside the scikit-image wheel (usable offline), and
the image files of folders a user names (every suffix the server's decoder, Pillow in the preprocess
model, opens: `image_suffixes`)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Iterable

#: Photos of everyday ImageNet-like subjects, in skimage/data/.
SAMPLE_PHOTO_NAMES = ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg", "motorcycle_left.png")
#: Other real photos of the same wheel, never used to calibrate the INT8 model: the held-out inputs its
#: agreement with FP32 is measured on (resnet18_kit/export/quantize.py).
HELD_OUT_PHOTO_NAMES = ("motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "camera.png",
                        "coins.png", "brick.png", "grass.png", "gravel.png", "moon.png", "ihc.png")
#: Used when Pillow cannot be imported here: what Pillow 11+ with its bundled codecs opens.
FALLBACK_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".bmp", ".dib", ".gif", ".tif",
                               ".tiff", ".webp", ".avif", ".avifs", ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico",
                               ".jp2", ".j2k", ".jpx", ".jpf", ".j2c", ".jpc", ".qoi", ".psd", ".pcx", ".sgi"})
#: Formats Pillow registers but cannot decode without outside programs (EPS: Ghostscript) or at all (MPEG:
#: header only); its stub formats (BUFR, GRIB, HDF5, WMF) are left out as well.
UNDECODABLE_FORMATS = frozenset({"EPS", "MPEG"})


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


@lru_cache(maxsize=1)
def image_suffixes() -> frozenset[str]:
    """File suffixes (lower case, with the dot) of the image formats Pillow decodes: its registered
    extensions whose format it can open, stubs and UNDECODABLE_FORMATS excepted (the same Pillow as the
    preprocess model's, by the shared constraints); FALLBACK_SUFFIXES without Pillow."""
    try:
        from PIL import Image, ImageFile
    except ImportError:
        return FALLBACK_SUFFIXES
    Image.init()

    def decodable(format_name: str) -> bool:
        factory = Image.OPEN.get(format_name, (None,))[0]
        stub = isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile)
        return factory is not None and not stub and format_name not in UNDECODABLE_FORMATS

    return frozenset(suffix for suffix, name in Image.registered_extensions().items() if decodable(name))


def __getattr__(name: str):
    if name == "IMAGE_SUFFIXES":  # computed on first use (it imports Pillow and its plugins)
        return image_suffixes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def expand_paths(paths: Iterable[Path], skipped: list[Path] | None = None) -> list[Path]:
    """Files as given; folders replaced by the image files under them (recursively, sorted; an image file
    is one with a suffix of `image_suffixes()`). Files of a folder passed over are appended to `skipped`
    when a list is given."""
    files: list[Path] = []
    suffixes = image_suffixes()
    for path in paths:
        if path.is_dir():
            for found in sorted(p for p in path.rglob("*") if p.is_file()):
                if found.suffix.lower() in suffixes:
                    files.append(found)
                elif skipped is not None:
                    skipped.append(found)
        else:
            files.append(path)
    return files
