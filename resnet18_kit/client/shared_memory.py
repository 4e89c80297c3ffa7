"""System shared memory for tensor inputs and outputs (Triton's shared-memory extension).

The client writes the input batch into a POSIX shared-memory region and the server writes the logits into
another; the request carries only the region names, so neither tensor crosses the socket. It only works
when client and server share a host (the same /dev/shm).

One `TensorRegions` holds the input and output region of one model, sized for its max_batch_size, so it
is created and registered with the server once and reused by every call; `close()` destroys it (the
client unregisters it first). Encoded photos (the ensemble's BYTES input) go the same way in an input
region alone, sized by `photo_region_bytes` for the largest request so far (the answer, top-k strings,
comes back over the socket). A finalizer destroys the local regions even when `close()` is never
reached (an exception, Ctrl-C, interpreter exit), so no /dev/shm segment outlives the process.
"""
from __future__ import annotations

import itertools
import os
import warnings
import weakref

import numpy as np

with warnings.catch_warnings():  # tritonclient 2.51 imports the deprecated pkg_resources here
    warnings.simplefilter("ignore", UserWarning)
    import tritonclient.utils.shared_memory as shm
from tritonclient.utils import serialize_byte_tensor

_counter = itertools.count()
#: The smallest region for encoded photos, bytes: a few phone photos; a larger request doubles it.
MIN_PHOTO_REGION_BYTES = 4 << 20


def photo_region_bytes(byte_size: int) -> int:
    """The size of a region for a BYTES request of `byte_size` bytes: MIN_PHOTO_REGION_BYTES doubled until
    it fits, so a client re-creates its region only when a request outgrows it."""
    size = MIN_PHOTO_REGION_BYTES
    while size < byte_size:
        size *= 2
    return size


def bytes_byte_size(images) -> int:
    """Bytes the BYTES tensor of `images` (encoded files) takes as Triton lays it out: each element's
    4-byte length, then its bytes (tritonclient.utils.serialize_byte_tensor)."""
    return sum(4 + len(image) for image in images)


def _destroy(handles) -> None:
    for handle in handles:
        try:
            shm.destroy_shared_memory_region(handle)
        except Exception:  # already destroyed
            pass


class TensorRegions:
    """An input and an output region of system shared memory, for one model.

    input_bytes / output_bytes: region sizes in bytes (max_batch_size x bytes per batch element; for
    photos, photo_region_bytes). output_bytes 0: no output region (the answer comes over the socket).
    Region names (`input_name`, `output_name`) are what the server knows them by; keys are the
    /dev/shm names, unique per process and instance.
    """

    def __init__(self, model: str, input_bytes: int, output_bytes: int = 0):
        tag = f"{model}_{os.getpid()}_{next(_counter)}"
        self.input_name, self.output_name = f"{tag}_input", f"{tag}_output"
        self.input_key, self.output_key = f"/triton_{tag}_input", f"/triton_{tag}_output"
        self.input_bytes, self.output_bytes = input_bytes, output_bytes
        self._input = shm.create_shared_memory_region(self.input_name, self.input_key, input_bytes)
        self._output = (shm.create_shared_memory_region(self.output_name, self.output_key, output_bytes)
                        if output_bytes else None)
        self._finalizer = weakref.finalize(self, _destroy, [h for h in (self._input, self._output) if h is not None])

    def registrations(self) -> list[tuple[str, str, int]]:
        """(name, key, byte_size) of each region, for `register_system_shared_memory`."""
        return [(self.input_name, self.input_key, self.input_bytes)] + (
            [(self.output_name, self.output_key, self.output_bytes)] if self.output_bytes else [])

    def write_input(self, batch: np.ndarray) -> int:
        """Copy `batch` into the input region; return its size in bytes. A BYTES batch (numpy object
        array of encoded files) is written as Triton lays it out (bytes_byte_size). Raises ValueError
        when it does not fit (a batch larger than the model's max_batch_size, photos larger than the
        region)."""
        if batch.dtype == np.object_:
            batch = serialize_byte_tensor(batch)
            byte_size = len(batch.item())
        else:
            batch = np.ascontiguousarray(batch)
            byte_size = batch.nbytes
        if byte_size > self.input_bytes:
            raise ValueError(f"batch of {byte_size} bytes exceeds the shared-memory region of {self.input_bytes} bytes")
        shm.set_shared_memory_region(self._input, [batch])
        return byte_size

    def read_output(self, dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A copy of the output region's first prod(shape) elements, as an array of `shape`."""
        return np.array(shm.get_contents_as_numpy(self._output, dtype, shape))

    def close(self) -> None:
        """Destroy both regions (idempotent). Unregister them from the server first."""
        self._finalizer()
