"""Giving the memory a start freed back to the system. Loading and compiling a model free many small temporaries
(the float rows a layer is quantized from, the graphs compilation traces), and glibc's allocator keeps the pages
they held for later allocations rather than returning them; `malloc_trim` returns them. Measured on the packaged
model: an int4 engine's process held 165 MiB fewer after it, an fp32 one 40 MiB."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)


def give_back_freed_memory() -> bool:
    """Return the allocator's free pages to the system, where the C library is glibc; whether it could."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        logger.debug("no malloc_trim in this C library: freed memory stays with the allocator")
        return False
    trim(0)
    return True
