"""Per-step bookkeeping of the Numba backend as one compiled call each, not one numpy or
torch call per tensor: the step counters, read and advanced through their addresses, and
the stochastic-rounding stream keys of a bucket's tensors.

What for: a step over ~150 small params would spend more time in these per-tensor calls
(``torch._foreach_add_`` falls back to a loop on CPU) than in its update.  The step cache
(``bf16opt/step_cache.py``) checks the counters' identities and addresses before it
passes them here.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .storage import pointer_to

_MASK32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B9)  # storage.GOLDEN


@njit(nogil=True, cache=True)
def counters_equal(addresses, expected):
    """True when the float64 at each ``addresses[i]`` is ``expected[i]``."""
    for i in range(addresses.size):
        if pointer_to(addresses[i], np.float64)[0] != expected[i]:
            return False
    return True


@njit(nogil=True, cache=True)
def advance_counters(addresses):
    """Add 1 to the float64 at each of ``addresses``."""
    for i in range(addresses.size):
        counter = pointer_to(addresses[i], np.float64)
        counter[0] += 1.0


@njit(nogil=True, cache=True)
def _fmix32(h):
    """MurmurHash3 fmix32 (storage.fmix32_int) on a uint64 holding a uint32."""
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _MASK32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _MASK32
    return h ^ (h >> np.uint64(16))


@njit(nogil=True, cache=True)
def stream_keys(key, tensors, keys):
    """``keys[i, b]``: storage.stream_key's hash chain continued from ``key`` (the seed's
    and step's words hashed) with the words ``tensors[i]`` (uint64, the low 32 bits are
    used) and buffer ``b``, for every buffer column ``b`` of ``keys`` (uint32)."""
    for i in range(tensors.size):
        tensor = _fmix32(((key ^ (tensors[i] & _MASK32)) + _GOLDEN) & _MASK32)
        for buffer in range(keys.shape[1]):
            keys[i, buffer] = _fmix32(((tensor ^ np.uint64(buffer)) + _GOLDEN) & _MASK32)
