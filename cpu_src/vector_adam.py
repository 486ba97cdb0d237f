"""Adam with float32 moments, hand-vectorised: the blocks of ``adam.py``'s element loop for
the configurations DeepSpeedCPUAdam's fp32-state kernel competes with -- float32 or bfloat16
params that are their own master, or bfloat16 params with a float32 master copy; float32
or bfloat16 grads; no amsgrad, no telemetry -- where the target CPU has AVX-512.

Why: from ``adam.py``'s element loop LLVM builds one vector per array per iteration, which
runs no faster than any plain exact loop; a loop that loads eight 512-bit vectors of each
array before computing any (DeepSpeedCPUAdam's form) is 5-10% faster on an AVX-512 Xeon,
with the same arithmetic (``benchmarks/cpu_step.py --same-arrays``).  LLVM does not build that
form from Numba source (512-bit vectors, forced interleaving, blocked loops: measured, none
faster), so it is written here as LLVM vector IR, from an ``@intrinsic``.

Bits: each operation is ``adam.py``'s (so ``reference.py``'s), in its order, on ``LANES``
lanes at once -- IEEE multiplication, addition, square root and division, each rounded on its
own (no fused multiply-add: LLVM only fuses operations marked ``contract``) -- bfloat16
decoded and encoded as ``storage.decode_bf16`` / ``storage.encode_bf16`` do (a shift; round
to nearest even on the integer lanes), and every stored NaN made canonical.  The tests that
compare ``adam.py``'s kernels with the reference element for element run this path wherever
it is on.
"""

from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

from .storage import CANONICAL_NAN_F32

__all__ = ["BLOCK", "COPY", "GRAD16", "L2", "PARAM16", "UNIT", "available", "block"]

LANES = 16  # float32 lanes of one vector: a 512-bit register
SPAN = 8    # vectors of each array loaded before any is computed
BLOCK = LANES * SPAN  # elements of one block

# the bits of a block's form (a compile-time constant of the chunk function)
L2 = 1       # the weight decay is added to the grad
UNIT = 2     # no multiplication by the unscaling factor (it is exactly 1)
PARAM16 = 4  # the param is bfloat16
GRAD16 = 8   # the grad is bfloat16
COPY = 16    # the master is a float32 copy (the companion), the param its rounding (PARAM16)


def available() -> bool:
    """Whether Numba's target CPU has AVX-512 (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, or
    the host's): without 512-bit registers the blocks would be split and spilled."""
    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


@intrinsic(prefer_literal=True)
def block(typingctx, form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale):
    """``block(form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale)``: updates
    the ``BLOCK`` elements at the addresses (int64; the companion's read only with ``COPY``)
    in place.  ``form``: a constant of the flags above; ``scalars``: the chunk function's
    (``adam.py``: beta1, beta2, 1 - beta1, 1 - beta2, step size, 1 / sqrt(bias correction 2),
    eps, weight decay, decay); ``scale``: ``inv_grad_scale * sign``, not read with ``UNIT``.
    (One intrinsic, the form a literal: an intrinsic made per form and held in a chunk
    function's closure would put its per-process id into Numba's on-disk cache key.)"""
    if not isinstance(form, types.IntegerLiteral):
        return None
    flags = form.literal_value
    l2, unit, param16, grad16, copy = (bool(flags & bit) for bit in (L2, UNIT, PARAM16, GRAD16, COPY))
    signature = types.void(form, param, grad, companion, exp_avg, exp_avg_sq, scalars, scale)

    def codegen(context, builder, sig, args):
        _, param_at, grad_at, companion_at, exp_avg_at, exp_avg_sq_at, scalars_at, scale_value = args
        f32, i16, i32, i64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        vector, words, halves = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES), ir.VectorType(i16, LANES)

        def splat(x):
            one = builder.insert_element(ir.Constant(vector, ir.Undefined), x, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                          ir.Constant(ir.VectorType(i32, LANES), [0] * LANES))

        def scalar(k):
            return splat(builder.load(builder.gep(scalars_at, [ir.Constant(i64, k)])))

        def word(value):
            return ir.Constant(words, [value] * LANES)

        beta1, beta2, one_minus_beta1, one_minus_beta2 = scalar(0), scalar(1), scalar(2), scalar(3)
        step_size, inv_sqrt_bias_correction2, eps = scalar(4), scalar(5), scalar(6)
        weight_decay, decay = scalar(7), scalar(8)
        scale = splat(scale_value)
        canonical_nan = builder.bitcast(word(int(CANONICAL_NAN_F32)), vector)
        sqrt = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector]),
                                              f"llvm.sqrt.v{LANES}f32")

        def vectors(address, sixteen):  # the block's SPAN vectors of one array
            kind = halves if sixteen else vector
            step = (2 if sixteen else 4) * LANES
            return [builder.inttoptr(builder.add(address, ir.Constant(i64, step * k)), kind.as_pointer())
                    for k in range(SPAN)]

        def load(pointer, sixteen):  # storage.decode: bfloat16 is the upper half of a float32
            x = builder.load(pointer, align=2 if sixteen else 4)
            if not sixteen:
                return x
            return builder.bitcast(builder.shl(builder.zext(x, words), word(16)), vector)

        def canonical(x):  # storage.encode_f32: x, or the canonical NaN
            return builder.select(builder.fcmp_unordered("uno", x, x), canonical_nan, x)

        def stored(x, sixteen):  # storage.encode_f32 / encode_bf16 (round to nearest even)
            x = canonical(x)
            if not sixteen:
                return x
            bits = builder.bitcast(x, words)
            odd = builder.and_(builder.lshr(bits, word(16)), word(1))
            rounded = builder.add(builder.add(bits, word(0x7FFF)), odd)
            return builder.trunc(builder.lshr(rounded, word(16)), halves)

        param_pointers = vectors(param_at, param16)
        grad_pointers = vectors(grad_at, grad16)
        master_pointers = vectors(companion_at, False) if copy else param_pointers
        moment_pointers = vectors(exp_avg_at, False), vectors(exp_avg_sq_at, False)
        w0s = [load(pointer, param16 and not copy) for pointer in master_pointers]
        gs = [load(pointer, grad16) for pointer in grad_pointers]
        ms, vs = ([load(pointer, False) for pointer in pointers] for pointers in moment_pointers)
        results = []
        for w, g, m, v in zip(w0s, gs, ms, vs):  # adam.py's update, operation by operation
            if not unit:
                g = builder.fmul(g, scale)
            if l2:
                g = builder.fadd(g, builder.fmul(w, weight_decay))
            w = builder.fmul(w, decay)
            m = builder.fadd(builder.fmul(m, beta1), builder.fmul(g, one_minus_beta1))
            v = builder.fadd(builder.fmul(v, beta2), builder.fmul(builder.fmul(g, g), one_minus_beta2))
            d = builder.fadd(builder.fmul(builder.call(sqrt, [v]), inv_sqrt_bias_correction2), eps)
            w = builder.fsub(w, builder.fmul(builder.fdiv(m, d), step_size))
            results.append((w, m, v))
        for k, (w, m, v) in enumerate(results):
            builder.store(stored(w, param16), param_pointers[k], align=2 if param16 else 4)
            if copy:
                builder.store(stored(w, False), master_pointers[k], align=4)
            builder.store(stored(m, False), moment_pointers[0][k], align=4)
            builder.store(stored(v, False), moment_pointers[1][k], align=4)
        return context.get_dummy_value()

    return signature, codegen
