"""The host update of the offload pipeline: one bucket's update, cut into chunks.

The pipeline (``offload.py``) uploads each chunk's new params as soon as the chunk is written.
A host update offers the chunks (``pieces[k]``: ``(param position, first element, element
count)`` each) and four steps, called in this order by the thread driving the pipeline:

* :meth:`start` -- with, per chunk, the copies its inputs wait for (grads, read-back mirrors);
* :meth:`wait` ``(k)`` -- returns once chunk ``k`` is written (in chunk order);
* :meth:`written_from` ``(k)`` -- the first chunk from ``k`` on not known to be written yet
  (never blocks);
* :meth:`finish` -- after the last chunk, or on an error: nothing runs any more when it returns.

Two kinds:

* :class:`RowUpdate` (the Numba backend): one launch per step and bucket
  (``backend.prepare_rows``), whose chunks are row ranges of one chunk table.  It runs on the
  *update thread*: for the first chunk not yet run it waits for that chunk's inputs, then
  updates it and every later chunk whose inputs are already on the host (usually all of them) in
  one parallel kernel call, which counts each chunk's rows as they finish and holds no GIL.
  The driving thread reads those counts, sleeping between looks, so its Python per chunk is a
  look and the uploads.
* :class:`PieceUpdate` (any other backend, e.g. the reference): each chunk a bucket of its own,
  prepared and run on the driving thread when it waits for the chunk.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from typing import Optional

from .offload_copies import PHASES, phase
from .storage import Q8, Q8_BLOCK, q8_piece

__all__ = ["PieceUpdate", "RowUpdate", "host_threads", "host_update", "piece_chunks"]

#: the driving thread's first sleep while a chunk is being written, and the bounds of the later
#: ones (a quarter of the time chunks have taken so far)
_FIRST_LOOK_S, _SHORTEST_LOOK_S, _LONGEST_LOOK_S = 50e-6, 20e-6, 1e-3


@contextlib.contextmanager
def host_threads(threads: int):
    """Numba's thread count for the host update on this thread (restored afterwards;
    thread-local in Numba), capped at Numba's pool."""
    try:
        import numba  # noqa: PLC0415
    except ImportError:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(before)


def host_update(bucket, backend, scalars, chunk_elements: int, threads: int, nvtx: bool):
    """The host update of an offloaded ``bucket`` (phase one of a step: every check done here,
    nothing changed): a :class:`RowUpdate` where the backend has ``prepare_rows``, else a
    :class:`PieceUpdate`."""
    prepare_rows = getattr(backend, "prepare_rows", None)
    if prepare_rows is not None:
        with phase(PHASES["prepare"], nvtx):
            return RowUpdate(prepare_rows(bucket, scalars, chunk_elements), threads, nvtx)
    backend.prepare(bucket, scalars)  # its checks (each chunk is prepared again, on its own)
    return PieceUpdate(bucket, backend, scalars, piece_chunks(bucket, chunk_elements), threads, nvtx)


def _wait_all(transfers: list) -> None:
    for transfer in transfers:
        transfer.wait()


class RowUpdate:
    """A :class:`~bf16opt.backends.numba_rows.RowLaunch` run on the update thread."""

    def __init__(self, launch, threads: int, nvtx: bool):
        self.launch, self.threads, self.nvtx = launch, threads, nvtx
        self.pieces = launch.pieces
        self._done = self._job = None
        self._started, self._seen = 0.0, 0  # when the update started; chunks known written

    def start(self, inputs: list) -> None:
        self._done = self.launch.counters()
        self._started, self._seen = time.perf_counter(), 0
        self._job = _update_thread().submit(self._work, inputs)

    def _work(self, inputs: list) -> None:
        """On the update thread: each run of chunks whose inputs are on the host, in one call."""
        with host_threads(self.threads):
            first, count = 0, len(self.pieces)
            while first < count:
                with phase(PHASES["grad_wait"], self.nvtx):
                    _wait_all(inputs[first])
                end = first + 1
                while end < count and all(transfer.done() for transfer in inputs[end]):
                    end += 1
                with phase(PHASES["host_update"], self.nvtx):
                    self.launch.run(first, end, self._done)
                first = end

    def wait(self, chunk: int) -> None:
        """Sleep until the update thread wrote ``chunk`` (re-raising its error, if any)."""
        look = _FIRST_LOOK_S if not self._seen else min(_LONGEST_LOOK_S, max(
            _SHORTEST_LOOK_S, (time.perf_counter() - self._started) / self._seen / 4))
        while not self.launch.is_done(self._done, chunk):
            if self._job.done():
                self._job.result()  # its error; else it wrote the chunk just before ending
                if not self.launch.is_done(self._done, chunk):
                    raise AssertionError(f"offload: the host update ended without chunk {chunk}")
                break
            time.sleep(look)
        self._seen = chunk + 1

    def written_from(self, chunk: int) -> int:
        while chunk < len(self.pieces) and self.launch.is_done(self._done, chunk):
            chunk += 1
        self._seen = max(self._seen, chunk)  # (the pace the next look's sleep is taken from)
        return chunk

    def finish(self) -> None:
        """Returns once the update thread is done with this update (also after an error on
        either thread; its own error re-raised)."""
        job, self._job = self._job, None
        if job is not None:
            concurrent.futures.wait([job])
            job.result()
        self.launch.finish()


class PieceUpdate:
    """Each chunk a bucket of its own, run by the driving thread when it waits for it."""

    def __init__(self, bucket, backend, scalars, pieces: list, threads: int, nvtx: bool):
        self.bucket, self.backend, self.scalars = bucket, backend, scalars
        self.pieces, self.threads, self.nvtx = pieces, threads, nvtx
        self._inputs: list = []

    def start(self, inputs: list) -> None:
        self._inputs = inputs

    def wait(self, chunk: int) -> None:
        with phase(PHASES["grad_wait"], self.nvtx):
            _wait_all(self._inputs[chunk])
        piece_bucket = self._piece_bucket(self.pieces[chunk])
        with phase(PHASES["prepare"], self.nvtx):
            launch = self.backend.prepare(piece_bucket, self.scalars)
        with phase(PHASES["host_update"], self.nvtx), host_threads(self.threads):
            launch()
        if self.bucket.counts is not None:
            for row, (i, _, _) in enumerate(self.pieces[chunk]):
                self.bucket.counts[i] += piece_bucket.counts[row]

    @staticmethod
    def written_from(chunk: int) -> int:
        return chunk  # (a chunk is written when the driving thread waits for it)

    def _piece_bucket(self, pieces: list):
        """A bucket of the pieces' elements; each keeps its elements' global indices and its
        param's streams."""
        from .backends import Bucket  # noqa: PLC0415  (backends import the optimizer's modules)

        bucket = self.bucket
        piece_bucket = Bucket(bucket.config, seed=bucket.seed, step=bucket.step)
        for i, start, count in pieces:
            tensors = [None if column[i] is None else
                       q8_piece(column[i], start, count) if column[i].dtype == Q8 else
                       column[i].view(-1)[start:start + count] for column in bucket.tensors]
            piece_bucket.append(tensors, bucket.indices[i], bucket.offset(i) + start, bucket.stream_id(i))
        if bucket.counts is not None:
            piece_bucket.counts = bucket.counts.new_zeros(len(pieces), 3)
        return piece_bucket

    def finish(self) -> None:
        self._inputs = []


def piece_chunks(bucket, chunk_elements: int) -> list:
    """A :class:`PieceUpdate`'s chunks: lists of (param position, first element, element count)
    pieces, about ``chunk_elements`` elements each (an empty param: one empty piece)."""
    pieces = []
    step = max(1, chunk_elements)
    if bucket.config.quantized:  # pieces of q8 state are whole blocks
        step = -(-step // Q8_BLOCK) * Q8_BLOCK
    for i, param in enumerate(bucket.params):
        numel = param.numel()
        pieces += [(i, start, min(step, numel - start)) for start in range(0, numel, step)] or [(i, 0, 0)]
    chunks, current, size = [], [], 0
    for piece in pieces:
        current.append(piece)
        size += piece[2]
        if size >= chunk_elements:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


# ---------------------------------------------------------------- the update thread

_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_executor_lock = threading.Lock()


def _update_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's update thread (one: kernel calls are serialised anyway), made at first use."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bf16opt-offload-update")
        return _executor


def _forget_in_child() -> None:
    """A fork child has no update thread (only the thread that forked survives): make a new one."""
    global _executor, _executor_lock
    _executor, _executor_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
