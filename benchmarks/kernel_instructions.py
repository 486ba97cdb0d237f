"""Executed instructions per element of every preset's Numba kernel and of its compute-limit kernel.

Run:  python benchmarks/kernel_instructions.py [--algorithms AdamW,Lion,SGD] [--presets bf16,bf16-sr]
      [--asm DIR]

Counts come from valgrind's callgrind (``valgrind`` must be on PATH), which counts every
executed instruction, so they are repeatable on a loaded machine where timings are not.  The
script builds each configuration's arrays; a child process (importing the kernels but not torch,
whose import alone takes 20-25 s under valgrind) runs, on its own thread:

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
FP32_PARAMS = "fp32 params"  # a job's storage: compute_limit.FP32_PARAMS, else a preset's


def jobs(algorithms, presets, directory: pathlib.Path) -> list:
    """What the child runs, built natively (with torch): per configuration of ``cpu_step.py``
    (in its order), its chunk function's arguments (``numba.chunk_arguments``: the step's
    kernel, no grad scale, not maximizing, SGD without dampening), the element sizes of its
    buffers, its compute-limit kernel's family and storage, and its arrays, scalars and
    stream keys, saved in ``directory``.  (The child imports no torch: under valgrind,
    importing torch alone takes 20-25 s.)"""
    import torch  # noqa: PLC0415

    import cpu_step  # noqa: PLC0415  (imports torch and bf16opt)
    import bf16opt._cpu  # noqa: PLC0415
    from bf16opt.algorithms import ELEMENT_BYTES, kernel_config  # noqa: PLC0415
    from bf16opt.backends import numba as backend  # noqa: PLC0415
    from bf16opt.precision import as_precision, plan_for  # noqa: PLC0415

    out = []
    for algorithm in algorithms:
        cls, hyper, family = cpu_step.OPTIMIZERS[algorithm]
        for label, dtype, preset, _, _ in cpu_step.CONFIGS:
            if presets and preset not in presets:
                continue
            param = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
            opt = cls([param], precision=preset, backend="numba", **hyper)
            group = opt.param_groups[0]
            config = kernel_config(opt.algorithm, plan_for(as_precision(preset), dtype),
                                   tuple(opt._flags(group).items()))
            module, (formats, weights, rounding, track), flags = backend.chunk_arguments(config, True)
            name = f"{algorithm} {label}"
            path = directory / f"{_stem(name)}.npz"
            arrays = {f"{size}_{b}": array for size in SIZES for b, array in enumerate(_arrays(config, size))}
            np.savez(path, scalars=np.array([*opt._scalars(group, 2), 1.0], dtype=np.float32),
                     keys=backend.stream_keys(1234, 2, [0]), **arrays)
            out.append(dict(name=name, arrays=str(path), module=module, formats=[f.__name__ for f in formats],
                            weights=weights, rounding=rounding, track=track, flags=flags,
                            itemsizes=[0 if d is None else ELEMENT_BYTES[d] for d in config.dtypes],
                            family=family, storage=FP32_PARAMS if dtype == torch.float32 else preset,
                            kernels=str(pathlib.Path(bf16opt._cpu.__file__).parent)))
    return out


def _arrays(config, n: int) -> list:
    """One tensor of ``n`` elements per buffer of ``config``, stored as the step stores them."""
    import torch  # noqa: PLC0415

    import cpu_step  # noqa: PLC0415

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
    return arrays


def _import_kernels(directory: str) -> None:
    """Import ``bf16opt._cpu`` (``cpu_src/``: numpy and Numba only) from ``directory`` under
    its own name, without running ``bf16opt/__init__.py`` (which imports torch)."""
    import importlib.util  # noqa: PLC0415
    import types as modules  # noqa: PLC0415

    package = sys.modules.setdefault("bf16opt", modules.ModuleType("bf16opt"))
    package.__path__ = []
    spec = importlib.util.spec_from_file_location("bf16opt._cpu", os.path.join(directory, "__init__.py"),
                                                  submodule_search_locations=[directory])
    kernels = sys.modules["bf16opt._cpu"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    package._cpu = kernels


def _chunk_call(job: dict, n: int, saved):
    """A call running a job's chunk function over ``n`` elements of one tensor (the arrays,
    table, scalars and stream keys as the numba backend makes them), plus the chunk function."""
    import importlib  # noqa: PLC0415

    from bf16opt._cpu import chunks  # noqa: PLC0415

    module = importlib.import_module(f"bf16opt._cpu.{job['module']}")
    formats = tuple(getattr(np, name) for name in job["formats"])
    chunk = module.chunk_function(formats, job["weights"], job["rounding"], job["track"], **job["flags"])
    arrays = [saved[f"{n}_{b}"] for b in range(len(formats))]
    addresses = np.array([[a.ctypes.data if size else 0 for a, size in zip(arrays, job["itemsizes"])]],
                         dtype=np.int64)
    table = chunks.build_chunk_table(addresses, np.array(job["itemsizes"], dtype=np.int64), np.array([n]))
    bounds = np.array([0, table.shape[0]], dtype=np.int64)
    scalars, keys = saved["scalars"], saved["keys"]
    counts = np.zeros((table.shape[0], chunks.COUNTERS), dtype=np.int64)
    run = chunks.run_chunks_serial

    def call():
        run(chunk.address, table, scalars, keys, counts, bounds)

    call.keep = arrays  # the table holds their addresses
    return call, chunk


def _limit_call(job: dict, passes: int):
    """A call running the compute-limit chunk function ``passes`` times over one block, through
    the serial driver, plus the chunk function."""
    import compute_limit  # noqa: PLC0415

    storage = compute_limit.FP32_PARAMS if job["storage"] == FP32_PARAMS \
        else compute_limit.PRESET_STORAGE[job["storage"]]
    operands = compute_limit.arrays(1, BLOCK, job["family"], storage)
    return (compute_limit.runner(job["family"], storage, operands, passes, serial=True),
            compute_limit.chunk_function(job["family"], storage))


def child(jobs_file: pathlib.Path, asm_dir) -> None:
    """Run every counted call once (uncounted, which loads or compiles it), then counted, in
    order; print the labels of the dumps as JSON."""
    all_jobs = json.loads(jobs_file.read_text(encoding="utf-8"))
    _import_kernels(all_jobs[0]["kernels"])
    llvm.initialize_native_asmparser()  # the client requests are inline assembly
    labels, calls = [], []
    for job in all_jobs:
        name = job["name"]
        saved = dict(np.load(job["arrays"]))
        for size in SIZES:
            call, chunk = _chunk_call(job, size, saved)
            labels.append([name, "bf16opt", size])
            calls.append(call)
        for passes in PASSES:
            call, limit = _limit_call(job, passes)
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
    asm_dir = pathlib.Path(args.asm).resolve() if args.asm else None
    if asm_dir:
        asm_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(here))
    with tempfile.TemporaryDirectory() as tmp:
        jobs_file = pathlib.Path(tmp) / "jobs.json"
        jobs_file.write_text(json.dumps(jobs(args.algorithms.split(","),
                                             set(args.presets.split(",")) if args.presets else None,
                                             pathlib.Path(tmp))))
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", str(jobs_file)]
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
            text = (pathlib.Path(tmp) / f"callgrind.out.{k}").read_text(encoding="utf-8")
            counts.append(int(re.search(r"^totals:\s+(\d+)", text, re.M).group(1)))
    per_element = {}
    for k in range(0, len(labels), 2):
        (name, kind, small), (_, _, large) = labels[k], labels[k + 1]
        per_element.setdefault(name, {})[kind] = (counts[k + 1] - counts[k]) / (large - small)

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
            line += (f" {hot_loop((asm_dir / f'{stem}.bf16opt.s').read_text(encoding='utf-8')):>18}"
                     f" {hot_loop((asm_dir / f'{stem}.limit.s').read_text(encoding='utf-8')):>16}")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="AdamW,Lion,SGD", help="comma-separated (default: %(default)s)")
    parser.add_argument("--presets", help="comma-separated presets (default: all)")
    parser.add_argument("--asm", help="directory to write each kernel's assembly to")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the jobs file
    args = parser.parse_args()
    if args.child:
        child(pathlib.Path(args.child), pathlib.Path(args.asm) if args.asm else None)
    else:
        parent(args)


if __name__ == "__main__":
    main()
