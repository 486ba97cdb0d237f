"""The compute-limit kernel's exact AdamW over float32 params and states, hand-vectorised in
Numba: what a bf16opt kernel of DeepSpeed's loop form would run at (``cpu_step.py
--same-arrays``; a benchmark, not part of bf16opt).

bf16opt's Numba loops leave vectorisation to LLVM, which builds one vector per array per
iteration (``exact_adamw.c``'s AVX2 kernel runs at the same speed); DeepSpeedCPUAdam's C loop
loads eight 512-bit vectors of each array before computing any, and is faster.  Here the same
form is written from Numba: an ``@intrinsic`` emitting LLVM vector IR for a block of
``SPAN`` vectors of ``LANES`` floats per array -- all loads, then the arithmetic, then all
stores -- with the compute-limit kernel's operations, each rounded on its own (IEEE square
root and division, no fused multiply-add) and every stored NaN canonical: its bits (a test
checks them).  LLVM lowers the vectors to whatever the CPU has; 16 x 8 suits AVX-512.
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

ADAM_SCALARS = 8  # compute_limit.SCALARS["adam"]: beta1, beta2, 1-beta1, 1-beta2, step, 1/sqrt(bc2), eps, decay


def _block_intrinsic(lanes: int, span: int):
    """``block(p, g, m, v, scalars)``: addresses (int64) of ``lanes * span`` float32 elements
    of each array and of the eight scalars; updates the block in place."""

    @intrinsic
    def block(typingctx, p, g, m, v, scalars):
        signature = types.void(types.int64, types.int64, types.int64, types.int64, types.int64)

        def codegen(context, builder, sig, args):
            p_at, g_at, m_at, v_at, scalars_at = args
            f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
            vector = ir.VectorType(f32, lanes)
            scalar_ptr = builder.inttoptr(scalars_at, f32.as_pointer())

            def splat(k):
                x = builder.load(builder.gep(scalar_ptr, [ir.Constant(i64, k)]))
                one = builder.insert_element(ir.Constant(vector, ir.Undefined), x, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                              ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))

            beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bc2, eps, decay = \
                (splat(k) for k in range(ADAM_SCALARS))
            canonical_nan = ir.Constant(vector, [float("nan")] * lanes)  # 0x7FC00000 in each lane
            sqrt = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector]),
                                                  f"llvm.sqrt.v{lanes}f32")

            def vectors(base):  # pointers to the block's vectors of one array
                return [builder.inttoptr(builder.add(base, ir.Constant(i64, 4 * lanes * k)), vector.as_pointer())
                        for k in range(span)]

            def canonical(x):
                return builder.select(builder.fcmp_unordered("uno", x, x), canonical_nan, x)

            at = {name: vectors(base) for name, base in (("p", p_at), ("g", g_at), ("m", m_at), ("v", v_at))}
            loaded = {name: [builder.load(ptr, align=4) for ptr in ptrs] for name, ptrs in at.items()}
            results = []
            for k in range(span):  # compute_limit.chunk_function's Adam, operation by operation
                grad = loaded["g"][k]
                new = builder.fmul(loaded["p"][k], decay)
                first = builder.fadd(builder.fmul(loaded["m"][k], beta1), builder.fmul(grad, one_minus_beta1))
                second = builder.fadd(builder.fmul(loaded["v"][k], beta2),
                                      builder.fmul(builder.fmul(grad, grad), one_minus_beta2))
                d = builder.fadd(builder.fmul(builder.call(sqrt, [second]), inv_sqrt_bc2), eps)
                new = builder.fsub(new, builder.fmul(builder.fdiv(first, d), step_size))
                results.append((canonical(new), canonical(first), canonical(second)))
            for k, values in enumerate(results):
                for name, value in zip("pmv", values):
                    builder.store(value, at[name][k], align=4)
            return context.get_dummy_value()

        return signature, codegen

    return block


@functools.lru_cache(maxsize=None)
def kernel(lanes: int = 16, span: int = 8):
    """``run(p, g, m, v, scalars, parts)``: float32 arrays of one size, a multiple of
    ``parts * lanes * span``; ``parts`` contiguous ranges, one per parallel task."""
    block = _block_intrinsic(lanes, span)
    width = lanes * span

    @njit(parallel=True, nogil=True)
    def run(p, g, m, v, scalars, parts):
        per = p.size // parts
        for t in prange(parts):
            for j in range(t * per, (t + 1) * per, width):
                block(p.ctypes.data + 4 * j, g.ctypes.data + 4 * j, m.ctypes.data + 4 * j, v.ctypes.data + 4 * j,
                      scalars.ctypes.data)

    return run
