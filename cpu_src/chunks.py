"""The launch plan shared by the kernels: a chunk table over many tensors, and its driver.

One kernel call updates every tensor of a bucket.  The tensors are cut into chunks of at
most ``CHUNK`` elements; row ``c`` of the table holds, for each buffer of the update
(param, grad, master, moments...), the byte address of the chunk's first element, then
three columns: the chunk's length, the index of its first element in its tensor (the
element counter of stochastic rounding) and the tensor's position in the bucket.
Buffers a configuration does not have get address 0 and are never read.

The work of a configuration is a *chunk function* (``rows.py``'s loops around the math of
``adam.py``, ``lion.py`` or ``sgd.py``): a serial
Numba ``cfunc`` with the C signature :data:`CHUNK_SIGNATURE`
``void(int64 *row, float32 *scalars, uint32 *keys, int64 *counts)`` that updates the
elements of one table row: ``scalars`` are the step's float32 scalars, ``keys`` the
tensor's random-stream keys (one per stream, see ``storage.py``), ``counts`` the row's
three telemetry counters.  :func:`run_chunks` is the one parallel kernel: it gives each
thread one contiguous range of rows holding about the same number of elements
(:func:`balanced_bounds`: a model's many small tensors make rows of unequal length, so an
equal number of rows per thread would not be equal work) and calls the chunk function
through its address; a thread done with its range takes the rows left at the back of the
others' (work stealing), so a thread slowed by other work on its core does not hold up the
step.  It is compiled once for all configurations; each configuration costs only a serial
compile, much cheaper than compiling a ``parallel=True`` kernel.

Every element is computed independently of the others and each row writes its own
counters, so results do not depend on the chunk size, the number of threads or which thread
ran a row.
"""

from __future__ import annotations

import hashlib
import pathlib
from types import FunctionType

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba.extending import intrinsic

from .roles import STREAMS

__all__ = ["CHUNK", "CHUNK_SIGNATURE", "COUNTERS", "KERNEL_SOURCES", "KEYS", "balanced_bounds",
           "build_chunk_table", "cached_njit", "chunk_compiler", "rows_done", "run_chunks",
           "run_chunks_serial", "run_rows_in_order", "run_rows_in_order_serial", "inline_jit",
           "tensor_counts", "update_jit"]

#: elements per chunk: large enough for long vector loops, small enough to balance threads
CHUNK = 1 << 15
#: columns after the buffer addresses: length, first element index, tensor index
TRAILING_COLUMNS = 3
#: random-stream keys per tensor: stream 0 (buffers WEIGHTS and EXP_AVG), stream 1 (EXP_AVG_SQ and
#: MAX_EXP_AVG_SQ) -- roles.py's STREAMS
KEYS = STREAMS
#: telemetry counters per row (swallowed, exp_avg underflow, exp_avg_sq underflow)
COUNTERS = 3
#: a range's rows still to run, packed in one int64 word (claimed with one compare-exchange):
#: the first in the low 32 bits, the end in the high 32 bits
_ROW_MASK = (1 << 31) - 1
#: int64 words between two ranges' words: one cache line each (the owners' claims do not
#: contend for a line)
_CURSOR_STRIDE = 8


def _sources_digest(directory: pathlib.Path) -> str:
    """Digest of the kernel sources in ``directory`` (every ``.py`` file, by name and content)."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


#: digest of this package's sources, part of the name each kernel is cached under
KERNEL_SOURCES = _sources_digest(pathlib.Path(__file__).resolve().parent)


def _source_named(function):
    """``function`` renamed to hold :data:`KERNEL_SOURCES`, the name Numba caches it under:
    Numba checks a cached compilation against the file defining the function only, not the
    functions it inlines or links from other files (``storage.py``, ``vector_blocks.py``,
    this file's drivers), so after an edit of any kernel source no cached kernel is loaded."""
    function.__qualname__ = f"{function.__qualname__}_{KERNEL_SOURCES[:16]}"
    return function


def cached_njit(**options):
    """``numba.njit(cache=True, **options)``, cached under a name holding the kernel sources'
    digest (:func:`_source_named`)."""
    return lambda function: njit(cache=True, **options)(_source_named(function))


#: the decorator of an algorithm's element update (``rows.py``): called at several sites of the
#: loops, so compiled once and inlined by LLVM (Numba would compile it again at each site), and
#: called from nowhere else, so compiled without the wrappers Python and C callers need (a
#: CPython wrapper unboxing a tuple of scalars costs compile time and is never called)
update_jit = njit(forceinline=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)
#: the decorator of the functions a chunk function calls once (``rows.py``'s loops, an
#: algorithm's ``begin`` and ``block``): inlined by Numba, compiled with the caller, not apart
inline_jit = njit(inline="always")


CHUNK_SIGNATURE = types.void(types.CPointer(types.int64), types.CPointer(types.float32),
                             types.CPointer(types.uint32), types.CPointer(types.int64))


def chunk_compiler(configuration: tuple, **functions):
    """Decorator compiling a chunk function of one ``configuration`` (the arguments it was
    made from, a tuple with a deterministic repr): a ``cfunc`` of :data:`CHUNK_SIGNATURE`,
    cached on disk under a name of its own.

    ``functions``: the configuration's jitted functions the chunk function calls by their
    global names (``rows.py``: ``drive``, the row's loops, jitted by :data:`inline_jit`).
    Globals, not closure cells: Numba's on-disk cache key holds the pickled closure, and a
    jitted function pickles with a per-process id.

    Why a name of its own: Numba keeps every cached compilation of one Python function in
    one index file, and its save reads the index, adds the entry under the first unused
    data-file number and writes index and data file separately.  Two processes saving
    different configurations at once (xdist workers, DDP ranks on first use) can both take
    the same number, so one configuration's entry ends up naming the other's machine code
    -- a wrong update or a crash in every later process (numba issue 4807).  With one index
    per configuration, processes writing one index at once write the same compilation.
    The name also holds the kernel sources' digest (:func:`_source_named`).
    """
    digest = hashlib.sha256(repr(configuration).encode()).hexdigest()[:16]

    def compile_chunk(function):
        qualname = function.__qualname__
        if functions:
            function = FunctionType(function.__code__, dict(function.__globals__, **functions),
                                    function.__name__, function.__defaults__, function.__closure__)
        function.__qualname__ = f"{qualname}_{digest}"
        return cfunc(CHUNK_SIGNATURE, cache=True, error_model="numpy")(_source_named(function))

    return compile_chunk


def build_chunk_table(addresses: np.ndarray, itemsizes: np.ndarray, numels: np.ndarray,
                      chunk: int = CHUNK) -> np.ndarray:
    """int64 table (n_chunks, n_buffers + 3) for tensors described by their addresses.

    ``addresses[t, b]`` is the byte address of buffer ``b`` of tensor ``t`` (contiguous
    memory), ``itemsizes[b]`` its element size in bytes (0 for an absent buffer; negative for
    a q8 buffer: minus its bytes per block of 256 elements -- ``chunk`` is a multiple of 256,
    so rows start on blocks), ``numels[t]`` the tensor's element count.  Empty tensors get no
    rows.
    """
    addresses = np.asarray(addresses, dtype=np.int64)
    itemsizes = np.asarray(itemsizes, dtype=np.int64)
    numels = np.asarray(numels, dtype=np.int64)
    n_tensors, n_buffers = addresses.shape
    counts = (numels + (chunk - 1)) // chunk
    tensor_of_row = np.repeat(np.arange(n_tensors, dtype=np.int64), counts)
    first_row = np.cumsum(counts) - counts
    start = (np.arange(tensor_of_row.size, dtype=np.int64) - first_row[tensor_of_row]) * chunk
    table = np.empty((tensor_of_row.size, n_buffers + TRAILING_COLUMNS), dtype=np.int64)
    per_block = itemsizes < 0
    if per_block.any() and chunk % 256:
        raise ValueError(f"chunks of q8 buffers are whole blocks of 256 elements, got chunk={chunk}")
    offsets = np.where(per_block[None, :], (start[:, None] // 256) * -itemsizes[None, :],
                       start[:, None] * itemsizes[None, :])
    table[:, :n_buffers] = addresses[tensor_of_row] + offsets
    table[:, n_buffers] = np.minimum(numels[tensor_of_row] - start, chunk)
    table[:, n_buffers + 1] = start
    table[:, n_buffers + 2] = tensor_of_row
    return table


def balanced_bounds(table: np.ndarray, parts: int) -> np.ndarray:
    """int64 row boundaries (parts + 1 of them, from 0 to the row count) cutting ``table`` into
    ``parts`` contiguous ranges with about equal element counts (within one chunk)."""
    if table.shape[0] > _ROW_MASK:  # (2**31 rows of 2**15 elements: beyond any machine's memory)
        raise ValueError(f"the chunk table has {table.shape[0]} rows; the driver counts up to {_ROW_MASK}")
    done = np.cumsum(table[:, -3])  # elements in rows 0..r
    total = int(done[-1]) if done.size else 0
    targets = np.arange(1, parts, dtype=np.int64) * total // parts
    inner = np.searchsorted(done, targets, side="left") + 1  # the row reaching a target closes its range
    return np.concatenate(([0], np.minimum(inner, table.shape[0]), [table.shape[0]])).astype(np.int64)


def tensor_counts(table: np.ndarray, row_counts: np.ndarray, n_tensors: int) -> np.ndarray:
    """Per-tensor sums (n_tensors, COUNTERS) of the rows' telemetry counters."""
    out = np.zeros((n_tensors, row_counts.shape[1]), dtype=np.int64)
    np.add.at(out, table[:, -1], row_counts)
    return out


# ---------------------------------------------------------------- the parallel driver
@intrinsic
def _element_pointer(typingctx, array, offset):
    """Pointer to element ``offset`` (flat, C order) of a C-contiguous array."""
    if not isinstance(array, types.Array) or not isinstance(offset, types.Integer):
        return None
    pointer = types.CPointer(array.dtype)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        return builder.gep(data, [args[1]])

    return pointer(array, offset), codegen


@intrinsic
def _call_chunk(typingctx, address, row, scalars, keys, counts):
    """Call the chunk function at ``address`` (signature CHUNK_SIGNATURE)."""
    arguments = (row, scalars, keys, counts)
    if not isinstance(address, types.Integer) or arguments != tuple(CHUNK_SIGNATURE.args):
        return None

    def codegen(context, builder, signature, args):
        function_type = ir.FunctionType(ir.VoidType(), [a.type for a in args[1:]])
        function = builder.inttoptr(args[0], function_type.as_pointer())
        builder.call(function, args[1:])
        return context.get_dummy_value()

    return types.void(address, row, scalars, keys, counts), codegen


@intrinsic
def _atomic_load(typingctx, array, index):
    """``array[index]`` of an int64 array, read atomically (other threads write it)."""
    if not isinstance(array, types.Array) or array.dtype != types.int64 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "monotonic", 8)

    return types.int64(array, index), codegen


@intrinsic
def _compare_exchange(typingctx, array, index, expected, desired):
    """Atomically: if ``array[index] == expected``, store ``desired``.  Returns the value
    found (``expected`` when it stored)."""
    if not isinstance(array, types.Array) or array.dtype != types.int64 \
            or not all(isinstance(a, types.Integer) for a in (index, expected, desired)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        found = builder.cmpxchg(builder.gep(data, [args[1]]), args[2], args[3], "acq_rel", "monotonic")
        return builder.extract_value(found, 0)

    return types.int64(array, index, expected, desired), codegen


@intrinsic
def _fetch_add(typingctx, array, index, value):
    """Atomically add ``value`` to ``array[index]`` (int64), returning the value before; ordered
    after this thread's earlier writes (a reader that sees the sum sees them too)."""
    if not isinstance(array, types.Array) or array.dtype != types.int64 \
            or not all(isinstance(a, types.Integer) for a in (index, value)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        return builder.atomic_rmw("add", builder.gep(data, [args[1]]), args[2], "acq_rel")

    return types.int64(array, index, value), codegen


@intrinsic
def _acquire_load(typingctx, array, index):
    """``array[index]`` of an int64 array, read with acquire ordering (pairs with :func:`_fetch_add`)."""
    if not isinstance(array, types.Array) or array.dtype != types.int64 \
            or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)

    return types.int64(array, index), codegen


@njit(inline="always")
def _run_row(address, table, scalars, keys, row_counts, row):
    """The chunk function at ``address`` on row ``row`` of ``table`` (every driver's call)."""
    width = table.shape[1]
    _call_chunk(address, _element_pointer(table, row * width), _element_pointer(scalars, 0),
                _element_pointer(keys, table[row, width - 1] * KEYS), _element_pointer(row_counts, row * COUNTERS))


@njit(inline="always")
def _claim_row(cursors, part, from_back):
    """A row of range ``part`` no thread has claimed, taken from the range's front (its own
    thread, in order) or back (another thread, done with its own range); -1 when none is left."""
    place = part * _CURSOR_STRIDE
    word = _atomic_load(cursors, place)
    while True:
        first, end = word & _ROW_MASK, word >> 32
        if first >= end:
            return -1
        row = end - 1 if from_back else first
        remaining = first | (row << 32) if from_back else (first + 1) | (end << 32)
        found = _compare_exchange(cursors, place, word, remaining)
        if found == word:
            return row
        word = found


@cached_njit(parallel=True, nogil=True)
def run_chunks(address, table, scalars, keys, row_counts, bounds):
    """Run the chunk function at ``address`` on every row of ``table``, each row once: the
    rows ``bounds[k]:bounds[k + 1]`` in order by thread ``k`` (the ranges in parallel); a
    thread done with its range runs rows from the back of the others' ranges.

    ``keys``: uint32 (n_tensors, KEYS); ``row_counts``: int64 (n_rows, COUNTERS), written
    by chunk functions that count (telemetry), never read by others.
    """
    parts = bounds.size - 1
    cursors = np.empty(parts * _CURSOR_STRIDE, dtype=np.int64)
    for part in range(parts):
        cursors[part * _CURSOR_STRIDE] = bounds[part] | (bounds[part + 1] << 32)
    for part in prange(parts):
        for k in range(parts):  # its own range, then the others' (stealing from their backs)
            other = (part + k) % parts
            while True:
                row = _claim_row(cursors, other, k != 0)
                if row < 0:
                    break
                _run_row(address, table, scalars, keys, row_counts, row)


@cached_njit(nogil=True)
def run_chunks_serial(address, table, scalars, keys, row_counts, bounds):
    """:func:`run_chunks` on the calling thread only: for forked children, where the parent's
    OpenMP thread pool (Numba's ``omp`` layer) is not usable.  Same rows, same bits."""
    for part in range(bounds.size - 1):
        for row in range(bounds[part], bounds[part + 1]):
            _run_row(address, table, scalars, keys, row_counts, row)


# ---------------------------------------------------------------- the offload pipeline's driver
@cached_njit(parallel=True, nogil=True)
def run_rows_in_order(address, table, scalars, keys, row_counts, first, end, chunk_of_row, done,
                      parts):
    """Run the chunk function at ``address`` on rows ``first:end`` of ``table``, each once, the
    ``parts`` threads taking them from one shared counter in row order; after each row, add one to
    ``done[chunk_of_row[row]]``.  The offload pipeline reads those counts
    (:func:`rows_done`) to upload each of its chunks (row ranges) as soon as they are written,
    while the rows after them are still being updated."""
    cursor = np.full(_CURSOR_STRIDE, first, dtype=np.int64)
    for _ in prange(parts):
        while True:
            row = _fetch_add(cursor, 0, 1)
            if row >= end:
                break
            _run_row(address, table, scalars, keys, row_counts, row)
            _fetch_add(done, chunk_of_row[row], 1)


@cached_njit(nogil=True)
def run_rows_in_order_serial(address, table, scalars, keys, row_counts, first, end, chunk_of_row, done,
                             parts):
    """:func:`run_rows_in_order` on the calling thread only (forked children, as
    :func:`run_chunks_serial`)."""
    for row in range(first, end):
        _run_row(address, table, scalars, keys, row_counts, row)
        _fetch_add(done, chunk_of_row[row], 1)


@cached_njit(nogil=True)
def rows_done(done, chunk):
    """``done[chunk]`` as :func:`run_rows_in_order` left it, with its rows' writes visible."""
    return _acquire_load(done, chunk)
