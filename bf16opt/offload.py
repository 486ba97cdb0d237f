"""CPU offload: an offloaded group's optimizer state lives in host RAM and its update runs there.

A group with ``offload="cpu"`` keeps its master weights, moments and compensation or remainder
buffers in host memory (page-locked for CUDA params); the param and its grad stay on their
device.  The update is the same kernel call as without offload, on host buffers: the same bits.

One step's pipeline:

1. **Grads leave during backward**: a post-accumulate-grad hook per param starts its grad's
   device->host copy into a staging buffer, hidden behind the rest of backward.
2. **step() re-checks**: a staged grad is used only while it is still the param's grad with the
   same version counter, address and :func:`fingerprint` (clipping, ``unscale_``, ``.data``
   edits and collectives are seen); else, or without a hook, it is copied again.  A param
   changed on its device since its host mirror was written (``load_state_dict``, an EMA swap,
   ``p.data = ...``) is read back.
3. **Chunks overlap**: the update runs in chunks, and each chunk's new params start their
   host->device copy as soon as it is written, while the later chunks are updated.  With the
   Numba backend the update is one launch per step and bucket, run by the *update thread*
   without the GIL, so the calling thread's Python per chunk is a look at a row count and the
   copies it enqueues (``offload_update.py``).  The kernels write straight into the uploaded
   host mirror, and stochastic rounding's element counter stays global to the param, so
   chunking never changes the bits.
4. **Published before returning**: the uploads are complete (CPU) or ordered before later work
   on the device's current stream (CUDA).

Timeline: each phase above is a range named in :data:`PHASES` (``torch.profiler``, Perfetto;
NVTX for CUDA params), free when no profiler runs.

Host threads: ``offload_threads`` per group, by default every core of the process but one for
CUDA params (the thread driving the GPU and the copies needs a core), every core for CPU params.

Memory: no device staging; per param on the host, the state, a mirror and a grad staging buffer
in the grad's dtype (float32 grads of a 16-bit param are never rounded).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Optional

import torch

from .distributed import local
from .offload_copies import PHASES, CopyEngine, engine_for, phase
from .offload_update import host_update
from .offload_update import host_threads as _host_threads
from .tensors import read_view, real_view

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "OFFLOAD_VALUES", "PHASES", "Offloader", "check_offload",
           "use_copy_engine"]

OFFLOAD_VALUES = (None, "cpu")
#: elements per pipeline chunk: the first upload starts early, and a chunk's uploads are few
#: (figures: docs/performance.md, benchmarks/offload_step.py)
DEFAULT_CHUNK_ELEMENTS = 1 << 22


def check_offload(value, threads=None) -> None:
    if value not in OFFLOAD_VALUES:
        raise ValueError(f"offload must be None or 'cpu', got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"offload_threads must be None (the cores of the process, less one for CUDA "
                         f"params) or an int >= 1, "
                         f"got {threads!r}")


def default_threads(device: Optional[torch.device] = None) -> int:
    """The host update's threads by default: the cores this process may run on (its affinity,
    not all cores of the machine), less one for CUDA params, whose driving thread enqueues the
    copies while the update runs (at least one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    cuda = device is not None and torch.device(device).type == "cuda"
    return max(1, cores - 1) if cuda else cores


def host_threads(threads: Optional[int], device: Optional[torch.device] = None):
    """Numba's thread count on this thread (restored afterwards): ``threads``, by default
    :func:`default_threads` of ``device``; capped at Numba's pool."""
    return _host_threads(threads or default_threads(device))


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 sum of a tensor's bit patterns (on its device, no copy of the data).

    The version counter misses some in-place changes (``GradScaler.unscale_``, ``.data`` edits,
    collectives writing into grads); any realistic change of the values changes this sum, so a
    staged copy is reused only when both agree."""
    real = read_view(tensor.detach())
    if real.is_contiguous() and real.numel():
        # summed as 64-bit words, one vectorised pass rather than widening each element
        # (docs/performance.md); the tail bytes on their own; wrapping is fine here
        # (as_strided: a one-element view may keep a stride other than 1, which view refuses)
        raw = real.as_strided((real.numel(),), (1,)).view(torch.uint8)
        words, tail = divmod(raw.numel(), 8)
        try:
            head = (raw[:words * 8] if tail else raw).view(torch.int64).sum()
        except RuntimeError:  # a storage offset that is not a multiple of 8 bytes
            head = None
        if head is not None:  # (no tail: one kernel launch on a GPU, not four)
            return head + raw[words * 8:].to(torch.int64).sum() if tail else head
    return real.view(_BITS[real.element_size()]).sum(dtype=torch.int64)


def _stamp(tensor: torch.Tensor) -> tuple:
    """What changes when a tensor is written in place (its version counter) or given other
    memory (its data address: ``p.data = p.data[perm]`` keeps the counter and the
    :func:`fingerprint`)."""
    return tensor._version, tensor.data_ptr()


class _HostParam:
    """Host buffers and bookkeeping of one offloaded param."""

    __slots__ = ("mirror", "grad", "grad_ref", "grad_stamp", "grad_print", "grad_transfer",
                 "mirror_stamp", "mirror_print", "mirror_transfer", "uploads", "hook", "__weakref__")

    def __init__(self, engine: CopyEngine, param: torch.Tensor):
        self.hook = None
        self.fit(engine, param)

    def fit(self, engine: CopyEngine, param: torch.Tensor) -> None:
        """Buffers for the param as it is now, nothing staged or read yet."""
        real = real_view(local(param))  # a DTensor's host buffers hold its local shard
        self.mirror = engine.host_empty(real.shape, real.dtype)   # the param's value on the host
        self.grad = engine.host_empty(real.shape, real.dtype)     # the grad's staging buffer (its dtype)
        self.grad_ref = None          # weakref to the grad tensor last copied
        self.grad_stamp = None        # that grad's :func:`_stamp` at the copy
        self.grad_print = None        # and its fingerprint
        self.grad_transfer = None
        self.mirror_stamp = None      # the param's :func:`_stamp` when the mirror matched it
        self.mirror_print = None      # and its fingerprint
        self.mirror_transfer = None
        self.uploads = []             # host->device copies from the mirror still in flight


class Offloader:
    """The host side of an optimizer's offloaded groups: host buffers, hooks, the pipeline."""

    def __init__(self, optimizer):
        self._records: dict = {}      # param -> _HostParam (params are hashed by identity)
        self._engines: dict = {}      # device -> CopyEngine
        self.chunk_elements = DEFAULT_CHUNK_ELEMENTS
        self.engine_override: Optional[CopyEngine] = None
        # hooks hold no reference to the optimizer; removing them when it goes away
        weakref.finalize(optimizer, Offloader._remove_hooks, self._records)

    # ---- buffers and hooks
    def engine(self, device: torch.device) -> CopyEngine:
        if self.engine_override is not None:
            return self.engine_override
        device = torch.device(device)
        if device not in self._engines:
            self._engines[device] = engine_for(device)
        return self._engines[device]

    def record(self, param: torch.Tensor) -> _HostParam:
        record = self._records.get(param)
        if record is None:
            record = self._records[param] = _HostParam(self.engine(param.device), param)
        else:
            self._refit(param, record)
        if record.hook is None and param.requires_grad:
            self_ref = weakref.ref(self)

            def grad_ready(tensor, self_ref=self_ref):
                offloader = self_ref()
                if offloader is not None:
                    offloader._grad_ready(tensor)

            record.hook = param.register_post_accumulate_grad_hook(grad_ready)
        return record

    def _refit(self, param: torch.Tensor, record: _HostParam) -> None:
        """New host buffers where the param's dtype or shape changed since they were made
        (``model.float()`` sets each param's ``.data``): the mirror is then read again."""
        real = real_view(local(param))
        if record.mirror.dtype == real.dtype and record.mirror.shape == real.shape:
            return
        for transfer in (record.grad_transfer, record.mirror_transfer, *record.uploads):
            if transfer is not None:
                transfer.wait()
        record.fit(self.engine(param.device), param)

    def release(self, keep) -> None:
        """Free the host buffers and hooks of params not in ``keep`` (they left the offloaded
        groups: removed, or their group's ``offload`` was set to None)."""
        for param in [p for p in self._records if p not in keep]:
            record = self._records.pop(param)
            for transfer in (record.grad_transfer, record.mirror_transfer, *record.uploads):
                if transfer is not None:
                    transfer.wait()
            if record.hook is not None:
                record.hook.remove()

    @staticmethod
    def _remove_hooks(records: dict) -> None:
        for record in records.values():
            if record.hook is not None:
                record.hook.remove()
        records.clear()

    def host_like(self, param: torch.Tensor, dtype: torch.dtype, value: Optional[torch.Tensor] = None):
        """A host buffer shaped like ``param``'s real view: zeros, or ``value`` copied in."""
        real = real_view(local(param))
        buffer = self.engine(param.device).host_empty(real.shape, dtype)
        if value is None:
            buffer.zero_()
        else:
            buffer.copy_(value)
        return buffer

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a state buffer) as a contiguous host tensor (the pipeline walks host
        buffers in flat pieces), page-locked when the engine pins."""
        engine = self.engine_override or next(iter(self._engines.values()), None)
        if engine is not None and engine.pinned and not tensor.is_pinned():
            pinned = engine.host_empty(tensor.shape, tensor.dtype)
            return pinned.copy_(tensor)
        tensor = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
        return tensor.contiguous()

    # ---- grads and mirrors
    def _grad_ready(self, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook: start the grad's copy to the host (a sparse grad is
        left to step(), which refuses it by name)."""
        record = self._records.get(param)
        grad = param.grad
        if record is None or grad is None or grad.layout != torch.strided:
            return
        self._copy_grad(param, record, during_backward=True)

    def _copy_grad(self, param: torch.Tensor, record: _HostParam, during_backward: bool = False) -> None:
        """Start the grad's copy into its staging buffer.  Only a copy started during backward
        takes a fingerprint (later clipping or unscaling must be seen); without one, the next
        step copies again rather than trust it."""
        if record.grad_transfer is not None:
            record.grad_transfer.wait()  # one copy into the staging buffer at a time
        grad = param.grad
        data = local(grad)  # a DTensor grad: its local shard
        real = read_view(data)
        with phase(PHASES["grad_copy"], real.is_cuda):
            if record.grad.dtype != real.dtype:  # float32 grads of a 16-bit param: staged as float32, not rounded
                record.grad = self.engine(param.device).host_empty(real.shape, real.dtype)
            record.grad_print = fingerprint(data) if during_backward else None
            record.grad_transfer = self.engine(param.device).to_host(record.grad, real)
        record.grad_ref, record.grad_stamp = weakref.ref(grad), _stamp(data)

    def stage(self, params: list, reads_param: list) -> list:
        """(mirror, grad buffer) per param for this step's update, after the checks of the
        module docstring's step 2: stale grads copied again, changed params' mirrors read back.
        One host sync for all."""
        with phase(PHASES["recheck"], bool(params) and params[0].is_cuda):
            return self._stage(params, reads_param)

    def _stage(self, params: list, reads_param: list) -> list:
        records = [self.record(param) for param in params]
        checks = []  # (record position, kind, recorded fingerprint, current fingerprint)
        for k, (param, record, reads) in enumerate(zip(params, records, reads_param)):
            grad, shard = param.grad, local(param)
            if record.grad_print is not None and record.grad_ref() is grad and \
                    record.grad_stamp == _stamp(local(grad)):
                checks.append((k, "grad", record.grad_print, fingerprint(local(grad))))
            else:
                self._copy_grad(param, record)
            if reads:
                if record.mirror_stamp == _stamp(shard) and record.mirror_print is not None:
                    checks.append((k, "mirror", record.mirror_print, fingerprint(shard)))
                else:
                    self._read_mirror(param, record)
        if checks:
            with phase(PHASES["recheck_sync"], checks[0][3].is_cuda):
                changed = (torch.stack([c[2].to(c[3].device) for c in checks]) !=
                           torch.stack([c[3] for c in checks])).tolist()
            for (k, kind, _, _), stale in zip(checks, changed):
                if stale and kind == "grad":
                    self._copy_grad(params[k], records[k])
                elif stale:
                    self._read_mirror(params[k], records[k])
        return [(record.mirror, record.grad) for record in records]

    def _read_mirror(self, param: torch.Tensor, record: _HostParam) -> None:
        for upload in record.uploads:  # they read the mirror
            upload.wait()
        record.uploads = []
        shard = local(param)
        with phase(PHASES["mirror_read"], shard.is_cuda):
            real = real_view(shard.detach())
            record.mirror_transfer = self.engine(param.device).to_host(record.mirror, real)
            record.mirror_stamp, record.mirror_print = _stamp(shard), fingerprint(shard)

    def wait_grad(self, param: torch.Tensor) -> None:
        """The param's staged grad has arrived on the host (before it is changed there)."""
        transfer = self._records[param].grad_transfer
        if transfer is not None:
            transfer.wait()

    def set_mirror(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """The param was just written with ``value`` (a state conversion): the mirror follows."""
        record = self.record(param)
        for transfer in (record.mirror_transfer, *record.uploads):
            if transfer is not None:
                transfer.wait()
        record.uploads, record.mirror_transfer = [], None
        record.mirror.copy_(value)
        shard = local(param)
        record.mirror_stamp, record.mirror_print = _stamp(shard), fingerprint(shard)

    # ---- the pipeline
    @staticmethod
    def check(bucket) -> None:
        """Phase one's check of an offloaded bucket: the pipeline cuts every host buffer into
        flat pieces, so each must be contiguous (other kinds of wrong values: the backend's checks)."""
        for column in bucket.tensors:
            for tensor in column:
                if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                    raise ValueError("offload: a host buffer of the update is not contiguous (was a "
                                     "state tensor replaced by hand?)")

    def prepare(self, bucket, params: list, backend, scalars, threads: Optional[int] = None):
        """Phase one for an offloaded ``bucket`` (host tensors of ``params``): every check, and
        the host update made once for the step (``offload_update.host_update``).  Returns the
        launch: the pipeline with ``threads`` host threads (default: :func:`default_threads`)."""
        self.check(bucket)
        nvtx = bool(params) and params[0].is_cuda  # (a bucket's params share a device)
        threads = threads or default_threads(params[0].device if params else None)
        update = host_update(bucket, backend, scalars, self.chunk_elements, threads, nvtx)
        return functools.partial(self.run, update, params)

    def run(self, update, params: list) -> None:
        """The pipeline: ``update`` chunk by chunk, each chunk's new params uploaded as soon as
        it is written; the uploads published."""
        records = [self._records[p] for p in params]
        nvtx = bool(params) and params[0].is_cuda
        with phase(PHASES["pipeline"], nvtx):
            self._await_uploads(records, nvtx)
            update.start(self._inputs(update.pieces, records))
            try:
                uploads, prints = self._upload_chunks(update, params, records, nvtx)
            finally:
                update.finish()  # nothing writes the host buffers any more (also after an error)
            with phase(PHASES["publish"], nvtx):
                for engine in {id(self.engine(p.device)): self.engine(p.device) for p in params}.values():
                    engine.publish(uploads)
        self._note_mirrors(params, records, prints)

    @staticmethod
    def _await_uploads(records: list, nvtx: bool) -> None:
        """Last step's uploads are done: they read the mirrors the kernels now write."""
        with phase(PHASES["upload_wait"], nvtx):
            for record in records:
                for upload in record.uploads:
                    upload.wait()
                record.uploads = []

    @staticmethod
    def _inputs(pieces: list, records: list) -> list:
        """Per chunk, the copies it must wait for: the grads (and read-back mirrors) of the
        params it is the first chunk of."""
        inputs, seen = [], set()
        for chunk in pieces:
            waits = []
            for i, _, _ in chunk:
                if i not in seen:
                    seen.add(i)
                    record = records[i]
                    waits += [t for t in (record.grad_transfer, record.mirror_transfer) if t is not None]
            inputs.append(waits)
        return inputs

    def _upload_chunks(self, update, params: list, records: list, nvtx: bool) -> tuple:
        """(uploads started, fingerprints taken from the mirrors): in chunk order, each turn
        uploading the chunks written since the last, a param's adjacent pieces as one copy (a
        driving thread that falls behind the update makes fewer, larger copies)."""
        uploads, prints = [], [None] * len(params)
        targets = [self._upload_target(param, record) for param, record in zip(params, records)]
        first, count = 0, len(update.pieces)
        while first < count:
            with phase(PHASES["chunk"], nvtx):
                with phase(PHASES["update_wait"], nvtx):
                    update.wait(first)
                end = update.written_from(first + 1)
                with phase(PHASES["upload"], nvtx):
                    for i, start, size in _merged(update.pieces[first:end]):
                        self._upload(targets[i], records[i], start, size, prints, i, uploads, nvtx)
            first = end
        return uploads, prints

    def _upload_target(self, param: torch.Tensor, record: _HostParam) -> tuple:
        """(the param's flat view, or None when strided: uploaded whole after its last piece;
        its real view; its engine; whether its fingerprint is taken from the mirror)."""
        shard = real_view(local(param).detach())
        flat = shard.view(-1) if shard.is_contiguous() else None
        return flat, shard, self.engine(param.device), self._prints_from_mirror(shard, record)

    @staticmethod
    def _upload(target: tuple, record: _HostParam, start: int, count: int, prints: list, i: int,
                uploads: list, nvtx: bool) -> None:
        """Start the upload of one piece (a strided param's: all of it, after its last piece)."""
        flat, shard, engine, from_mirror = target
        last = start + count == shard.numel()
        if flat is not None:
            end = start + count
            transfer = engine.to_device(flat[start:end], record.mirror.view(-1)[start:end])
        elif last:
            transfer = engine.to_device(shard, record.mirror)
        else:
            return
        record.uploads.append(transfer)
        uploads.append(transfer)
        if from_mirror and last:
            with phase(PHASES["mirror_print"], nvtx):
                prints[i] = fingerprint(record.mirror)

    @staticmethod
    def _note_mirrors(params: list, records: list, prints: list) -> None:
        """The mirror is what the param now holds, and its fingerprint (every master policy
        reads the param: an edit of it is seen at the next step)."""
        for param, record, taken in zip(params, records, prints):
            shard = local(param)
            record.mirror_stamp = _stamp(shard)
            record.mirror_print = taken if taken is not None else fingerprint(shard)

    @staticmethod
    def _prints_from_mirror(shard: torch.Tensor, record: _HostParam) -> bool:
        """Whether the mirror's fingerprint is the uploaded param's, saving a pass over the param:
        for contiguous, 8-byte aligned CPU params (on a GPU that pass is cheap), whose sums take
        the same path over the same bytes."""
        return (shard.device.type == "cpu" and shard.is_contiguous() and shard.data_ptr() % 8 == 0
                and record.mirror.data_ptr() % 8 == 0)

    # ---- accounting
    def host_bytes(self) -> dict:
        """{"mirror": bytes, "grad_staging": bytes} of the live host buffers."""
        mirror = sum(r.mirror.numel() * r.mirror.element_size() for r in self._records.values())
        grads = sum(r.grad.numel() * r.grad.element_size() for r in self._records.values())
        return {"param_mirror": mirror, "grad_staging": grads}

    def pinned(self) -> bool:
        return any(r.mirror.is_pinned() for r in self._records.values())


def _merged(chunks: list) -> list:
    """The pieces of consecutive chunks, a param's adjacent pieces joined into one."""
    pieces = []
    for chunk in chunks:
        for i, start, count in chunk:
            if pieces and pieces[-1][0] == i and sum(pieces[-1][1:]) == start:
                pieces[-1] = (i, pieces[-1][1], pieces[-1][2] + count)
            else:
                pieces.append((i, start, count))
    return pieces


def use_copy_engine(optimizer, engine: CopyEngine) -> None:
    """Make ``optimizer``'s offloaded groups copy through ``engine`` (tests and benchmarks:
    e.g. a ``ThreadedCopyEngine`` standing in for a PCIe link on a CPU machine)."""
    optimizer._offloader.engine_override = engine

