"""Every notebook in notebooks/ runs top to bottom (a quick run: BF16OPT_NOTEBOOK_STEPS), draws
and prints what it is about (checked from what its figures hold and the data behind them) without
stray object reprs; MemoryReport renders as a table in Jupyter."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import bf16opt

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))

# what each notebook must print or show (text of its outputs)
EXPECTED = {
    "01_presets_and_memory.ipynb": ["of updates swallowed", "final loss", "vs fp32", "optimizer bytes/param",
                                    "Memory breakdown"],
    "02_precision_telemetry.ipynb": ["swallowed updates: first 10% of steps", "after the switch",
                                     "4.0 before, 12.0 after the switch", "Memory breakdown"],
    "03_cpu_offload.ipynb": ["params identical with and without offload: True", "host: optimizer state",
                             "with offload: device", "optimizer state in host RAM",
                             "params identical with update_in_backward: True"],
}
# matplotlib artists, bound methods, ... echoed by a cell's last expression or printed
STRAY_REPR = re.compile(r"<[\w.]+(?: object)? at 0x[0-9a-fA-F]+>|^\[?<matplotlib\.|^Text\(|^<Axes|^\[<")


def test_there_are_notebooks():
    assert {path.name for path in NOTEBOOKS} >= set(EXPECTED)


# The notebooks read it: a quick run (the default is a few times longer), same code and plots.
QUICK_STEPS = "30"
PROBE = "bf16opt-test-probe "
# Inserted after a notebook's first code cell: records what each plt.show() draws.
RECORD_FIGURES = """
try:
    import matplotlib.pyplot as _plt
except ImportError:
    _plt = None
_figures = []
if _plt is not None:
    _show = _plt.show

    def _recording_show(*args, **kwargs):
        _figures.append([{"title": axis.get_title(), "ylabel": axis.get_ylabel(),
                          "legend": axis.get_legend_handles_labels()[1],
                          "xticks": [t.get_text() for t in axis.get_xticklabels()],
                          "yticks": [t.get_text() for t in axis.get_yticklabels()]}
                         for axis in _plt.gcf().axes])
        return _show(*args, **kwargs)

    _plt.show = _recording_show
"""
# Appended to each notebook: the figures and (per notebook) the facts its text is about, as JSON.
FACTS = {
    "01_presets_and_memory.ipynb":
        "{'presets': list(results), 'steps': [len(r[0]) for r in results.values()]}",
    "02_precision_telemetry.ipynb": (
        "{'layers': LAYERS, 'switch': SWITCH, "
        "'runs': {p: {'steps': len(r['loss']), 'layers': list(r['layers']), "
        "'per_layer_steps': sorted({len(v) for v in r['layers'].values()}), 'total': r['total']} "
        "for p, r in runs.items()}}"),
    "03_cpu_offload.ipynb": (
        "{'presets': PRESETS, 'placements': {p: {k: [r.device_bytes, r.host_bytes, sum(r.staging.values()), "
        "r.num_params] for k, r in reports[p].items()} for p in PRESETS}, "
        "'released': [[p, o, r, sum(v.values()), v['device: grads (most alive at once)']] "
        "for (p, o, r), v in released.items()]}"),
}


def notebook_runner() -> tuple:
    """nbformat and nbclient (bf16opt[notebooks]), or a skip naming the missing one."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat (bf16opt[notebooks]) reads the notebooks")
    nbclient = pytest.importorskip("nbclient", reason="nbclient (bf16opt[notebooks]) runs the notebooks")
    return nbformat, nbclient.NotebookClient


def execute_notebook(path: Path, directory: Path):
    """``path`` run top to bottom in its own kernel, with the test's two cells added; an error is
    kept in the cell's outputs (test_notebook_executes reports it)."""
    nbformat, NotebookClient = notebook_runner()
    notebook = nbformat.read(path, as_version=4)
    first = next(i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code")
    notebook.cells.insert(first + 1, nbformat.v4.new_code_cell(RECORD_FIGURES))
    facts = FACTS.get(path.name, "{}")
    notebook.cells.append(nbformat.v4.new_code_cell(
        f"import json as _json\nprint({PROBE!r} + _json.dumps({{'figures': _figures, 'facts': {facts}}}))"))
    env = dict(os.environ, BF16OPT_NOTEBOOK_STEPS=QUICK_STEPS)
    NotebookClient(notebook, timeout=300, kernel_name="python3", shutdown_kernel="immediate",
                   allow_errors=True, resources={"metadata": {"path": str(directory)}}).execute(env=env)
    return notebook


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict:
    """Every notebook, executed once (the tests below read its outputs).  The kernels run side by
    side: each spends most of its time starting up and importing, one core apiece."""
    notebook_runner()  # a missing package skips every test that reads the outputs, before any kernel starts
    with ThreadPoolExecutor(len(NOTEBOOKS)) as pool:
        running = {path.name: pool.submit(execute_notebook, path, tmp_path_factory.mktemp(path.stem))
                   for path in NOTEBOOKS}
    return {name: future.result() for name, future in running.items()}


def probe(notebook) -> dict:
    """What the appended cell recorded (the cells the test added are not the notebook's own)."""
    (line,) = [line for output in outputs(notebook, notebook.cells)
               for line in output.get("text", "").splitlines() if line.startswith(PROBE)]
    return json.loads(line[len(PROBE):])


def own_cells(notebook) -> list:
    """The notebook's cells, without the two the test inserted."""
    return [cell for cell in notebook.cells
            if cell.source != RECORD_FIGURES and PROBE not in cell.source]


def outputs(notebook, cells=None):
    return [output for cell in (own_cells(notebook) if cells is None else cells) if cell.cell_type == "code"
            for output in cell.get("outputs", [])]


def text_of(output) -> str:
    return output.get("text", "") + output.get("data", {}).get("text/plain", "")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, executed):
    notebook = executed[path.name]
    errors = [output for output in outputs(notebook) if output.get("output_type") == "error"]
    assert not errors, "\n".join("\n".join(e.get("traceback", [])) for e in errors)
    shown = "".join(text_of(output) for output in outputs(notebook))
    for text in EXPECTED.get(path.name, ["loss"]):
        assert text in shown, f"{path.name} does not show {text!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_shows_no_stray_reprs(path, executed):
    """A cell's result is shown only when it is meant to be (a MemoryReport's table): no
    ``[<matplotlib.lines.Line2D at 0x...>]`` or ``Text(0.5, 0, 'step')`` echoes."""
    notebook = executed[path.name]
    for output in outputs(notebook):
        if output.get("output_type") == "execute_result":
            assert "text/html" in output["data"], f"stray result: {output['data'].get('text/plain')!r}"
        for line in output.get("text", "").splitlines():
            assert not STRAY_REPR.search(line), f"stray repr printed: {line!r}"
        if output.get("output_type") == "display_data" and "image/png" not in output.get("data", {}):
            assert "text/html" in output["data"], f"stray display: {output['data']!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_draws_its_figures(path, executed):
    pytest.importorskip("matplotlib", reason="matplotlib (bf16opt[notebooks]) draws the figures")
    notebook = executed[path.name]
    images = [o for o in outputs(notebook) if "image/png" in o.get("data", {})]
    plotting_cells = [c for c in own_cells(notebook) if c.cell_type == "code" and "plt.show()" in c.source]
    assert len(images) == len(plotting_cells) >= 1


def test_notebook_memory_report_is_an_html_table(executed):
    path = next(p for p in NOTEBOOKS if p.name.startswith("01_"))
    notebook = executed[path.name]
    tables = [o["data"] for o in outputs(notebook) if "text/html" in o.get("data", {})]
    assert tables and tables[-1]["text/html"].startswith("<table>")
    assert "Memory breakdown for N = " in tables[-1]["text/html"]
    assert tables[-1]["text/plain"].startswith("Memory breakdown for N = ")  # the text table, not a repr


def figures(path, executed) -> tuple[list, dict]:
    pytest.importorskip("matplotlib", reason="matplotlib (bf16opt[notebooks]) draws the figures")
    found = probe(executed[path.name])
    return found["figures"], found["facts"]


def notebook_named(prefix: str) -> Path:
    return next(p for p in NOTEBOOKS if p.name.startswith(prefix))


def test_notebook_01_shows_each_presets_gap_to_fp32(executed):
    """Under the loss curves (which overlap), a panel of each preset's loss minus fp32's."""
    shown, facts = figures(notebook_named("01_"), executed)
    assert facts["presets"] == list(bf16opt.PRESETS) and set(facts["steps"]) == {int(QUICK_STEPS)}
    (curves, gaps), = [axes for axes in shown if len(axes) == 2]
    assert curves["legend"] == gaps["legend"] == list(bf16opt.PRESETS)
    assert gaps["ylabel"].startswith("loss - fp32 loss")


def test_notebook_02_plots_swallowed_updates_per_layer_and_a_precision_switch(executed):
    shown, facts = figures(notebook_named("02_"), executed)
    layers, steps, switch = facts["layers"], int(QUICK_STEPS), facts["switch"]
    runs = facts["runs"]
    assert set(runs) == {"fp32", "bf16", "bf16-sr", "fp32-remainder", "bf16 -> fp32"}
    for run in runs.values():  # per layer, every step
        assert run["layers"] == layers and run["per_layer_steps"] == [steps] == [run["steps"]]
    # swallowed updates: bf16 and bf16-sr lose some late in the (decayed) schedule; an fp32 master
    # only updates below half an fp32 spacing (weight decay and the gradient step all but
    # cancelling: an element now and then, which of them depends on the CPU's matmul rounding)
    assert max(runs["bf16"]["total"][-steps // 10:]) > 0 and max(runs["bf16-sr"]["total"]) > 0
    bf16_lost = sum(runs["bf16"]["total"])
    for preset in ("fp32", "fp32-remainder"):
        assert max(runs[preset]["total"]) <= 1e-3 and sum(runs[preset]["total"]) < bf16_lost / 100, preset
    switched = runs["bf16 -> fp32"]["total"]
    assert max(switched[:switch]) > 0 and max(switched[switch:]) <= 1e-3
    assert sum(switched[switch:]) < sum(runs["bf16"]["total"][switch:]) / 100
    # the plots: a panel per preset with a line per layer; gaps to fp32; the switch
    per_layer = [axes for axes in shown
                 if [a["title"] for a in axes] == ["bf16", "bf16-sr", "fp32-remainder"]]
    assert per_layer and per_layer[0][-1]["legend"] == layers
    assert "swallowed" in per_layer[0][0]["ylabel"]
    assert [[a["legend"], a["ylabel"][:15]] for a in shown[1]] == \
        [[["bf16", "bf16-sr", "fp32-remainder"], "loss - fp32 los"]]
    assert [a["legend"] for a in shown[2]] == [["bf16", "bf16 -> fp32"]] * 2


def test_notebook_03_draws_device_and_host_memory_per_preset(executed):
    shown, facts = figures(notebook_named("03_"), executed)
    presets = facts["presets"]
    assert len(presets) >= 5
    for preset, placements in facts["placements"].items():
        (device, host, staging, _), (off_device, off_host, off_staging, n) = \
            placements["on device"], placements["offloaded"]
        assert device == off_host > 0 and host == off_device == staging == 0  # the state moved, all of it
        assert off_staging == 4 * n  # bf16 param mirror + grad
    per_param, projection, release = shown
    assert [t for t in per_param[0]["xticks"]] == presets
    assert {"host: optimizer state", "device: optimizer state"} <= set(per_param[0]["legend"])
    assert projection[0]["yticks"] == presets and "host, offload='cpu'" in projection[0]["legend"]
    # update in backward: one Linear(128, 128) weight's grad of eight layers alive at once
    assert release[0]["xticks"] == presets and "device: grads (most alive at once)" in release[0]["legend"]
    peaks = {(p, o, r): (total, grads) for p, o, r, total, grads in facts["released"]}
    assert len(peaks) == 4 * len(presets)
    for (preset, offload, release_on), (total, grads) in peaks.items():
        whole = 8 * (128 * 128 + 128)
        assert grads == (2 * 128 * 128 / whole if release_on else 2.0), (preset, offload, release_on)
        assert not release_on or total < peaks[preset, offload, False][0]


# ---------------------------------------------------------------- MemoryReport in Jupyter
def stepped_report(offload=None) -> bf16opt.MemoryReport:
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), precision="bf16-kahan", backend="reference", offload=offload)
    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    return bf16opt.memory_report(opt)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_memory_report_html_has_the_rows_of_its_text(offload):
    report = stepped_report(offload)
    html = report._repr_html_()
    assert html.startswith("<table>") and html.endswith("</table>")
    assert "<caption>Memory breakdown for N = 36 parameters</caption>" in html
    text_rows = [line for line in str(report).splitlines()[1:] if not line.startswith("|--")]
    html_rows = re.findall(r"<tr>(.*?)</tr>", html)
    assert len(html_rows) == len(text_rows)
    for text_row, html_row in zip(text_rows, html_rows):
        cells = [c.strip() for c in text_row.strip("|").split("|")]
        assert [re.sub("<[^>]+>", "", c) for c in re.findall(r"<t[hd][^>]*>.*?</t[hd]>", html_row)] == \
            [c.replace("'", "&#x27;") for c in cells]
    assert 'style="text-align: right"' in html  # numbers right-aligned, as in the text table


def test_memory_report_displays_as_html_in_jupyter_and_as_text_elsewhere():
    formatters = pytest.importorskip("IPython.core.formatters", reason="IPython (ipykernel) formats outputs")
    report = stepped_report()
    data, _ = formatters.DisplayFormatter().format(report)
    assert data["text/html"] == report._repr_html_()
    assert data["text/plain"] == str(report)  # a terminal IPython shows the table too
    assert str(report).startswith("Memory breakdown for N = 36 parameters\n| Component")
