"""Every notebook in notebooks/ runs top to bottom (on its small default setting), and shows
what it is about without stray object reprs; MemoryReport renders as a table in Jupyter."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

import bf16opt

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))

# what each notebook must print or show (text of its outputs)
EXPECTED = {
    "01_presets_and_memory.ipynb": ["of updates swallowed", "final loss", "vs fp32", "optimizer bytes/param",
                                    "Memory breakdown"],
    "02_precision_telemetry.ipynb": ["swallowed updates: first 10% of steps", "after the switch",
                                     "4.0 before, 12.0 after the switch", "Memory breakdown"],
    "03_cpu_offload.ipynb": ["params identical with and without offload: True", "host: optimizer state",
                             "with offload: device", "optimizer state in host RAM"],
}
# matplotlib artists, bound methods, ... echoed by a cell's last expression or printed
STRAY_REPR = re.compile(r"<[\w.]+(?: object)? at 0x[0-9a-fA-F]+>|^\[?<matplotlib\.|^Text\(|^<Axes|^\[<")


def test_there_are_notebooks():
    assert {path.name for path in NOTEBOOKS} >= set(EXPECTED)


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict:
    """Each notebook, executed once (the tests below read its outputs)."""
    return {}


def execute(path: Path, executed: dict, tmp_path: Path):
    if path.name not in executed:
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
        executed[path.name] = notebook
    return executed[path.name]


def outputs(notebook):
    return [output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", [])]


def text_of(output) -> str:
    return output.get("text", "") + output.get("data", {}).get("text/plain", "")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, executed, tmp_path):
    notebook = execute(path, executed, tmp_path)
    errors = [output for output in outputs(notebook) if output.get("output_type") == "error"]
    assert not errors, "\n".join("\n".join(e.get("traceback", [])) for e in errors)
    shown = "".join(text_of(output) for output in outputs(notebook))
    for text in EXPECTED.get(path.name, ["loss"]):
        assert text in shown, f"{path.name} does not show {text!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_shows_no_stray_reprs(path, executed, tmp_path):
    """A cell's result is shown only when it is meant to be (a MemoryReport's table): no
    ``[<matplotlib.lines.Line2D at 0x...>]`` or ``Text(0.5, 0, 'step')`` echoes."""
    notebook = execute(path, executed, tmp_path)
    for output in outputs(notebook):
        if output.get("output_type") == "execute_result":
            assert "text/html" in output["data"], f"stray result: {output['data'].get('text/plain')!r}"
        for line in output.get("text", "").splitlines():
            assert not STRAY_REPR.search(line), f"stray repr printed: {line!r}"
        if output.get("output_type") == "display_data" and "image/png" not in output.get("data", {}):
            assert "text/html" in output["data"], f"stray display: {output['data']!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_draws_its_figures(path, executed, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (bf16opt[notebooks]) draws the figures")
    notebook = execute(path, executed, tmp_path)
    images = [o for o in outputs(notebook) if "image/png" in o.get("data", {})]
    plotting_cells = [c for c in notebook.cells if c.cell_type == "code" and "plt.show()" in c.source]
    assert len(images) == len(plotting_cells) >= 1


def test_notebook_memory_report_is_an_html_table(executed, tmp_path):
    path = next(p for p in NOTEBOOKS if p.name.startswith("01_"))
    notebook = execute(path, executed, tmp_path)
    tables = [o["data"] for o in outputs(notebook) if "text/html" in o.get("data", {})]
    assert tables and tables[-1]["text/html"].startswith("<table>")
    assert "Memory breakdown for N = " in tables[-1]["text/html"]
    assert tables[-1]["text/plain"].startswith("Memory breakdown for N = ")  # the text table, not a repr


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
