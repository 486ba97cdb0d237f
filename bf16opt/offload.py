"""CPU offload: an offloaded group's optimizer state lives in host RAM and its update runs there.

A group with ``offload="cpu"`` keeps its master weights, moments and compensation or remainder
buffers in host memory (page-locked for CUDA params); the param and its grad stay on their
device.  The update is the same kernel call as without offload, on host buffers: the same bits.

One step's pipeline:

1. **Grads leave during backward**: a post-accumulate-grad hook per param starts its grad's
   device->host copy into a staging buffer, hidden behind the rest of backward.
2. **step() re-checks**: a staged grad is used only while it is still the param's grad with the
   same version counter and :func:`fingerprint` (clipping, ``unscale_``, ``.data`` edits and
   collectives are seen); else, or without a hook, it is copied again.  A param changed on its
   device since its host mirror was written (``load_state_dict``, an EMA swap) is read back.
3. **Chunks overlap**: chunk k is updated while chunk k-1's new params travel host->device.
   The kernels write straight into the uploaded host mirror, and stochastic rounding's element
   counter stays global to the param, so chunking never changes the bits.
4. **Published before returning**: the uploads are complete (CPU) or ordered before later work
   on the device's current stream (CUDA).

Timeline: each phase above is a range named in :data:`PHASES` (``torch.profiler``, Perfetto;
NVTX for CUDA params), free when no profiler runs.

Memory: no device staging; per param on the host, the state, a mirror and a grad staging buffer
in the grad's dtype (float32 grads of a 16-bit param are never rounded).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Optional

import torch

from .distributed import local
from .offload_copies import CopyEngine, engine_for, phase

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "OFFLOAD_VALUES", "PHASES", "Offloader", "check_offload",
           "use_copy_engine"]

OFFLOAD_VALUES = (None, "cpu")
#: elements per pipeline chunk: a kernel call's fixed cost stays small, yet the first upload
#: starts early (figures: docs/performance.md, benchmarks/offload_step.py)
DEFAULT_CHUNK_ELEMENTS = 1 << 22

#: the pipeline's ranges on the profiler timeline (record_function; NVTX for CUDA params)
PHASES = {
    "grad_copy": "bf16opt.offload.grad_copy",        # a grad's device->host copy started (hook or step)
    "recheck": "bf16opt.offload.recheck",            # step's checks of the staged grads and mirrors
    "recheck_sync": "bf16opt.offload.recheck_sync",  # their one host sync on the fingerprints
    "mirror_read": "bf16opt.offload.mirror_read",    # a changed param's read-back started
    "pipeline": "bf16opt.offload.pipeline",          # one bucket's update and uploads, published
    "upload_wait": "bf16opt.offload.upload_wait",    # last step's uploads finished (they read the mirrors)
    "chunk": "bf16opt.offload.chunk",                # one chunk: its waits, update and uploads
    "grad_wait": "bf16opt.offload.grad_wait",        # a piece's grad (and read-back) copy finished
    "prepare": "bf16opt.offload.prepare",            # the backend's checks and launch for the chunk
    "host_update": "bf16opt.offload.host_update",    # the host kernel over the chunk
    "upload": "bf16opt.offload.upload",              # the chunk's host->device copies enqueued
    "mirror_print": "bf16opt.offload.mirror_print",  # a piece's fingerprint summed from the mirror
    "publish": "bf16opt.offload.publish",            # uploads finished (CPU) or ordered (CUDA)
}


def check_offload(value, threads=None) -> None:
    if value not in OFFLOAD_VALUES:
        raise ValueError(f"offload must be None or 'cpu', got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"offload_threads must be None (all cores of the process) or an int >= 1, "
                         f"got {threads!r}")


def default_threads() -> int:
    """All cores this process may run on (its affinity), not all cores of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def host_threads(threads: Optional[int]):
    """Numba's thread count for the host update (restored afterwards; thread-local in Numba)."""
    try:
        import numba  # noqa: PLC0415
    except ImportError:
        yield
        return
    wanted = min(threads or default_threads(), numba.config.NUMBA_NUM_THREADS)
    before = numba.get_num_threads()
    numba.set_num_threads(wanted)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def _real(tensor):
    return torch.view_as_real(tensor) if tensor is not None and tensor.is_complex() else tensor


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 sum of a tensor's bit patterns (on its device, no copy of the data).

    The version counter misses some in-place changes (``GradScaler.unscale_``, ``.data`` edits,
    collectives writing into grads); any realistic change of the values changes this sum, so a
    staged copy is reused only when both agree."""
    real = _real(tensor.detach())
    if real.is_contiguous() and real.numel():
        # summed as 64-bit words, one vectorised pass rather than widening each element
        # (docs/performance.md); the tail bytes on their own; wrapping is fine here
        raw = real.reshape(-1).view(torch.uint8)
        words = raw.numel() // 8
        try:
            head = raw[:words * 8].view(torch.int64).sum()
        except RuntimeError:  # a storage offset that is not a multiple of 8 bytes
            head = None
        if head is not None:
            return head + raw[words * 8:].to(torch.int64).sum()
    return real.view(_BITS[real.element_size()]).sum(dtype=torch.int64)


class _HostParam:
    """Host buffers and bookkeeping of one offloaded param."""

    __slots__ = ("mirror", "grad", "grad_ref", "grad_version", "grad_print", "grad_transfer",
                 "mirror_version", "mirror_print", "mirror_transfer", "uploads", "hook", "__weakref__")

    def __init__(self, engine: CopyEngine, param: torch.Tensor):
        real = _real(local(param))  # a DTensor's host buffers hold its local shard
        self.mirror = engine.host_empty(real.shape, real.dtype)   # the param's value on the host
        self.grad = engine.host_empty(real.shape, real.dtype)     # the grad's staging buffer (its dtype)
        self.grad_ref = None          # weakref to the grad tensor last copied
        self.grad_version = None      # that grad's version counter at the copy
        self.grad_print = None        # and its fingerprint
        self.grad_transfer = None
        self.mirror_version = None    # the param's version counter when the mirror matched it
        self.mirror_print = None      # and its fingerprint
        self.mirror_transfer = None
        self.uploads = []             # host->device copies from the mirror still in flight
        self.hook = None


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
        if record.hook is None and param.requires_grad:
            self_ref = weakref.ref(self)

            def grad_ready(tensor, self_ref=self_ref):
                offloader = self_ref()
                if offloader is not None:
                    offloader._grad_ready(tensor)

            record.hook = param.register_post_accumulate_grad_hook(grad_ready)
        return record

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
        real = _real(local(param))
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
        real = _real(data)
        with phase(PHASES["grad_copy"], real.is_cuda):
            if record.grad.dtype != real.dtype:  # float32 grads of a 16-bit param: staged as float32, not rounded
                record.grad = self.engine(param.device).host_empty(real.shape, real.dtype)
            record.grad_print = fingerprint(data) if during_backward else None
            record.grad_transfer = self.engine(param.device).to_host(record.grad, real)
        record.grad_ref, record.grad_version = weakref.ref(grad), data._version

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
                    record.grad_version == local(grad)._version:
                checks.append((k, "grad", record.grad_print, fingerprint(local(grad))))
            else:
                self._copy_grad(param, record)
            if reads:
                if record.mirror_version == shard._version and record.mirror_print is not None:
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
            record.mirror_transfer = self.engine(param.device).to_host(record.mirror, _real(shard.detach()))
            record.mirror_version, record.mirror_print = shard._version, fingerprint(shard)

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
        record.mirror_version, record.mirror_print = shard._version, fingerprint(shard)

    # ---- the pipeline
    @staticmethod
    def check(bucket) -> None:
        """Phase one's check of an offloaded bucket: the pipeline cuts every host buffer into
        flat pieces, so each must be contiguous."""
        for column in bucket.tensors:
            for tensor in column:
                if tensor is not None and not tensor.is_contiguous():
                    raise ValueError("offload: a host buffer of the update is not contiguous (was a "
                                     "state tensor replaced by hand?)")

    def run(self, bucket, params: list, backend, scalars, threads: Optional[int] = None) -> None:
        """Update ``bucket`` (host tensors of the offloaded ``params``) chunk by chunk with
        ``threads`` host threads, uploading each chunk's new params as soon as it is done;
        publish the uploads."""
        with host_threads(threads):
            self._run(bucket, params, backend, scalars)

    def _run(self, bucket, params: list, backend, scalars) -> None:
        records = [self._records[p] for p in params]
        nvtx = bool(params) and params[0].is_cuda  # (a bucket's params share a device)
        with phase(PHASES["pipeline"], nvtx):
            with phase(PHASES["upload_wait"], nvtx):
                for record in records:  # last step's uploads read the mirrors the kernels now write
                    for upload in record.uploads:
                        upload.wait()
                    record.uploads = []
            uploads = []
            reads_param = bucket.config.weights != "copy"  # (a master copy wins over param edits)
            # the uploaded params' fingerprints, summed from the mirror's pieces while in cache
            from_mirror = [reads_param and self._prints_from_mirror(p, r) for p, r in zip(params, records)]
            prints = [None] * len(params)
            for chunk in self._chunks(bucket):
                with phase(PHASES["chunk"], nvtx):
                    self._update(chunk, bucket, records, backend, scalars, nvtx)
                    self._upload(chunk, params, records, from_mirror, prints, uploads, nvtx)
            with phase(PHASES["publish"], nvtx):
                for engine in {id(self.engine(p.device)): self.engine(p.device) for p in params}.values():
                    engine.publish(uploads)
        # the mirror is what the param now holds
        for param, record, piece_sum in zip(params, records, prints):
            shard = local(param)
            record.mirror_version = shard._version
            record.mirror_print = None if not reads_param else \
                piece_sum if piece_sum is not None else fingerprint(shard)

    def _chunks(self, bucket) -> list:
        """The pipeline's chunks: lists of (param position, first element, element count) pieces,
        about ``chunk_elements`` elements each."""
        pieces = []
        step = max(1, self.chunk_elements)
        for i, param in enumerate(bucket.params):
            numel = param.numel()
            pieces += [(i, start, min(step, numel - start)) for start in range(0, numel, step)] or [(i, 0, 0)]
        chunks, current, size = [], [], 0
        for piece in pieces:
            current.append(piece)
            size += piece[2]
            if size >= self.chunk_elements:
                chunks.append(current)
                current, size = [], 0
        if current:
            chunks.append(current)
        return chunks

    def _update(self, chunk: list, bucket, records: list, backend, scalars, nvtx: bool) -> None:
        """One chunk's host update, once its grads (and read-back mirrors) are on the host."""
        from .backends import Bucket  # noqa: PLC0415  (backends import the optimizer's modules)

        n_roles = len(bucket.tensors)
        piece_bucket = Bucket(bucket.config, seed=bucket.seed, step=bucket.step)
        for i, start, count in chunk:
            record = records[i]
            with phase(PHASES["grad_wait"], nvtx):
                for transfer in (record.grad_transfer, record.mirror_transfer):
                    if transfer is not None:
                        transfer.wait()
            tensors = [None if bucket.tensors[k][i] is None else
                       bucket.tensors[k][i].view(-1)[start:start + count] for k in range(n_roles)]
            # a piece keeps its elements' global indices and its param's streams
            piece_bucket.append(tensors, bucket.indices[i], bucket.offset(i) + start, bucket.stream_id(i))
        if bucket.counts is not None:
            piece_bucket.counts = torch.zeros(len(chunk), 3, dtype=torch.int64)
        with phase(PHASES["prepare"], nvtx):
            launch = backend.prepare(piece_bucket, scalars)
        with phase(PHASES["host_update"], nvtx):
            launch()
        if bucket.counts is not None:
            for row, (i, _, _) in enumerate(chunk):
                bucket.counts[i] += piece_bucket.counts[row]

    def _upload(self, chunk: list, params: list, records: list, from_mirror: list, prints: list,
                uploads: list, nvtx: bool) -> None:
        """Start the uploads of one chunk's new params (a strided param's after its last piece)."""
        with phase(PHASES["upload"], nvtx):
            for i, start, count in chunk:
                param = _real(local(params[i]).detach())
                record = records[i]
                if from_mirror[i]:
                    with phase(PHASES["mirror_print"], nvtx):
                        piece = fingerprint(record.mirror.view(-1)[start:start + count])
                    prints[i] = piece if prints[i] is None else prints[i] + piece
                if param.is_contiguous():
                    transfer = self.engine(params[i].device).to_device(
                        param.view(-1)[start:start + count], record.mirror.view(-1)[start:start + count])
                elif start + count == param.numel():
                    transfer = self.engine(params[i].device).to_device(param, record.mirror)
                else:
                    continue
                record.uploads.append(transfer)
                uploads.append(transfer)

    def _prints_from_mirror(self, param: torch.Tensor, record: _HostParam) -> bool:
        """Whether the mirror pieces' fingerprints sum to the uploaded param's, saving a pass over
        the param: for contiguous, 8-byte aligned CPU params (on a GPU that pass is cheap) whose
        pieces but the last are whole 8-byte words, so each piece's sum is part of the whole's."""
        shard = _real(local(param))
        return (shard.device.type == "cpu" and shard.is_contiguous() and shard.data_ptr() % 8 == 0
                and record.mirror.data_ptr() % 8 == 0
                and (self.chunk_elements * shard.element_size()) % 8 == 0)

    # ---- accounting
    def host_bytes(self) -> dict:
        """{"mirror": bytes, "grad_staging": bytes} of the live host buffers."""
        mirror = sum(r.mirror.numel() * r.mirror.element_size() for r in self._records.values())
        grads = sum(r.grad.numel() * r.grad.element_size() for r in self._records.values())
        return {"param_mirror": mirror, "grad_staging": grads}

    def pinned(self) -> bool:
        return any(r.mirror.is_pinned() for r in self._records.values())


def use_copy_engine(optimizer, engine: CopyEngine) -> None:
    """Make ``optimizer``'s offloaded groups copy through ``engine`` (tests and benchmarks:
    e.g. a ``ThreadedCopyEngine`` standing in for a PCIe link on a CPU machine)."""
    optimizer._offloader.engine_override = engine

