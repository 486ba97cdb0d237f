"""Numba backend: the CPU kernels of ``cpu_src/`` (installed as ``bf16opt._cpu``).

A thin adapter: it stages a :class:`Bucket` (``staging.py``), turns it into one chunk
table (byte addresses of every tensor's roles, see ``cpu_src/chunks.py``) plus the step's
float32 scalars, the random-stream keys of stochastic rounding and telemetry counters,
picks the compiled chunk function of the bucket's
:class:`~bf16opt.algorithms.KernelConfig` (``cpu_src/<algorithm>.py``'s
``chunk_function``) and makes one parallel kernel call per bucket.  Tensors travel zero-copy: the kernels read and write the tensors' own memory;
bfloat16 and float16 are handled as 16-bit integers.

Every plan is supported: round to nearest or stochastic rounding, Kahan compensation,
the int16 remainder, and precision telemetry (``bucket.counts``), all bit-identical to
``reference.py``.

Importing this module compiles nothing; the kernels (and Numba itself) are imported on
the first step, and compiled on the first step of each configuration, or loaded from
Numba's on-disk cache.

Kernel calls are serialised by one process-wide lock: Numba's ``workqueue`` threading
layer (the one left when neither TBB nor OpenMP is installed) aborts the process when two
Python threads enter parallel code at once, and two parallel calls would only
oversubscribe the cores anyway.  A call over one chunk row runs on the calling thread
(:func:`on_calling_thread`): one thread runs it anyway.

Processes: in a child made by ``fork()`` (a DataLoader worker with the fork start method,
a multiprocessing pool) the kernels run on the calling thread (``run_chunks_serial``): the
parent's OpenMP pool, which Numba's ``omp`` threading layer uses, hangs in a forked child.
Results are the same bits; for parallel updates in a subprocess use the spawn start method.
(torch's own parallel ops have the same problem in a fork child unless it calls
``torch.set_num_threads(1)``, as DataLoader workers do.)

Non-contiguous tensors are laid out by ``staging.py`` (in place in memory order when
every buffer shares one dense layout and no stochastic rounding is involved, otherwise
through contiguous copies written back afterwards); both keep results identical to the
reference.

Between steps: the optimizer's step cache (``bf16opt/step_cache.py``) keeps a bucket's
kernel call as a :class:`Relaunch` -- its own copy of the chunk table, whose grad column is
pointed at each step's grads -- and reuses it while nothing it was built from changed; a
reused call is one compiled call (``step_helpers.relaunch``: grads pointed, stream keys made,
chunks run).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import threading

import numpy as np
import torch

from ..algorithms import ELEMENT_BYTES, SGD, KernelConfig
from ..storage import MASK32, Q8, Q8_ROW, STREAMS
from .base import Bucket, check_scalars
from .staging import check, stage

name = "numba"

# element class each storage dtype travels as (16-bit formats as raw bits: see cpu_src/storage.py)
_VIEW_DTYPES = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16,
                torch.int16: np.int16, Q8: np.uint8}

_KERNEL_LOCK = threading.Lock()  # one parallel kernel at a time (see the module docstring)
_FORKED = False                  # this process is a fork() child: kernels run serially


def _after_fork_in_child() -> None:
    """A forked child inherits the lock in whatever state a parent thread left it, and the
    parent's OpenMP thread pool (Numba's ``omp`` layer; GNU OpenMP is not fork-safe): make
    a new lock and run kernels on the child's one thread (same bits)."""
    global _KERNEL_LOCK, _FORKED
    _KERNEL_LOCK = threading.Lock()
    _FORKED = True


os.register_at_fork(after_in_child=_after_fork_in_child)
_TABLE_CACHE: dict = {}
_TABLE_CACHE_SIZE = 16


def available() -> bool:
    """True when numba is importable (without importing it)."""
    return importlib.util.find_spec("numba") is not None


def check_device(device: torch.device) -> None:
    if torch.device(device).type != "cpu":
        raise ValueError(f"backend='numba' runs on CPU tensors only, got device {device}; "
                         f"use backend='cupy' or 'auto' for CUDA tensors")
    if not available():
        raise ValueError("backend='numba' needs the numba package (pip install numba)")


def _chunks():
    """``cpu_src/chunks.py`` (installed inside the package as bf16opt._cpu, setup.cfg's
    package_dir), imported at the first call (importing compiles nothing)."""
    return _cpu_module("chunks")


def helpers():
    """``cpu_src/step_helpers.py``: step counters by address, stream keys, a kept launch's call."""
    return _cpu_module("step_helpers")


_cpu_modules: dict = {}  # (looked up here: a ``from`` import of a package's module runs Python each time)


def _cpu_module(name: str):
    module = _cpu_modules.get(name)
    if module is None:
        if not _cpu_modules and not _FORKED:  # (a fork child runs kernels serially: no pool)
            _start_threads()
        module = _cpu_modules[name] = importlib.import_module(f"bf16opt._cpu.{name}")
    return module


def _start_threads() -> None:
    """Start Numba's thread pool, keeping torch's intra-op thread count: Numba's OpenMP layer
    sets the OpenMP thread count to ``NUMBA_NUM_THREADS`` as its pool starts, which is torch's
    count too where both use one OpenMP runtime (a lower ``NUMBA_NUM_THREADS`` slowed torch)."""
    from numba.np.ufunc import parallel  # noqa: PLC0415  (numba is imported on the first step)
    launch = getattr(parallel, "_launch_threads", None)
    if launch is None:
        return
    before = torch.get_num_threads()
    launch()
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


def threads() -> int:
    """Numba's thread count (the thread ranges of a chunk table depend on it)."""
    from numba import get_num_threads  # noqa: PLC0415  (numba is imported on the first step)
    return get_num_threads()


def chunk_function(config: KernelConfig, unit: bool = False):
    """The compiled chunk function of ``config``: ``cpu_src/<algorithm>.py``'s
    ``chunk_function`` with the roles' element classes, the master policy, the rounding,
    telemetry and every flag but ``maximize`` (a run-time scalar, ``sign``) as constants;
    ``unit``: the variant for scalars of which :func:`unit_scalars` holds."""
    name, arguments, flags = chunk_arguments(config, unit)
    return _cpu_module(name).chunk_function(*arguments, **flags)


def chunk_arguments(config: KernelConfig, unit: bool = False) -> tuple:
    """(module, arguments, flags): :func:`chunk_function` of ``config`` is
    ``cpu_src/<module>.py``'s ``chunk_function(*arguments, **flags)``."""
    formats = tuple(np.float32 if dtype is None else _VIEW_DTYPES[dtype] for dtype in config.dtypes)
    flags = {name: value for name, value in config.flags if name != "maximize"}
    if first_as_later(config):
        flags["first"] = False
    if unit:
        flags["unit"] = True
    if config.plan.q8_rounding == "stochastic":
        flags["q8_rounding"] = "stochastic"
    return config.algorithm.name, (formats, config.weights, config.plan.rounding, config.track), flags


def unit_scalars(config: KernelConfig, values) -> bool:
    """Whether the kernel may leave out its multiplications by 1 at this step (``unit`` in
    ``cpu_src/<algorithm>.py``): the unscaling factor times the sign of maximize, as the
    kernel computes it, is exactly 1 (no GradScaler, not maximizing), and for SGD
    ``1 - dampening`` too.  Not for telemetry (``track_precision``): a diagnostic run, whose
    kernels count per element anyway, is not worth a second compilation of each
    configuration.  ``values``: :func:`_values`, as an array or a list (its products by
    the sign, +-1, are exact in float32 and float64 alike)."""
    return not config.track and bool(values[-2] * values[-1] == 1) \
        and (config.algorithm is not SGD or bool(values[_ONE_MINUS_DAMPENING] == 1))


_ONE_MINUS_DAMPENING = SGD.scalars._fields.index("one_minus_dampening")  # (its place in _values)
_MOMENTUM_BUFFER = [role.name for role in SGD.roles].index("momentum_buffer")


def first_as_later(config: KernelConfig) -> bool:
    """Whether a momentum buffer's first SGD step runs the later steps' chunk function, one
    compilation fewer per configuration: on a buffer of -0.0 with ``1 - dampening`` = 1, whose
    ``-0 * momentum + g`` is ``g`` bit for bit, as torch's clone of the grad (not for q8
    buffers, whose blocks have no -0)."""
    return config.algorithm is SGD and dict(config.flags).get("first", False) \
        and config.dtypes[_MOMENTUM_BUFFER] != Q8


def _start_first_as_later(bucket: Bucket, values: np.ndarray) -> None:
    """:func:`first_as_later`'s set-up: the bucket's fresh momentum buffers (made at this step,
    not installed yet) filled with -0.0, and ``values``' ``1 - dampening`` set to 1."""
    for buffer in bucket.tensors[_MOMENTUM_BUFFER]:
        buffer.fill_(-0.0)
    values[_ONE_MINUS_DAMPENING] = 1.0


def _table(pointers: np.ndarray, numels: list, itemsizes: np.ndarray, offsets: list, chunks) -> tuple:
    """The chunk table and each thread's range of its rows (memoised: a training loop
    sees the same addresses each step)."""
    parts = threads()
    key = (pointers.tobytes(), pointers.shape, tuple(numels), itemsizes.tobytes(), tuple(offsets),
           chunks.CHUNK, parts)
    cached = _TABLE_CACHE.get(key)
    if cached is None:
        if len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
            _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
        table = chunks.build_chunk_table(pointers, itemsizes, np.array(numels, dtype=np.int64),
                                         chunk=chunks.CHUNK)
        if offsets:  # element counters continue from each piece's first element in its param
            table[:, -2] += np.asarray(offsets, dtype=np.int64)[table[:, -1]]
        cached = _TABLE_CACHE[key] = (table, chunks.balanced_bounds(table, parts))
    return cached


def stream_keys(seed: int, step: int, indices, out: "np.ndarray | None" = None) -> np.ndarray:
    """uint32 (len(indices), STREAMS): ``storage.stream_key(seed, step, index, stream)`` for
    the streams 0 and 1, one compiled loop over tensors (negative indices as their two's
    complement); written into ``out`` when given."""
    tensors = np.asarray(indices, dtype=np.int64)
    keys = np.empty((tensors.size, STREAMS), dtype=np.uint32) if out is None else out
    helpers().stream_keys(helpers().step_key(seed_words(seed), step), tensors, keys)
    return keys


def seed_words(seed: int) -> np.ndarray:
    """A seed (0 <= seed < 2**64) as ``step_helpers.step_key`` takes it."""
    return np.array([seed & MASK32, seed >> 32], dtype=np.uint64)


def _values(config: KernelConfig, scalars, sign: "float | None" = None) -> np.ndarray:
    """The kernels' float32 scalars: the step's, then the sign of maximize (``sign``, when
    the caller keeps it: ``config.flag`` makes a dict at each call)."""
    return np.array([*scalars, _sign(config) if sign is None else sign], dtype=np.float32)


def _sign(config: KernelConfig) -> float:
    return -1.0 if config.flag("maximize") else 1.0


def _itemsizes(config: KernelConfig) -> np.ndarray:
    return np.array([0 if d is None else -Q8_ROW if d == Q8 else ELEMENT_BYTES[d] for d in config.dtypes],
                    dtype=np.int64)


def _call(address: int, table: np.ndarray, values: np.ndarray, keys: np.ndarray, row_counts: np.ndarray,
          bounds: np.ndarray) -> None:
    """The one kernel call, under the process-wide lock: parallel, or serial where
    :func:`on_calling_thread` says so."""
    chunks = _chunks()
    with _KERNEL_LOCK:
        driver = chunks.run_chunks_serial if on_calling_thread(table) else chunks.run_chunks
        driver(address, table, values, keys, row_counts, bounds)


def on_calling_thread(table: np.ndarray) -> bool:
    """Whether a kernel call over ``table`` runs on the calling thread: in a fork child (the
    parent's thread pool is not usable there), or when the table has one row, which one
    thread runs anyway (waking the others would cost more than the row: a small param updated
    alone in backward).  The same rows either way, so the same bits."""
    return _FORKED or table.shape[0] <= 1


def _checked(bucket: Bucket, scalars) -> tuple:
    """:func:`prepare`'s checks of a bucket with params (after ``check_scalars``), then (chunk
    function, float32 scalars, stream keys, item sizes); a momentum buffer's first step is set
    up to run as a later one (:func:`first_as_later`: its buffers are fresh, not installed yet)."""
    config = bucket.config
    for param in bucket.params:
        if not param.is_cpu:  # (is_cpu, not device.type: asked for every param of every step)
            raise ValueError(f"numba backend: expected CPU tensors, got a param on {param.device}")
    n = len(bucket.params)
    if config.stochastic and len(bucket.indices) != n:
        raise ValueError(f"numba backend: stochastic rounding needs each param's index "
                         f"(bucket.indices has {len(bucket.indices)} entries for {n} params)")
    check(bucket, "numba")
    values = _values(config, scalars)
    chunk = chunk_function(config, unit_scalars(config, values))
    if first_as_later(config):
        _start_first_as_later(bucket, values)
    keys = stream_keys(bucket.seed, bucket.step, bucket.streams()) if config.stochastic else \
        np.zeros((n, _chunks().KEYS), dtype=np.uint32)  # never read
    return chunk, values, keys, _itemsizes(config)


def prepare(bucket: Bucket, scalars):
    """Everything that can fail, done now: checks, the chunk function (compiled or loaded),
    the stream keys.  Returns the launch, which cannot fail on user input."""
    config = bucket.config
    check_scalars(bucket, scalars)
    if not bucket.params:
        return lambda: None
    chunk, values, keys, itemsizes = _checked(bucket, scalars)
    chunks = _chunks()
    n = len(bucket.params)

    def launch() -> None:
        staged = stage(bucket, "numba", checked=True)
        table, bounds = _table(staged.pointers, staged.numels, itemsizes, bucket.offsets, chunks)
        row_counts = np.zeros((table.shape[0], chunks.COUNTERS), dtype=np.int64)
        _call(chunk.address, table, values, keys, row_counts, bounds)
        staged.finish()
        if bucket.counts is not None:
            _write_counts(bucket, table, row_counts)

    return launch


def _write_counts(bucket: Bucket, table: np.ndarray, row_counts: np.ndarray) -> None:
    """Telemetry: each param's counters, summed over its rows, into ``bucket.counts``."""
    columns = len(bucket.config.algorithm.counters)
    totals = _chunks().tensor_counts(table, row_counts, len(bucket.params))
    bucket.counts[:, :columns] = torch.from_numpy(totals[:, :columns])


def prepare_rows(bucket: Bucket, scalars, chunk_elements: int):
    """:func:`prepare` for the offload pipeline: the bucket's one launch of a step, cut into
    chunks of about ``chunk_elements`` elements, each a row range of one chunk table
    (``numba_rows.RowLaunch``; every buffer contiguous)."""
    from .numba_rows import RowLaunch  # noqa: PLC0415  (numba_rows builds on this module)

    check_scalars(bucket, scalars)
    if not bucket.params:
        return RowLaunch.empty(bucket)
    return RowLaunch(bucket, *_checked(bucket, scalars), chunk_elements)


def run(bucket: Bucket, scalars) -> None:
    """One parallel kernel call over every tensor of the bucket."""
    prepare(bucket, scalars)()


_GRAD_COLUMN = 1  # every algorithm's roles start param, grad (algorithms.py)
_NO_COUNTERS = np.zeros(0, dtype=np.int64)  # (Relaunch.run: no step counters to advance)
_NO_STEPS = np.zeros(0, dtype=np.float64)
_NO_WRITTEN = np.zeros(0, dtype=np.int64)  # (no version counters to bump)
_NO_PLACES = np.zeros(3, dtype=np.int64)


class Relaunch:
    """A bucket's kernel call kept for later steps by the optimizer's step cache
    (``step_cache.py``): the chunk function, thread ranges and chunk table -- a copy of its
    own, whose grad column :meth:`run` points at each step's grads.  Valid while the other
    tensors keep their addresses and the grads their dtypes and layouts (the cache checks);
    made by :func:`relaunch`."""

    def __init__(self, bucket: Bucket, table: np.ndarray, bounds: np.ndarray, grad_positions: list):
        config = self.config = bucket.config
        chunks = _chunks()
        self.addresses = {}  # unit_scalars -> the chunk function's address (one of two variants)
        # the same for run_in_one_call's compiled call, by int(unit); 0: not compiled yet (the dict
        # serves Python's lookups: a numpy index costs more with the caches cold)
        self.unit_addresses = np.zeros(2, dtype=np.int64)
        self.table, self.bounds = table.copy(), bounds
        # row r reads the grad at grad_addresses[grad_of_row[r]] (run's argument), from element start
        self.grad_of_row = np.asarray(grad_positions, dtype=np.int64)[table[:, -1]]
        self.grad_row_bytes = table[:, -2] * ELEMENT_BYTES[config.grad]
        self.sign = _sign(config)
        # the stream keys of the tensors key_streams, written by run() (none without stochastic
        # rounding: zeros, never read), from the seed's words and the step's
        self.seed_words = seed_words(bucket.seed)
        self.key_streams = np.array(bucket.streams() if config.stochastic else [], dtype=np.int64)
        self.step_keys = np.zeros((len(bucket.params), chunks.KEYS), dtype=np.uint32)
        self.row_counts = np.zeros((table.shape[0], chunks.COUNTERS), dtype=np.int64)  # untracked: never read
        # run_in_one_call's: the kernel's float32 scalars (written in its compiled call), and where
        # unit_scalars reads SGD's dampening among them (-1: not SGD)
        self.kernel_values = np.zeros(len(config.algorithm.scalars._fields) + 1, dtype=np.float32)
        self.dampening = _ONE_MINUS_DAMPENING if config.algorithm is SGD else -1

    def arguments(self, scalars, inv_grad_scale: float, step: int) -> "tuple | None":
        """A step's phase one: the chunk function's address for these scalars (compiled or
        loaded now), the kernel's scalars and the step, which :meth:`run` passes on; None when
        a scalar is not a finite float32.  ``scalars``: the algorithm's scalars unrounded
        (float64), each rounded to float32 here once, as ``f32`` rounds each in a full step;
        ``inv_grad_scale``: the step's (a float32)."""
        values = _values(self.config, (*scalars[:-1], inv_grad_scale), self.sign)
        rounded = values.tolist()  # (Python floats: numpy's ufuncs are slow with cold caches)
        if not all(map(math.isfinite, rounded)):
            return None
        return self.address(unit_scalars(self.config, rounded)), values, step

    def address(self, unit: bool) -> int:
        """The address of the chunk function of the variant ``unit`` (compiled or loaded now)."""
        address = self.addresses.get(unit)
        if address is None:
            address = self.addresses[unit] = chunk_function(self.config, unit).address
            self.unit_addresses[int(unit)] = address
        return address

    def run(self, grad_addresses: np.ndarray, address: int, values: np.ndarray, step: int,
            counters: np.ndarray = _NO_COUNTERS, steps: np.ndarray = _NO_STEPS,
            written: np.ndarray = _NO_WRITTEN, places: np.ndarray = _NO_PLACES) -> None:
        """The kernel call with the grads at ``grad_addresses`` (int64, indexed by the
        ``grad_positions`` given at construction) and :meth:`arguments`' answer: the grad
        column pointed, the stream keys made and the chunks run in one compiled call
        (``step_helpers.relaunch``: each call is costly with the caches cold), under
        the process-wide lock as :func:`_call`; first, the float64 step counters at
        ``counters`` advanced, and their kept copy ``steps`` (the step cache's, of a group's
        params: given to the group's first kernel call, in the same compiled call), and the
        version counters of the tensor objects whose ids are ``written`` bumped
        (``step_helpers.bump_versions`` with ``places``, likewise)."""
        with _KERNEL_LOCK:
            helpers().relaunch(on_calling_thread(self.table), address, self.table, values, self.step_keys,
                               self.row_counts, self.bounds, _GRAD_COLUMN, self.grad_of_row, self.grad_row_bytes,
                               grad_addresses, self.seed_words, step, self.key_streams, counters, steps, written,
                               places)

    def launch_record(self, *, written: np.ndarray, places: np.ndarray, first: int) -> np.ndarray:
        """The ``"launch"`` record ``step_helpers.checked_relaunch`` takes (``step_helpers.pack_record``):
        this launch's arrays and integers, with the version counters to bump (``written``,
        ``places``) and the position of its first param's counter among the group's (``first``).
        The caller keeps ``written`` and ``places`` alive."""
        return helpers().pack_record(
            "launch", values=self.kernel_values, addresses=self.unit_addresses, table=self.table,
            keys=self.step_keys, row_counts=self.row_counts, grad_of_row=self.grad_of_row,
            row_bytes=self.grad_row_bytes, seed_words=self.seed_words, streams=self.key_streams,
            written=written, places=places, first=first, dampening=self.dampening, grad_column=_GRAD_COLUMN)

    def run_in_one_call(self, checks: np.ndarray, launch: np.ndarray, grad_ids: np.ndarray, scalars,
                        inv_grad_scale: float, step: int) -> bool:
        """A step whose only kernel call this is, checks, scalars and all, in one compiled call
        (``step_helpers.checked_relaunch``; one call less with cold caches than
        :meth:`arguments` and :meth:`run` after the step cache's own): True when it ran;
        False when it changed nothing, for a check that failed or a scalar that is not a
        finite float32 (the full path then decides and names it).  ``checks``: the step
        cache's ``"checks"`` record; ``launch``: :meth:`launch_record`'s; ``grad_ids``: the ids
        of the step's grads; ``scalars``, ``inv_grad_scale`` and ``step`` as :meth:`arguments`
        takes them.  A chunk function not compiled yet is compiled (or loaded) and the call
        made again."""
        compiled = helpers()
        for _ in range(2):
            with _KERNEL_LOCK:
                answer = compiled.checked_relaunch(checks, launch, grad_ids, step, tuple(scalars), inv_grad_scale,
                                                   self.sign, on_calling_thread(self.table), self.bounds)
            if answer < compiled.UNCOMPILED:
                return answer == compiled.RAN
            self.address(bool(answer - compiled.UNCOMPILED))
        raise AssertionError("checked_relaunch: a chunk function's address stayed unknown")


def relaunch(bucket: Bucket, grad_positions: list) -> "Relaunch | None":
    """``bucket``'s kernel call for reuse, or None when it cannot be reused: telemetry
    (fresh counts every step), shards (element offsets), or tensors staged through copies
    (new every step).  ``bucket`` has passed :func:`prepare`'s checks."""
    config = bucket.config
    if config.track or bucket.offsets or first_as_later(config):  # (a step that made state is not kept)
        return None
    staged = stage(bucket, "numba", checked=True)
    if any(copy is not tensor for column, copies in zip(bucket.tensors, staged.tensors)
           for tensor, copy in zip(column, copies)):
        return None
    table, bounds = _table(staged.pointers, staged.numels, _itemsizes(config), bucket.offsets, _chunks())
    return Relaunch(bucket, table, bounds, grad_positions)
