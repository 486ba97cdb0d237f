"""Per-step bookkeeping of the Numba backend as one compiled call each, not one numpy or
torch call per tensor: the step counters, read and advanced through their addresses, the
stochastic-rounding stream keys of a bucket's tensors, tensors' data addresses, and a kept
launch's step (its chunk table's grad column pointed, its stream keys made, its chunks run).

What for: a step over ~150 small params would spend more time in these per-tensor calls
(``torch._foreach_add_`` falls back to a loop on CPU) than in its update; and every call,
compiled or numpy, is costly when the caches are cold after a kernel's stream (a step
over one large param), so the step cache's checks are one call, and so is its kernel call.  The step cache
(``bf16opt/step_cache.py``) checks the counters' identities and addresses before it
passes them here.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .chunks import cached_njit, run_chunks, run_chunks_serial
from .storage import pointer_to

_MASK32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B9)  # storage.GOLDEN


@cached_njit(nogil=True)
def counters_equal(addresses, expected):
    """True when the float64 at each ``addresses[i]`` is ``expected[i]``."""
    for i in range(addresses.size):
        if pointer_to(addresses[i], np.float64)[0] != expected[i]:
            return False
    return True


@cached_njit(nogil=True)
def advance_counters(addresses, steps):
    """Add 1 to the float64 at each of ``addresses`` and to each of ``steps`` (the kept copy
    of the counters; one call, not a numpy call more)."""
    for i in range(addresses.size):
        counter = pointer_to(addresses[i], np.float64)
        counter[0] += 1.0
        steps[i] += 1.0


@cached_njit(nogil=True)
def point_grads(table, column, grad_of_row, row_bytes, grad_addresses):
    """``table[r, column]``: the address of row ``r``'s first grad element, at byte
    ``row_bytes[r]`` of the grad at ``grad_addresses[grad_of_row[r]]``."""
    for r in range(grad_of_row.size):
        table[r, column] = grad_addresses[grad_of_row[r]] + row_bytes[r]


@cached_njit(nogil=True)
def _fmix32(h):
    """MurmurHash3 fmix32 (storage.fmix32_int) on a uint64 holding a uint32."""
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _MASK32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _MASK32
    return h ^ (h >> np.uint64(16))


@cached_njit(nogil=True)
def stream_keys(key, tensors, keys):
    """``keys[i, s]``: storage.stream_key's hash chain continued from ``key`` (the seed's
    and step's words hashed) with the words ``tensors[i]`` (int64, the low 32 bits are
    used) and stream ``s``, for every stream column ``s`` of ``keys`` (uint32)."""
    for i in range(tensors.size):
        tensor = _fmix32(((key ^ (np.uint64(tensors[i]) & _MASK32)) + _GOLDEN) & _MASK32)
        for stream in range(keys.shape[1]):
            keys[i, stream] = _fmix32(((tensor ^ np.uint64(stream)) + _GOLDEN) & _MASK32)


@cached_njit(nogil=True)
def step_key(seed_words, step):
    """storage.stream_key's hash chain over the seed's and the step's words (``stream_keys``'
    ``key``); ``seed_words``: uint64 (seed & MASK32, seed >> 32)."""
    step = np.uint64(step)
    key = np.uint64(0)
    for word in (seed_words[0], (seed_words[1] ^ (step >> np.uint64(32))) & _MASK32, step & _MASK32):
        key = _fmix32(((key ^ word) + _GOLDEN) & _MASK32)
    return key


@intrinsic
def _add_one(typingctx, address):
    """Add 1 to the uint32 at ``address`` atomically (as C++'s ``++`` on a ``std::atomic``)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        builder.atomic_rmw("add", pointer, ir.Constant(ir.IntType(32), 1), "seq_cst")
        return context.get_dummy_value()

    return types.void(address), codegen


@cached_njit(nogil=True)
def bump_versions(tensors, places):
    """Autograd's version counter of each tensor object whose ``id`` is ``tensors[i]`` advanced
    by one, as ``torch.autograd.graph.increment_version`` does (a tensor without one, made
    under inference mode, is left alone, as there).  ``places``: int64 [offset of the
    ``at::Tensor`` in the object, of the counter's pointer in the ``TensorImpl``, of the
    version in the counter]: bf16opt/step_cache.py's ``version_places`` probes them.  Read
    through the object every time: a tensor swapped (``torch.utils.swap_tensors``) holds
    another counter.  The caller keeps the objects alive and has checked their types."""
    for i in range(tensors.size):
        impl = pointer_to(tensors[i] + places[0], np.int64)[0]
        counter = pointer_to(impl + places[1], np.int64)[0]
        if counter != 0:
            _add_one(counter + places[2])


@cached_njit(nogil=True)
def relaunch(serial, address, table, scalars, keys, row_counts, bounds, grad_column, grad_of_row, row_bytes,
             grad_addresses, seed_words, step, streams, counters, steps, written, places):
    """A kept launch's step in one compiled call (each call is costly with cold caches):
    the step counters at ``counters`` advanced (:func:`advance_counters`) and the version
    counters of the tensors ``written`` (:func:`bump_versions` with ``places``) -- a group's
    first kernel call does both for all of its tensors, the others get none --, its grad
    column pointed (:func:`point_grads`), the step's stream keys written into ``keys`` for the
    tensors ``streams`` (none without stochastic rounding), and the chunk driver run, on
    Numba's threads or (``serial``, in a fork child) on this one."""
    advance_counters(counters, steps)
    bump_versions(written, places)
    point_grads(table, grad_column, grad_of_row, row_bytes, grad_addresses)
    if streams.size:
        stream_keys(step_key(seed_words, step), streams, keys)
    if serial:
        run_chunks_serial(address, table, scalars, keys, row_counts, bounds)
    else:
        run_chunks(address, table, scalars, keys, row_counts, bounds)


@intrinsic
def _address_of(typingctx, reader, tensor):
    """``reader(tensor)``: the C function at address ``reader``, ``void *(PyObject *)``, called
    with the object at address ``tensor`` (its ``id``); the pointer it returns as an int64."""
    if not isinstance(reader, types.Integer) or not isinstance(tensor, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        bytes_pointer = ir.IntType(8).as_pointer()
        function = builder.inttoptr(args[0], ir.FunctionType(bytes_pointer, [bytes_pointer]).as_pointer())
        address = builder.call(function, [builder.inttoptr(args[1], bytes_pointer)])
        return builder.ptrtoint(address, ir.IntType(64))

    return types.int64(reader, tensor), codegen


@intrinsic
def _thread_count(typingctx):
    """Numba's thread count for the calling thread (``numba.get_num_threads()``) without its
    Python function's locks: the threading layer's C function ``int get_num_threads(void)``,
    the symbol Numba registers when it launches its threads -- as ``numba.get_num_threads()``
    does, which the step cache calls before it keeps a launch (and a cached compilation
    referring to the symbol is only loaded after that)."""

    def codegen(context, builder, signature, args):
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                                  "get_num_threads")
        return builder.sext(builder.call(function, []), ir.IntType(64))

    return types.int64(), codegen


# ---------------------------------------------------------------- tensors' forms, read in C
# A tensor's form as the step cache compares it from one step to the next, int64 words:
#   [Python type, layout, device type, dtype, data address, dim, sizes..., strides...]
# read from the tensor object at address ``tensor`` (its ``id``): the type from the object's
# header, the rest through the getters of torch's C shim for AOTInductor (``aoti_torch_get_*``,
# a C ABI), called on the ``at::Tensor`` the object holds.  ``shim``: int64 [offset of the type
# word in the object, offset of its at::Tensor, the getters' addresses in FORM_GETTERS order,
# the offset in a ``TensorImpl`` of the word holding its negative bit, that bit's mask];
# bf16opt/torch_internals.py's ``tensor_shim`` probes the offsets, every getter and the bit.
# A negative view is no form at all: the shim has no getter for the bit, and its memory
# holds the values negated (the full path stages it through a copy).
FORM_GETTERS = ("layout", "device_type", "dtype", "data_ptr", "dim", "sizes", "strides")
FORM_HEAD = 6  # the words before the sizes
FORM_ADDRESS = 4  # the data address's word
SHIM_NEGATIVE = 2 + len(FORM_GETTERS)  # the negative bit's word offset, then its mask


@intrinsic
def _get(typingctx, getter, handle, answer):
    """``getter(handle, answer)``: the C function at address ``getter``, ``int32 (void *, void *)``
    (a getter of torch's C shim: a tensor handle, where to write the answer), called with the
    addresses ``handle`` and ``answer``; its error code (0: success)."""
    if not all(isinstance(a, types.Integer) for a in (getter, handle, answer)):
        return None

    def codegen(context, builder, signature, args):
        bytes_pointer = ir.IntType(8).as_pointer()
        kind = ir.FunctionType(ir.IntType(32), [bytes_pointer, bytes_pointer])
        function = builder.inttoptr(args[0], kind.as_pointer())
        code = builder.call(function, [builder.inttoptr(args[1], bytes_pointer),
                                       builder.inttoptr(args[2], bytes_pointer)])
        return builder.sext(code, ir.IntType(64))

    return types.int64(getter, handle, answer), codegen


@cached_njit()
def _is_negative(shim, tensor):
    """Whether the tensor object at ``tensor`` is a negative view (its ``TensorImpl``'s bit)."""
    impl = pointer_to(tensor + shim[1], np.int64)[0]
    return (pointer_to(impl + shim[SHIM_NEGATIVE], np.int64)[0] & shim[SHIM_NEGATIVE + 1]) != 0


@cached_njit()
def _read_form(shim, tensor, form, start, stop, answer):
    """The form of the tensor object at ``tensor`` written into ``form[start:stop]``; False when
    it is a negative view, a getter fails or the form is not ``stop - start`` words long.  ``answer``: two int64 of
    scratch (an int32 answer lands in the low half of ``answer[0]``: the probe checks the
    words against Python's on this machine)."""
    form[start] = pointer_to(tensor + shim[0], np.int64)[0]
    if _is_negative(shim, tensor):
        return False
    handle, place = tensor + shim[1], answer.ctypes.data
    for k in range(1, FORM_HEAD):  # layout, device type, dtype (int32 each), address, dim
        answer[0] = 0
        if _get(shim[1 + k], handle, place) != 0:
            return False
        form[start + k] = answer[0]
    dim = answer[0]
    if dim < 0 or stop - start != FORM_HEAD + 2 * dim:
        return False
    for k in range(2):  # sizes, strides: the answer is a pointer to dim int64s (borrowed)
        if _get(shim[1 + FORM_HEAD + k], handle, place) != 0:
            return False
        values = pointer_to(answer[0], np.int64)
        for d in range(dim):
            form[start + FORM_HEAD + k * dim + d] = values[d]
    return True


@cached_njit()
def _form_holds(shim, tensor, form, start, answer, address_too):
    """Whether the object at ``tensor`` has the form ``form[start:]`` (as :func:`_read_form`
    reads it; the data address compared only with ``address_too``, and left in ``answer[1]``),
    compared word by word up to the first difference: the type before any getter (any object
    has a type word) or the negative bit, and no getter on a tensor whose layout, device or dtype already differ
    (torch's shim raises on, and logs, e.g. a sparse tensor's strides).  A walk of its own: one
    function reading or comparing by a flag was slower in the step's check."""
    if pointer_to(tensor + shim[0], np.int64)[0] != form[start] or _is_negative(shim, tensor):
        return False
    handle, place = tensor + shim[1], answer.ctypes.data
    for k in range(1, FORM_HEAD):
        answer[0] = 0
        if _get(shim[1 + k], handle, place) != 0:
            return False
        if k == FORM_ADDRESS:
            answer[1] = answer[0]
        if answer[0] != form[start + k] and (address_too or k != FORM_ADDRESS):
            return False
    dim = answer[0]  # (the same as the form's)
    for k in range(2):
        if _get(shim[1 + FORM_HEAD + k], handle, place) != 0:
            return False
        values = pointer_to(answer[0], np.int64)
        for d in range(dim):
            if values[d] != form[start + FORM_HEAD + k * dim + d]:
                return False
    return True


@cached_njit()
def read_forms(shim, tensors, starts, forms):
    """``forms[starts[i]:starts[i + 1]]``: the form of the tensor object whose ``id`` is
    ``tensors[i]`` (``starts`` sized by each tensor's dim; the caller has checked that each
    is a torch.Tensor or Parameter, the types the probe tried); False when one cannot be read."""
    answer = np.zeros(2, dtype=np.int64)
    for i in range(tensors.size):
        if not _read_form(shim, tensors[i], forms, starts[i], starts[i + 1], answer):
            return False
    return True


@cached_njit()
def forms_hold(shim, tensors, starts, forms, addresses, compare_addresses):
    """True when each object whose ``id`` is ``tensors[i]`` (any object: its type is compared
    first) is a tensor of the form ``forms[starts[i]:starts[i + 1]]`` -- its data address too
    where ``compare_addresses``, else the address is read into ``addresses[i]`` (any address:
    a grad is a new tensor each step).  The caller keeps the objects alive."""
    answer = np.zeros(2, dtype=np.int64)
    for i in range(tensors.size):
        if not _form_holds(shim, tensors[i], forms, starts[i], answer, compare_addresses):
            return False
        if not compare_addresses:
            addresses[i] = answer[1]
    return True


@cached_njit(nogil=True)
def have_memory(addresses, sized):
    """True unless a tensor with ``sized[i]`` (elements to read) has address 0 (an empty
    tensor may; a grad whose storage was freed, as FSDP frees it, does)."""
    for i in range(addresses.size):
        if sized[i] and addresses[i] == 0:
            return False
    return True


@cached_njit()
def words_equal(objects, offset, expected):
    """True when the uint64 at byte ``offset`` of each object whose ``id`` is ``objects[i]`` is
    ``expected[i]`` (a dict's version: bf16opt/step_cache.py's ``dict_version_word``)."""
    for i in range(objects.size):
        if pointer_to(objects[i] + offset, np.uint64)[0] != expected[i]:
            return False
    return True


@cached_njit()
def launch_forms_hold(checks, grads):
    """:func:`launch_holds` with the forms checked here too, through torch's C shim; ``checks``:
    a record of the layout ``"checks"``, ``grads``: the grads' ids.  True when Numba's thread
    count is ``threads``, each state dict (``dicts``) has its version (:func:`words_equal` at
    ``dict_word``; no dicts: checked by the caller), every param and state tensor
    (``tensors``) has its form, data address included (:func:`forms_hold`), the float64 at
    each ``counters[i]`` is ``steps[i]`` (read once the addresses held), and every grad has its
    form, its address aside: read into ``grad_addresses``, non-zero for each grad with
    ``sized[i]``."""
    shim, grad_addresses = record_array(checks, "shim"), record_array(checks, "grad_addresses")
    if _thread_count() != record_integer(checks, "threads") or not words_equal(
            record_array(checks, "dicts"), record_integer(checks, "dict_word"), record_array(checks, "versions")):
        return False
    if not forms_hold(shim, record_array(checks, "tensors"), record_array(checks, "starts"),
                      record_array(checks, "forms"), grad_addresses, True):
        return False
    if not counters_equal(record_array(checks, "counters"), record_array(checks, "steps")):
        return False
    return forms_hold(shim, grads, record_array(checks, "grad_starts"), record_array(checks, "grad_forms"),
                      grad_addresses, False) and have_memory(grad_addresses, record_array(checks, "sized"))


# (the two below keep the GIL: ``reader`` reads Python objects)
@cached_njit()
def read_addresses(reader, tensors, out):
    """``out[i]``: the data address of the tensor whose ``id`` is ``tensors[i]``, read by
    ``reader`` (torch's C function, see ``bf16opt/step_cache.py``'s ``address_reader``).
    The caller keeps the tensors alive and has checked that they are dense tensors."""
    for i in range(tensors.size):
        out[i] = _address_of(reader, tensors[i])


@cached_njit()
def launch_holds(reader, tensors, expected, counters, steps, grads, grad_addresses, sized, threads):
    """The step cache's checks of a kept launch in one call (each compiled call is costly when
    the caches are cold, as they are after a backward pass): True when Numba's
    thread count is ``threads``, the tensor whose ``id`` is ``tensors[i]`` has its data at
    ``expected[i]`` for every ``i``, and the float64 at each ``counters[i]`` is ``steps[i]``
    (the counters are among the tensors: read only once their addresses held); the grads'
    addresses are read into ``grad_addresses`` (as :func:`read_addresses`), and each grad
    with ``sized[i]`` has memory (an empty tensor may have address 0)."""
    if _thread_count() != threads:
        return False
    for i in range(tensors.size):
        if _address_of(reader, tensors[i]) != expected[i]:
            return False
    if not counters_equal(counters, steps):
        return False
    read_addresses(reader, grads, grad_addresses)
    return have_memory(grad_addresses, sized)


@intrinsic
def _release_gil(typingctx):
    """``PyEval_SaveThread()``: the GIL released (its thread state, for :func:`_take_gil`), as
    Numba's ``nogil`` wrapper releases it, here inside a function that needed it so far."""
    def codegen(context, builder, signature, args):
        save = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.voidptr_t, []),
                                              "PyEval_SaveThread")
        return builder.call(save, [])
    return types.voidptr(), codegen


@intrinsic
def _take_gil(typingctx, state):
    """``PyEval_RestoreThread(state)``: the GIL taken back."""
    def codegen(context, builder, signature, args):
        restore = cgutils.get_or_insert_function(builder.module,
                                                 ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t]),
                                                 "PyEval_RestoreThread")
        builder.call(restore, [args[0]])
        return context.get_dummy_value()
    return types.void(types.voidptr), codegen


# ---------------------------------------------------------------- a kept launch's records
#: the layouts of the two records a kept launch's compiled calls take, each written once: arrays
#: (name, dtype, dimensions), each held as its data address and two dimensions, then integers.
#: One array argument where they were ~25, as Numba's dispatch unboxes each array argument.
#: Compiled code reads a slot by name (:func:`record_array`, :func:`record_integer`), resolved at
#: compile time; names are unique across the two.
RECORD_LAYOUTS = {
    # what the step cache's compiled checks read (:func:`launch_forms_hold`)
    "checks": ((("shim", np.int64, 1), ("dicts", np.int64, 1), ("versions", np.uint64, 1),
                ("tensors", np.int64, 1), ("starts", np.int64, 1), ("forms", np.int64, 1),
                ("counters", np.int64, 1), ("steps", np.float64, 1), ("grad_starts", np.int64, 1),
                ("grad_forms", np.int64, 1), ("grad_addresses", np.int64, 1), ("sized", np.bool_, 1)),
               ("dict_word", "threads")),
    # what a single launch's step reads beyond them (:func:`checked_relaunch`)
    "launch": ((("values", np.float32, 1), ("addresses", np.int64, 1), ("table", np.int64, 2),
                ("keys", np.uint32, 2), ("row_counts", np.int64, 2), ("grad_of_row", np.int64, 1),
                ("row_bytes", np.int64, 1), ("seed_words", np.uint64, 1), ("streams", np.int64, 1),
                ("written", np.int64, 1), ("places", np.int64, 1)),
               ("first", "dampening", "grad_column")),
}
_ARRAY_SLOTS = {name: (3 * k, dtype, dims) for arrays, _ in RECORD_LAYOUTS.values()
                for k, (name, dtype, dims) in enumerate(arrays)}
_INTEGER_SLOTS = {name: 3 * len(arrays) + k for arrays, integers in RECORD_LAYOUTS.values()
                  for k, name in enumerate(integers)}


def pack_record(kind: str, **given) -> np.ndarray:
    """A record of the layout ``RECORD_LAYOUTS[kind]``.  It holds addresses: the caller keeps
    the arrays alive and never replaces them (they are written in place).  Raises TypeError on
    an array of another dtype, dimension count or layout, or a name missing or unknown (a
    caller's mistake)."""
    arrays, integers = RECORD_LAYOUTS[kind]
    names = [name for name, _, _ in arrays] + list(integers)
    if sorted(given) != sorted(names):
        raise TypeError(f"a {kind} record needs exactly {names}, got {sorted(given)}")
    words = []
    for name, dtype, dims in arrays:
        array = given[name]
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != dims \
                or not array.flags.c_contiguous or not array.flags.writeable:
            raise TypeError(f"a {kind} record's {name} must be a writable C-contiguous {dims}-d "
                            f"{np.dtype(dtype)} array")
        words += [array.ctypes.data, array.shape[0], array.shape[1] if dims == 2 else 0]
    words += [int(given[name]) for name in integers]
    return np.array(words, dtype=np.int64)


def record_array(record, name):
    """In compiled code: the array ``name`` (a constant string) of a :func:`pack_record` record."""
    raise NotImplementedError("record_array is for compiled code")


def record_integer(record, name):
    """In compiled code: the integer ``name`` (a constant string) of a :func:`pack_record` record."""
    raise NotImplementedError("record_integer is for compiled code")


@overload(record_array, inline="always")
def _record_array(record, name):
    if not isinstance(name, types.StringLiteral) or name.literal_value not in _ARRAY_SLOTS:
        return None
    at, element, dims = _ARRAY_SLOTS[name.literal_value]
    if dims == 1:
        return lambda record, name: carray(pointer_to(record[at], element), (record[at + 1],))
    return lambda record, name: carray(pointer_to(record[at], element), (record[at + 1], record[at + 2]))


@overload(record_integer, inline="always")
def _record_integer(record, name):
    if not isinstance(name, types.StringLiteral) or name.literal_value not in _INTEGER_SLOTS:
        return None
    at = _INTEGER_SLOTS[name.literal_value]
    return lambda record, name: record[at]


#: :func:`checked_relaunch`'s answers (``UNCOMPILED + unit``: the chunk function of that variant)
RAN, CHANGED, NOT_FINITE, UNCOMPILED = 0, 1, 2, 3


@cached_njit()
def kernel_scalars(scalars, inv_grad_scale, sign, values):
    """The kernel's float32 scalars written into ``values``: the algorithm's ``scalars``
    (float64, unrounded; the last, ``inv_grad_scale``'s place, replaced by ``inv_grad_scale``),
    then ``sign``, each rounded to float32 once (as ``numpy.float32``); False when one is
    not finite."""
    n = len(scalars)
    for i in range(n - 1):
        values[i] = np.float32(scalars[i])
    values[n - 1] = np.float32(inv_grad_scale)
    values[n] = np.float32(sign)
    for i in range(n + 1):
        if not np.isfinite(values[i]):
            return False
    return True


@cached_njit()
def checked_relaunch(checks, launch, grads, step, scalars, inv_grad_scale, sign, serial, bounds):
    """A kept launch's whole step in one compiled call, where it is its optimizer's only
    kernel call (each call is costly with the caches cold): :func:`launch_forms_hold`'s
    checks, with the counter at ``steps[first]`` one below ``step``, the step's scalars
    (:func:`kernel_scalars`), and, only when all of that holds, :func:`relaunch` with the
    chunk function at ``addresses[unit]`` -- ``unit``: the grad scale times the sign is 1, and
    so is ``values[dampening]`` unless ``dampening`` < 0 (``backends/numba.py``'s
    ``unit_scalars``) -- with the GIL released, as :func:`relaunch`'s ``nogil`` releases it.
    ``checks`` and ``launch``: :func:`pack_record`'s records of those layouts; ``grads``: the
    step's grads' ids; ``bounds``: the chunk driver's thread ranges; ``serial``: run them on
    this thread.  Answers :data:`RAN`, or why nothing changed: :data:`CHANGED` (a check
    failed), :data:`NOT_FINITE` (a scalar), ``UNCOMPILED + unit`` (``addresses[unit]`` is 0)."""
    steps, first = record_array(checks, "steps"), record_integer(launch, "first")
    if steps[first] + 1.0 != step:
        return CHANGED
    if not launch_forms_hold(checks, grads):
        return CHANGED
    values = record_array(launch, "values")
    if not kernel_scalars(scalars, inv_grad_scale, sign, values):
        return NOT_FINITE
    n = len(scalars)
    dampening = record_integer(launch, "dampening")
    unit = values[n - 1] * values[n] == 1 and (dampening < 0 or values[dampening] == 1)
    variant = 1 if unit else 0
    address = record_array(launch, "addresses")[variant]
    if address == 0:
        return UNCOMPILED + variant
    state = _release_gil()
    relaunch(serial, address, record_array(launch, "table"), values, record_array(launch, "keys"),
             record_array(launch, "row_counts"), bounds, record_integer(launch, "grad_column"),
             record_array(launch, "grad_of_row"), record_array(launch, "row_bytes"),
             record_array(checks, "grad_addresses"), record_array(launch, "seed_words"), step,
             record_array(launch, "streams"), record_array(checks, "counters"), steps,
             record_array(launch, "written"), record_array(launch, "places"))
    _take_gil(state)
    return RAN
