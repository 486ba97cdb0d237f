"""bf16opt's hand-vectorised Adam blocks (``cpu_src/vector_blocks.py``) over the compute-limit
kernel's arrays, without bf16opt's chunk table and driver: the bare loop of DeepSpeed's form
(``cpu_step.py --same-arrays``' vector row; a benchmark).

The blocks were measured here first, as a kernel of their own, against bf16opt's element loop
(then 5-10% slower on an AVX-512 Xeon) and DeepSpeedCPUAdam; since bf16opt runs them itself,
the row says what its chunking costs around them.  ``run`` does the compute-limit kernel's
Adam (decoupled weight decay, no grad scale) on float32 arrays: its bits (a test checks them).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from bf16opt._cpu import vector_blocks
from bf16opt._cpu.storage import pointer_to

BLOCK = vector_blocks.ADAM_BLOCK


def scalars(limit_scalars) -> np.ndarray:
    """The blocks' scalars (``cpu_src/adam.py``'s: a weight decay before the decay) from the
    compute-limit kernel's eight Adam scalars (decoupled: the weight decay is not read)."""
    values = list(limit_scalars)
    return np.array(values[:7] + [0.0] + values[7:], dtype=np.float32)


@functools.lru_cache(maxsize=None)
def kernel():
    """``run(p, g, m, v, scalars, parts)``: float32 arrays of one size, a multiple of
    ``parts * BLOCK``; ``scalars`` from :func:`scalars`; ``parts`` contiguous ranges, one per
    parallel task."""
    form = vector_blocks.UNIT | vector_blocks.PREFETCH * vector_blocks.prefetching()  # (as bf16opt's)

    @njit(parallel=True, nogil=True)
    def run(p, g, m, v, scalars, parts):
        per = p.size // parts
        scale = np.float32(1.0)
        values = pointer_to(scalars.ctypes.data, np.float32)
        keys = pointer_to(scalars.ctypes.data, np.uint32)  # (not read: no stochastic rounding)
        for t in prange(parts):
            for j in range(t * per, (t + 1) * per, BLOCK):
                at = 4 * j
                vector_blocks.adam_block(form, p.ctypes.data + at, g.ctypes.data + at, 0, m.ctypes.data + at,
                                         v.ctypes.data + at, values, scale, keys, j,
                                         vector_blocks.prefetch_ahead(j - t * per, per, BLOCK))

    return run
