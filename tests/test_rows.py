"""cpu_src/rows.py is the one row driver: the algorithm files hold their math, no loops."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("numba")


@pytest.mark.parametrize("name", ["adam", "lion", "sgd"])
def test_algorithm_files_leave_the_loops_to_the_row_driver(name):
    import bf16opt._cpu

    source = (Path(bf16opt._cpu.__file__).parent / f"{name}.py").read_text(encoding="utf-8")
    loops = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.For, ast.While))]
    assert loops == [], f"cpu_src/{name}.py has loops at lines {loops}: they belong in rows.py"
    assert "rows.chunk_function(" in source


def test_row_driver_refuses_more_states_or_counters_than_it_has_slots():
    import numpy as np

    from bf16opt._cpu import rows

    math = rows.Math(begin=None, update=None)
    formats = (np.float32,) * 3
    with pytest.raises(ValueError, match="at most"):
        rows.chunk_function((), formats, "param", (rows.State(np.float32),) * (rows.STATES + 1), 1, False, math,
                            None)
    with pytest.raises(ValueError, match="at most"):
        rows.chunk_function((), formats, "param", (rows.State(np.float32),), 4, False, math, None)
