"""Keep freed large blocks in this process's heap, so a request's buffers are not faulted in anew each time.

glibc's malloc serves a block above its mmap threshold (128 KiB at start) with a fresh mmap and gives it
back to the kernel on free; it also trims the heap's free top above its trim threshold. Every request of
the served models allocates such blocks and frees them at once: the Python backend's stub copies each
input out of shared memory (an encoded photo, 0.1-20 MB; a network batch, 150,528 bytes a row), unpacks a
BYTES tensor into one more copy, and Pillow allocates the decoded image. Each fresh block costs a page
fault and a zeroed page per 4 KiB touched: 0.65 ms for copying and unpacking one 1.1 MB BYTES tensor the
way the stub does, 0.06 ms with large blocks kept (262 faults against 3).

keep_large_blocks() fixes both thresholds at 32 MiB for the calling process. The served models call it
from initialize(); the in-process pipeline the kit measures them against calls it too. Cost: a process
may hold up to TRIM_THRESHOLD_BYTES of freed heap it would have given back.
"""
import ctypes

#: mallopt parameter numbers (glibc <malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: 32 MiB, glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): above the largest encoded image
#: the preprocess model accepts (its max_image_bytes, 20 MB) and a full network batch (16 x 150,528 bytes).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Freed memory at the heap's top kept before it is given back (the most a process holds in addition).
TRIM_THRESHOLD_BYTES = 32 << 20


def keep_large_blocks() -> bool:
    """Set this process's malloc thresholds (module doc). Returns True when both are set; False where
    the C library is not glibc (no mallopt) or refuses a value: the process then runs with its defaults."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and \
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
