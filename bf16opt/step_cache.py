"""A param group's launch kept between steps: a step over many small params costs its kernel
calls and a few bulk checks, not a Python pass over every param.

A full step (``step_plan.py``) checks each param, grad and state tensor, works out each
param's KernelConfig, groups the params into buckets and builds each bucket's chunk table.
From one training step to the next none of that changes but the grads (new tensors after
``zero_grad``), the step number and the scalars.  After a full step of a group that
qualifies, :func:`build` keeps its buckets' kernel calls (the ``Relaunch`` of
``backends/numba.py`` or ``backends/cupy.py``); at the next step :meth:`GroupLaunch.prepare` checks that everything they were
built from still holds -- the group's params, settings and first index; each param's and
state tensor's form and address; which params have grads and each grad's form; each state
dict's keys and values; the step counters (one more than after the last step, below 2**53);
the thread count -- in passes that run in C or compiled code, using torch's and CPython's
internals where their probes (``torch_internals.py``) found them usable, else Python.  Any
difference, and the step takes the full path, which raises on bad input as always and builds
the launch again.  ``prepare`` (phase one) changes nothing; the callable it returns (phase
two) advances the counters, bumps autograd's version counters and runs the kernels.

An optimizer whose only group has a launch of one kernel call, checked through torch's C
shim, runs both phases in one compiled call (:meth:`GroupLaunch.step_in_one_call`), as each
call into compiled code is costly with the caches cold after a step (docs/performance.md).

Qualifies: a group updated by a kernel backend (numba or cupy: its ``relaunch``; not offloaded),
of plain real tensors, without precision telemetry, whose full step made or converted no state,
whose step counters are float64, and whose tensors are all addressed in place (no staging copies).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from itertools import chain, compress, repeat
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from . import torch_internals as internals
from .backends import numba as numba_backend
from .checks import STEP_LIMIT

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_GRAD = operator.attrgetter("grad")
_PARAM_FORM = operator.attrgetter("dtype", "shape")
_GRAD_FORM = operator.attrgetter("layout", "dtype", "shape", "is_cpu")
_STRIDES = torch.Tensor.stride
_IS_NEGATIVE = torch.Tensor.is_neg  # (a negative view's memory holds its values negated)
_ADDRESS = torch.Tensor.data_ptr
_NO_STATE: dict = {}
def _shim_forms(tensors: list) -> "Optional[tuple]":
    """(starts, forms) of ``tensors`` for ``step_helpers.forms_hold``, or None without the shim
    or when a tensor is not a plain one (the offsets are probed on torch.Tensor and Parameter)."""
    shim = internals.tensor_shim()
    if shim is None or not _PLAIN.issuperset(map(type, tensors)):
        return None
    helpers = numba_backend.helpers()
    starts = np.cumsum([0] + [helpers.FORM_HEAD + 2 * tensor.dim() for tensor in tensors], dtype=np.int64)
    forms = np.zeros(starts[-1], dtype=np.int64)
    ids = np.fromiter(map(id, tensors), dtype=np.int64, count=len(tensors))
    return (starts, forms) if helpers.read_forms(shim, ids, starts, forms) else None


def _guards_of(tensors: list):
    """A bulk check that ``tensors`` (distinct tensors) keep their types and forms, or None."""
    guards = internals.tensor_guards()
    if guards is None:
        return None
    try:
        check = guards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        return check if check.check(*tensors) is True else None
    except Exception:  # noqa: BLE001
        return None


def same_objects(a: list, b: list) -> bool:
    """Whether ``a`` and ``b`` hold the same objects (identity) in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class StateView:
    """The optimizer's ``state`` mapping at one moment, made once per step for all groups: a
    launch whose params' state dicts were found under one view needs no lookup (torch's
    ``Tensor.__hash__`` runs in Python) under a later view that :meth:`matches` it.

    Two moments match when the mapping is the same dict whose version (:func:`dict_versions`)
    did not change, or, without versions, when it holds the same keys and values in the same
    order (a param's hash is its id: the same items map every param to the same state).
    Only a plain dict or defaultdict: another mapping's ``get`` could answer otherwise."""

    __slots__ = ("state", "version", "keys", "values", "_matches")

    def __init__(self, state):
        self.state = state if type(state) in (dict, defaultdict) else None
        versions = internals.dict_versions()
        self.version = self.keys = self.values = None
        if self.state is not None:
            if versions is not None:
                self.version = versions(state)
            else:
                self.keys, self.values = list(state), list(state.values())
        self._matches = {}

    def matches(self, other: "Optional[StateView]") -> bool:
        """Whether the mapping holds what it held at ``other`` (an earlier view)."""
        if other is None or self.state is None or other.state is None:
            return False
        if other is self:
            return True
        if self.version is not None or other.version is not None:
            return self.state is other.state and self.version == other.version
        same = self._matches.get(id(other))  # (groups checked under one view compare once)
        if same is None:
            same = self._matches[id(other)] = same_objects(self.keys, other.keys) \
                and same_objects(self.values, other.values)
        return same


def settings(optimizer, group: dict, precision) -> tuple:
    """What a group's kernel configurations and random streams depend on besides its tensors."""
    names = group.get("param_names")
    return (precision, tuple(optimizer._flags(group).items()), bool(group.get("track_precision")),
            group["seed"], group["backend"], group.get("offload"), group.get("sr_streams"),
            None if names is None else tuple(names), group.get("max_grad_norm_per_param"),
            group.get("capturable"))


class GroupLaunch:
    """What a group's full step built, kept for the next steps (see the module doc)."""

    def __init__(self, optimizer, group: dict, first_index: int, precision, updated: list, grads: list,
                 relaunches: list, written: list):
        self.first_index = first_index
        self.params = list(group["params"])
        self.settings = settings(optimizer, group, precision)
        has_grad = list(map(operator.is_not, map(_GRAD, self.params), repeat(None)))
        self.has_grad = None if all(has_grad) else has_grad  # (None: a missing grad fails the type check)
        self.updated = updated
        self.grad_forms = list(map(_GRAD_FORM, grads))
        self.grad_strides = list(map(_STRIDES, grads))
        # grads that must have memory (an empty tensor may have address 0)
        self.sized_grads = np.array([grad.numel() > 0 for grad in grads], dtype=np.bool_)
        self.states = list(map(optimizer.state.get, updated))
        self.found_under = StateView(optimizer.state)  # the view self.states were last found under
        self.values = list(chain.from_iterable(map(dict.values, self.states)))  # the state tensors
        self.addressed = updated + self.values  # (one list: no chain per step)
        self.addresses = np.fromiter(map(_ADDRESS, self.addressed), dtype=np.int64, count=len(self.addressed))
        self.ids = np.fromiter(map(id, self.addressed), dtype=np.int64, count=len(self.addressed))  # (kept alive here)
        # forms of params and state tensors (a state tensor reshaped or retyped in place,
        # ``m.data = m.data[:3]``, keeps its identity and address)
        self.forms = list(map(_PARAM_FORM, self.addressed))
        self.strides = list(map(_STRIDES, self.addressed))
        # the forms' check: in compiled code through torch's C shim, else torch's bulk check,
        # else the Python checks (each holds no tensor: their forms alone)
        forms, grad_forms = _shim_forms(self.addressed), _shim_forms(grads)
        self.shim = internals.tensor_shim() if forms is not None and grad_forms is not None else None
        if self.shim is not None:
            self.form_starts, self.forms_read = forms
            self.grad_form_starts, self.grad_forms_read = grad_forms
        self.guards = _guards_of(self.addressed + grads) if self.shim is None else None
        self.reader = internals.address_reader() if self.guards is not None else None
        self.keys = list(chain.from_iterable(self.states))  # (str)
        self.versions = internals.dict_versions()
        self.state_versions = None if self.versions is None else list(map(self.versions, self.states))
        # with the shim, the state dicts' versions are compared in its compiled call too
        self.dict_word = internals.dict_version_word() if self.shim is not None else None
        self.dicts = np.fromiter(map(id, self.states), dtype=np.int64, count=len(self.states)) \
            if self.dict_word is not None else np.zeros(0, dtype=np.int64)
        self.expected_versions = np.array(self.state_versions, dtype=np.uint64) \
            if self.dict_word is not None else np.zeros(0, dtype=np.uint64)
        self.counter_addresses = np.array([state["step"].data_ptr() for state in self.states], dtype=np.int64)
        self.steps = np.array([state["step"].item() for state in self.states])  # the counters after the last step
        self.helpers = numba_backend.helpers()
        self.threads = numba_backend.threads()
        self.relaunches = relaunches  # (Relaunch, position in ``updated`` of its first param)
        # for autograd's version counters: what the kernels write through addresses, and the
        # step counters advanced through theirs (a full step adds to them in place)
        self.written = written + [state["step"] for state in self.states]
        # their version counters bumped in the first kernel call (its arguments for that), where
        # the forms were checked through the shim (the tensors' types among them); else none,
        # and torch bumps them after the kernels
        places = internals.version_places() if self.shim is not None else None
        self.compiled_bump = () if places is None else \
            (np.fromiter(map(id, self.written), dtype=np.int64, count=len(self.written)), places)
        self.checks, self.one_call_record = self._records(relaunches)

    def _records(self, relaunches: list) -> tuple:
        """The records of the compiled calls (``step_helpers.pack_record``), where the forms are
        read through the shim: the checks' (the arrays above, and one the grads' addresses are
        read into), and, where this is the only kernel call and every check and bump is
        compiled, the launch's for :meth:`step_in_one_call`; None where not."""
        self.grad_addresses_read = np.empty(len(self.sized_grads), dtype=np.int64)
        if self.shim is None:
            return None, None
        checks = self.helpers.pack_record(
            "checks", shim=self.shim, dicts=self.dicts, versions=self.expected_versions, tensors=self.ids,
            starts=self.form_starts, forms=self.forms_read, counters=self.counter_addresses, steps=self.steps,
            grad_starts=self.grad_form_starts, grad_forms=self.grad_forms_read,
            grad_addresses=self.grad_addresses_read, sized=self.sized_grads, dict_word=self.dict_word or 0,
            threads=self.threads)
        relaunch, first = relaunches[0]
        if len(relaunches) != 1 or not self.compiled_bump or not hasattr(relaunch, "launch_record"):
            return checks, None  # (the one call is Numba's)
        return checks, relaunch.launch_record(written=self.compiled_bump[0], places=self.compiled_bump[1],
                                              first=first)

    def prepare(self, optimizer, group: dict, first_index: int, precision, inv_grad_scale: float,
                view: Optional[StateView] = None) -> Optional[Callable[[], None]]:
        """Phase one of this group's step: None unless everything the launch was built from
        still holds (then the caller takes the full path); else the step's phase two, which
        advances the counters and runs the kernels.  Changes nothing (but the view it last
        found its states under).  ``view``: ``StateView(optimizer.state)`` now."""
        checked = self._checked_in_python(optimizer, group, first_index, precision, view)
        if checked is None:
            return None
        grads, guarded = checked
        grad_addresses = self._grad_addresses(grads, guarded)
        if grad_addresses is None:
            return None
        calls = []
        for relaunch, first in self.relaunches:
            step = self._next_step(first)
            if step is None:
                return None
            # unrounded: the kernel's array rounds each to float32 once, as a full step does
            arguments = relaunch.arguments(optimizer._scalars(group, step, float), inv_grad_scale, step)
            if arguments is None:  # a scalar is not a finite float32: the full path names it
                return None
            calls.append((relaunch, arguments))

        def run() -> None:
            # (the first advances the counters and bumps the versions, before its kernel)
            (first, arguments), *others = calls
            first.run(grad_addresses, *arguments, self.counter_addresses, self.steps, *self.compiled_bump)
            for relaunch, arguments in others:
                relaunch.run(grad_addresses, *arguments)
            if not self.compiled_bump:
                torch.autograd.graph.increment_version(self.written)

        return run

    def step_in_one_call(self, optimizer, group: dict, first_index: int, precision, inv_grad_scale: float,
                   view: Optional[StateView] = None) -> bool:
        """The whole step of an optimizer whose only group this is, where :attr:`alone`: the
        checks of :meth:`prepare` made in Python, then everything else in one compiled call
        (``Relaunch.run_in_one_call``: the compiled checks, the scalars, the counters, the versions,
        the kernel).  True when the step ran; False when it changed nothing (the caller takes
        the full path), as :meth:`prepare` answers None."""
        checked = self._checked_in_python(optimizer, group, first_index, precision, view)
        if checked is None:
            return False
        grads = checked[0]
        relaunch, first = self.relaunches[0]
        step = self._next_step(first)
        if step is None:
            return False
        return relaunch.run_in_one_call(self.checks, self.one_call_record,
                                        np.fromiter(map(id, grads), dtype=np.int64, count=len(grads)),
                                  optimizer._scalars(group, step, float), inv_grad_scale, step)

    def _next_step(self, first: int) -> Optional[int]:
        """The step number the kernel call whose first param's counter is ``steps[first]`` runs
        now, or None where the full path refuses it (a count of 2**53)."""
        counted = int(self.steps[first])
        return None if counted >= STEP_LIMIT else counted + 1

    def _checked_in_python(self, optimizer, group: dict, first_index: int, precision,
                           view: Optional[StateView]) -> "Optional[tuple]":
        """The checks of a step made in Python (all but the compiled call's): (the grads of
        the params with grads, whether torch's check confirmed their forms) when they hold,
        else None.  Changes nothing but the view the states were last found under."""
        params = group["params"]
        if first_index != self.first_index or not same_objects(params, self.params) \
                or settings(optimizer, group, precision) != self.settings:
            return None
        grads = list(map(_GRAD, params))
        if self.has_grad is not None:
            if list(map(operator.is_not, grads, repeat(None))) != self.has_grad:
                return None
            grads = list(compress(grads, self.has_grad))
        guarded = False  # (by torch's check; with the shim, the forms are read with the addresses)
        if self.shim is None:
            guarded = self.guards is not None and self.guards.check(*self.addressed, *grads) is True
            if not guarded and not self._forms_hold(grads):
                return None
        if view is None or not view.matches(self.found_under):
            if not same_objects(list(map(optimizer.state.get, self.updated, repeat(_NO_STATE))), self.states):
                return None
            self.found_under = view
        if self.dict_word is None and self._state_dicts_changed():  # (else compared in the compiled call)
            return None
        return grads, guarded

    def _state_dicts_changed(self) -> bool:
        """Whether a state dict changed: its version, else its keys and values."""
        if self.state_versions is not None:
            return list(map(self.versions, self.states)) != self.state_versions
        return not same_objects(list(chain.from_iterable(map(dict.values, self.states))), self.values) \
            or list(chain.from_iterable(self.states)) != self.keys

    def _grad_addresses(self, grads: list, guarded: bool) -> Optional[np.ndarray]:
        """The grads' addresses if the thread count, the addresses of params and state tensors,
        then the counters (read through their addresses) hold, and with the shim every form
        and the state dicts' versions too, all in one compiled call; else None.  The compiled
        reading through torch's address reader only of forms its check confirmed (module doc)."""
        if self.shim is None and not (guarded and self.reader is not None):  # (in Python)
            grad_addresses = np.fromiter(map(_ADDRESS, grads), dtype=np.int64, count=len(grads))
            holds = numba_backend.threads() == self.threads \
                and np.array_equal(np.fromiter(map(_ADDRESS, self.addressed), dtype=np.int64,
                                                count=len(self.addressed)), self.addresses) \
                and self.helpers.counters_equal(self.counter_addresses, self.steps) \
                and grad_addresses[self.sized_grads].all()
            return grad_addresses if holds else None
        grad_ids = np.fromiter(map(id, grads), dtype=np.int64, count=len(grads))
        if self.shim is not None:  # (the grads' addresses are read into the checks' own array)
            holds = self.helpers.launch_forms_hold(self.checks, grad_ids)
            return self.grad_addresses_read if holds else None
        grad_addresses = np.empty(len(grads), dtype=np.int64)
        holds = self.helpers.launch_holds(self.reader, self.ids, self.addresses, self.counter_addresses,
                                          self.steps, grad_ids, grad_addresses, self.sized_grads, self.threads)
        return grad_addresses if holds else None

    def _forms_hold(self, grads: list) -> bool:
        """The Python form of ``self.guards``' check (without torch's, or when it fails,
        e.g. on a param whose requires_grad was switched)."""
        return _PLAIN.issuperset(map(type, grads)) and list(map(_GRAD_FORM, grads)) == self.grad_forms \
            and list(map(_STRIDES, grads)) == self.grad_strides \
            and list(map(_PARAM_FORM, self.addressed)) == self.forms \
            and list(map(_STRIDES, self.addressed)) == self.strides \
            and not any(map(_IS_NEGATIVE, grads)) and not any(map(_IS_NEGATIVE, self.addressed))


def build(optimizer, material) -> Optional[GroupLaunch]:
    """The launch of a group's full step kept for reuse, or None when the group does not
    qualify (module doc).  Called once the step has run; ``material``:
    ``step_plan.KeptLaunchMaterial`` (the entries of the params with grads, in group order,
    and the (bucket, backend) of each kernel call)."""
    group, first_index, precision, entries, buckets = material
    if any(getattr(backend, "relaunch", None) is None for _, backend in buckets):  # (the reference's)
        return None
    if not all(entry.param is entry.original and type(entry.original) in _PLAIN
               and type(entry.grad) in _PLAIN for entry in entries):
        return None
    updated = [entry.original for entry in entries]
    states = [optimizer.state.get(param) for param in updated]
    if not all(isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())
               and state["step"].dtype == torch.float64 and state["step"].is_cpu and state["step"].numel() == 1
               for state in states):
        return None
    position = {id(param): k for k, param in enumerate(updated)}
    relaunches = []
    for bucket, backend in buckets:
        positions = [position[id(param)] for param in bucket.params]
        relaunch = backend.relaunch(bucket, positions)
        if relaunch is None:
            return None
        relaunches.append((relaunch, positions[0]))
    if not relaunches:  # (a reused step advances the counters in its first kernel call)
        return None
    return GroupLaunch(optimizer, group, first_index, precision, updated, [entry.grad for entry in entries],
                       relaunches, [tensor for bucket, _ in buckets for tensor in bucket.written()])


class ReuseAnswer(NamedTuple):
    """What the kept launches answered at the start of a step."""

    ran: bool      # the whole step already ran, in one compiled call
    answers: list  # (group, precision, phase two or None) of the groups asked, in order, up to the first None

    def every_group_reuses(self, groups: list) -> bool:
        return len(self.answers) == len(groups) and all(run is not None for _, _, run in self.answers)


_NOT_ASKED = ReuseAnswer(False, [])
_RAN = ReuseAnswer(True, [])


def reused_step(optimizer, inv_grad_scale: float = 1.0) -> ReuseAnswer:
    """Phase one of the common training step, in which every group reuses its kept launch,
    without the full path's plan: asks each group's launch in order and stops at the first
    that cannot reuse (the full path goes on from there).  Asks none when a group has no
    kept launch, or host buffers may be released (offload).  Changes nothing -- except where
    the optimizer's only group runs its whole step in one compiled call: then ``ran``."""
    kept, groups = optimizer._group_launches, optimizer.param_groups
    if len(kept) != len(groups) or "_offloader_instance" in optimizer.__dict__:
        return _NOT_ASKED
    view = StateView(optimizer.state)
    sole_launch = kept.get(0) if len(groups) == 1 else None
    if sole_launch is not None and sole_launch.one_call_record is not None:
        group = groups[0]
        precision = optimizer._group_precision(0, group)
        if not sole_launch.step_in_one_call(optimizer, group, 0, precision, inv_grad_scale, view):
            return ReuseAnswer(False, [(group, precision, None)])
        group["precision"] = precision
        return _RAN
    answers, first_index = [], 0
    for number, group in enumerate(groups):
        precision = optimizer._group_precision(number, group)
        launch = kept.get(number)
        run = None if launch is None else launch.prepare(optimizer, group, first_index, precision,
                                                         inv_grad_scale, view)
        answers.append((group, precision, run))
        if run is None:
            break
        first_index += len(group["params"])
    return ReuseAnswer(False, answers)
