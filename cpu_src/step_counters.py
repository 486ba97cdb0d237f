"""Every param's step counter (``state["step"]``, a one-element float64 CPU tensor) read and
advanced through its address, all counters in one call.

For the optimizer's step cache (``bf16opt/step_cache.py``): one torch call per counter
(``torch._foreach_add_`` falls back to a loop on CPU) costs more than the whole update of
~150 small params.  The cache checks the counters' identities and addresses first.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .storage import pointer_to


@njit(nogil=True, cache=True)
def read_counters(addresses, values):
    """``values[i]`` = the float64 at ``addresses[i]``."""
    for i in range(addresses.size):
        values[i] = pointer_to(addresses[i], np.float64)[0]


@njit(nogil=True, cache=True)
def advance_counters(addresses):
    """Add 1 to the float64 at each of ``addresses``."""
    for i in range(addresses.size):
        counter = pointer_to(addresses[i], np.float64)
        counter[0] += 1.0
