"""Executed instructions per element of every preset's Numba kernel and of its compute-limit kernel.

Run:  python benchmarks/kernel_instructions.py [--algorithms AdamW,Lion,SGD] [--presets bf16,bf16-sr]
      [--asm DIR]

Counts come from valgrind's callgrind (``valgrind`` must be on PATH), which counts every
executed instruction, so they are repeatable on a loaded machine where timings are not.  A
child process builds each configuration's arrays and runs, on its own thread:

* ``bf16opt``: the configuration's chunk function (``cpu_src/``) over one tensor, through the
  real serial driver ``chunks.run_chunks_serial``, for the same configurations as
  ``cpu_step.py`` (bf16 params for every preset, plus fp32 params with "fp32"; AdamW with
  decoupled decay, Lion, SGD with momentum and L2 decay, as ``cpu_step.py`` runs them);
* ``limit``: the preset's compute-limit kernel (``compute_limit.py``, one thread's share).

Collection is switched on only around each call (callgrind client requests, issued from
Numba code) and each call is dumped on its own; a configuration runs at two sizes and the
count per element is the difference divided by the difference of the sizes, so the
constant costs (Python's call, the driver, the loops' prologues) cancel.

What is counted is the code Numba builds for this machine, with one exception: valgrind
cannot execute AVX-512, so on AVX-512 machines the kernels are built without it for the
count (printed).  The code is built by a native run first (Numba's on-disk cache), with the
target CPU pinned by NUMBA_CPU_NAME / NUMBA_CPU_FEATURES: under valgrind, LLVM would
otherwise see valgrind's emulated CPU and build other code.

``--asm DIR`` writes each kernel's assembly (Numba's ``inspect_asm``) there; the table's
``hot loop`` column gives the instruction count and widest vector register of the loop with
the most vector instructions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# callgrind.h: VG_USERREQ_TOOL_BASE('C', 'T') + DUMP_STATS (0) / TOGGLE_COLLECT (2) /
# START_INSTRUMENTATION (4)
_DUMP_STATS = (ord("C") << 24) | (ord("T") << 16)
_TOGGLE_COLLECT = _DUMP_STATS + 2
_START_INSTRUMENTATION = _DUMP_STATS + 4
#: element counts (bf16opt) and passes over one block (limit) of the two runs per kernel
SIZES = (1 << 12, 1 << 16)
BLOCK = 1 << 12
PASSES = (1, 16)


# ---------------------------------------------------------------- callgrind client requests
@intrinsic
def _client_request(typingctx, request):
    """valgrind.h's VALGRIND_DO_CLIENT_REQUEST on amd64 (a no-op outside valgrind): the
    argument block's address in %rax, the magic rotations of %rdi, then xchg %rbx,%rbx."""
    if not isinstance(request, types.IntegerLiteral):
        return None
    code = request.literal_value

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        block = cgutils.alloca_once(builder, i64, size=6)
        for k in range(6):
            builder.store(ir.Constant(i64, code if k == 0 else 0), builder.gep(block, [ir.Constant(i64, k)]))
        asm = ir.InlineAsm(ir.FunctionType(i64, [block.type, i64]),
                           "rolq $$3, %rdi ; rolq $$13, %rdi\n\trolq $$61, %rdi ; rolq $$51, %rdi\n\t"
                           "xchgq %rbx, %rbx", "={dx},{ax},0,~{cc},~{memory}", side_effect=True)
        builder.call(asm, [block, ir.Constant(i64, 0)])
        return context.get_dummy_value()

    return types.void(request), codegen


@njit(cache=True)
def _toggle_collect():
    _client_request(_TOGGLE_COLLECT)


@njit(cache=True)
def _dump_stats():
    _client_request(_DUMP_STATS)


@njit(cache=True)
def _start_instrumentation():
    _client_request(_START_INSTRUMENTATION)


def _counted(call) -> None:
    """Run ``call()`` with collection on, then dump its counts (one callgrind output file)."""
    _toggle_collect()
    call()
    _toggle_collect()
    _dump_stats()


# ---------------------------------------------------------------- the configurations
def _configurations(algorithms, presets) -> list:
    """(algorithm, label, param dtype, preset) in cpu_step.py's order."""
    import cpu_step  # noqa: PLC0415  (imports torch and bf16opt)

    return [(algorithm, label, dtype, preset) for algorithm in algorithms
            for label, dtype, preset, _, _ in cpu_step.CONFIGS if not presets or preset in presets]


def _chunk_call(algorithm: str, dtype, preset: str, n: int):
    """A call running ``algorithm``'s chunk function for ``preset`` over ``n`` elements of one
    tensor (arrays, table, scalars, stream keys as the numba backend makes them), plus the
    chunk function."""
    import torch  # noqa: PLC0415

    import cpu_step  # noqa: PLC0415
    from bf16opt import _cpu  # noqa: PLC0415
    from bf16opt.algorithms import ELEMENT_BYTES, kernel_config  # noqa: PLC0415
    from bf16opt.backends import numba as backend  # noqa: PLC0415
    from bf16opt.precision import as_precision, plan_for  # noqa: PLC0415

    cls, hyper, _ = cpu_step.OPTIMIZERS[algorithm]
    opt = cls([torch.nn.Parameter(torch.zeros(1, dtype=dtype))], precision=preset, backend="numba", **hyper)
    group = opt.param_groups[0]
    config = kernel_config(opt.algorithm, plan_for(as_precision(preset), dtype), tuple(opt._flags(group).items()))
    chunk = backend.chunk_function(config, True)  # the step's: no grad scale, not maximizing (SGD: no dampening)
    rng = np.random.default_rng(0)
    scale = {"param": 0.02, "grad": 1e-3, "companion": 1e-6, "exp_avg": 1e-4}
    arrays = []
    for role, dtype_ in zip(config.algorithm.roles, config.dtypes):
        if dtype_ is None:
            arrays.append(np.zeros(1, dtype=np.float32))
            continue
        x = rng.standard_normal(n).astype(np.float32) * np.float32(scale.get(role.name, 1e-4))
        if role.name.endswith("exp_avg_sq"):
            x = x * x
        if config.weights == "copy" and role.name == "companion":
            x = arrays[0].astype(np.float32) if arrays[0].dtype == np.float32 else \
                (arrays[0].astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
        arrays.append(torch.from_numpy(x).to(dtype_).view(cpu_step.VIEW[dtype_]).numpy().copy())
    addresses = np.array([[0 if d is None else a.ctypes.data for a, d in zip(arrays, config.dtypes)]],
                         dtype=np.int64)
    itemsizes = np.array([0 if d is None else ELEMENT_BYTES[d] for d in config.dtypes], dtype=np.int64)
    table = _cpu.chunks.build_chunk_table(addresses, itemsizes, np.array([n]))
    bounds = np.array([0, table.shape[0]], dtype=np.int64)
    scalars = np.array([*opt._scalars(group, 2), 1.0], dtype=np.float32)
    keys = backend.stream_keys(1234, 2, [0])
    counts = np.zeros((table.shape[0], _cpu.chunks.COUNTERS), dtype=np.int64)
    run = _cpu.chunks.run_chunks_serial

    def call():
        run(chunk.address, table, scalars, keys, counts, bounds)

    call.keep = arrays  # the table holds their addresses
    return call, chunk


def _limit_call(algorithm: str, dtype, preset: str, passes: int):
    """A call running the compute-limit chunk function ``passes`` times over one block, through
    the serial driver, plus the chunk function."""
    import torch  # noqa: PLC0415

    import compute_limit  # noqa: PLC0415
    import cpu_step  # noqa: PLC0415

    family = cpu_step.OPTIMIZERS[algorithm][2]
    storage = compute_limit.FP32_PARAMS if dtype == torch.float32 else compute_limit.PRESET_STORAGE[preset]
    operands = compute_limit.arrays(1, BLOCK, family, storage)
    return (compute_limit.runner(family, storage, operands, passes, serial=True),
            compute_limit.chunk_function(family, storage))


def child(algorithms, presets, asm_dir) -> None:
    """Run every counted call once (uncounted, which loads or compiles it), then counted, in
    order; print the labels of the dumps as JSON."""
    llvm.initialize_native_asmparser()  # the client requests are inline assembly
    labels, calls = [], []
    for algorithm, label, dtype, preset in _configurations(algorithms, presets):
        name = f"{algorithm} {label}"
        for size in SIZES:
            call, chunk = _chunk_call(algorithm, dtype, preset, size)
            labels.append([name, "bf16opt", size])
            calls.append(call)
        for passes in PASSES:
            call, limit = _limit_call(algorithm, dtype, preset, passes)
            labels.append([name, "limit", passes * BLOCK])
            calls.append(call)
        if asm_dir:  # (code compiled in this process: code loaded from the cache has no assembly)
            stem = _stem(name)
            (asm_dir / f"{stem}.bf16opt.s").write_text(chunk._library.get_asm_str())
            (asm_dir / f"{stem}.limit.s").write_text(limit._library.get_asm_str())
    _start_instrumentation()  # (valgrind runs the set-up uninstrumented: several times faster)
    for call in calls:
        call()
    gc.disable()  # nothing but the calls between the client requests
    for call in calls:
        _counted(call)
    print(json.dumps(labels))


# ---------------------------------------------------------------- the parent
def _stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def target_cpu() -> tuple:
    """(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES, note): this machine's, without AVX-512."""
    name, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    avx512 = "+avx512f" in features
    features = re.sub(r"\+(avx512|avx10|amx)", r"-\1", features)
    note = "built without AVX-512 (valgrind cannot execute it)" if avx512 else "built as for a native run"
    return name, features, note


def hot_loop(asm: str) -> str:
    """Instruction count and widest vector register of the hot loop of the first function in
    ``asm``: of its innermost loops (a backward jump to a label, no loop inside), the one using
    the widest packed registers (scalar float math uses xmm registers too), then the longest."""
    lines = asm.split("\n")
    end = next((k for k, line in enumerate(lines) if line.startswith("cfunc.") or line.startswith(".Lfunc_end")),
               len(lines))
    labels, loops, best = {}, [], (0, 0, "scalar")
    for k, line in enumerate(lines[:end]):
        found = re.match(r"^(\.LBB\w+):", line)
        if found:
            labels[found.group(1)] = k
            continue
        jump = re.match(r"^\s+j\w+\s+(\.LBB\w+)", line)
        if jump and jump.group(1) in labels:
            start = labels[jump.group(1)]
            loops.append((start, k))
            if any(start < inner[0] for inner in loops[:-1] if inner[1] <= k):
                continue
            body = [x for x in lines[start + 1:k + 1] if x.startswith("\t") and not x.lstrip().startswith(".")]
            packed = [x for x in body if re.search(r"%[yz]mm", x)
                      or (re.search(r"%xmm", x) and not re.match(r"\s+\w+(ss|sd)\s", x))]
            rank = max((3 if "%zmm" in x else 2 if "%ymm" in x else 1 for x in packed), default=0)
            if (rank, len(body)) > best[:2]:
                best = (rank, len(body), ["scalar", "xmm", "ymm", "zmm"][rank])
    return f"{best[1]} {best[2]}"


def parent(args) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit("kernel_instructions.py issues callgrind's client requests as x86-64 assembly")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    here = pathlib.Path(__file__).resolve().parent
    cpu, features, note = target_cpu()
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child",
               "--algorithms", args.algorithms] + (["--presets", args.presets] if args.presets else [])
    asm_dir = pathlib.Path(args.asm).resolve() if args.asm else None
    if asm_dir:
        asm_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # a fresh Numba cache: the native run compiles every kernel into it (so their assembly
        # can be inspected), the run under valgrind loads them
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=tmp,
                   PYTHONHASHSEED="0", NUMBA_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONPATH=os.pathsep.join([str(here)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        subprocess.run(command + (["--asm", str(asm_dir)] if asm_dir else []), env=env, check=True,
                       stdout=subprocess.DEVNULL)
        out = pathlib.Path(tmp) / "callgrind.out"
        result = subprocess.run([valgrind, "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                                 f"--callgrind-out-file={out}"] + command,
                                env=env, check=True, capture_output=True, text=True)
        labels = json.loads(result.stdout.strip().splitlines()[-1])
        counts = []
        for k in range(1, len(labels) + 1):
            text = (pathlib.Path(tmp) / f"callgrind.out.{k}").read_text()
            counts.append(int(re.search(r"^totals:\s+(\d+)", text, re.M).group(1)))
    per_element = {}
    for k in range(0, len(labels), 2):
        (name, kind, small), (_, _, large) = labels[k], labels[k + 1]
        per_element.setdefault(name, {})[kind] = (counts[k + 1] - counts[k]) / (large - small)

    sys.path.insert(0, str(here))
    from machine import cpu_name  # noqa: PLC0415

    print(f"executed instructions per element (callgrind), {cpu_name()}; code for {cpu}, {note}.\n"
          f"bf16opt: the chunk function; limit: the compute-limit kernel (compute_limit.py); "
          f"hot loop: instructions, widest register")
    header = f"{'configuration':36} {'bf16opt':>8} {'limit':>8} {'ratio':>6}"
    if asm_dir:
        header += f" {'hot loop (bf16opt)':>18} {'hot loop (limit)':>16}"
    print(header)
    print("-" * len(header))
    for name, kinds in per_element.items():
        line = f"{name:36} {kinds['bf16opt']:8.2f} {kinds['limit']:8.2f} {kinds['bf16opt'] / kinds['limit']:5.2f}x"
        if asm_dir:
            stem = _stem(name)
            line += (f" {hot_loop((asm_dir / f'{stem}.bf16opt.s').read_text()):>18}"
                     f" {hot_loop((asm_dir / f'{stem}.limit.s').read_text()):>16}")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="AdamW,Lion,SGD", help="comma-separated (default: %(default)s)")
    parser.add_argument("--presets", help="comma-separated presets (default: all)")
    parser.add_argument("--asm", help="directory to write each kernel's assembly to")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.algorithms.split(","), set(args.presets.split(",")) if args.presets else None,
              pathlib.Path(args.asm) if args.asm else None)
    else:
        parent(args)


if __name__ == "__main__":
    main()
