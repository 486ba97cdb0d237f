"""A param group's launch kept between steps: a step over many small params costs its
kernel call and a few bulk checks, not a Python pass over every param.

A full step (``optimizer._prepare_step``) checks each param, grad and state tensor, works
out each param's KernelConfig, groups the params into buckets and builds each bucket's
chunk table.  From one training step to the next none of that changes but the grads (new
tensors after ``zero_grad``), the step number and the scalars.  After a full step of a
group that qualifies (below), :func:`build` keeps its buckets' kernel calls
(``backends/numba.py``'s ``Relaunch``); at the next step :meth:`GroupLaunch.prepare` checks,
in passes over lists that run in C, that everything they were built from still holds:

* the group's param list and the index of its first param in the optimizer, and the
  settings that choose kernel configurations and random streams (precision, flags,
  backend, offload, seed, telemetry, param names);
* each updated param's dtype, shape, strides and address (``p.data = ...`` changes them);
* which params have grads, and each grad's type, layout, dtype, shape, strides and device
  (a new grad only needs those to match: its address is put into the table every step);
* each state dict, every key and value in it (identity), every state tensor's dtype, shape
  and strides (``m.data = m.data[:3]`` keeps identity and address) and its address;
* the step counters: each exactly one more than after the last step (params whose counters
  differ go in different buckets), and below 2**53;
* the number of Numba threads (the table's thread ranges).

How, per step (well under 1 µs of Python per param; the fallbacks are exact, only slower):

* forms and addresses, with the step counters and the thread count: one compiled call
  (``cpu_src/step_helpers.py``'s ``launch_forms_hold``) over the objects' ids (params, state
  tensors, grads) that reads each one's type from its object header, then its layout,
  device, dtype, data address, dim, sizes and strides through torch's C shim for
  AOTInductor (``aoti_torch_get_*``, a C ABI) called on the ``at::Tensor`` the object holds
  (its offset in the object is private layout: used only once :func:`_probe_shim` has found
  it where torch's own copy of the ``at::Tensor`` points, and the forms read match Python's).
  Each is compared with its form at the launch's build (a grad's address aside: it is read),
  up to the first difference: a getter only on an object of a tensor type, and only on the
  tensor whose layout, device and dtype matched.  ~30 ns per tensor.
* without the shim: the forms (type, layout, device, dtype, shape, strides) in one call of
  torch.compile's C++ ``TensorGuards`` check over all of them (private API: used only once
  :func:`_probe_guards` has seen it refuse each kind of change; when it refuses, e.g. a
  param whose requires_grad was switched, the checks in Python decide), ~100 ns per tensor;
  then the addresses, counters and thread count in one compiled call (``launch_holds``)
  that reads each address through torch's C function
  ``_torchinductor_pyobject_tensor_data_ptr`` (private API, the one torch.compile's
  generated C++ calls; used once :func:`_probe_reader` has seen it answer ``data_ptr``'s
  address), only for tensors whose forms torch's check has just confirmed (dense, with
  storage: the function raises a C++ exception otherwise, which compiled code cannot
  catch); else ``data_ptr`` per tensor.  One call each, as each call costs tens of µs with
  the caches cold after a backward pass or the last step's kernel.
* the state dicts: the mapping ``optimizer.state`` is the same dict at the same version
  (:func:`dict_versions`: CPython's per-dict version, which every change of a dict bumps,
  read by torch.compile's private ``dict_version``, probed likewise), else each param's
  state is looked up; each state dict at the same version, else (without versions) the
  same values and keys.  Without versions, :class:`StateView` compares the mapping's
  keys and values by identity instead of a lookup per param (``Tensor.__hash__`` is Python).
  With the shim, the state dicts' versions are compared in its compiled call, read at the
  word of a dict object where :func:`_probe_version_word` found ``dict_version``'s answers
  (CPython's ``ma_version_tag``; ~60 ns per dict through ``dict_version``).

* autograd's version counters of the tensors the kernels write through addresses (params,
  state tensors, step counters), as torch.optim's in-place ops bump them: with the shim,
  in the group's first kernel call (``step_helpers.bump_versions``), each read through the
  object's ``at::Tensor`` and ``TensorImpl`` where :func:`_probe_version_places` found it
  (private layout, confirmed by torch's own bumps and ``_version``); ~10 ns per tensor
  against ~80 through ``torch.autograd.graph.increment_version``, which bumps them otherwise.

The group's hyper-parameter checks (``MixedPrecisionOptimizer._group_precision``) run again
only when a value of the group changed or could change in place.

Any difference, and the step takes the full path, which raises on bad input as always and
builds the launch again.  As in a full step, ``prepare`` (phase one) changes nothing -- a
step that raises, here or in another group, leaves the optimizer as it was -- and the
callable it returns (phase two) advances the counters and runs the kernels.

An optimizer whose only group has a launch of one kernel call, checked through the shim and
bumping the version counters in compiled code (:attr:`GroupLaunch.alone`), runs both phases
in one compiled call (:meth:`GroupLaunch.step_alone`, ``step_helpers.checked_relaunch``):
the checks above, then the scalars rounded to float32 and checked finite, then -- only when
all hold, else changing nothing -- the counters, versions and kernel, the GIL released for
the kernel as in the other kernel calls.  One compiled call less with cold caches: 15-58 µs
off a step over one 2^25 param, 8-13 µs off steps of 0.1-0.3 ms (model-167 Xeon).  Its ~25
arrays go as one record of their addresses (``step_helpers.launch_record``, made once per
launch), as Numba's dispatch unboxes each array argument: 49 -> 24 µs a call with the caches
cold, 15-28 µs off those steps again (paired medians).

Qualifies: a group updated by the numba backend (not offloaded; float64 params go to the
reference backend), of plain real tensors (no DTensor, no complex), without precision
telemetry, whose full step made or converted no state (the next step's kernels run
without the flags of fresh buffers, e.g. SGD's ``first``), whose step counters are
float64, and whose tensors are all addressed in place (no staging copies).
"""

from __future__ import annotations

import ctypes
import glob
import operator
import os
from collections import defaultdict
from itertools import chain, compress, repeat
from typing import Callable, Optional

import numpy as np
import torch

from .backends import numba as numba_backend

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_GRAD = operator.attrgetter("grad")
_PARAM_FORM = operator.attrgetter("dtype", "shape")
_GRAD_FORM = operator.attrgetter("layout", "dtype", "shape", "is_cpu")
_STRIDES = torch.Tensor.stride
_ADDRESS = torch.Tensor.data_ptr
_NO_STATE: dict = {}
_UNPROBED = object()
_tensor_guards = _UNPROBED  # torch's bulk tensor check once probed (tensor_guards()), or None


def tensor_guards():
    """torch.compile's C++ check of many tensors' forms (``TensorGuards``, private API), or
    None when this torch lacks it or it does not behave as :func:`_probe_guards` expects."""
    global _tensor_guards
    if _tensor_guards is _UNPROBED:
        _tensor_guards = _probe_guards()
    return _tensor_guards


def _probe_guards():
    """``TensorGuards`` if it tells a tensor of the example's form from each kind of change the
    cache must see, else None.  What it compares (torch/csrc/dynamo/guards.cpp): the exact
    Python type, the dispatch key set (backend, so device type and layout: sparse, mkldnn,
    meta; conj/neg bits; autograd), dtype, device index, requires_grad, sizes and strides;
    and that no tensor is passed twice.  Not the address, which the cache checks itself."""
    try:
        from torch._C._dynamo.guards import TensorGuards  # noqa: PLC0415
        example = torch.zeros(2, 3)
        guards = TensorGuards(example, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        changed = [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, 2), torch.zeros(3, 2).t(),
                   torch.nn.Parameter(torch.zeros(2, 3)), torch.zeros(2, 3).to_sparse(),
                   torch.zeros(2, 3, device="meta"), torch.zeros(2, 3)._neg_view()]
        if guards.check(torch.ones(2, 3)) is True and not any(guards.check(tensor) for tensor in changed):
            return TensorGuards
    except Exception:  # noqa: BLE001  (any failure: the checks in Python)
        pass
    return None


_dict_versions = _UNPROBED  # torch's reading of a dict's version once probed (dict_versions()), or None


def dict_versions():
    """A function giving a dict's version, which every change of the dict changes (CPython's
    ``ma_version_tag``, PEP 509, read by torch.compile's private ``dict_version``), or None
    when unavailable or it does not behave as :func:`_probe_versions` expects."""
    global _dict_versions
    if _dict_versions is _UNPROBED:
        _dict_versions = _probe_versions()
    return _dict_versions


def _word(address: int) -> int:
    """The uint64 at ``address`` (a probe's read of a private layout)."""
    return ctypes.c_uint64.from_address(address).value


_dict_version_word = _UNPROBED  # where a dict holds its version once probed (dict_version_word()), or None


def dict_version_word() -> Optional[int]:
    """The offset in a dict object of the version :func:`dict_versions` reads (CPython's
    ``ma_version_tag``), for compiled code to compare many dicts' versions in one call; None
    without dict versions, or when no word of the dict's fixed part follows them."""
    global _dict_version_word
    if _dict_version_word is _UNPROBED:
        _dict_version_word = _probe_version_word()
    return _dict_version_word


def _probe_version_word() -> Optional[int]:
    """The first offset in a dict's fixed part (after the object header) whose word equals
    :func:`dict_versions`' answer for several dicts, through each kind of change, else None;
    None too when those answers are not all different (a dict's length or a constant could
    match another word of the dict)."""
    versions = dict_versions()
    if versions is None:
        return None
    dicts = [{}, {"a": 1}, dict.fromkeys(range(20))]
    changes = [lambda d: d.__setitem__("b", 2), lambda d: d.pop("b"), lambda d: d.update(c=3),
               lambda d: d.clear(), lambda d: d.setdefault("e", 5)]
    seen = [[] for _ in dicts]  # each dict's (version, word at each offset), before and after each change
    offsets = range(object.__basicsize__, dict.__basicsize__ - 7, 8)
    for change in [None, *changes]:
        for d, record in zip(dicts, seen):
            if change is not None:
                change(d)
            record.append((versions(d), [_word(id(d) + at) for at in offsets]))
    answers = [version for record in seen for version, _ in record]
    if len(set(answers)) != len(answers):  # (a version is unique: one word matching them all is it)
        return None
    for k, offset in enumerate(offsets):
        if all(version == words[k] for record in seen for version, words in record):
            return offset
    return None


def _probe_versions():
    """torch's ``dict_version`` if every kind of change of a dict tried here changes it and
    reading does not, else None."""
    try:
        from torch._C._dynamo.guards import dict_version  # noqa: PLC0415
        d = {"a": 0, "b": 1}
        changes = [lambda: d.__setitem__("c", 2), lambda: d.__setitem__("a", 5), lambda: d.__delitem__("c"),
                   lambda: d.pop("a"), lambda: d.popitem(), lambda: d.setdefault("x", 1),
                   lambda: d.update(y=2), lambda: d.__ior__({"z": 3}), lambda: d.clear(),
                   lambda: dict.__init__(d, a=1), lambda: d.__setitem__("a", 2)]
        version = dict_version(d)
        for change in changes:
            change()
            now = dict_version(d)
            if not isinstance(now, int) or now == version:
                return None
            version = now
        d.get("a"), list(d.values()), "a" in d  # noqa: B018
        if dict_version(d) == version and dict_version({}) != dict_version({}):
            return dict_version
    except Exception:  # noqa: BLE001  (any failure: the checks in Python)
        pass
    return None


_address_reader = _UNPROBED  # torch's C function reading a tensor's address once probed (address_reader()), or None


def address_reader() -> Optional[int]:
    """The address of torch's C function ``void *(PyObject *tensor)`` giving a dense
    tensor's data address (``_torchinductor_pyobject_tensor_data_ptr``, private API), or None
    when this torch lacks it or it does not answer as :func:`_probe_reader` expects."""
    global _address_reader
    if _address_reader is _UNPROBED:
        _address_reader = _probe_reader()
    return _address_reader


def _probe_reader() -> Optional[int]:
    """The function's address if, called from compiled code, it gives ``data_ptr`` of dense
    tensors of several forms (offset views, a Parameter, empty, 0-dim), else None."""
    try:
        from torch._C._dynamo.guards import _torchinductor_pyobject_tensor_data_ptr as reader  # noqa: PLC0415
        if type(reader) is not int or reader <= 0:  # (an address, as torch exports it)
            return None
        examples = [torch.zeros(3), torch.zeros(4, 5, dtype=torch.bfloat16)[1:, 2:],
                    torch.nn.Parameter(torch.zeros(2)), torch.zeros(0), torch.zeros((), dtype=torch.float64),
                    torch.zeros(6)[5:]]
        addresses = np.zeros(len(examples), dtype=np.int64)
        numba_backend.helpers().read_addresses(reader, np.array(list(map(id, examples)), dtype=np.int64),
                                               addresses)
        if addresses.tolist() == list(map(_ADDRESS, examples)):
            return reader
    except Exception:  # noqa: BLE001  (any failure: data_ptr)
        pass
    return None


_tensor_shim = _UNPROBED  # the form reading through torch's C shim once probed (tensor_shim()), or None


def tensor_shim() -> Optional[np.ndarray]:
    """What ``cpu_src/step_helpers.py``'s form functions need to read a tensor object's form in
    compiled code (the offsets of its type word and of its ``at::Tensor``, and the addresses of
    torch's C shim getters), or None when this torch or Python lacks them or they do not answer
    as :func:`_probe_shim` expects."""
    global _tensor_shim
    if _tensor_shim is _UNPROBED:
        _tensor_shim = _probe_shim()
    return _tensor_shim


def _loaded_libraries(maps: str = "/proc/self/maps") -> list:
    """Paths of the shared libraries this process has mapped (Linux; empty elsewhere)."""
    try:
        with open(maps) as lines:
            return sorted({line.split(None, 5)[5].strip() for line in lines if line.count(" ") >= 5
                           and line.rstrip().endswith(".so")})
    except OSError:
        return []


def _shim_library():
    """torch's C library holding the shim for AOTInductor (``aoti_torch_*``): the
    ``libtorch_cpu`` this process has loaded (wherever its layout puts it: a conda
    environment's ``lib``), else the one in ``torch/lib`` (pip wheels, other systems)."""
    found = [path for path in _loaded_libraries() if os.path.basename(path) == "libtorch_cpu.so"] \
        or sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*torch_cpu.*")))
    return ctypes.CDLL(found[0]) if found else None


def _tensor_offset(examples: list) -> Optional[int]:
    """The offset in a tensor object of the ``at::Tensor`` it holds, its first member after the
    object header (``THPVariable``'s layout in torch's headers), if each example holds there
    the same ``TensorImpl`` pointer as a copy of its ``at::Tensor`` made by torch; else None.
    No other offset is tried: a torch whose objects hold something else first (older ones
    held a ``MaybeOwned<Tensor>``, at times a pointer to a tensor held elsewhere) keeps
    TensorGuards."""
    from torch._C import _aoti  # noqa: PLC0415
    capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    impls = []
    for tensor in examples:
        copy = _aoti.unsafe_alloc_void_ptr_from_tensor(tensor)  # (a new at::Tensor, in a capsule)
        try:
            impls.append(ctypes.c_void_p.from_address(capsule_pointer(copy, None)).value)
        finally:
            _aoti.alloc_tensor_by_stealing_from_void_ptr(copy)  # (deletes the copy)
    offset = object.__basicsize__
    if torch.Tensor.__basicsize__ >= offset + ctypes.sizeof(ctypes.c_void_p) \
            and all(ctypes.c_void_p.from_address(id(tensor) + offset).value == impl
                    for tensor, impl in zip(examples, impls)):
        return offset
    return None


def _probe_shim() -> Optional[np.ndarray]:
    """The shim array if the compiled form reading answers, for tensors of several forms
    (dtypes, offset and transposed views, a Parameter, empty, 0-dim), the Python type, torch's
    codes of the strided layout, the CPU and the dtype (the shim's own constants), ``data_ptr``,
    ``dim``, ``shape`` and ``stride``; else None."""
    try:
        library = _shim_library()
        if library is None:
            return None
        helpers = numba_backend.helpers()
        examples = [torch.zeros(3), torch.zeros(4, 5, dtype=torch.bfloat16)[1:, 2:],
                    torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float16)).t(), torch.zeros(0),
                    torch.zeros((), dtype=torch.float64),
                    torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16))]
        type_word = object.__basicsize__ - ctypes.sizeof(ctypes.c_void_p)  # (ob_type ends the object header)
        if not all(ctypes.c_void_p.from_address(id(tensor) + type_word).value == id(type(tensor))
                   for tensor in examples):
            return None
        offset = _tensor_offset(examples)
        if offset is None:
            return None
        getters = [ctypes.cast(getattr(library, f"aoti_torch_get_{name}"), ctypes.c_void_p).value
                   for name in helpers.FORM_GETTERS]
        shim = np.array([type_word, offset, *getters], dtype=np.int64)
        codes = {dtype: getattr(library, f"aoti_torch_dtype_{name}")()
                 for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                                     (torch.float16, "float16"), (torch.float64, "float64"))}
        strided, cpu = library.aoti_torch_layout_strided(), library.aoti_torch_device_type_cpu()
        expected = [[id(type(t)), strided, cpu, codes[t.dtype], t.data_ptr(), t.dim(), *t.shape, *t.stride()]
                    for t in examples]
        starts = np.cumsum([0] + [len(form) for form in expected], dtype=np.int64)
        forms = np.zeros(starts[-1], dtype=np.int64)
        ids = np.array(list(map(id, examples)), dtype=np.int64)
        if helpers.read_forms(shim, ids, starts, forms) and forms.tolist() == sum(expected, []) \
                and len(set(codes.values())) == len(codes):
            return shim
    except Exception:  # noqa: BLE001  (any failure: torch's or the Python checks)
        pass
    return None


_version_places = _UNPROBED  # where a tensor's autograd version lives once probed (version_places()), or None


def version_places() -> Optional[np.ndarray]:
    """Where compiled code finds a tensor object's autograd version counter
    (``cpu_src/step_helpers.py``'s ``bump_versions``: the ``at::Tensor``'s offset in the
    object, the counter's pointer's in the ``TensorImpl``, the version's in the counter), or
    None without :func:`tensor_shim` or when :func:`_probe_version_places` does not find them."""
    global _version_places
    if _version_places is _UNPROBED:
        shim = tensor_shim()
        _version_places = None if shim is None else _probe_version_places(int(shim[1]))
    return _version_places


def _probe_version_places(tensor_offset: int) -> Optional[np.ndarray]:
    """The places if exactly one word of a ``TensorImpl``'s first twelve (private layout:
    ``version_counter_``) is the same for tensors that share a version counter (a tensor, a
    view of it, its ``detach()``), other for those that do not (its ``.data``, which shares its
    storage; another tensor of its form), not zero, and zero for an inference tensor (which
    has no counter); then exactly one uint32 of what it points to follows the version through
    torch's bumps; then the compiled bump advances the version of a tensor and its views, a
    Parameter and a bfloat16 tensor by one each, and no other; else None."""
    try:
        def impl_words(tensor) -> list:
            impl = _word(id(tensor) + tensor_offset)
            return [_word(impl + at) for at in range(0, 96, 8)]

        base = torch.zeros(4)
        sharing = [impl_words(t) for t in (base, base.view(2, 2), base.detach())]
        others = [impl_words(t) for t in (base.data, torch.zeros(4))]
        with torch.inference_mode():
            inference = torch.zeros(4)
        untracked = impl_words(inference)
        found = [k for k in range(1, 12) if sharing[0][k] != 0 and untracked[k] == 0
                 and all(words[k] == sharing[0][k] for words in sharing)
                 and all(words[k] != sharing[0][k] for words in others)]
        if len(found) != 1:
            return None
        counter = sharing[0][found[0]]

        def versions() -> list:  # the uint32s after the counter's header (vtable pointer)
            return [ctypes.c_uint32.from_address(counter + at).value for at in range(8, 24, 4)]

        for _ in range(41):  # (a version no count of owners is likely to equal)
            torch.autograd.graph.increment_version(base)
        before = versions()
        torch.autograd.graph.increment_version(base)
        after = versions()
        places = [at for at, (b, a) in zip(range(8, 24, 4), zip(before, after))
                  if b == base._version - 1 and a == base._version]
        if len(places) != 1 or sum(b != a for b, a in zip(before, after)) != 1:
            return None
        answer = np.array([tensor_offset, 8 * found[0], places[0]], dtype=np.int64)
        view, alias, other = base[1:], base.data, torch.zeros(3)
        param = torch.nn.Parameter(torch.zeros(2))
        bf16 = torch.zeros(5, dtype=torch.bfloat16)
        bumped, unchanged = [base, param, bf16], [alias, other]
        expected = [t._version + 1 for t in bumped] + [t._version for t in unchanged]
        numba_backend.helpers().bump_versions(np.array([id(base), id(param), id(bf16), id(inference)],
                                                       dtype=np.int64), answer)
        if [t._version for t in bumped + unchanged] == expected and view._version == base._version:
            return answer
    except Exception:  # noqa: BLE001  (any failure: torch's increment_version)
        pass
    return None


def _shim_forms(tensors: list) -> "Optional[tuple]":
    """(starts, forms) of ``tensors`` for ``step_helpers.forms_hold``, or None without the shim
    or when a tensor is not a plain one (the offsets are probed on torch.Tensor and Parameter)."""
    shim = tensor_shim()
    if shim is None or not _PLAIN.issuperset(map(type, tensors)):
        return None
    helpers = numba_backend.helpers()
    starts = np.cumsum([0] + [helpers.FORM_HEAD + 2 * tensor.dim() for tensor in tensors], dtype=np.int64)
    forms = np.zeros(starts[-1], dtype=np.int64)
    ids = np.fromiter(map(id, tensors), dtype=np.int64, count=len(tensors))
    return (starts, forms) if helpers.read_forms(shim, ids, starts, forms) else None


def _guards_of(tensors: list):
    """A bulk check that ``tensors`` (distinct tensors) keep their types and forms, or None."""
    guards = tensor_guards()
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
        versions = dict_versions()
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
            None if names is None else tuple(names))


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
        self.shim = tensor_shim() if forms is not None and grad_forms is not None else None
        if self.shim is not None:
            self.form_starts, self.forms_read = forms
            self.grad_form_starts, self.grad_forms_read = grad_forms
        self.guards = _guards_of(self.addressed + grads) if self.shim is None else None
        self.reader = address_reader() if self.guards is not None else None
        self.keys = list(chain.from_iterable(self.states))  # (str)
        self.versions = dict_versions()
        self.state_versions = None if self.versions is None else list(map(self.versions, self.states))
        # with the shim, the state dicts' versions are compared in its compiled call too
        self.dict_word = dict_version_word() if self.shim is not None else None
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
        places = version_places() if self.shim is not None else None
        self.compiled_bump = () if places is None else \
            (np.fromiter(map(id, self.written), dtype=np.int64, count=len(self.written)), places)
        # step_alone's record where it can run (one kernel call, every check and bump compiled):
        # the addresses of the arrays above and the relaunch's, and an array the grads'
        # addresses are read into (the call uses them and returns)
        self.grad_addresses_read = np.empty(len(grads), dtype=np.int64)
        alone = len(relaunches) == 1 and bool(self.compiled_bump)
        self.alone = None if not alone else relaunches[0][0].alone_record(
            shim=self.shim, dicts=self.dicts, versions=self.expected_versions, tensors=self.ids,
            starts=self.form_starts, forms=self.forms_read, counters=self.counter_addresses, steps=self.steps,
            grad_starts=self.grad_form_starts, grad_forms=self.grad_forms_read,
            grad_addresses=self.grad_addresses_read, sized=self.sized_grads, written=self.compiled_bump[0],
            places=self.compiled_bump[1], dict_word=self.dict_word or 0, threads=self.threads,
            first=relaunches[0][1])

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

    def step_alone(self, optimizer, group: dict, first_index: int, precision, inv_grad_scale: float,
                   view: Optional[StateView] = None) -> bool:
        """The whole step of an optimizer whose only group this is, where :attr:`alone`: the
        checks of :meth:`prepare` made in Python, then everything else in one compiled call
        (``Relaunch.run_alone``: the compiled checks, the scalars, the counters, the versions,
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
        return relaunch.run_alone(self.alone, np.fromiter(map(id, grads), dtype=np.int64, count=len(grads)),
                                  optimizer._scalars(group, step, float), inv_grad_scale, step)

    def _next_step(self, first: int) -> Optional[int]:
        """The step number the kernel call whose first param's counter is ``steps[first]`` runs
        now, or None where the full path refuses it (a count of 2**53)."""
        counted = int(self.steps[first])
        return None if counted >= 2 ** 53 else counted + 1

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
        grad_addresses = np.empty(len(grads), dtype=np.int64)
        if self.shim is not None:
            holds = self.helpers.launch_forms_hold(
                self.shim, self.dicts, self.dict_word or 0, self.expected_versions, self.ids,
                self.form_starts, self.forms_read, self.counter_addresses, self.steps, grad_ids,
                self.grad_form_starts, self.grad_forms_read, grad_addresses, self.sized_grads, self.threads)
        else:
            holds = self.helpers.launch_holds(self.reader, self.ids, self.addresses, self.counter_addresses,
                                              self.steps, grad_ids, grad_addresses, self.sized_grads,
                                              self.threads)
        return grad_addresses if holds else None

    def _forms_hold(self, grads: list) -> bool:
        """The Python form of ``self.guards``' check (without torch's, or when it fails,
        e.g. on a param whose requires_grad was switched)."""
        return _PLAIN.issuperset(map(type, grads)) and list(map(_GRAD_FORM, grads)) == self.grad_forms \
            and list(map(_STRIDES, grads)) == self.grad_strides \
            and list(map(_PARAM_FORM, self.addressed)) == self.forms \
            and list(map(_STRIDES, self.addressed)) == self.strides


def build(optimizer, group: dict, first_index: int, precision, entries: list, buckets: list) -> Optional[GroupLaunch]:
    """The launch of a group's full step kept for reuse, or None when the group does not
    qualify (module doc).  Called once the step has run; ``entries``: the step's
    ``_Entry`` of each param with a grad, in group order; ``buckets``: (bucket, backend)."""
    if any(backend is not numba_backend for _, backend in buckets):
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
    for bucket, _ in buckets:
        positions = [position[id(param)] for param in bucket.params]
        relaunch = numba_backend.relaunch(bucket, positions)
        if relaunch is None:
            return None
        relaunches.append((relaunch, positions[0]))
    if not relaunches:  # (a reused step advances the counters in its first kernel call)
        return None
    return GroupLaunch(optimizer, group, first_index, precision, updated, [entry.grad for entry in entries],
                       relaunches, [tensor for bucket, _ in buckets for tensor in bucket.written()])
