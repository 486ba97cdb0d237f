"""What each rounded array of an update draws on, stated once: its stochastic-rounding buffer
(which half of which random stream's bits) and, for an optimizer state, its q8 map.

Every backend derives its choice from :data:`STATE_ROLES`: the reference
(``bf16opt/storage.py``'s ``q8_signed``, ``bf16opt/backends/reference.py``), the role
descriptions (``bf16opt/algorithms.py``'s ``Role.buffer``), the Numba kernels (``rows.state``,
the blocks of ``vector_blocks.py`` and ``q8_blocks.py``) and the CUDA instantiations
(``bf16opt/backends/cupy.py``'s ``Q8<signed, ...>`` template argument).  A new state is a row
here; a new algorithm whose states are known rows adds nothing.

Plain Python without numba: ``bf16opt`` imports it (as ``bf16opt._cpu.roles``) without
importing the kernels, and a change here changes ``chunks.KERNEL_SOURCES`` (every ``.py`` file
of this directory), so no cached kernel built on an older table is loaded.

Buffers (docs/numerics.md, "Random streams"): buffer ``b`` draws from stream ``b >> 1``, the
even buffer of a stream the upper 16 bits of its hash, the odd one the lower 16.  The CUDA
kernels name the same numbers in ``enum Buffer`` (``cuda_src/storage.cuh``; the tests check
it and the kernels' ``Q8Slot`` wiring against this table).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["EXP_AVG", "EXP_AVG_SQ", "MAX_EXP_AVG_SQ", "STATE_ROLES", "STREAMS", "WEIGHTS", "StateRole",
           "buffer_of", "q8_signed", "state_role", "stream_of"]

#: the buffer numbers: the param (when it is its own master) and the states
WEIGHTS, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ = 0, 1, 2, 3
#: random streams per tensor and step (two buffers each)
STREAMS = 2


class StateRole(NamedTuple):
    """An optimizer state's rounding: ``buffer`` the random bits it rounds with (stochastic
    rounding of 16-bit or q8 storage); ``q8_signed`` its q8 map: signed (-1..1, a first moment)
    or unsigned (0..1, a second moment, never negative)."""
    buffer: int
    q8_signed: bool


#: every state an algorithm may keep, by role name (``bf16opt.algorithms``' ``Role.name``)
STATE_ROLES = {
    "exp_avg": StateRole(EXP_AVG, q8_signed=True),
    "exp_avg_sq": StateRole(EXP_AVG_SQ, q8_signed=False),
    "max_exp_avg_sq": StateRole(MAX_EXP_AVG_SQ, q8_signed=False),
    "momentum_buffer": StateRole(EXP_AVG, q8_signed=True),  # SGD's first moment: exp_avg's buffer
}


def state_role(role: str) -> StateRole:
    """The row of the state ``role``; a ValueError for a role without one."""
    try:
        return STATE_ROLES[role]
    except KeyError:
        raise ValueError(f"no state role {role!r} in bf16opt._cpu.roles.STATE_ROLES") from None


def buffer_of(role: str) -> int:
    """The buffer the array ``role`` rounds with: ``WEIGHTS`` for the param, a state's own."""
    return WEIGHTS if role == "param" else state_role(role).buffer


def q8_signed(role: str) -> bool:
    """Whether the state ``role`` uses the signed q8 map (first moments) or the unsigned one."""
    return state_role(role).q8_signed


def stream_of(buffer: int) -> int:
    """The random stream whose hash gives ``buffer`` its bits."""
    return buffer >> 1


assert all(0 <= stream_of(row.buffer) < STREAMS for row in STATE_ROLES.values())
