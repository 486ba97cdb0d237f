"""Copy engines for CPU offload: device<->host copies that the offload pipeline starts and waits on.

An optimizer group with ``offload="cpu"`` keeps its state in host RAM.  Grads travel device->host
(``to_host``) during backward; new params travel host->device (``to_device``) during ``step()``.

* :class:`ImmediateCopyEngine` -- CPU params; every copy is done when the call returns.
* :class:`ThreadedCopyEngine` -- CPU params; copies run on background threads, optionally throttled
  to a link's bandwidth/latency and completed out of order (``jitter``), to test and benchmark the
  pipeline on a machine without a GPU.
* :class:`CudaCopyEngine` -- CUDA params; side streams, events, page-locked host buffers.

Guarantees common to every engine:

* ``dst`` and ``src`` must have the same shape and dtype (a copy is bit-exact; it never converts),
  else ``ValueError``/``TypeError`` is raised by the call.  Either may be non-contiguous.
* Errors found when a copy is started raise from ``to_host``/``to_device``; errors of an
  asynchronous copy are re-raised by ``Transfer.wait()`` (and ``publish``/``synchronize``).
* ``dst`` may be written at any moment between the start of a transfer and its completion; it must
  not be read, and a host ``src`` must not be written, until the transfer is done (or published).
* The engine keeps ``src`` and ``dst`` alive until the copy is done.
* All methods may be called from any thread (e.g. autograd hooks).

:func:`phase` names a stretch of the pipeline on the profiler timeline (``torch.profiler`` and
Perfetto; NVTX for Nsight on CUDA); a ``ThreadedCopyEngine`` marks each copy on its worker thread
(``bf16opt.copy.d2h``/``h2d``: recorded by a profiler with ``profile_all_threads``).
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
import warnings
import weakref
from typing import Iterable, NamedTuple

import torch
from torch.autograd import profiler as _profiler

__all__ = ["PHASES", "phase", "Transfer", "CopyEngine", "ImmediateCopyEngine", "ThreadedCopyEngine",
           "CudaCopyEngine", "HostBytes", "engine_for"]


#: the offload pipeline's ranges on the profiler timeline (record_function; NVTX for CUDA params);
#: "update thread": the thread that runs a Numba host update (``offload_update.RowUpdate``)
PHASES = {
    "grad_copy": "bf16opt.offload.grad_copy",        # a grad's device->host copy started (hook or step)
    "recheck": "bf16opt.offload.recheck",            # step's checks of the staged grads and mirrors
    "recheck_sync": "bf16opt.offload.recheck_sync",  # their one host sync on the fingerprints
    "mirror_read": "bf16opt.offload.mirror_read",    # a changed param's read-back started
    "prepare": "bf16opt.offload.prepare",            # the backend's checks and launch: once per bucket
    "pipeline": "bf16opt.offload.pipeline",          # one bucket's update and uploads, published
    "upload_wait": "bf16opt.offload.upload_wait",    # last step's uploads finished (they read the mirrors)
    "chunk": "bf16opt.offload.chunk",                # a turn of the driving thread: a chunk's wait, the
                                                     # uploads of the chunks written since its last turn
    "update_wait": "bf16opt.offload.update_wait",    # the chunk not written yet: the driving thread sleeps
    "grad_wait": "bf16opt.offload.grad_wait",        # (update thread) a chunk's grad and read-back copies
    "host_update": "bf16opt.offload.host_update",    # (update thread) one kernel call over a run of chunks
    "upload": "bf16opt.offload.upload",              # the chunk's host->device copies enqueued
    "mirror_print": "bf16opt.offload.mirror_print",  # an uploaded param's fingerprint, from its mirror
    "publish": "bf16opt.offload.publish",            # uploads finished (CPU) or ordered (CUDA)
}


class _NoPhase:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


_NO_PHASE = _NoPhase()


class _Phase:
    """An NVTX range (CUDA params) and, while a profiler runs, a ``record_function`` range."""

    __slots__ = ("name", "nvtx", "record")

    def __init__(self, name: str, nvtx: bool):
        self.name, self.nvtx, self.record = name, nvtx, None

    def __enter__(self):
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        if _profiler._is_profiler_enabled:
            self.record = torch.profiler.record_function(self.name)
            self.record.__enter__()
        return self

    def __exit__(self, *exc_info):
        if self.record is not None:
            self.record.__exit__(*exc_info)
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        return False


def phase(name: str, nvtx: bool = False):
    """A context manager naming a phase on the timeline: ``record_function(name)`` while a torch
    profiler runs, plus an NVTX range when ``nvtx`` (params on CUDA; a no-op without Nsight).
    Without either it is a shared do-nothing object: one global read per phase."""
    if nvtx or _profiler._is_profiler_enabled:
        return _Phase(name, nvtx)
    return _NO_PHASE


class HostBytes(NamedTuple):
    """Bytes of live host buffers made by ``CopyEngine.host_empty``, split page-locked/pageable."""

    pinned: int
    pageable: int

    @property
    def total(self) -> int:
        return self.pinned + self.pageable


class Transfer:
    """A started copy.  ``done()`` never blocks; ``wait()`` blocks the calling host thread until the
    copy finished and re-raises the exception the copy raised, if any (on every call)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


_DONE = Transfer()


def _check(dst: torch.Tensor, src: torch.Tensor, dst_device: torch.device, src_device: torch.device) -> int:
    """Validate a copy; return its size in bytes."""
    if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
        raise TypeError("dst and src must be tensors")
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy needs equal shapes and dtypes, got dst {tuple(dst.shape)} {dst.dtype} "
                         f"and src {tuple(src.shape)} {src.dtype}")
    for name, t, dev in (("dst", dst, dst_device), ("src", src, src_device)):
        if t.device != dev:
            raise ValueError(f"{name} must be on {dev}, got {t.device}")
    return src.numel() * src.element_size()


class _Counter:
    """Thread-safe byte counters; referenced by buffer finalizers instead of the engine itself."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bytes = {True: 0, False: 0}

    def add(self, pinned: bool, n: int) -> None:
        with self.lock:
            self.bytes[pinned] += n


class CopyEngine:
    """Base class and protocol of the copy engines.

    ``device`` is the params' device; ``pinned`` is True while host buffers from ``host_empty`` are
    page-locked (it turns False, with a warning, once pinning fails; later buffers are pageable).
    """

    device: torch.device
    pinned: bool = False

    def __init__(self, device="cpu", pinned: bool = False):
        self.device = torch.device(device)
        self.pinned = pinned
        self._host = _Counter()

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor, page-locked while ``self.pinned``; counted by ``host_bytes``."""
        buf, pinned = None, False
        if self.pinned:
            try:
                buf, pinned = torch.empty(shape, dtype=dtype, pin_memory=True), True
            except RuntimeError as exc:
                self.pinned = False
                warnings.warn(f"page-locked host memory unavailable ({exc}); using pageable memory",
                              RuntimeWarning, stacklevel=2)
        if buf is None:
            buf = torch.empty(shape, dtype=dtype)
        storage = buf.untyped_storage()  # one Python object per storage: dies with the last view
        self._host.add(pinned, storage.nbytes())
        weakref.finalize(storage, self._host.add, pinned, -storage.nbytes())
        return buf

    def host_bytes(self) -> HostBytes:
        """Bytes of host buffers made by ``host_empty`` whose storage is still alive (including
        views).  Freed page-locked blocks may still be cached by torch's host allocator."""
        with self._host.lock:
            return HostBytes(self._host.bytes[True], self._host.bytes[False])

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Start copying device tensor ``src`` into host tensor ``dst``.  The copy reads ``src`` only
        after the work already queued on the device's current stream (its producer) finished.  Work
        queued later that overwrites ``src`` in place must be ordered after the transfer (``publish``)."""
        raise NotImplementedError

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Start copying host tensor ``src`` into ``dst`` (a device tensor or a view of one).  ``dst`` is
        written only after the work already queued on the device's current stream finished."""
        raise NotImplementedError

    def publish(self, transfers: Iterable[Transfer]) -> None:
        """After this returns, work queued later on the device's current stream sees the copied data.
        CPU engines wait for the transfers (re-raising the first error after waiting for all)."""
        _wait_all(list(transfers))

    def synchronize(self) -> None:
        """Wait for every transfer started so far (re-raising the first error not reported yet by
        ``synchronize``)."""

    def close(self) -> None:
        """Release background resources (pending copies still complete); idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _wait_all(transfers) -> None:
    error = None
    for t in transfers:
        try:
            t.wait()
        except BaseException as exc:  # noqa: BLE001 -- re-raised below
            error = error or exc
    if error is not None:
        raise error


class ImmediateCopyEngine(CopyEngine):
    """CPU params: ``dst.copy_(src)`` runs synchronously; the returned transfer is already done."""

    def __init__(self, device="cpu"):
        super().__init__(device)
        if self.device.type != "cpu":
            raise ValueError(f"ImmediateCopyEngine is for CPU params, got {self.device}")

    def _copy(self, dst, src) -> Transfer:
        _check(dst, src, self.device, self.device)
        dst.copy_(src)
        return _DONE

    to_host = _copy
    to_device = _copy


class _Task(Transfer):
    def __init__(self, dst, src, nbytes, delay):
        self.dst, self.src, self.nbytes, self.delay = dst, src, nbytes, delay
        self.error = None
        self.event = threading.Event()

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise self.error


class _Link:
    """One direction of a simulated link: copies share its bandwidth, each adds ``latency``."""

    def __init__(self, bandwidth, latency):
        self.bandwidth, self.latency = bandwidth, latency
        self.lock = threading.Lock()
        self.free_at = 0.0

    def deadline(self, started: float, nbytes: int) -> float:
        if not self.bandwidth:
            return started + self.latency
        with self.lock:
            self.free_at = max(started, self.free_at) + nbytes / self.bandwidth
            return self.free_at + self.latency


def _worker(tasks: queue.SimpleQueue, link: _Link, name: str) -> None:
    # Never touches Numba or the engine (so the engine can be garbage collected).
    while (task := tasks.get()) is not None:
        started = time.perf_counter()
        try:
            with phase(name):  # from pickup to the simulated link's completion
                if task.delay:
                    time.sleep(task.delay)  # jitter: the data lands late, so early readers see stale data
                task.dst.copy_(task.src)
                time.sleep(max(0.0, link.deadline(started, task.nbytes) - time.perf_counter()))
        except BaseException as exc:  # noqa: BLE001 -- handed to Transfer.wait()
            task.error = exc
        task.dst = task.src = None
        task.event.set()
        del task


def _stop(tasks_by_direction, workers: int) -> None:
    for tasks in tasks_by_direction:
        for _ in range(workers):
            tasks.put(None)


class ThreadedCopyEngine(CopyEngine):
    """CPU params; each copy runs on a daemon worker thread of its direction (d2h, h2d).

    * ``bandwidth`` (bytes/s, shared by the copies of one direction) and ``latency`` (s): a copy
      completes no earlier than ``nbytes / bandwidth + latency`` after a worker picked it up (the
      worker sleeps the remainder after copying) -- a stand-in for a PCIe link.
    * ``jitter`` (s): each copy first sleeps a random extra delay in ``[0, jitter)`` drawn from
      ``random.Random(seed)`` in start order, and ``workers`` (default 4 with jitter, else 1) threads
      serve each direction, so copies of one direction complete out of order.  With one worker a
      direction is FIFO.
    * ``close()`` (or ``with``, or garbage collection of the engine) lets queued copies finish, then
      ends the threads; ``close()`` also joins them.  Starting a copy after ``close()`` raises.
    """

    _ids = itertools.count()

    def __init__(self, device="cpu", bandwidth: float | None = None, latency: float = 0.0,
                 jitter: float | None = None, seed: int = 0, workers: int | None = None):
        super().__init__(device)
        if self.device.type != "cpu":
            raise ValueError(f"ThreadedCopyEngine is for CPU params, got {self.device}")
        if (bandwidth is not None and bandwidth <= 0) or latency < 0 or (jitter or 0) < 0:
            raise ValueError("bandwidth must be positive; latency and jitter must be >= 0")
        workers = workers or (4 if jitter else 1)
        self.jitter, self._rng = jitter, random.Random(seed)
        self._lock = threading.Lock()
        self._pending: list[_Task] = []
        self._prune_at = 64
        self._closed = False
        self._queues, self._threads = {}, []
        name = f"bf16opt-copy-{next(self._ids)}"
        for direction in ("d2h", "h2d"):
            tasks, link = queue.SimpleQueue(), _Link(bandwidth, latency)
            self._queues[direction] = tasks
            for i in range(workers):
                thread = threading.Thread(target=_worker, args=(tasks, link, f"bf16opt.copy.{direction}"),
                                          daemon=True, name=f"{name}-{direction}-{i}")
                thread.start()
                self._threads.append(thread)
        self._finalizer = weakref.finalize(self, _stop, list(self._queues.values()), workers)

    def _submit(self, direction, dst, src) -> Transfer:
        task = _Task(dst, src, _check(dst, src, self.device, self.device), 0.0)
        with self._lock:
            if self._closed:
                raise RuntimeError("copy engine is closed")
            if self.jitter:
                task.delay = self._rng.uniform(0.0, self.jitter)
            if len(self._pending) >= self._prune_at:  # forget copies that finished without an error
                self._pending = [t for t in self._pending if not t.done() or t.error is not None]
                self._prune_at = max(64, 2 * len(self._pending))
            self._pending.append(task)
            self._queues[direction].put(task)
        return task

    def to_host(self, dst, src) -> Transfer:
        return self._submit("d2h", dst, src)

    def to_device(self, dst, src) -> Transfer:
        return self._submit("h2d", dst, src)

    def synchronize(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        _wait_all(pending)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()


class _CudaTransfer(Transfer):
    def __init__(self, event, stream, seq, keep):
        self.event, self.stream, self.seq, self._keep = event, stream, seq, keep

    def done(self) -> bool:
        if self._keep is not None and self.event.query():
            self._keep = None
        return self._keep is None

    def wait(self) -> None:
        self.event.synchronize()
        self._keep = None


class CudaCopyEngine(CopyEngine):
    """CUDA params: copies run on two side streams (d2h, h2d) of ``device`` with ``non_blocking=True``.

    Each copy's side stream first waits on the device's current stream (so it sees the producer of
    ``src``, or the last readers of ``dst``), an event is recorded after it, and the device tensor is
    ``record_stream``-ed on the side stream so the caching allocator does not reuse it early; the
    transfer also holds both tensors until it is observed done.  ``publish`` makes the current stream
    wait on the last event per side stream (streams are FIFO).  Host buffers are page-locked; if
    pinning fails the engine warns and falls back to pageable memory (``pinned`` becomes False).
    """

    def __init__(self, device="cuda"):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs a CUDA device, got {device}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs a CUDA device; torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device, pinned=True)
        try:
            torch.empty(1, pin_memory=True)
        except RuntimeError as exc:
            self.pinned = False
            warnings.warn(f"page-locked host memory unavailable ({exc}); using pageable memory",
                          RuntimeWarning, stacklevel=2)
        self._streams = {d: torch.cuda.Stream(device=device) for d in ("d2h", "h2d")}
        self._seq, self._lock = itertools.count(), threading.Lock()  # seq follows stream order

    def _submit(self, direction, dst, src, dst_device, src_device) -> Transfer:
        _check(dst, src, dst_device, src_device)
        side = self._streams[direction]
        with self._lock:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            seq = next(self._seq)
        (src if direction == "d2h" else dst).record_stream(side)
        return _CudaTransfer(event, side, seq, (dst, src))

    def to_host(self, dst, src) -> Transfer:
        return self._submit("d2h", dst, src, torch.device("cpu"), self.device)

    def to_device(self, dst, src) -> Transfer:
        return self._submit("h2d", dst, src, self.device, torch.device("cpu"))

    def publish(self, transfers: Iterable[Transfer]) -> None:
        last = {}
        for t in transfers:
            if isinstance(t, _CudaTransfer):
                if t.seq > last.get(t.stream, (-1, None))[0]:
                    last[t.stream] = (t.seq, t.event)
            else:
                t.wait()
        current = torch.cuda.current_stream(self.device)
        for _, event in last.values():
            current.wait_event(event)

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()


def engine_for(device, **options) -> CopyEngine:
    """The copy engine for params on ``device``: CUDA -> :class:`CudaCopyEngine`; CPU ->
    :class:`ImmediateCopyEngine`, or :class:`ThreadedCopyEngine` when ``options`` (its keyword
    arguments, e.g. ``bandwidth=25e9``) are given."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaCopyEngine(device, **options)
    if device.type == "cpu":
        return ThreadedCopyEngine(device, **options) if options else ImmediateCopyEngine(device)
    raise ValueError(f"no copy engine for {device.type} params")
