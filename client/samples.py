"""Real sample photographs that ship inside the scikit-image wheel (usable offline)."""
from __future__ import annotations

from pathlib import Path

#: Photos of everyday ImageNet-like subjects, in skimage/data/.
SAMPLE_PHOTO_NAMES = ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg", "motorcycle_left.png")


def sample_photos() -> list[Path]:
    """Paths of the sample photos. Raises FileNotFoundError when scikit-image is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("scikit-image is not installed; it carries the sample photos (make setup)")
    data = Path(spec.origin).parent / "data"
    return [data / name for name in SAMPLE_PHOTO_NAMES]
