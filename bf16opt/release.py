"""Update in backward (gradient release): ``update_in_backward=True`` per param group.

A param of such a group is updated once autograd has accumulated its grad for this backward
(its post-accumulate-grad hook), and its grad is freed right after the update read it: the
model's grads never all exist at once.  Params whose hooks fire one after another at adjacent
places of their group wait for one update together until their grads reach the group's
``update_in_backward_bucket`` elements (:data:`BUCKET_ELEMENTS` by default), or backward ends
(:class:`_Bucket`): one launch for a run of small params, not one each, and one bucket of grads
alive at most.  A larger param is updated from its own hook.  The update is the normal step's
for those params (``step_plan.plan_update``): each with its own state, step counter, scalars and
stochastic-rounding stream, so its bits are the normal step's for the same grads.

* :class:`ReleaseHooks` keeps one hook per param of a release group: installed at construction,
  ``add_param_group``, ``zero_grad`` and ``step``; removed there when the group leaves the mode,
  and when the optimizer is garbage collected (the hooks hold no reference to it).
* Inside ``optimizer.accumulating()`` the hooks do nothing, so grads accumulate; the next
  backward outside updates from the sum.  Nor do they in a backward nested in another
  (reentrant activation checkpointing): those params are updated at ``step()``.
* ``step()`` updates the params that still hold a grad, as a normal step would (none after a
  backward outside ``accumulating()``), and returns; ``zero_grad()`` has nothing left to free.
* What cannot work refuses by name (``check_step``): a closure, GradScaler.  Sparse grads are
  refused by the update's own checks, in the hook.
* Offloaded groups (``offload="cpu"``): the update plans itself (its checks, the grads' copies to
  the host already started by the offload hook) and frees the device grads (the copy engine
  keeps them alive until copied); the host update and the upload of the new params run on a
  :class:`Background` thread while backward goes on.
* At its end, backward updates the buckets still waiting and waits for the background
  updates (re-raising an error of theirs), so it returns with every param updated, as without
  offload; ``step()``, ``state_dict()`` and ``load_state_dict()`` wait too, where it could not.
"""

from __future__ import annotations

import functools
import gc
import numbers
import os
import queue
import sys
import threading
import warnings
import weakref
from typing import Callable

import torch

from . import step_cache
from .distributed import is_dtensor
from .offload_copies import phase
from .step_plan import narrowed_group, plan_update

__all__ = ["BUCKET_ELEMENTS", "BUCKET_KEY", "Background", "PHASES", "ReleaseHooks", "check_bucket",
           "check_reduced_grads", "check_step", "update", "wanted"]

KEY = "update_in_backward"
#: a group's bucket: its small params updated together in backward until their grads have this
#: many elements (0: each param from its own hook)
BUCKET_KEY = "update_in_backward_bucket"
BUCKET_ELEMENTS = 1 << 20  # (its default)
#: update in backward's ranges on the profiler timeline (NVTX too for CUDA params)
PHASES = {
    "update": "bf16opt.release.update",                # a hook's update (offloaded: its plan and install)
    "host_update": "bf16opt.release.host_update",      # an offloaded param's host update and upload
    "backward_wait": "bf16opt.release.backward_wait",  # backward's end, waiting for the host updates
}


def wanted(groups: list) -> bool:
    """Whether any group asks for updates in backward."""
    return any(group.get(KEY) for group in groups)


#: every live bf16opt optimizer: a param one of them updates in backward must be in no other
_OPTIMIZERS: "weakref.WeakSet" = weakref.WeakSet()


def register(optimizer) -> None:
    _OPTIMIZERS.add(optimizer)


def other_optimizers(optimizer) -> list:
    """The live bf16opt optimizers but ``optimizer``."""
    return [other for other in list(_OPTIMIZERS) if other is not optimizer]


def check_sole_owner(optimizer, groups: list) -> None:
    """Refuse (ValueError) a param of ``groups`` that another live bf16opt optimizer also lists
    where either updates it in backward: that update frees the grad the other steps from, so
    one of the two would silently skip it."""
    clash = _shared_with_another(optimizer, groups)
    if clash is not None:
        gc.collect()  # (an optimizer no longer referenced but not yet collected is no owner)
        clash = _shared_with_another(optimizer, groups)
    if clash is None:
        return
    name, other, theirs = clash
    mode = "updates it in backward" if theirs else "lists it"
    raise ValueError(f"{name} is also a param of another live bf16opt optimizer "
                     f"({type(other).__name__} at {id(other):#x}), which {mode}: an update in backward "
                     f"frees the grad, so one optimizer would silently skip the param. A param updated "
                     f"in backward belongs to one optimizer: delete the other (del it, with every "
                     f"reference, e.g. a scheduler or a notebook's Out[]) or set update_in_backward=False")


def _shared_with_another(optimizer, groups: list):
    """(the param's name, the other optimizer, whether it updates it in backward) of the first
    param that clashes, or None."""
    others = other_optimizers(optimizer)
    if not others:
        return None
    listed, in_backward = {}, set()
    for other in others:
        for group in other.param_groups:
            for param in group["params"]:
                listed.setdefault(id(param), other)
                if group.get(KEY):
                    in_backward.add(id(param))
    for number, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            other = listed.get(id(param))
            if other is not None and (group.get(KEY) or id(param) in in_backward):
                return f"param {position} of group {number}", other, id(param) in in_backward
    return None


def check_reduced_grads(params: list, number: int) -> None:
    """The hooks must see each param's reduced grad.  FSDP2 runs them after its reduce-scatter
    (DTensor params); DistributedDataParallel, or any all-reduce of plain params' grads, runs
    after them, so each rank would update from its own grad and the replicas drift apart."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    plain = [k for k, param in enumerate(params) if not is_dtensor(param)]
    if plain:
        raise ValueError(f"{KEY}: param group {number} holds plain params (not DTensors, e.g. "
                         f"params[{plain[0]}]) in a process group of {dist.get_world_size()} ranks: "
                         f"their hooks run before DistributedDataParallel (or any all-reduce) averages "
                         f"the grads, so each rank would update from its own. Shard them with FSDP2's "
                         f"fully_shard (its hooks see the reduced grad), or set {KEY}=False")


def check_bucket(value) -> int:
    """``value`` as a bucket size (int >= 0), else TypeError or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{BUCKET_KEY} must be an int (grad elements a bucket of small params waits for "
                        f"in backward; 0: each param alone), got {value!r}")
    if value < 0:
        raise ValueError(f"{BUCKET_KEY} must be >= 0 (0: each param updated alone), got {value}")
    return int(value)


def check_step(groups: list, closure, grad_scale, found_inf, scaler_attributes: bool) -> None:
    """Refuse a step that cannot be right when a group updates in backward (before it changes
    anything): a closure's backward would update inside step, and GradScaler's inf check and
    unscale need every grad at once, after backward."""
    names = [number for number, group in enumerate(groups) if group.get(KEY)]
    if not names:
        return
    if closure is not None:
        raise ValueError(f"step(closure) is not supported with update_in_backward=True (param groups "
                         f"{names}): the params are updated during backward, so call backward "
                         f"yourself, then step() without a closure (under Lightning, which passes a "
                         f"closure to every step: docs/integrations_ecosystem.md)")
    if grad_scale is not None or found_inf is not None or scaler_attributes:
        raise RuntimeError(f"torch.amp.GradScaler cannot be used with update_in_backward=True (param groups "
                           f"{names}): it finds infs and unscales after backward, when these params were "
                           f"already updated from scaled grads in this backward; train in bfloat16 "
                           f"without a scaler, or set update_in_backward=False")


#: this process's ReleaseHooks and Background objects, set right again in a fork child
_FORK_AWARE: "weakref.WeakSet" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for thing in list(_FORK_AWARE):
        thing.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


UNSTEPPED_BACKWARDS = (
    "update_in_backward: a second backward updated params with no step() or zero_grad() since the "
    "previous one, so each backward made an update of its own. If they are micro-batches of one step "
    "(gradient accumulation, e.g. a training library's gradient_accumulation_steps), run all but the "
    "last inside `with opt.accumulating():`, or set update_in_backward=False; if each backward is a "
    "step, call opt.step() after it. (Warned once per optimizer.)")


class ReleaseHooks:
    """The post-accumulate-grad hooks of an optimizer's release groups."""

    def __init__(self, optimizer):
        self._owner = weakref.ref(optimizer)
        self._handles: dict = {}        # param -> hook handle (params are hashed by identity)
        self._places: dict = {}         # id(param) -> (group number, position in it)
        self._layout: tuple = ()        # (group, its param count) of each group when placed
        self._starts: list = []         # each group's first optimizer index when placed
        self.accumulating = 0           # depth of accumulating() blocks
        self.checked = False            # every release group's settings checked in this backward
        self.lock = threading.Lock()    # one update at a time (CUDA backward runs a thread per device)
        _FORK_AWARE.add(self)
        self.launches: dict = {}        # first param -> its bucket's update's launch (step_cache.GroupLaunch)
        self.pending: dict = {}         # group number -> its params waiting for one update (_Bucket)
        self._ends_task = None          # the backward whose end updates the rest (its graph task id)
        self.updated = set()            # ids of the params updated in this backward (see on_grad)
        self.updating_backwards = 0     # backwards that updated since the last step() or zero_grad()
        self.warned_unstepped = False
        self._nesting = (None, False)   # (graph task id, whether it is a nested backward) last asked
        weakref.finalize(optimizer, ReleaseHooks._remove_all, self._handles)

    def after_fork(self) -> None:
        """In a fork child: a lock another thread held at the fork stays held there."""
        self.lock = threading.Lock()

    def sync(self, groups: list) -> None:
        """Hooks on exactly the params of the groups in the mode that require grads."""
        keep = {param for group in groups if group.get(KEY) is True
                for param in group["params"] if param.requires_grad}
        self.pending.clear()  # (a step or zero_grad: the grads left are the step's, or gone)
        self.updated.clear()
        self.updating_backwards = 0
        self.checked = False
        for param in [param for param in self._handles if param not in keep]:
            self._handles.pop(param).remove()
        for param in [param for param in self.launches if param not in keep]:
            del self.launches[param]
        owner_ref = weakref.ref(self)
        for param in keep:
            if param not in self._handles:
                self._handles[param] = param.register_post_accumulate_grad_hook(
                    lambda tensor, owner_ref=owner_ref: _grad_ready(owner_ref, tensor))
        self._layout = ()  # (placed again at the next hook)

    def keep_launch(self, param: torch.Tensor, launch) -> None:
        """Keep ``param``'s launch for its next updates (None: forget it); launches kept for
        buckets that share a param with it go (they hold tensors the new one replaced)."""
        if launch is None:
            self.launches.pop(param, None)
            return
        ids = set(map(id, launch.params))
        for first in [first for first, kept in self.launches.items()
                      if not ids.isdisjoint(map(id, kept.params))]:
            del self.launches[first]
        self.launches[param] = launch

    def hooked(self) -> int:
        return len(self._handles)

    @staticmethod
    def _remove_all(handles: dict) -> None:
        for handle in handles.values():
            handle.remove()
        handles.clear()

    def place(self, groups: list, param: torch.Tensor):
        """(group number, first optimizer index of the group, position in it) of ``param``, or
        None when no group lists it."""
        layout = tuple((id(group), len(group["params"])) for group in groups)
        found = self._places.get(id(param)) if layout == self._layout else None
        if found is None or groups[found[0]]["params"][found[1]] is not param:
            self._placed(groups, layout)  # (groups changed, or a param list was edited in place)
            found = self._places.get(id(param))
            if found is None:
                return None
        number, position = found
        return number, self._starts[number], position

    def _placed(self, groups: list, layout: tuple) -> None:
        self._places = {id(p): (number, position) for number, group in enumerate(groups)
                        for position, p in enumerate(group["params"])}
        self._starts = [0]
        for group in groups:
            self._starts.append(self._starts[-1] + len(group["params"]))
        self._layout = layout

    def on_grad(self, param: torch.Tensor) -> None:
        optimizer = self._owner()
        if optimizer is None or self.accumulating:
            return
        if self._nested():  # (the param is updated at step(), from all of its grad)
            if id(param) in self.updated:
                self._refuse_nested(optimizer, param)
            return
        with self.lock:
            groups = optimizer.param_groups
            place = self.place(groups, param)
            if place is None or groups[place[0]].get(KEY) is not True:
                return
            number, first_index, position = place
            optimizer._check_release_groups()  # (the bucket size among them)
            bucket = self.pending.get(number)
            if bucket is not None and not bucket.takes(first_index, position):
                self._flush(optimizer, number)
                bucket = None
            if bucket is None:
                bucket = self.pending[number] = _Bucket(first_index, position)
            bucket.add(position, param)
            full = bucket.elements >= groups[number].get(BUCKET_KEY, BUCKET_ELEMENTS)
            if full or not self.end_backward_here():
                self._flush(optimizer, number)

    def _nested(self) -> bool:
        """:func:`_in_a_nested_backward`, asked once per graph task (a walk of the Python stack)."""
        task = _graph_task()
        if task == -1:
            return _in_a_nested_backward()
        if task != self._nesting[0]:
            self._nesting = (task, _in_a_nested_backward())
        return self._nesting[1]

    def _refuse_nested(self, optimizer, param) -> None:
        """A nested backward adds to the grad of a param this backward already updated: its
        update used part of its grad, and cannot be taken back."""
        place = self.place(optimizer.param_groups, param)
        name = "a param" if place is None else f"param {place[1] + place[2]}"
        raise RuntimeError(f"update_in_backward: {name} was updated in this backward before a "
                           f"reentrant checkpoint's backward added to its grad (it is used both inside "
                           f"and outside a checkpoint(..., use_reentrant=True) segment); use "
                           f"use_reentrant=False, or update_in_backward=False for its group")

    def _flush(self, optimizer, number: int) -> None:
        """Update the params of group ``number``'s bucket (it is emptied first: after an error
        their grads stay for ``step()``, as a normal step's would; so they do where the group's
        params were edited since they arrived)."""
        bucket = self.pending.pop(number)
        groups = optimizer.param_groups
        if number < len(groups) and bucket.holds(groups[number]["params"]):
            self.updated.update(map(id, bucket.params.values()))
            if torch.compiler.is_compiling():  # (compiled autograd traces the hook: the update runs eagerly)
                update = _not_traced(type(optimizer)._update_in_backward)
                update(optimizer, number, bucket.first_index, bucket.start, bucket.stop)
            else:
                optimizer._update_in_backward(number, bucket.first_index, bucket.start, bucket.stop)

    def end_backward_here(self) -> bool:
        """Have the running backward call :meth:`_at_backward_end` at its end, once; False where
        it cannot (no backward runs on this thread, a torch without the callbacks, or compiled
        autograd tracing the hook): then each bucket is updated at once."""
        task = _graph_task()
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        queue_callback = getattr(engine, "queue_callback", None)  # (what FSDP uses, private)
        if task == -1 or queue_callback is None:
            return False
        if torch.compiler.is_compiling():  # (compiled autograd traces the hook; it refuses the callback)
            return False
        if task != self._ends_task:
            self._ends_task = task
            queue_callback(self._at_backward_end)
        return True

    def _at_backward_end(self) -> None:
        """The buckets still waiting updated, then the background's updates waited for."""
        optimizer = self._owner()
        if optimizer is None:
            return
        try:
            with self.lock:
                self._ends_task = None  # (hooks that a later end-of-backward callback runs queue another)
                for number in list(self.pending):
                    self._flush(optimizer, number)
                self.updating_backwards += bool(self.updated)
                self.updated.clear()
            if self.updating_backwards > 1 and not self.warned_unstepped:
                self.warned_unstepped = True
                warnings.warn(UNSTEPPED_BACKWARDS, UserWarning, stacklevel=2)
        finally:
            self.checked = False  # (the next backward checks the settings again)
            background = optimizer.__dict__.get("_background_instance")
            if background is not None:
                with phase(PHASES["backward_wait"], background.cuda):
                    background.finish()


class _Bucket:
    """Params of one group whose grads wait for one update: adjacent places of the group, as
    backward reaches a model's params one module after another (in either direction)."""

    __slots__ = ("first_index", "start", "stop", "elements", "params")

    def __init__(self, first_index: int, position: int):
        self.first_index = first_index  # the group's first optimizer index, when placed
        self.start = self.stop = position
        self.elements = 0
        self.params: dict = {}  # position -> param

    def takes(self, first_index: int, position: int) -> bool:
        """Whether the param at ``position`` adjoins the bucket (or is in it: a hook of a
        backward that failed before its end, whose bucket was not updated)."""
        return first_index == self.first_index and self.start - 1 <= position <= self.stop

    def add(self, position: int, param) -> None:
        if position in self.params:
            return
        self.params[position] = param
        self.start, self.stop = min(self.start, position), max(self.stop, position + 1)
        self.elements += param.numel()

    def holds(self, params: list) -> bool:
        """Whether ``params[start:stop]`` are still the params that arrived at those places."""
        return len(params) >= self.stop and all(params[k] is param for k, param in self.params.items())


#: the Python frames of a Function's backward run by the engine (``BackwardCFunction.apply``),
#: and of a backward started from Python (torch's ``_engine_run_backward``); private, or None
_FUNCTION_BACKWARD = getattr(getattr(torch.autograd.function, "BackwardCFunction", None), "apply", None)
_FUNCTION_BACKWARD = getattr(_FUNCTION_BACKWARD, "__code__", None)
_ENGINE_RUN = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def _graph_task() -> int:
    """The running backward's graph task id (private), -1 outside one or without it."""
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)()


def _in_a_nested_backward() -> bool:
    """Whether this hook runs in a backward that a Function's backward started (reentrant
    activation checkpointing: below the hook, the engine's entry, and below that a Function's
    backward): the param may get more grad from the backward around it, or from another such
    nested one (a layer shared by two segments), so its grad is final only at ``step()``,
    which updates it as a normal step does.  A Function's backward that runs the hooks itself
    (FSDP2's, after its reduce-scatter) is no nested backward.  Without torch's frames to tell,
    every hook counts as nested: the updates wait for ``step()``, still exact."""
    if _FUNCTION_BACKWARD is None or _ENGINE_RUN is None:
        return True
    frame, in_engine = sys._getframe(2), False
    while frame is not None:
        if frame.f_code is _ENGINE_RUN:
            in_engine = True
        elif in_engine and frame.f_code is _FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False


@functools.cache  # (one wrapper per function: a new one at each update makes Dynamo recompile)
def _not_traced(function):
    """``function`` as Dynamo runs it eagerly, behind a graph break (only asked while compiling,
    so torch._dynamo is loaded already)."""
    import torch._dynamo  # noqa: PLC0415

    return torch._dynamo.disable(function)


def _grad_ready(owner_ref, param: torch.Tensor) -> None:
    hooks = owner_ref()
    if hooks is not None:
        hooks.on_grad(param)


def update(optimizer, number: int, group: dict, first_index: int, start: int, stop: int) -> None:
    """Update the params at ``start:stop`` of group ``number`` (the optimizer's param numbers
    from ``first_index + start``) from their grads and free the grads; raises before anything
    changes.  The launch is kept between updates (the narrowed group's ``step_cache.GroupLaunch``,
    under its first param)."""
    hooks = optimizer._release
    precision = optimizer._group_precision(number, group)
    narrowed = narrowed_group(group, start, stop)
    params = narrowed["params"]
    kept = hooks.launches.get(params[0])
    run = kept and kept.prepare(optimizer, narrowed, first_index + start, precision, 1.0)
    if kept is not None and not run:  # (stale: it would hold on to the state it was built from)
        hooks.keep_launch(params[0], None)
    if run:  # nothing the launch was built from changed since these params' last update
        group["precision"] = precision
        run()
    elif group.get("offload") == "cpu":
        _offloaded_update(optimizer, number, narrowed, first_index + start, precision)
    else:
        plan = plan_update(optimizer, number, narrowed, first_index + start, precision)
        optimizer._group_launches.pop(number, None)  # (kept for full steps of the whole group)
        optimizer._install_and_run(plan)
        group["precision"] = precision
        material = plan.built[0][1] if plan.built else None
        hooks.keep_launch(params[0], None if material is None else step_cache.build(optimizer, material))
    for param in params:
        param.grad = None  # (an offloaded grad: the copy engine keeps it until copied)


def _offloaded_update(optimizer, number: int, narrowed: dict, index: int, precision) -> None:
    """Plan and install an offloaded bucket's update; its host update and upload go on beside
    backward, which waits for them at its end."""
    background = optimizer._background
    params = narrowed["params"]
    if not background.params.isdisjoint(map(id, params)):
        background.finish()  # (a param's last update still reads its host buffers)
    plan = plan_update(optimizer, number, narrowed, index, precision)
    optimizer._group_launches.pop(number, None)
    clips, launches = plan.clips, plan.launches
    plan.clips, plan.launches = [], []
    optimizer._install_and_run(plan)
    optimizer.param_groups[number]["precision"] = precision
    # (a CUDA backward's stream, current in its hooks, not the background thread's default one)
    stream = torch.cuda.current_stream(params[0].device) if params[0].is_cuda else None
    background.submit(functools.partial(_on_stream, stream, optimizer._run_launches, clips, launches), params)
    optimizer._release.end_backward_here()  # (else step() waits)


def _on_stream(stream, job: Callable, *args) -> None:
    """``job(*args)`` with ``stream`` current (None: as it is): its uploads are ordered after
    that stream's work and published to it."""
    if stream is None:
        job(*args)
        return
    with torch.cuda.stream(stream):
        job(*args)


class Background:
    """One thread running an optimizer's offloaded updates in order, during backward."""

    def __init__(self, owner):
        self._owner = weakref.ref(owner)
        self.cuda = False               # (NVTX ranges too)
        self.after_fork()
        _FORK_AWARE.add(self)

    def after_fork(self) -> None:
        """A fresh start; in a fork child, whose copy of the thread does not run (only the
        forking thread survives a fork), the next submit starts one of its own."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._queued = 0                # jobs submitted and not finished
        self._error = None              # the first error of a job, re-raised by finish()
        self.params: set = set()        # ids of the params whose updates are queued
        self._thread = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=Background._serve, args=(self._jobs, weakref.ref(self)),
                                        name="bf16opt-update-in-backward", daemon=True)
        self._thread.start()
        owner = self._owner()
        if owner is not None:
            weakref.finalize(owner, self._jobs.put, None)  # (the thread ends with the optimizer)

    def submit(self, job: Callable[[], None], params: list) -> None:
        if self._thread is None:
            self._start()
        self.cuda = self.cuda or any(param.is_cuda for param in params)
        with self._idle:
            self._queued += 1
            self.params.update(map(id, params))
        self._jobs.put(job)

    def finish(self) -> None:
        """Wait for every queued update; re-raise the first error of one."""
        with self._idle:
            while self._queued:
                self._idle.wait()
            self.params.clear()
            error, self._error = self._error, None
        if error is not None:
            raise error

    @staticmethod
    def _serve(jobs: queue.SimpleQueue, self_ref) -> None:
        while (job := jobs.get()) is not None:
            error = None
            try:
                with phase(PHASES["host_update"], False):
                    job()
            except BaseException as exc:  # noqa: BLE001 -- handed to finish()
                error = exc
            del job
            self = self_ref()
            if self is None:
                return
            with self._idle:
                if error is not None and self._error is None:
                    self._error = error
                self._queued -= 1
                self._idle.notify_all()
            del self
