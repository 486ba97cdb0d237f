"""The row driver: the loops of every chunk function over one chunk-table row's elements
(``cuda_src/multi_tensor.cuh``'s ``update_chunks`` on the CPU), around an algorithm's math.

An algorithm file (``adam.py``, ``lion.py``, ``sgd.py``) holds its math only: per
configuration, jitted functions (``update`` by :data:`chunks.update_jit`, compiled once and
inlined by LLVM at each of its call sites here; the others by :data:`chunks.inline_jit`),
which :func:`chunk_function` takes:

- ``begin(row, scalars, keys)``: the row's layout (its roles' order) and the step's scalars
  as the update reads them: ``(param, grad, companion, states, n, start, now, scale)``, the
  byte addresses of the param, grad and companion (0 when absent) and a tuple of the state
  arrays' addresses, the row's element count and its first element's index in its tensor,
  the update's scalars ``now`` (a tuple) and ``scale`` (``inv_grad_scale * sign``, the blocks');
- ``update(g, p, c, states, element, now)``: the update of one element, from its stored
  elements (grad, param, companion, a tuple of the states'; an element the configuration
  does not read is a zero of its format) to ``(p, c, states, hits)``: the elements to store
  and the telemetry flags, one per counter;
- ``block(param, grad, companion, states, scalars, scale, keys, element, ahead)``, where
  ``vector_blocks.form`` covers the configuration: its hand-vectorised update (the same
  operations, the same bits) of one block of elements at the addresses.

The loops, each running ``update`` on the elements the ones before it left:

- the paired loop, when every array the configuration touches is 16-bit (and the blocks do
  not take the row) and the row's addresses are 4-byte aligned: one uint32 word of each array
  holds two elements, so decoding is one shift or mask and encoding one merge per pair
  (cheaper than widening and narrowing 16-bit lanes);
- the blocks, whole blocks of ``block_size`` elements through ``block``;
- the element loop, one element at a time.

The loops of a configuration are one function (``drive``), which Numba inlines into the
algorithm file's chunk function (the same code as loops written there).  Formats, flags and
policies are closure constants, so LLVM folds them away: no run-time branch in a loop.  A
configuration has at most :data:`STATES` state arrays; the driver's slots past its own hold
address 0 and are neither read nor written.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba.core.extending import overload

from . import q8
from .chunks import COUNTERS, chunk_compiler, inline_jit
from .roles import state_role
from .storage import (MOMENT_ROUNDINGS, WEIGHT_ARRAYS, WEIGHT_POLICIES, element_index, high_half, low_half,
                      pair_word, pointer_to)
from .vector_blocks import prefetch_ahead

__all__ = ["STATES", "Math", "State", "block_math", "checked_policies", "chunk_function", "state"]

#: the most state arrays of one algorithm (Adam's exp_avg, exp_avg_sq, max_exp_avg_sq)
STATES = 3
_SIXTEEN_BITS = (np.int16, np.uint16)


class State(NamedTuple):
    """One state array of a configuration (:func:`state`): its element class, whether the
    update reads and whether it writes its elements; a q8 state's map (``q8.SIGNED`` or
    ``q8.UNSIGNED``, format np.uint8; 0: not q8) and its stochastic-rounding buffer number."""
    format: type
    reads: bool = True
    writes: bool = True
    q8: int = 0
    buffer: int = 0


_ABSENT = State(np.uint16, False, False)


class Math(NamedTuple):
    """An algorithm's functions for one configuration (the module docstring): ``block`` None
    where the blocks do not cover the configuration, else ``block_size`` elements per block
    (with q8 states: a q8 block of ``q8_blocks.py``, its states' row addresses for theirs).
    The loops call them as closure cells: only the shell is cached, under its own key."""
    begin: object
    update: object
    block: object = None
    block_size: int = 0
    q8_stochastic: bool = False  # q8 states round stochastically


def block_math(begin, update, form, quantized: bool, q8_stochastic: bool, block, block_size: int,
               q8_block) -> Math:
    """An algorithm's :class:`Math`: no blocks where ``form`` is None (``vector_blocks.form``
    does not cover the configuration), else ``q8_block`` over whole q8 blocks where the states
    are ``quantized``, else ``block`` of ``block_size`` elements."""
    if form is None:
        return Math(begin, update, q8_stochastic=q8_stochastic)
    if quantized:
        return Math(begin, update, q8_block, q8.BLOCK, q8_stochastic)
    return Math(begin, update, block, block_size)


def state(role: str, format, reads: bool = True, writes: bool = True) -> State:
    """The state array ``role`` of element class ``format`` (q8: np.uint8): its map and its
    buffer are its row of ``roles.STATE_ROLES``; the update takes the buffer, a constant, from
    ``State.buffer`` (``storage.buffer_bits``)."""
    row = state_role(role)
    kind = (q8.SIGNED if row.q8_signed else q8.UNSIGNED) if format is np.uint8 else 0
    return State(format, reads, writes, kind, row.buffer)


def element_class(format):
    """The element class an algorithm's ``update`` sees for a state of ``format``: q8 states
    (np.uint8) as float32 (the row driver decodes and quantizes their blocks)."""
    return np.float32 if format is np.uint8 else format


def checked_q8_rounding(rounding: str) -> bool:
    """Whether q8 states round stochastically (``rounding``: "nearest" or "stochastic")."""
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"unknown q8 rounding {rounding!r}")
    return rounding == "stochastic"


def checked_policies(weights: str, moment_rounding: str) -> tuple:
    """``(weights, moments)`` as plain strings (closure constants), refused unless known."""
    if weights not in WEIGHT_POLICIES or moment_rounding not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown storage policy {weights!r} / rounding {moment_rounding!r}")
    return str(weights), str(moment_rounding)


def padded(values, filler):
    """``values`` (a tuple of at most STATES) followed by ``filler`` up to STATES entries."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(padded, inline="always")
def _padded_impl(values, filler):
    missing = STATES - len(values)
    if missing == 0:
        return lambda values, filler: values
    if missing == 1:
        return lambda values, filler: values + (filler,)
    return lambda values, filler: values + (filler, filler)


def chunk_function(configuration: tuple, formats: tuple, weights: str, states: tuple, counters: int,
                   track: bool, math: Math, shell):
    """The compiled chunk function (``chunks.py``'s ``cfunc``) running ``update`` over a row.

    ``configuration``: the arguments it was made from (the name of its on-disk cache,
    :func:`chunks.chunk_compiler`); ``formats``: the element classes of the param, grad and
    companion; ``weights``: the master policy (``storage.WEIGHT_ARRAYS``: which of param and
    companion it reads); ``states``: a :class:`State` per state array, in the row's order;
    ``counters``: the telemetry counters ``update`` flags (counted with ``track``); ``math``:
    the algorithm's functions; ``shell``: the algorithm file's ``chunk(row, scalars, keys,
    counts)`` calling the global ``drive``, the loops below: Numba names a kernel's cache files
    after the file defining it, so each algorithm's stay its own.
    """
    param_format, grad_format, companion_format = formats
    reads_param, has_companion = WEIGHT_ARRAYS[weights]
    n_states = len(states)
    if not 0 < n_states <= STATES or not 0 < counters <= COUNTERS:
        raise ValueError(f"{n_states} state arrays and {counters} counters: at most {STATES} and {COUNTERS}")
    (format_0, reads_0, writes_0), (format_1, reads_1, writes_1), (format_2, reads_2, writes_2) = \
        (state[:3] for state in tuple(states) + (_ABSENT,) * (STATES - n_states))
    counts_1, counts_2 = counters > 1, counters > 2
    vector, block_size = math.block is not None, math.block_size
    present = (param_format, grad_format) + ((companion_format,) if has_companion else ()) + \
        tuple(state.format for state in states if state.reads or state.writes)
    # all arrays 16-bit: words of two elements, unless the blocks take them
    paired = not vector and all(f in _SIXTEEN_BITS for f in present)
    param_size, grad_size, companion_size, size_0, size_1, size_2 = (  # bytes per element
        np.dtype(f).itemsize for f in formats + (format_0, format_1, format_2))

    begin, update, block = math.begin, math.update, math.block
    if any(state.q8 for state in states):
        drive = _q8_drive(formats, weights, states, counters, track, math)
        chunk = chunk_compiler(configuration, drive=drive)(shell)
        chunk.vectorised = vector
        return chunk

    @inline_jit
    def drive(row, scalars, keys, counts):
        param_at, grad_at, companion_at, states_at, n, start, now, scale = begin(row, scalars, keys)
        at_0, at_1, at_2 = padded(states_at, 0)
        param = pointer_to(param_at, param_format)
        grad = pointer_to(grad_at, grad_format)
        companion = pointer_to(companion_at, companion_format)
        state_0 = pointer_to(at_0, format_0)
        state_1 = pointer_to(at_1, format_1)
        state_2 = pointer_to(at_2, format_2)
        hits_0, hits_1, hits_2 = 0, 0, 0
        first = 0
        # (uint32 words need 4-byte aligned addresses; absent arrays have address 0)
        if paired and ((param_at | grad_at | companion_at | at_0 | at_1 | at_2) & 3) == 0:
            param_words = pointer_to(param_at, np.uint32)
            grad_words = pointer_to(grad_at, np.uint32)
            companion_words = pointer_to(companion_at, np.uint32)
            words_0 = pointer_to(at_0, np.uint32)
            words_1 = pointer_to(at_1, np.uint32)
            words_2 = pointer_to(at_2, np.uint32)
            for j in range(n >> 1):
                g = grad_words[j]
                p = param_words[j] if reads_param else np.uint32(0)
                c = companion_words[j] if has_companion else np.uint32(0)
                s0 = words_0[j] if reads_0 else np.uint32(0)
                s1 = words_1[j] if reads_1 else np.uint32(0)
                s2 = words_2[j] if reads_2 else np.uint32(0)
                lows = (low_half(s0, format_0), low_half(s1, format_1), low_half(s2, format_2))
                highs = (high_half(s0, format_0), high_half(s1, format_1), high_half(s2, format_2))
                low = update(low_half(g, grad_format), low_half(p, param_format),
                             low_half(c, companion_format), lows[:n_states], element_index(start, 2 * j), now)
                high = update(high_half(g, grad_format), high_half(p, param_format),
                              high_half(c, companion_format), highs[:n_states],
                              element_index(start, 2 * j + 1), now)
                param_words[j] = pair_word(low[0], high[0])
                if has_companion:
                    companion_words[j] = pair_word(low[1], high[1])
                low_states, high_states = padded(low[2], np.uint16(0)), padded(high[2], np.uint16(0))
                if writes_0:
                    words_0[j] = pair_word(low_states[0], high_states[0])
                if writes_1:
                    words_1[j] = pair_word(low_states[1], high_states[1])
                if writes_2:
                    words_2[j] = pair_word(low_states[2], high_states[2])
                if track:
                    low_hits, high_hits = padded(low[3], False), padded(high[3], False)
                    hits_0 += low_hits[0] + high_hits[0]
                    hits_1 += low_hits[1] + high_hits[1]
                    hits_2 += low_hits[2] + high_hits[2]
            first = n - (n & 1)
        if vector:
            first = n - n % block_size
            for j in range(0, first, block_size):
                states_j = (at_0 + size_0 * j, at_1 + size_1 * j, at_2 + size_2 * j)
                block(param_at + param_size * j, grad_at + grad_size * j, companion_at + companion_size * j,
                      states_j[:n_states], scalars, scale, keys, element_index(start, j),
                      prefetch_ahead(j, n, block_size))
        for i in range(first, n):
            elements = (state_0[i] if reads_0 else format_0(0), state_1[i] if reads_1 else format_1(0),
                        state_2[i] if reads_2 else format_2(0))
            out = update(grad[i], param[i] if reads_param else param_format(0),
                         companion[i] if has_companion else companion_format(0), elements[:n_states],
                         element_index(start, i), now)
            param[i] = out[0]
            if has_companion:
                companion[i] = out[1]
            out_states = padded(out[2], np.uint16(0))
            if writes_0:
                state_0[i] = out_states[0]
            if writes_1:
                state_1[i] = out_states[1]
            if writes_2:
                state_2[i] = out_states[2]
            if track:
                out_hits = padded(out[3], False)
                hits_0 += out_hits[0]
                hits_1 += out_hits[1]
                hits_2 += out_hits[2]
        if track:
            counts[0] = hits_0
            if counts_1:
                counts[1] = hits_1
            if counts_2:
                counts[2] = hits_2

    # (the shell calls the loops as a global: see chunks.chunk_compiler)
    chunk = chunk_compiler(configuration, drive=drive)(shell)
    chunk.vectorised = vector  # (the tests check which loop a configuration got)
    return chunk


# ---------------------------------------------------------------- q8 states: block by block
@inline_jit
def _read_array(array, scratch, i, j):
    return array[i]


@inline_jit
def _read_scratch(array, scratch, i, j):
    return scratch[j]


@inline_jit
def _write_array(array, scratch, i, j, value):
    array[i] = value


@inline_jit
def _write_scratch(array, scratch, i, j, value):
    scratch[j] = value


@inline_jit
def _write_none(array, scratch, i, j, value):
    pass


def _reader(state: State):
    if state.q8:
        return _read_scratch
    if state.reads:
        return _read_array
    zero = state.format

    @inline_jit
    def read_zero(array, scratch, i, j):
        return zero(0)

    return read_zero


def _writer(state: State):
    if not state.writes:
        return _write_none
    return _write_scratch if state.q8 else _write_array


def _q8_drive(formats: tuple, weights: str, states: tuple, counters: int, track: bool, math: Math):
    """The loops of a configuration with q8 states (``q8.py``): the row's whole blocks through
    ``block`` (``q8_blocks.py``: every state q8, hand-vectorised) where the configuration has
    one; the other blocks one by one, the q8 states' codes decoded into float32 scratch arrays,
    ``update`` (which sees a q8 state as a float32 one) over the block's elements, then the new
    values quantized.  A row starts on a block (the chunk table's rows are whole blocks but for
    a tensor's last)."""
    param_format, grad_format, companion_format = formats
    reads_param, has_companion = WEIGHT_ARRAYS[weights]
    n_states = len(states)
    (format_0, _, writes_0, q8_0, buffer_0), (format_1, _, writes_1, q8_1, buffer_1), \
        (format_2, _, writes_2, q8_2, buffer_2) = tuple(states) + (_ABSENT,) * (STATES - n_states)
    read_0, read_1, read_2 = (_reader(s) for s in tuple(states) + (_ABSENT,) * (STATES - n_states))
    write_0, write_1, write_2 = (_writer(s) for s in tuple(states) + (_ABSENT,) * (STATES - n_states))
    # telemetry: state k's underflows go to counter k + 1 (amsgrad's maximum has none)
    count_0, count_1 = track and counters > 1, track and counters > 2
    counts_1, counts_2 = counters > 1, counters > 2
    stochastic = math.q8_stochastic
    begin, update, block = math.begin, math.update, math.block
    # whole blocks through the algorithm's q8 block (q8_blocks.py) where it covers the configuration
    vector = block is not None
    param_size, grad_size, companion_size = (np.dtype(f).itemsize for f in formats)

    @inline_jit
    def drive(row, scalars, keys, counts):
        param_at, grad_at, companion_at, states_at, n, start, now, scale = begin(row, scalars, keys)
        at_0, at_1, at_2 = padded(states_at, 0)
        param = pointer_to(param_at, param_format)
        grad = pointer_to(grad_at, grad_format)
        companion = pointer_to(companion_at, companion_format)
        state_0 = pointer_to(at_0, format_0)
        state_1 = pointer_to(at_1, format_1)
        state_2 = pointer_to(at_2, format_2)
        scratch_0, scratch_1, scratch_2 = q8.scratch_block(), q8.scratch_block(), q8.scratch_block()
        hits_0, hits_1, hits_2 = 0, 0, 0
        whole = 0
        if vector:
            whole = n - n % q8.BLOCK
            for first in range(0, whole, q8.BLOCK):
                row_at = (first // q8.BLOCK) * q8.ROW
                rows_at = (at_0 + row_at, at_1 + row_at, at_2 + row_at)
                block(param_at + param_size * first, grad_at + grad_size * first,
                      companion_at + companion_size * first, rows_at[:n_states], scalars, scale, keys,
                      element_index(start, first), prefetch_ahead(first, n, q8.BLOCK))
        for first in range(whole, n, q8.BLOCK):
            count = min(q8.BLOCK, n - first)
            row_at = (first // q8.BLOCK) * q8.ROW
            if q8_0:
                q8.decode_block(pointer_to(at_0 + row_at, np.uint8), count, q8_0, scratch_0)
            if q8_1:
                q8.decode_block(pointer_to(at_1 + row_at, np.uint8), count, q8_1, scratch_1)
            if q8_2:
                q8.decode_block(pointer_to(at_2 + row_at, np.uint8), count, q8_2, scratch_2)
            for j in range(count):
                i = first + j
                elements = (read_0(state_0, scratch_0, i, j), read_1(state_1, scratch_1, i, j),
                            read_2(state_2, scratch_2, i, j))
                out = update(grad[i], param[i] if reads_param else param_format(0),
                             companion[i] if has_companion else companion_format(0), elements[:n_states],
                             element_index(start, i), now)
                param[i] = out[0]
                if has_companion:
                    companion[i] = out[1]
                out_states = padded(out[2], np.uint16(0))
                write_0(state_0, scratch_0, i, j, out_states[0])
                write_1(state_1, scratch_1, i, j, out_states[1])
                write_2(state_2, scratch_2, i, j, out_states[2])
                if track:
                    out_hits = padded(out[3], False)
                    hits_0 += out_hits[0]
                    hits_1 += out_hits[1]
                    hits_2 += out_hits[2]
            if q8_0 and writes_0:
                under = q8.quantize_block(scratch_0, count, q8_0, stochastic, keys[buffer_0 >> 1], buffer_0 & 1,
                                          start + first, pointer_to(at_0 + row_at, np.uint8))
                if count_0:
                    hits_1 += under
            if q8_1 and writes_1:
                under = q8.quantize_block(scratch_1, count, q8_1, stochastic, keys[buffer_1 >> 1], buffer_1 & 1,
                                          start + first, pointer_to(at_1 + row_at, np.uint8))
                if count_1:
                    hits_2 += under
            if q8_2 and writes_2:
                q8.quantize_block(scratch_2, count, q8_2, stochastic, keys[buffer_2 >> 1], buffer_2 & 1,
                                  start + first, pointer_to(at_2 + row_at, np.uint8))
        if track:
            counts[0] = hits_0
            if counts_1:
                counts[1] = hits_1
            if counts_2:
                counts[2] = hits_2

    return drive
