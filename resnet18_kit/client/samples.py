"""Real sample photographs that ship inside the scikit-image wheel (usable offline)."""
from __future__ import annotations

from pathlib import Path

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
        raise FileNotFoundError("scikit-image is not installed; it carries the sample photos (make setup)")
    data = Path(spec.origin).parent / "data"
    return [data / name for name in names]
