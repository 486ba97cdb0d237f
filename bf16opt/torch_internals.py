"""Probes of torch's and CPython's private internals that the step cache may use, each
memoised once per process by :func:`probed`.

Every fast path of ``step_cache.py`` rests on a private API or layout: torch.compile's bulk
tensor check, CPython's per-dict version, torch's C address reader, torch's C shim for
AOTInductor read at the ``at::Tensor`` a tensor object holds, and autograd's version counter
inside a ``TensorImpl``.  Each is used only after its probe has seen it answer as expected on
tensors and dicts of several forms; a probe that fails (or raises) answers None, and the
cache then takes the next slower path, which is exact too.  Tests replace an answer through
:data:`ANSWERS`.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Callable, Optional

import numpy as np
import torch

from .backends import numba as numba_backend

__all__ = ["ANSWERS", "address_reader", "dict_version_word", "dict_versions", "tensor_guards", "tensor_shim",
           "version_places"]

#: probe name -> its answer (None: not usable here), once probed
ANSWERS: dict = {}
_ADDRESS = torch.Tensor.data_ptr


def probed(probe: Callable) -> Callable:
    """The answer of ``probe`` (a function of no arguments), computed at the first call."""
    name = probe.__name__

    def answer():
        if name not in ANSWERS:
            ANSWERS[name] = probe()
        return ANSWERS[name]

    answer.__name__, answer.__doc__ = name, probe.__doc__
    return answer


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


def _word(address: int) -> int:
    """The uint64 at ``address`` (a probe's read of a private layout)."""
    return ctypes.c_uint64.from_address(address).value


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


#: words of a TensorImpl the negative-bit probe reads: its 64-bit layout's size (the key set is
#: word 21 in torch 2.13, word 22 in 2.11); reading further could leave its allocation
_IMPL_WORDS = 24


def _negative_bit(tensor_offset: int, examples: list) -> Optional[list]:
    """[byte offset, mask] of the one bit a negative view sets in its ``TensorImpl`` (private
    layout: ``key_set_``'s Negative key), if exactly one word of the first ``_IMPL_WORDS``
    differs between every example and its ``_neg_view()`` by the same single bit, clear in
    every example and in a plain view; else None."""
    def impl_words(tensor) -> list:
        impl = _word(id(tensor) + tensor_offset)
        return [_word(impl + 8 * k) for k in range(_IMPL_WORDS)]

    plain = [t.detach() for t in examples]
    pairs = [(impl_words(t), impl_words(t._neg_view()), impl_words(t.view(t.shape))) for t in plain]
    found = set()
    for k in range(1, _IMPL_WORDS):
        bits = {before[k] ^ negative[k] for before, negative, _ in pairs}
        if len(bits) == 1:
            bit = bits.pop()
            if bit and bit & (bit - 1) == 0 and all(not (w[k] & bit) for before, _, view in pairs
                                                    for w in (before, view)):
                found.add((8 * k, bit))
    if len(found) != 1:
        return None
    offset, bit = found.pop()
    return [offset, bit - (1 << 64) if bit >= 1 << 63 else bit]  # (an int64 word)


def _probe_shim() -> Optional[np.ndarray]:
    """The shim array if the compiled form reading answers, for tensors of several forms
    (dtypes, offset and transposed views, a Parameter, empty, 0-dim), the Python type, torch's
    codes of the strided layout, the CPU and the dtype (the shim's own constants), ``data_ptr``,
    ``dim``, ``shape`` and ``stride``, and no form for their negative views; else None."""
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
        negative = _negative_bit(offset, examples)
        if negative is None:
            return None
        getters = [ctypes.cast(getattr(library, f"aoti_torch_get_{name}"), ctypes.c_void_p).value
                   for name in helpers.FORM_GETTERS]
        shim = np.array([type_word, offset, *getters, *negative], dtype=np.int64)
        codes = {dtype: getattr(library, f"aoti_torch_dtype_{name}")()
                 for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                                     (torch.float16, "float16"), (torch.float64, "float64"))}
        strided, cpu = library.aoti_torch_layout_strided(), library.aoti_torch_device_type_cpu()
        expected = [[id(type(t)), strided, cpu, codes[t.dtype], t.data_ptr(), t.dim(), *t.shape, *t.stride()]
                    for t in examples]
        starts = np.cumsum([0] + [len(form) for form in expected], dtype=np.int64)
        forms = np.zeros(starts[-1], dtype=np.int64)
        ids = np.array(list(map(id, examples)), dtype=np.int64)
        negatives = [t.detach()._neg_view() for t in examples]
        if helpers.read_forms(shim, ids, starts, forms) and forms.tolist() == sum(expected, []) \
                and len(set(codes.values())) == len(codes) \
                and not any(helpers.read_forms(shim, np.array([id(t)], dtype=np.int64), starts[k:k + 2] - starts[k],
                                               np.zeros(starts[k + 1] - starts[k], dtype=np.int64))
                            for k, t in enumerate(negatives)):
            return shim
    except Exception:  # noqa: BLE001  (any failure: torch's or the Python checks)
        pass
    return None


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


@probed
def tensor_guards():
    """torch.compile's C++ check of many tensors' forms (``TensorGuards``), or None."""
    return _probe_guards()


@probed
def dict_versions():
    """A function giving a dict's version, which every change of the dict changes (CPython's
    ``ma_version_tag``, PEP 509, read by torch.compile's ``dict_version``), or None."""
    return _probe_versions()


@probed
def dict_version_word() -> Optional[int]:
    """The offset in a dict object of the version :func:`dict_versions` reads, for compiled
    code to compare many dicts' versions in one call, or None."""
    return _probe_version_word()


@probed
def address_reader() -> Optional[int]:
    """The address of torch's C function ``void *(PyObject *tensor)`` giving a dense tensor's
    data address (``_torchinductor_pyobject_tensor_data_ptr``), or None."""
    return _probe_reader()


@probed
def tensor_shim() -> Optional[np.ndarray]:
    """What ``cpu_src/step_helpers.py``'s form functions need to read a tensor object's form in
    compiled code (the offsets of its type word and ``at::Tensor``, the C shim getters'
    addresses), or None."""
    return _probe_shim()


@probed
def version_places() -> Optional[np.ndarray]:
    """Where compiled code finds a tensor object's autograd version counter (for
    ``step_helpers.bump_versions``), or None without :func:`tensor_shim`."""
    shim = tensor_shim()
    return None if shim is None else _probe_version_places(int(shim[1]))
