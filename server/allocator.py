"""Process-wide malloc settings for the engine's numpy temporaries (glibc only; a no-op elsewhere).

A tick over a few thousand GPUs makes temporaries of a few hundred kB. Above glibc's mmap threshold
(128 kB until it adapts) each one is a fresh mmap, page-faulted in and unmapped again when freed: at
2,048 GPUs that was 200k page faults and a fifth of replay's time. Keeping such blocks on the heap, and
not trimming the heap for every freed one, removes that cost for a bounded amount of retained memory.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest accepted mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds; False (and nothing changed) where that is not glibc."""
    try:
        # The interpreter's own symbols: libc's mallopt where there is one, without a library search.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        log.debug("mallopt refused the thresholds; keeping the allocator's defaults")
    return ok
