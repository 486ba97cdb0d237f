"""Update in backward (gradient release): ``update_in_backward=True`` per param group.

A param of such a group is updated from its post-accumulate-grad hook, as soon as autograd has
accumulated its grad for this backward, and its grad is freed right after the update read it:
the model's grads never all exist at once.  The update is the normal step's for that param
alone (``step_plan.plan_update``): its own state, step counter, scalars and stochastic-rounding
stream, so its bits are the normal step's for the same grad.

* :class:`ReleaseHooks` keeps one hook per param of a release group: installed at construction,
  ``add_param_group``, ``zero_grad`` and ``step``; removed there when the group leaves the mode,
  and when the optimizer is garbage collected (the hooks hold no reference to it).
* Inside ``optimizer.accumulating()`` the hooks do nothing, so grads accumulate; the next
  backward outside updates from the sum.
* ``step()`` updates the params that still hold a grad, as a normal step would (none after a
  backward outside ``accumulating()``), and returns; ``zero_grad()`` has nothing left to free.
* What cannot work refuses by name (``check_step``): a closure, GradScaler.  Sparse grads are
  refused by the update's own checks, in the hook.
* Offloaded groups (``offload="cpu"``): the hook plans the update (its checks, the grad's copy to
  the host already started by the offload hook) and frees the device grad (the copy engine keeps
  it alive until copied); the host update and the upload of the new param run on a
  :class:`Background` thread while backward goes on.  Backward waits for them at its end
  (re-raising an error of theirs), so it returns with every param updated, as without offload;
  ``step()``, ``state_dict()`` and ``load_state_dict()`` wait too, where it could not.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from typing import Callable

import torch

from . import step_cache
from .offload_copies import phase
from .step_plan import plan_update, single_param_group

__all__ = ["Background", "PHASES", "ReleaseHooks", "check_step", "update", "wanted"]

KEY = "update_in_backward"
#: update in backward's ranges on the profiler timeline (NVTX too for CUDA params)
PHASES = {
    "update": "bf16opt.release.update",                # a hook's update (offloaded: its plan and install)
    "host_update": "bf16opt.release.host_update",      # an offloaded param's host update and upload
    "backward_wait": "bf16opt.release.backward_wait",  # backward's end, waiting for the host updates
}


def wanted(groups: list) -> bool:
    """Whether any group asks for updates in backward."""
    return any(group.get(KEY) for group in groups)


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
                         f"yourself, then step() without a closure")
    if grad_scale is not None or found_inf is not None or scaler_attributes:
        raise RuntimeError(f"torch.amp.GradScaler cannot be used with update_in_backward=True (param groups "
                           f"{names}): it finds infs and unscales after backward, when these params were "
                           f"already updated from scaled grads in this backward; train in bfloat16 "
                           f"without a scaler, or set update_in_backward=False")


class ReleaseHooks:
    """The post-accumulate-grad hooks of an optimizer's release groups."""

    def __init__(self, optimizer):
        self._owner = weakref.ref(optimizer)
        self._handles: dict = {}        # param -> hook handle (params are hashed by identity)
        self._places: dict = {}         # id(param) -> (group number, position in it)
        self._layout: tuple = ()        # (group, its param count) of each group when placed
        self._starts: list = []         # each group's first optimizer index when placed
        self.accumulating = 0           # depth of accumulating() blocks
        self.checked = False            # every release group's settings checked since the last step
        self.lock = threading.Lock()    # one update at a time (CUDA backward runs a thread per device)
        self.launches: dict = {}        # param -> its update's launch kept (step_cache.GroupLaunch)
        weakref.finalize(optimizer, ReleaseHooks._remove_all, self._handles)

    def sync(self, groups: list) -> None:
        """Hooks on exactly the params of the groups in the mode that require grads."""
        keep = {param for group in groups if group.get(KEY) is True
                for param in group["params"] if param.requires_grad}
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
        """Keep ``param``'s launch for its next updates (None: forget it)."""
        if launch is None:
            self.launches.pop(param, None)
        else:
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
        with self.lock:
            groups = optimizer.param_groups
            place = self.place(groups, param)
            if place is None or groups[place[0]].get(KEY) is not True:
                return
            number, first_index, position = place
            optimizer._update_in_backward(number, first_index, position)


def _grad_ready(owner_ref, param: torch.Tensor) -> None:
    hooks = owner_ref()
    if hooks is not None:
        hooks.on_grad(param)


def update(optimizer, number: int, group: dict, first_index: int, position: int) -> None:
    """Update the param at ``position`` of group ``number`` (the optimizer's param number
    ``first_index + position``) from its grad and free the grad; raises before anything changes.
    The param's launch is kept between updates (a one-param group's ``step_cache.GroupLaunch``)."""
    hooks = optimizer._release
    precision = optimizer._group_precision(number, group)
    narrowed = single_param_group(group, position)
    param = narrowed["params"][0]
    kept = hooks.launches.get(param)
    run = kept and kept.prepare(optimizer, narrowed, first_index + position, precision, 1.0)
    if run:  # nothing the param's launch was built from changed since its last update
        group["precision"] = precision
        run()
    elif group.get("offload") == "cpu":
        _offloaded_update(optimizer, number, narrowed, first_index + position, precision)
    else:
        plan = plan_update(optimizer, number, narrowed, first_index + position, precision)
        optimizer._group_launches.pop(number, None)  # (kept for full steps of the whole group)
        optimizer._install_and_run(plan)
        group["precision"] = precision
        material = plan.built[0][1] if plan.built else None
        hooks.keep_launch(param, None if material is None else step_cache.build(optimizer, material))
    param.grad = None  # (an offloaded grad: the copy engine keeps it until copied)


def _offloaded_update(optimizer, number: int, narrowed: dict, index: int, precision) -> None:
    """Plan and install an offloaded param's update; its host update and upload go on beside
    backward, which waits for them at its end."""
    background = optimizer._background
    param = narrowed["params"][0]
    if id(param) in background.params:
        background.finish()  # (its last update still reads its host buffers)
    plan = plan_update(optimizer, number, narrowed, index, precision)
    optimizer._group_launches.pop(number, None)
    clips, launches = plan.clips, plan.launches
    plan.clips, plan.launches = [], []
    optimizer._install_and_run(plan)
    optimizer.param_groups[number]["precision"] = precision
    background.submit(functools.partial(optimizer._run_launches, clips, launches), [param])
    finish_with_backward(background)


def finish_with_backward(background: "Background") -> None:
    """Make the running backward wait, at its end, for the updates ``background`` runs, so that
    it returns with every param updated (the next forward must not read a param whose upload is
    under way); without torch's end-of-backward callbacks, ``step()`` waits instead."""
    if background.waited_by_backward:
        return
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue_callback = getattr(engine, "queue_callback", None)  # (what FSDP uses, private)
    if queue_callback is None:
        return
    background.waited_by_backward = True

    def at_backward_end() -> None:
        background.waited_by_backward = False
        with phase(PHASES["backward_wait"], background.cuda):
            background.finish()
    queue_callback(at_backward_end)


class Background:
    """One thread running an optimizer's offloaded updates in order, during backward."""

    def __init__(self, owner):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._queued = 0                # jobs submitted and not finished
        self._error = None              # the first error of a job, re-raised by finish()
        self.params: set = set()        # ids of the params whose updates are queued
        self.waited_by_backward = False  # the running backward waits for them at its end
        self.cuda = False               # (NVTX ranges too)
        self._thread = threading.Thread(target=Background._serve, args=(self._jobs, weakref.ref(self)),
                                        name="bf16opt-update-in-backward", daemon=True)
        self._thread.start()
        weakref.finalize(owner, self._jobs.put, None)  # (the thread ends with the optimizer)

    def submit(self, job: Callable[[], None], params: list) -> None:
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
