"""System shared memory for tensor inputs and outputs (Triton's shared-memory extension).

The client writes the input batch into a POSIX shared-memory region and the server writes the logits into
another; the request carries only the region names, so neither tensor crosses the socket. It only works
when client and server share a host (the same /dev/shm).

One `TensorRegions` holds the input and output region of one model, sized for its max_batch_size, so it
is created and registered with the server once and reused by every call; `close()` destroys it (the
client unregisters it first). A finalizer destroys the local regions even when `close()` is never
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

_counter = itertools.count()


def _destroy(handles) -> None:
    for handle in handles:
        try:
            shm.destroy_shared_memory_region(handle)
        except Exception:  # already destroyed
            pass


class TensorRegions:
    """An input and an output region of system shared memory, for one model.

    input_bytes / output_bytes: region sizes in bytes (max_batch_size x bytes per batch element).
    Region names (`input_name`, `output_name`) are what the server knows them by; keys are the
    /dev/shm names, unique per process and instance.
    """

    def __init__(self, model: str, input_bytes: int, output_bytes: int):
        tag = f"{model}_{os.getpid()}_{next(_counter)}"
        self.input_name, self.output_name = f"{tag}_input", f"{tag}_output"
        self.input_key, self.output_key = f"/triton_{tag}_input", f"/triton_{tag}_output"
        self.input_bytes, self.output_bytes = input_bytes, output_bytes
        self._input = shm.create_shared_memory_region(self.input_name, self.input_key, input_bytes)
        self._output = shm.create_shared_memory_region(self.output_name, self.output_key, output_bytes)
        self._finalizer = weakref.finalize(self, _destroy, (self._input, self._output))

    def registrations(self) -> list[tuple[str, str, int]]:
        """(name, key, byte_size) of each region, for `register_system_shared_memory`."""
        return [(self.input_name, self.input_key, self.input_bytes),
                (self.output_name, self.output_key, self.output_bytes)]

    def write_input(self, batch: np.ndarray) -> int:
        """Copy `batch` into the input region; return its size in bytes.
        Raises ValueError when it does not fit (a batch larger than the model's max_batch_size)."""
        if batch.nbytes > self.input_bytes:
            raise ValueError(f"batch of {batch.nbytes} bytes exceeds the shared-memory region "
                             f"({self.input_bytes} bytes = the model's max_batch_size)")
        shm.set_shared_memory_region(self._input, [np.ascontiguousarray(batch)])
        return batch.nbytes

    def read_output(self, dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A copy of the output region's first prod(shape) elements, as an array of `shape`."""
        return np.array(shm.get_contents_as_numpy(self._output, dtype, shape))

    def close(self) -> None:
        """Destroy both regions (idempotent). Unregister them from the server first."""
        self._finalizer()
