"""The CPU benchmarks run and print their tables on a tiny size, so they do not rot.

(Figures at this size mean nothing; the benchmark is run by hand at 2^25 params.)
"""

from __future__ import annotations

import importlib
import math
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
BENCHMARK = BENCHMARKS / "cpu_step.py"


def benchmark_modules(*names: str) -> list:
    """The benchmarks' modules of these names (benchmarks/ is a directory of scripts)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(BENCHMARKS))


def limit_adam_bits(size: int) -> tuple:
    """The compute-limit kernel's fp32-params Adam operands (one row of ``size``) with NaN and
    infinities in the grad and a negative second moment (NaN from the square root): the
    operands after one update, and copies of param, exp_avg and exp_avg_sq before it."""
    compute_limit, = benchmark_modules("compute_limit")
    operands = compute_limit.arrays(1, size, "adam", compute_limit.FP32_PARAMS)
    operands.g[0, :3] = [np.nan, np.inf, -np.inf]
    operands.v[0, 3] = -1.0
    before = [a.copy() for a in (operands.p, operands.m, operands.v)]
    compute_limit.runner("adam", compute_limit.FP32_PARAMS, operands, 1)()
    assert np.isnan(operands.p[0, :4]).all()
    return operands, before


def test_cpu_benchmark_prints_its_table():
    """Two presets (stochastic rounding, remainder) keep the table code running; the full
    table is run by hand."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, str(BENCHMARK), "--log2-params", "16", "--repeats", "1",
                             "--algorithms", "AdamW", "--presets", "bf16-sr,fp32-remainder",
                             "--skip-multi-tensor"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("AdamW ")]
    assert len(rows) == 2, result.stdout
    for row in rows:
        # bf16opt, memory limit, compute limit, share of the ceiling, in-cache time, the
        # streamed compute limit, the step's share of it and its own share of the ceiling,
        # the limit step's share (ProtocolStep), bf16opt's kernel call alone and its share:
        # all measured (in ms to 0.1: tiny times print as 0.0)
        ours, memory, compute, share, in_cache, streamed, of_streamed, streamed_share, limit_step_share, kernel, \
            kernel_share = re.split(r"\s{2,}", row.strip())[1:12]
        assert float(ours) > 0 and float(memory) >= 0 and float(compute) >= 0 and float(in_cache) >= 0
        assert float(streamed) >= 0 and float(kernel) >= 0
        for percent in (share, of_streamed, streamed_share, limit_step_share, kernel_share):
            assert percent.endswith("%") and int(percent[:-1]) >= 0


def _row(configuration: str, of_ceiling: float, streamed: float, limit_step: float) -> dict:
    return dict(algorithm="AdamW", configuration=configuration, of_ceiling=of_ceiling,
                streamed_of_ceiling=streamed, limit_step_of_ceiling=limit_step, kernel_of_ceiling=0.95)


def test_preset_rows_are_classified_against_the_target():
    """met at >= 90% of the ceiling; out of reach when the streamed limit or the limit step is
    below 90% itself; else not met."""
    cpu_step, = benchmark_modules("cpu_step")
    assert cpu_step.classify(_row("a", 0.90, 0.80, 0.80)) == "met"
    assert cpu_step.classify(_row("b", 0.89, 0.89, 0.95)) == "out of reach"
    assert cpu_step.classify(_row("c", 0.89, 0.95, 0.89)) == "out of reach"
    assert cpu_step.classify(_row("d", 0.89, 0.90, 0.91)) == "not met"


def test_in_cache_times_are_the_faster_driver_form_per_repetition():
    """The in-cache kernels run with and without the driver's stealing; each repetition keeps
    the faster, and the static forms leave the table."""
    cpu_step, = benchmark_modules("cpu_step")
    runs = {"bf16opt": [5.0, 6.0], "compute": [3.0, 2.0], "compute static": [2.5, 2.5],
            "in cache": [4.0, 1.0], "in cache static": [1.5, 3.0]}
    assert cpu_step.fold_static(runs) == {"bf16opt": [5.0, 6.0], "compute": [2.5, 2.0], "in cache": [1.5, 1.0]}


def test_several_runs_are_summarised_row_by_row(capsys):
    cpu_step, = benchmark_modules("cpu_step")
    runs = [[_row("x", 0.91, 0.95, 0.95), _row("y", 0.85, 0.95, 0.93)],
            [_row("x", 0.88, 0.95, 0.86), _row("y", 0.86, 0.95, 0.92)]]
    cpu_step.runs_summary(runs)
    out = capsys.readouterr().out
    x, y = (line.split() for line in out.splitlines() if line.startswith("AdamW "))
    assert x[2:4] == ["91m", "88o"] and y[2:4] == ["85N", "86N"]
    assert "run 1: met 1, out of reach 0, not met 1" in out
    assert "run 2: met 0, out of reach 1, not met 1" in out


def test_cpu_benchmark_compares_with_peers():
    """``--peers``: one row per (configuration, peer); torch's fused AdamW is always there, so
    its rows carry both times and a paired ratio (DeepSpeed's say when it is missing).
    ``--same-arrays`` (same run): a row per contender on one set of arrays."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, str(BENCHMARK), "--peers", "--same-arrays", "--log2-params", "12",
                             "--repeats", "3"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    peers, same, bf16_master = result.stdout.split("all contenders on the same four arrays")

    def table(section: str) -> dict:  # contender -> its figures: the lines under the dashes, to a blank one
        lines = section.splitlines()[3:]
        lines = lines[:lines.index("")] if "" in lines else lines
        return {line[:26].strip(): line[26:].split() for line in lines}

    both = {"bf16opt", "bf16opt kernel alone", "memory limit", "streamed limit"}  # (both tables)
    assert both <= set(table(bf16_master)) <= both | {"DeepSpeedCPUAdam fp32"}, bf16_master
    same_rows = table(same)
    expected = both | {"torch AdamW(fused=True)", "streamed limit, fused", "vector blocks alone"}
    optional = {"DeepSpeedCPUAdam fp32", "C exact_avx2", "C exact_avx512_x8"}  # (installed; this CPU runs)
    assert expected <= set(same_rows) <= expected | optional, same
    assert same_rows["bf16opt"][1] == "1.000", same  # (its ratio to itself)
    for name, (ms, ratio, _) in same_rows.items():
        assert float(ms) >= 0 and float(ratio) > 0, name
    rows = [line for line in peers.splitlines() if "torch AdamW(fused=True)" in line]
    assert len(rows) == 2, result.stdout  # bf16 params with bf16 states, fp32 params with fp32 states
    for row in rows:
        # times, their paired ratio and its range, each step's share of its own memory limit
        ours, theirs, ratio, _, ours_of_limit, theirs_of_limit = row.split("torch AdamW(fused=True)")[1].split()[:6]
        assert float(ours) >= 0 and float(theirs) >= 0 and float(ratio) > 0
        assert ours_of_limit.endswith("%") and theirs_of_limit.endswith("%")
        # (whole percents; at this size and on a loaded machine a share can round to 0)
        assert int(ours_of_limit[:-1]) >= 0 and int(theirs_of_limit[:-1]) >= 0
    assert sum("DeepSpeedCPUAdam" in line for line in peers.splitlines()) == 3, result.stdout
    # the PyPI peers (optional): a row each, with figures where installed
    cpu_step, = benchmark_modules("cpu_step")
    for algorithm, preset, peer, _, _ in cpu_step.PYPI_PEERS:
        lines = [line for line in peers.splitlines()
                 if line.startswith(f"{algorithm} bf16 params, {preset} ") and f" {peer:24} " in line]
        assert len(lines) == 1, (peer, result.stdout)
        if "(not installed" not in lines[0]:
            ours, theirs, ratio = lines[0].split(f" {peer:24} ")[1].split()[:3]
            assert float(ours) >= 0 and float(theirs) >= 0 and float(ratio) > 0, lines[0]


def test_cpu_benchmark_compares_prefetching_on_and_off():
    """``--prefetch-ab``: a row per (algorithm, configuration asked for) with the kernel call's
    times with the blocks' prefetches off and on and their paired ratio, streamed and in cache;
    the process's choice restored afterwards (the module's switch back to the target CPU's)."""
    result = subprocess.run([sys.executable, str(BENCHMARK), "--prefetch-ab", "--log2-params", "14",
                             "--repeats", "3", "--algorithms", "AdamW", "--presets", "bf16-sr"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [row for row in lines[lines.index("-" * len(lines[lines.index("") + 2])) + 1:] if row.strip()]
    # one row (each is a cold compile of the kernel without its prefetches)
    assert [row[:38].strip() for row in rows] == ["AdamW bf16 params, bf16-sr"], result.stdout
    for row in rows:
        off, on, ratio, cache_off, cache_on, cache_ratio = row[38:].split()
        assert min(map(float, (off, on, cache_off, cache_on))) >= 0
        assert float(ratio) > 0 and float(cache_ratio) > 0
    cpu_step, = benchmark_modules("cpu_step")
    from bf16opt._cpu import adam, vector_blocks

    memoised = adam.chunk_function
    cpu_step.prefetch_table(1 << 12, 1, {"bf16"}, ("AdamW",))
    assert vector_blocks.PREFETCH_ON is None and adam.chunk_function is memoised


def test_fused_limit_kernel_fuses():
    """The ``contract`` variant of the compute-limit kernel (``--same-arrays``' fused row) really
    fuses multiply-adds: from the same operands its float32 results differ from the exact
    kernel's in some elements (one rounding instead of two), and only slightly."""
    compute_limit, = benchmark_modules("compute_limit")
    storage = compute_limit.FP32_PARAMS
    results = []
    for contract in (False, True):
        operands = compute_limit.arrays(1, 256, "adam", storage)
        compute_limit.runner("adam", storage, operands, 1, contract=contract)()
        results.append(np.stack([operands.p, operands.m, operands.v]))
    exact, fused = results
    assert not np.array_equal(exact, fused)
    np.testing.assert_allclose(fused, exact, rtol=1e-5)


@pytest.mark.parametrize("algorithm, preset", [("adam", "fp32"), ("adam", "bf16-sr"), ("lion", "bf16-kahan"),
                                               ("sgd", "fp32-remainder"), ("adam", None)])
def test_prefetching_limit_kernel_gives_the_plain_bits(algorithm, preset):
    """The compute-limit kernel's prefetching form (the streamed limit where bf16opt's blocks
    prefetch) does the plain form's work in groups: the same bits from the same operands, over
    rows that are not whole groups (the paired loop for all-16-bit storage, the element loop
    else; ``None``: fp32 params).  And the streamed limit takes that form exactly where bf16opt's
    blocks prefetch."""
    compute_limit, cpu_step = benchmark_modules("compute_limit", "cpu_step")
    storage = compute_limit.FP32_PARAMS if preset is None else compute_limit.PRESET_STORAGE[preset]
    results = []
    for prefetch in (False, True):
        operands = compute_limit.arrays(3, 2 * compute_limit.GROUP + 6, algorithm, storage, seed=5)
        compute_limit.runner(algorithm, storage, operands, 1, prefetch=prefetch)()  # (one pass: rows of
        # one block run on whichever thread, so two passes could update a block at once)
        results.append([a.copy() for a in (operands.p, operands.w, operands.m, operands.v)])
    for plain, prefetched in zip(*results):
        np.testing.assert_array_equal(prefetched.view(np.uint8), plain.view(np.uint8))
    import torch

    param = torch.zeros(1 << 16)
    calls = []
    real = compute_limit.runner
    compute_limit.runner = lambda *args, **kwargs: calls.append(kwargs["prefetch"])
    try:
        cpu_step.streamed_limit_step(param, param.clone(), [param.clone(), param.clone()], "adam", "fp32")
    finally:
        compute_limit.runner = real
    from bf16opt._cpu import vector_blocks

    assert calls == [vector_blocks.available() and vector_blocks.prefetching()]


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler (cc) with OpenMP")
def test_exact_c_kernels_give_the_compute_limit_bits():
    """``exact_adamw.c``'s hand-written kernels (``--same-arrays``' C rows) do the exact work of
    the compute-limit kernel: the same bits from the same operands, NaN and infinity included."""
    import torch
    from llvmlite import binding as llvm

    cpu_step, = benchmark_modules("cpu_step")
    kernels = cpu_step.exact_c_kernels()
    assert ("exact_avx2" in kernels) == bool(llvm.get_host_cpu_features().get("avx2"))
    operands, before = limit_adam_bits(512)
    for name in kernels:
        p, m, v = (torch.from_numpy(a.copy()) for a in before)
        cpu_step.exact_c_step(name, p, torch.from_numpy(operands.g), [m, v])()
        for got, want in zip((p, m, v), (operands.p, operands.m, operands.v)):
            np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32), err_msg=name)


def test_vector_blocks_alone_give_the_compute_limit_bits():
    """``vector_adam.py``'s bare loop of bf16opt's hand-vectorised Adam blocks (``--same-arrays``'
    row) does the exact work of the compute-limit kernel: the same bits from the same operands,
    NaN and infinity included (16 lanes are split in two where the CPU has no 512-bit registers)."""
    vector_adam, = benchmark_modules("vector_adam")
    operands, before = limit_adam_bits(1024)
    p, m, v = (a.ravel() for a in before)
    vector_adam.kernel()(p, operands.g.ravel().copy(), m, v, vector_adam.scalars(operands.scalars), 2)
    for got, want in zip((p, m, v), (operands.p, operands.m, operands.v)):
        np.testing.assert_array_equal(got.view(np.int32), want.ravel().view(np.int32))


@pytest.mark.parametrize("preset", ["bf16-sr", "bf16-kahan", "fp32-remainder"])
def test_compute_limit_kernel_does_the_work(preset):
    """The compute-limit kernel is not dead code: it rewrites every stored operand, and its
    16-bit encodes are real roundings of the float32 results (bf16 bits of a value near 0.02)."""
    compute_limit, = benchmark_modules("compute_limit")
    storage = compute_limit.PRESET_STORAGE[preset]
    operands = compute_limit.arrays(1, 64, "adam", storage)
    before = [a.copy() for a in (operands.p, operands.w, operands.m, operands.v)]
    compute_limit.runner("adam", storage, operands, 1)()
    for name, old, new in zip("pwmv", before, (operands.p, operands.w, operands.m, operands.v)):
        if name == "w" and not (storage.kahan or storage.master != "param"):
            continue
        assert not np.array_equal(old, new), name


def test_offload_benchmark_prints_its_tables():
    """The offload benchmark on a tiny size: the sweep, one row per preset with every column
    measured, and the 7B projection (figures at this size mean nothing)."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "offload_step.py"), "--log2-params", "14",
                             "--tensors", "4", "--repeats", "1", "--chunk", "4096", "--threads", "1"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.strip() == "chosen: 2^12 elements, 1 thread(s)" for line in lines), result.stdout
    rows = [line for line in lines if line.split(" ", 1)[0] in ("bf16", "bf16-sr", "fp32-remainder-bf16-states")]
    assert len(rows) == 2 * 3, result.stdout  # the measured table, then the projection
    for row in rows[:3]:
        left, right = row.split("|")
        figures = [float(x) for x in left.split()[1:]] + [float(x) for x in right.split()]
        assert len(figures) == 12 and all(f > 0 for f in figures), row


def test_step_overhead_benchmark_prints_its_table():
    """benchmarks/step_overhead.py runs and measures every row (figures mean nothing here),
    with the floor of each (ProtocolStep's Python CPU) and bf16opt's excess over it; with --cold:
    the Python before and after each step's kernel call, for SGD and AdamW, the floor (the same
    call inside cpu_step.ProtocolStep), and the whole step's excess over the floor's step."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "step_overhead.py"), "--repeats", "1", "--steps", "1",
                             "--cold", "--cold-log2-params", "12", "--multi-tensor-repeats", "2"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("150 x 64", "GPT-2 small / 64"))]
    assert len(rows) == 6, result.stdout
    for row in rows:
        step, kernel, empty, _, python, floor, excess = map(float, row[-7:])
        assert step > 0 and kernel > 0 and empty > 0 and python >= 0 and floor > 0
        assert excess == pytest.approx(python - floor, abs=2e-3)  # (each printed to the µs)
    cold = [line.split() for line in result.stdout.splitlines() if line.startswith("1 param of 2^12")]
    assert [row[5] for row in cold] == ["SGD", "AdamW"], result.stdout
    for row in cold:
        before, after, python, kernel = map(float, row[6:10])
        assert before > 0 and after > 0 and python == pytest.approx(before + after, abs=2e-3) and kernel >= 0
        assert row[10].endswith("%")
        floor, excess = map(float, row[11:13])  # the same kernel call inside ProtocolStep, and the difference
        assert floor > 0 and excess == pytest.approx(python - floor, abs=2e-3)
        assert len(row) == 14 and math.isfinite(float(row[13]))  # the step's excess over the floor's step


@pytest.mark.skipif(shutil.which("valgrind") is None or platform.machine() != "x86_64",
                    reason="counts instructions with valgrind's callgrind (x86-64 client requests)")
def test_kernel_instructions_prints_its_table():
    """One preset's row: instructions per element of bf16opt's kernel and of its limit, counted."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_instructions.py"), "--algorithms", "SGD",
                             "--presets", "bf16"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("SGD ")]
    assert len(rows) == 1, result.stdout
    ours, limit, ratio = re.split(r"\s{2,}", rows[0].strip())[1:4]
    assert float(ours) > 1 and float(limit) > 1 and ratio.endswith("x")


def test_replacing_the_kernel_driver_leaves_the_step_helpers_the_real_one():
    """cpu_step.py replaces bf16opt's parallel chunk driver while it captures a step's kernel
    call; the step helpers, which bind the driver when imported, are imported before that:
    imported during the capture (a first kept launch), they kept the replacement, and with a
    fresh Numba cache the next reused step failed to compile (a fresh checkout's first run)."""
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import cpu_step; import bf16opt\n"
            "from bf16opt import _cpu\n"
            "assert 'bf16opt._cpu.step_helpers' not in sys.modules\n"
            "p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16)); p.grad = torch.ones_like(p)\n"
            "opt = bf16opt.SGD([p], lr=0.1, backend='numba'); opt.step()\n"
            "cpu_step.captured_kernel_call(opt)\n"
            "assert _cpu.step_helpers.run_chunks is _cpu.chunks.run_chunks\n")
    result = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("algorithm, preset", [("adam", "fp32-remainder-q8"), ("lion", "bf16-sr-q8")])
def test_q8_compute_limit_does_the_work_and_prefetches_the_same_bits(algorithm, preset):
    """The q8 compute-limit kernel rewrites every operand (params, the remainder, each q8 row's
    codes and scale), and its prefetching form gives the plain form's bits."""
    compute_limit, = benchmark_modules("compute_limit")
    storage = compute_limit.PRESET_STORAGE[preset]
    results = []
    for prefetch in (False, True):
        operands = compute_limit.arrays(2, 512, algorithm, storage, seed=3)
        before = [a.copy() for a in (operands.p, operands.w, operands.m, operands.v)]
        compute_limit.runner(algorithm, storage, operands, 1, prefetch=prefetch)()
        after = [operands.p, operands.w, operands.m, operands.v]
        for name, old, new in zip("pwmv", before, after):
            if new.size:
                assert not np.array_equal(old, new), name
        m_rows = operands.m.reshape(2, 2, 260)
        assert not np.array_equal(before[2].reshape(2, 2, 260)[..., 256:], m_rows[..., 256:])  # new scales
        results.append([a.copy() for a in after])
    for plain, prefetched in zip(*results):
        np.testing.assert_array_equal(prefetched.view(np.uint8), plain.view(np.uint8))


def test_q8_memory_limit_moves_every_q8_byte():
    """cpu_step's memory limit of a q8 preset adds the grad to the param and the remainder and
    increments every 4-byte word of both moments' q8 rows (scales included)."""
    import torch

    cpu_step, = benchmark_modules("cpu_step")
    param = torch.zeros(1024, dtype=torch.bfloat16)
    grad = torch.full((1024,), 3, dtype=torch.int16).view(torch.bfloat16)  # (the limit adds bit patterns)
    remainder = torch.zeros(1024, dtype=torch.int16)
    m, v = (torch.zeros((4, 260), dtype=torch.uint8) for _ in range(2))
    cpu_step.limit_step(param, grad, [remainder, m, v])()
    assert torch.equal(param.view(torch.int16), grad.view(torch.int16))
    assert torch.equal(remainder, grad.view(torch.int16))
    for rows in (m, v):
        assert torch.equal(rows.view(torch.int32), torch.ones((4, 65), dtype=torch.int32))


def test_q8_step_benchmark_times_the_named_presets_steps_alone(capsys):
    """q8_step.py --steps-only: the presets' steps and memory limits (no kernels in cache or
    compute limits to compile on a many-core host), bf16-states the reference."""
    (q8_step,) = benchmark_modules("q8_step")
    assert q8_step.main(["--log2-params", "12", "--repeats", "1", "--steps-only",
                         "--presets", "bf16-states,fp32-remainder-q8"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert sorted(rows) == ["bf16-states", "fp32-remainder-q8"]
    assert rows["bf16-states"][1] == "1.00" and rows["fp32-remainder-q8"][2:4] == ["-", "-"]
    with pytest.raises(SystemExit):
        q8_step.main(["--presets", "fp32-remainder-q8"])  # (no bf16-states to compare with)
    assert "--presets: bf16-states and any of" in capsys.readouterr().err


def test_q8_quality_benchmark_prints_its_table():
    """Two steps keep q8_quality.py's table code running (the figures come from 300); peers that
    are not installed are named, never raised.  On the reference backend: the kernels' bits are
    the reference's (test_q8_kernels.py), and a cold run would compile six configurations."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "q8_quality.py"), "--steps", "2", "--skip-maps",
                             "--backend", "reference"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = _q8_quality_rows(result.stdout)
    assert {"fp32", "fp32-remainder-q8", "bf16-sr-q8"} <= set(rows), result.stdout
    assert rows["fp32"][1] == "+0.000%" and all(float(row[0]) > 0 for row in rows.values())
    assert "torchao" in result.stdout and "bitsandbytes" in result.stdout


def _q8_quality_rows(stdout: str) -> dict:
    """q8_quality.py's table as {row name: (final loss, gap)}; names (peers') may hold spaces and commas."""
    table = stdout.split("final loss, gap to fp32")[1].splitlines()
    return {match[1]: (match[2], match[3]) for line in table
            if (match := re.match(r"  (\S.*?) +(\d+\.\d{4})  (\(no fp32 row\)|[+-]\d+\.\d{3}%)", line))}


def test_q8_quality_benchmark_runs_only_the_named_rows_with_the_seed(capsys):
    """--rows runs just the rows named (no fp32 row: no gap), --seed changes the run, a wrong name
    stops before any training (in this process: the table code is the subprocess test's)."""
    q8_quality, = benchmark_modules("q8_quality")

    def final(*args):
        assert q8_quality.main(["--steps", "2", "--skip-maps", "--backend", "reference", "--no-peers", *args]) == 0
        return _q8_quality_rows(capsys.readouterr().out)
    seed_0, seed_1 = final("--rows", "bf16-sr-q8"), final("--rows", "bf16-sr-q8", "--seed", "1")
    assert set(seed_0) == set(seed_1) == {"bf16-sr-q8"} and seed_0["bf16-sr-q8"][1] == "(no fp32 row)"
    assert seed_0["bf16-sr-q8"][0] != seed_1["bf16-sr-q8"][0]
    with pytest.raises(SystemExit) as stopped:
        q8_quality.main(["--rows", "fp33"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--rows" in err and "fp33" in err
