"""The Numba backend's launch for the offload pipeline: one per step and bucket, run in chunks.

The offload pipeline (``bf16opt/offload.py``) uploads an offloaded bucket's new params chunk by
chunk while the later chunks are still being updated.  Here a chunk is a range of rows of the
bucket's one chunk table (``cpu_src/chunks.py``), built with the checks, the chunk function and
the stream keys once per step and bucket (:func:`~bf16opt.backends.numba.prepare_rows`).

:meth:`RowLaunch.run` updates the rows of a run of chunks in one parallel kernel call, the
threads taking rows in order (``chunks.run_rows_in_order``) and counting each chunk's rows as
they finish; :meth:`RowLaunch.is_done` reads a chunk's count from any thread.  The call holds
no GIL, so the thread that drives the pipeline keeps enqueuing uploads meanwhile.

A chunk's rows hold about ``chunk_elements`` elements; rows are at most that long, so every
chunk has rows.  Which rows form a chunk never changes the bits: each element is updated on
its own, with its index in its param as stochastic rounding's counter.
"""

from __future__ import annotations

import numpy as np

from . import numba as numba_backend
from ..storage import Q8_BLOCK
from .base import Bucket
from .staging import stage

__all__ = ["RowLaunch", "RowPlan"]

_PLAN_CACHE: dict = {}
_PLAN_CACHE_SIZE = 16


class RowPlan:
    """The chunk table of a bucket's buffers and its cut into the pipeline's chunks.

    ``table``: the chunk table (rows of at most ``chunk_elements`` elements, element counters
    shifted by the pieces' offsets); ``chunk_of_row``; ``first_rows``: chunk ``k`` is rows
    ``first_rows[k]:first_rows[k + 1]``; ``rows``: each chunk's row count; ``pieces[k]``: chunk
    ``k``'s ``(param position, first element, element count)``, one per param it touches."""

    def __init__(self, pointers: np.ndarray, numels: list, itemsizes: np.ndarray, offsets: list,
                 chunk_elements: int):
        chunks = numba_backend._chunks()
        row = max(1, min(chunks.CHUNK, chunk_elements))
        if (itemsizes < 0).any():  # q8 buffers: rows of whole blocks
            row = -(-row // Q8_BLOCK) * Q8_BLOCK
        table = chunks.build_chunk_table(pointers, itemsizes, np.array(numels, dtype=np.int64), chunk=row)
        lengths, starts, tensors = table[:, -3], table[:, -2].copy(), table[:, -1]
        if offsets:  # element counters continue from each piece's first element in its param
            table[:, -2] += np.asarray(offsets, dtype=np.int64)[tensors]
        # a row joins the chunk its first element falls in: rows <= chunk_elements leave no chunk empty
        self.chunk_of_row = (np.cumsum(lengths) - lengths) // max(1, chunk_elements)
        count = int(self.chunk_of_row[-1]) + 1 if table.shape[0] else 0
        self.table = table
        self.first_rows = np.searchsorted(self.chunk_of_row, np.arange(count + 1)).astype(np.int64)
        self.rows = np.diff(self.first_rows)
        self.pieces = self._pieces(lengths, starts, tensors, count)

    def _pieces(self, lengths, starts, tensors, count: int) -> list:
        """Per chunk, the runs of rows of one param: (position, first element, element count)."""
        chunk_of_row = self.chunk_of_row
        if not tensors.size:  # (only empty params: no rows, no chunks)
            return []
        heads = np.ones(tensors.size, dtype=bool)
        heads[1:] = (tensors[1:] != tensors[:-1]) | (chunk_of_row[1:] != chunk_of_row[:-1])
        first = np.flatnonzero(heads)
        last = np.append(first[1:], tensors.size) - 1
        pieces = [[] for _ in range(count)]
        ends = starts[last] + lengths[last]
        for chunk, position, start, end in zip(chunk_of_row[first].tolist(), tensors[first].tolist(),
                                               starts[first].tolist(), ends.tolist()):
            pieces[chunk].append((position, start, end - start))
        return pieces

    @classmethod
    def of(cls, pointers: np.ndarray, numels: list, itemsizes: np.ndarray, offsets: list,
           chunk_elements: int) -> "RowPlan":
        """Memoised: a training loop's buffers keep their addresses from step to step."""
        key = (pointers.tobytes(), pointers.shape, tuple(numels), itemsizes.tobytes(), tuple(offsets),
               chunk_elements)
        plan = _PLAN_CACHE.get(key)
        if plan is None:
            if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
                _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
            plan = _PLAN_CACHE[key] = cls(pointers, numels, itemsizes, offsets, chunk_elements)
        return plan


class RowLaunch:
    """One offloaded bucket's kernel call of a step, made chunk range by chunk range.

    ``pieces[k]``: what chunk ``k`` updates (:class:`RowPlan`).  :meth:`counters` gives a step's
    row counts, :meth:`run` fills them (any thread), :meth:`is_done` reads them (any thread),
    :meth:`finish` ends the step's call (version counters, telemetry) once every chunk ran."""

    def __init__(self, bucket: Bucket, chunk, values: np.ndarray, keys: np.ndarray, itemsizes: np.ndarray,
                 chunk_elements: int):
        self.bucket = bucket
        self.staged = stage(bucket, "numba", checked=True)
        if any(copy is not tensor for column, copies in zip(bucket.tensors, self.staged.tensors)
               for tensor, copy in zip(column, copies)):
            raise ValueError("offload: a host buffer of the update is not contiguous")
        self.plan = RowPlan.of(self.staged.pointers, self.staged.numels, itemsizes, bucket.offsets,
                               chunk_elements)
        self.pieces = self.plan.pieces
        self.address, self.values, self.keys = chunk.address, values, keys
        rows = self.plan.table.shape[0]
        self.row_counts = np.zeros((rows, numba_backend._chunks().COUNTERS), dtype=np.int64)

    @classmethod
    def empty(cls, bucket: Bucket) -> "RowLaunch":
        launch = cls.__new__(cls)
        launch.bucket, launch.staged, launch.pieces = bucket, None, []
        return launch

    def counters(self) -> np.ndarray:
        """A step's zeroed row counts, one per chunk."""
        return np.zeros(len(self.pieces), dtype=np.int64)

    def run(self, first: int, end: int, done: np.ndarray) -> None:
        """Update chunks ``first:end`` in one parallel kernel call (serial in a fork child),
        under the backend's process-wide lock, counting each chunk's rows in ``done``."""
        chunks, plan = numba_backend._chunks(), self.plan
        with numba_backend._KERNEL_LOCK:
            driver = chunks.run_rows_in_order_serial if numba_backend._FORKED else chunks.run_rows_in_order
            driver(self.address, plan.table, self.values, self.keys, self.row_counts,
                   plan.first_rows[first], plan.first_rows[end], plan.chunk_of_row, done,
                   numba_backend.threads())

    def is_done(self, done: np.ndarray, chunk: int) -> bool:
        """Whether every row of ``chunk`` was written (and its writes are visible here)."""
        return numba_backend._chunks().rows_done(done, chunk) == self.plan.rows[chunk]

    def finish(self) -> None:
        """After every chunk ran: autograd sees the written buffers change; telemetry counts."""
        if self.staged is None:
            return
        self.staged.finish()
        if self.bucket.counts is not None:
            numba_backend._write_counts(self.bucket, self.plan.table, self.row_counts)
