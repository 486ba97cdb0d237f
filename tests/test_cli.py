"""The ``bf16opt`` command line: one argparse parser with sub-commands, every argument checked
before any training (exit status 2, one line naming the argument), progress output, --json."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bf16opt
from bf16opt import cli, compare
from bf16opt.__main__ import main

TINY = ["--steps", "4", "--width", "16", "--layers", "1", "--batch", "4", "--block", "16",
        "--backend", "reference"]
TEXT = "the quick brown fox jumps over the lazy dog\n" * 200


@pytest.fixture
def no_plot(monkeypatch):
    """For runs whose figure nobody looks at (drawing it is most of a tiny run's time)."""
    monkeypatch.setattr(compare, "plot", lambda results, out: None)


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def bf16opt_command() -> list:
    """The installed console script when it is beside this interpreter, else ``python -m bf16opt``."""
    script = Path(sys.executable).with_name("bf16opt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "bf16opt"]


# ---------------------------------------------------------------- parser
def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"bf16opt {bf16opt.__version__}\n"


def test_version_from_the_installed_command():
    result = subprocess.run([*bf16opt_command(), "--version"], capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"bf16opt {bf16opt.__version__}\n", "")


@pytest.mark.parametrize("argv,words", [
    (["--help"], ["usage: bf16opt", "--version", "compare"]),
    (["compare", "--help"], ["usage: bf16opt compare", "--presets", "--optimizer {adamw,adam,lion,sgd}",
                             "--json", "--no-progress", "--corpus FILE", "example:"]),
])
def test_help_per_command(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out


@pytest.mark.parametrize("argv,start", [
    ([], "bf16opt: error: the following arguments are required: COMMAND"),
    (["frobnicate"], "bf16opt: error: argument COMMAND: invalid choice: 'frobnicate'"),
    (["--bogus"], "bf16opt: error:"),
])
def test_top_level_usage_errors(argv, start, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores permission bits: then a
    directory of a pseudo file system)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    candidates = [locked / "out", locked, Path("/sys/kernel"), Path("/proc/self")]
    for candidate in candidates:
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            (candidate / ".probe").write_text("")
        except OSError:
            return candidate
        (candidate / ".probe").unlink()
    pytest.skip("found no directory this process cannot write (needs a non-root user or /sys, /proc)")


BAD_ARGUMENTS = {
    # id: (arguments, the argument the message names)
    "unknown preset after a good one": (["--presets", "fp32,bogus"], "--presets"),
    "only a comma": (["--presets", ","], "--presets"),
    "empty presets": (["--presets", ""], "--presets"),
    "a preset twice": (["--presets", "fp32,bf16,fp32"], "--presets"),
    "empty out": (["--out", ""], "--out"),
    "out is a file": (["--out", "{file}"], "--out"),
    "out inside a file": (["--out", "{file}/runs"], "--out"),
    "out unwritable": (["--out", "{unwritable}"], "--out"),
    "steps 0": (["--steps", "0"], "--steps"),
    "steps not a number": (["--steps", "many"], "--steps"),
    "batch 0": (["--batch", "0"], "--batch"),
    "block negative": (["--block", "-3"], "--block"),
    "layers 0": (["--layers", "0"], "--layers"),
    "width not a multiple of the heads": (["--width", "10"], "--width"),
    "a model larger than memory": (["--width", "400000"], "--width and --layers"),
    "batches larger than memory": (["--batch", "1000000000", "--block", "100000"], "--batch and --block"),
    "lr 0": (["--lr", "0"], "--lr"),
    "lr nan": (["--lr", "nan"], "--lr"),
    "negative seed": (["--seed", "-1"], "--seed"),
    "missing corpus": (["--corpus", "{tmp}/missing.txt"], "--corpus"),
    "corpus is a directory": (["--corpus", "{tmp}"], "--corpus"),
    "corpus shorter than a block": (["--corpus", "{file}", "--block", "64"], "--corpus"),
    "unknown optimizer": (["--optimizer", "rmsprop"], "--optimizer"),
    "cupy backend for a CPU model": (["--backend", "cupy"], "--backend"),
    "unknown option": (["--presetz", "fp32"], "--presetz"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS), ids=list(BAD_ARGUMENTS))
def test_bad_argument_exits_2_with_one_line_before_training(case, tmp_path, capsys, monkeypatch):
    arguments, name = BAD_ARGUMENTS[case]
    small = tmp_path / "small.txt"
    small.write_text("too short")
    places = {"file": str(small), "tmp": str(tmp_path)}
    if any("{unwritable}" in a for a in arguments):
        places["unwritable"] = str(unwritable_directory(tmp_path))
    arguments = [a.format(**places) for a in arguments]
    out = tmp_path / "out"

    def no_training(*args, **kwargs):
        raise AssertionError("trained before every argument was checked")

    monkeypatch.setattr(compare, "train", no_training)
    defaults = ["--out", str(out)] if "--out" not in arguments else []
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *defaults, *TINY, *arguments])
    elapsed = time.perf_counter() - start
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("bf16opt compare: error: ") and name in lines[0], lines[0]
    assert "Traceback" not in captured.err
    assert elapsed < 1.0, f"{elapsed:.2f} s to reject {arguments}"
    assert not out.exists() or not any(out.iterdir())


def run_without_torch(argv: list, cwd: Path) -> tuple:
    """``python -m bf16opt ARGV`` under ``-X importtime``: (the process, its stderr lines that are
    not the import report, the modules the process imported)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "bf16opt", *argv], capture_output=True,
                            text=True, cwd=cwd)
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    assert "bf16opt" in imported  # the report is there: an absent module was not imported
    return result, [line for line in lines if not line.startswith("import time:")], imported


def heavy(imported: set) -> set:
    """The modules that take seconds to import among ``imported``."""
    return {name for name in imported if name.split(".")[0] in ("torch", "numba")}


def test_bad_argument_from_the_command_line(tmp_path):
    """A real process: exit status 2, one line on stderr, nothing trained or written, and torch
    never imported (it takes seconds: the arguments are checked without it)."""
    out = tmp_path / "out"
    result, err, imported = run_without_torch(["compare", "--presets", "fp32,bogus", "--out", str(out)],
                                              tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(err) == 1 and err[0].startswith("bf16opt compare: error: argument --presets: unknown preset "
                                               "'bogus'"), err
    assert not out.exists()
    assert "bf16opt.cli" in imported and heavy(imported) == set()


def test_version_imports_no_torch(tmp_path):
    result, err, imported = run_without_torch(["--version"], tmp_path)
    assert (result.returncode, result.stdout, err) == (0, f"bf16opt {bf16opt.__version__}\n", [])
    assert heavy(imported) == set()


def test_torch_free_names_match_the_torch_side():
    """bf16opt.cli names presets and optimizers without importing torch: the same names, in the
    same order, as bf16opt.PRESETS and compare.OPTIMIZERS."""
    assert cli.PRESET_NAMES == tuple(bf16opt.PRESETS)
    assert tuple(cli.DEFAULT_LR) == tuple(compare.OPTIMIZERS)
    assert set(cli.DEFAULT_PRESETS) <= set(bf16opt.PRESETS)
    assert (compare.__doc__ or "").splitlines()[0].endswith(": " + cli.SUMMARY)


@pytest.mark.parametrize("width, layers, block", [(16, 1, 16), (128, 2, 64), (40, 3, 7)])
def test_the_memory_check_counts_the_models_params(width, layers, block):
    model = compare.CharGPT(width=width, layers=layers, block=block)
    assert cli.model_params(width, layers, block) == sum(p.numel() for p in model.parameters())


def test_public_names_resolve_on_first_access():
    """``bf16opt``'s names are imported lazily (PEP 562) and are the submodules' objects."""
    from bf16opt import adam, lion, memory, precision, sgd

    assert (bf16opt.Adam, bf16opt.AdamW, bf16opt.Lion, bf16opt.SGD) == (adam.Adam, adam.AdamW, lion.Lion,
                                                                        sgd.SGD)
    assert (bf16opt.Precision, bf16opt.PRESETS) == (precision.Precision, precision.PRESETS)
    assert (bf16opt.MemoryReport, bf16opt.memory_report) == (memory.MemoryReport, memory.memory_report)
    namespace: dict = {}
    exec("from bf16opt import *", namespace)
    assert {name for name in namespace if name != "__builtins__"} == set(bf16opt.__all__)
    assert set(bf16opt.__all__) <= set(dir(bf16opt))
    with pytest.raises(AttributeError, match="module 'bf16opt' has no attribute 'Adamw'"):
        bf16opt.Adamw  # noqa: B018


def test_main_with_a_command_is_that_sub_command(capsys):
    """bf16opt.__main__.main(["compare", *ARGS]) is ``bf16opt compare ARGS`` (the same parser and messages)."""
    from bf16opt.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--steps", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == \
        "bf16opt compare: error: argument --steps: must be an integer >= 1, got '0'\n"


# ---------------------------------------------------------------- progress
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_is_plain_lines():
    stream = io.StringIO()
    progress = compare.Progress("bf16", 20, stream=stream)
    for step in range(1, 21):
        progress.update(step, 2.5)
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"bf16: step {s}/20" for s in range(2, 21, 2)]
    assert all("loss 2.5000" in line for line in lines)


def test_progress_on_a_terminal_is_a_live_bar():
    pytest.importorskip("tqdm", reason="tqdm (bf16opt[plot]) draws the live bar")
    stream = Terminal()
    progress = compare.Progress("bf16", 20, stream=stream)
    assert progress.bar is not None
    for step in range(1, 21):
        progress.update(step, 2.5)
    progress.close()
    text = stream.getvalue()
    assert "\r" in text and "20/20" in text and "loss 2.5000" in text


def test_progress_without_tqdm_is_plain_lines_on_a_terminal_too(monkeypatch):
    monkeypatch.setattr(compare, "tqdm", None)
    stream = Terminal()
    progress = compare.Progress("fp32", 5, stream=stream)
    for step in range(1, 6):
        progress.update(step, 1.0)
    progress.close()
    assert "\r" not in stream.getvalue()
    assert stream.getvalue().count("\n") == 5


def test_no_progress_writes_nothing():
    stream = Terminal()
    progress = compare.Progress("fp32", 5, stream=stream, enabled=False)
    for step in range(1, 6):
        progress.update(step, 1.0)
    progress.close()
    assert stream.getvalue() == ""


def test_piped_run_has_no_carriage_returns(tmp_path, corpus):
    """A whole run with stdout and stderr piped (as in CI logs): line-based progress, no "\\r"."""
    args = [*TINY, "--presets", "fp32,bf16", "--corpus", str(corpus), "--out", str(tmp_path / "out")]
    # `python -m bf16opt compare ARGS` without the figure (importing matplotlib and drawing would
    # be most of the run; the figure is tested in-process)
    script = ("import sys; from bf16opt import compare; compare.plot = lambda results, out: None; "
              "from bf16opt.__main__ import main; sys.exit(main(['compare', *sys.argv[1:]]))")
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                            cwd=tmp_path)  # bytes: any "\r" stays visible
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "\r" not in stdout and "\r" not in stderr
    for preset in ("fp32", "bf16"):
        assert [line.split(" (")[0] for line in stderr.splitlines() if line.startswith(f"{preset}: ")] == \
            [f"{preset}: step {s}/4" for s in range(1, 5)]
    assert "Final loss" in stdout and "step 4/4" not in stdout


# ---------------------------------------------------------------- results
def unpadded(text: str) -> str:
    """Printed tables without their alignment padding: ``| a | b |``."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def test_run_writes_csvs_plot_json_and_prints_both_tables(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    code = main(["compare", *TINY, "--no-progress", "--presets", "fp32,bf16-kahan", "--corpus", str(corpus),
                 "--out", str(out), "--json"])
    assert code == 0
    printed = unpadded(capsys.readouterr().out)
    assert "results.json" in printed
    for text in ("Memory breakdown", "| master | 4.00 (fp32) | - |", "| compensation | - | 2.00 (bf16) |",
                 "Final loss", "Swallowed updates", "| bf16-kahan |"):
        assert text in printed
    # the peak-memory row says how it was measured
    (peak_row,) = [line for line in printed.splitlines() if line.startswith("| step peak extra RSS")]
    assert compare.StepPeakMemory().label in peak_row
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["settings"]["presets"] == ["fp32", "bf16-kahan"]
    assert results["settings"]["corpus"] == str(corpus)
    assert results["peak_memory_method"] == compare.StepPeakMemory().label
    memory = {row["preset"]: row for row in results["memory"]}
    assert memory["fp32"]["bytes_per_param"]["master"] == 4.0
    assert memory["fp32"]["dtypes"]["master"] == ["fp32"]
    assert memory["bf16-kahan"]["bytes_per_param"]["compensation"] == 2.0
    assert memory["bf16-kahan"]["dtypes"]["compensation"] == ["bf16"]
    assert memory["fp32"]["optimizer_bytes_per_param"] == pytest.approx(12, abs=0.1)
    for row in results["loss"]:
        rows = list(csv.DictReader((out / row["csv"]).open()))
        assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
        losses = [float(r["loss"]) for r in rows]
        assert all(loss > 0 for loss in losses)
        assert row["final_loss"] == pytest.approx(statistics.fmean(losses[-1:]))
        assert row["mean_loss"] == pytest.approx(statistics.fmean(losses))
    assert results["loss"][0]["vs_first_preset"] == 0.0
    # every preset runs under the same torch schedule: the peak, then the cosine decay
    schedules = [[float(r["lr"]) for r in csv.DictReader((out / row["csv"]).open())]
                 for row in results["loss"]]
    assert schedules[0] == schedules[1] and schedules[0][0] == cli.DEFAULT_LR["adamw"]
    assert all(a >= b for a, b in zip(schedules[0], schedules[0][1:]))
    assert schedules[0][-1] < schedules[0][0] / 2
    pytest.importorskip("matplotlib", reason="matplotlib (bf16opt[plot]) draws loss_comparison.png")
    assert (out / "loss_comparison.png").stat().st_size > 1000


def test_schedule_is_torch_linear_warmup_then_cosine():
    """warmup_cosine is LinearLR then CosineAnnealingLR in a SequentialLR: (k+1)/warm during the
    first 10% of the steps, then a cosine from the peak to 5% of it."""
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = bf16opt.AdamW([param], lr=2e-3, backend="reference")
    steps, warm = 50, 5
    schedule = compare.warmup_cosine(opt, steps)
    assert isinstance(schedule, torch.optim.lr_scheduler.SequentialLR)
    kinds = [type(s) for s in schedule._schedulers]
    assert kinds == [torch.optim.lr_scheduler.LinearLR, torch.optim.lr_scheduler.CosineAnnealingLR]
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones_like(param)
        opt.step()
        schedule.step()
    expected = [2e-3 * (k + 1) / warm if k < warm else
                2e-3 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (k - warm) / (steps - warm))))
                for k in range(steps)]
    assert seen == pytest.approx(expected, rel=1e-9)


def test_sgd_with_momentum(tmp_path, corpus, capsys, no_plot):
    code = main(["compare", *TINY, "--no-progress", "--optimizer", "sgd", "--presets", "fp32,bf16",
                 "--corpus", str(corpus), "--out", str(tmp_path / "out")])
    assert code == 0
    printed = " ".join(capsys.readouterr().out.split())  # padding-insensitive
    assert printed.startswith("bf16opt compare: sgd, 4 steps, 2 presets")
    assert "| momentum_buffer | 4.00 (fp32) | 2.00 (bf16) |" in printed
    assert "| exp_avg_sq |" not in printed
    rows = list(csv.DictReader((tmp_path / "out" / "loss_bf16.csv").open()))
    assert float(rows[0]["lr"]) == pytest.approx(cli.DEFAULT_LR["sgd"])
    assert all(0 < float(r["loss"]) < 10 for r in rows)


@pytest.mark.parametrize("method", ["proc", "psutil"])
def test_step_peak_memory_methods(method):
    """Each way of measuring a step's peak memory sees a 64 MiB temporary, and says which way it is."""
    peak = compare.StepPeakMemory(method)
    if not peak.available:
        pytest.skip({"proc": "needs Linux's /proc/self/clear_refs", "psutil": "needs psutil"}[method])
    assert peak.method == method
    assert {"proc": "/proc", "psutil": "psutil"}[method] in peak.label
    with peak:
        temporary = torch.ones(64 << 20, dtype=torch.uint8)
        time.sleep(0.05)
        del temporary
    assert 48 <= peak.mib <= 96, peak.mib


def test_step_peak_memory_label_names_the_method():
    assert "/proc" in compare.StepPeakMemory.LABELS["proc"]
    assert "psutil" in compare.StepPeakMemory.LABELS["psutil"]
    if not compare.StepPeakMemory().available:
        assert compare.StepPeakMemory().mib is None


def test_out_directory_is_created_and_reused(tmp_path, corpus, no_plot):
    out = tmp_path / "a" / "b"
    for _ in range(2):
        assert main(["compare", *TINY, "--steps", "2", "--no-progress", "--presets", "bf16",
                     "--corpus", str(corpus), "--out", str(out)]) == 0
    assert (out / "loss_bf16.csv").exists()
    shutil.rmtree(out)



def test_every_table_is_drawn_by_the_one_helper(monkeypatch):
    """The memory table, the loss table and MemoryReport's text all come from memory.format_table
    (and MemoryReport's HTML from html_table, with the same rows)."""
    from bf16opt import memory

    drawn = []

    def recording(header, rows, align=""):
        drawn.append(list(header))
        return real(header, rows, align)

    real = memory.format_table
    monkeypatch.setattr(memory, "format_table", recording)
    monkeypatch.setattr(compare, "format_table", recording)
    report = memory.MemoryReport(bytes={"params": 8, "grads": 8, "master": 16}, dtypes={"params": {"bf16"}},
                                 num_params=4)
    results = [{"preset": preset, "memory": report, "peak_mib": None, "peak_method": "not measured",
                "final": 2.0, "mean": 2.5, "std": 0.1, "step_ms": 1.0, "swallowed": 0.0}
               for preset in ("fp32", "bf16")]
    compare.memory_table(results)
    compare.loss_table(results)
    str(report)
    assert [header[0] for header in drawn] == ["Component", "Preset", "Component"]


def readme_commands() -> list[list[str]]:
    """The ``bf16opt ...`` command lines of the README's shell examples, without comments."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.startswith("bf16opt ")]


def test_readme_shows_the_commands_and_each_one_parses(tmp_path, monkeypatch):
    """The README's examples: --version, --help, a run on the user's own text (--corpus) with
    --json; every one is accepted by the parser (files it names are made here)."""
    commands = readme_commands()
    flat = [" ".join(command) for command in commands]
    for shown in ("bf16opt --version", "bf16opt compare --help"):
        assert shown in flat
    assert any("--corpus" in command and "--json" in command for command in commands)
    monkeypatch.chdir(tmp_path)
    parser, _ = cli.build_parser()
    for command in commands:
        if "--corpus" in command:
            (tmp_path / command[command.index("--corpus") + 1]).write_text(TEXT)
        if "--help" in command or "--version" in command:
            continue  # they exit: test_help_per_command, test_version
        args = parser.parse_args(command[1:])
        assert args.command == "compare"
