"""Host memory that a run frees goes back to the operating system.

glibc's malloc serves requests above its mmap threshold with ``mmap`` (unmapped again on
``free``) and the others from its heaps, and after freeing a mapped block it raises the
threshold to that block's size (up to 32 MiB). From then on the weight copies, KV caches and
activations that XLA:CPU allocates and frees at every step come from the heaps, which fragment
and keep their pages: the 0.5B LoRA CPU preset's resident memory grew by ~1 GiB a step while
its live arrays stayed the same (15.0 -> 19.2 GiB over 5 steps, 6.7 GiB live), until the
kernel's out-of-memory killer ended it. A fixed threshold (which also turns the raising off)
keeps every block of 1 MiB or more mapped: the same run stayed at ~9 GiB.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_large_frees_to_os(threshold: int = 1 << 20) -> bool:
    """Makes glibc map every allocation of ``threshold`` bytes or more on its own (so that
    freeing it returns the memory), for the rest of the process; True when it took effect.
    A no-op off Linux, under another C library, or when the user set glibc's own
    ``MALLOC_MMAP_THRESHOLD_`` (theirs is kept)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold)))
