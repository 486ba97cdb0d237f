"""Type hints of the public API (checked with mypy), py.typed and LICENSE (that the wheel ships
both, and the extras: tests/test_packaging.py).

``python -m mypy`` (configured in pyproject.toml) checks bf16opt/__init__.py, the command line,
bf16opt/memory.py and this file, whose ``public_api_in_use`` is ordinary user code and whose
``misuses`` must each be an error: the ``# type: ignore[...]`` comments there would be unused
(an error under ``warn_unused_ignores``) if the hints did not catch them.
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.resources
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bf16opt

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- user code, type-checked by mypy
def public_api_in_use() -> str:
    """What a user writes; mypy checks it against the hints, and test_public_api_in_use runs it."""
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    adamw = bf16opt.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, precision="bf16",
                          backend="reference")
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=10)  # a torch.optim.Optimizer
    bf16opt.Adam(model.parameters(), lr=torch.tensor(1e-3), betas=(0.9, 0.95), amsgrad=True, seed=3,
                 offload="cpu", offload_threads=1)
    bf16opt.Lion([{"params": list(model.parameters()), "precision": bf16opt.PRESETS["fp32"]}], lr=1e-4)
    sgd = bf16opt.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, backend="reference",
                      precision=bf16opt.Precision(master="fp32", exp_avg="bf16"), track_precision=True)
    model(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    sgd.step()
    adamw.step()
    schedule.step()
    released = bf16opt.AdamW(torch.nn.Linear(4, 2).parameters(), update_in_backward=True,
                             max_grad_norm_per_param=1.0, backend="reference")
    with released.accumulating():
        pass
    released.step()
    swallowed: float = sgd.precision_stats()["total"]["swallowed"]
    report: bf16opt.MemoryReport = bf16opt.memory_report(sgd)
    per_param: float = report.optimizer_bytes_per_param
    components: dict[str, float] = report.bytes_per_param
    on_device: int = report.device_bytes
    precision: bf16opt.Precision = bf16opt.PRESETS["bf16-sr"]
    version: str = bf16opt.__version__
    return f"{swallowed} {per_param} {components} {on_device} {precision.label} {version} {report}"


def misuses() -> None:
    """Never run: each line is an error the hints must catch."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    bf16opt.AdamW(params, lr="fast")  # type: ignore[arg-type]
    bf16opt.Adam(params, amsgrad="yes")  # type: ignore[arg-type]
    bf16opt.Lion(params, betas=0.9)  # type: ignore[arg-type]
    bf16opt.SGD(params, precision=16)  # type: ignore[arg-type]
    bf16opt.SGD(params, seed="0")  # type: ignore[arg-type]
    bf16opt.AdamW(params, update_in_backward="yes")  # type: ignore[arg-type]
    bf16opt.Precision(master=16)  # type: ignore[arg-type]
    bf16opt.memory_report("adam")  # type: ignore[arg-type]
    size: str = bf16opt.memory_report(bf16opt.SGD(params)).total_per_param  # type: ignore[assignment]
    del size


def test_public_api_in_use() -> None:
    assert "Memory breakdown" in public_api_in_use()


def test_mypy_passes() -> None:
    pytest.importorskip("mypy", reason="mypy (in bf16opt[test]) type-checks the public API")
    # the cache (.mypy_cache, with its own .gitignore) makes runs after the first take seconds
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


PUBLIC_MODULES = ("bf16opt", "bf16opt.adam", "bf16opt.lion", "bf16opt.sgd", "bf16opt.memory",
                  "bf16opt.precision")


def unannotated(function: object) -> list[str]:
    signature = inspect.signature(function)  # type: ignore[arg-type]
    missing = [name for name, p in signature.parameters.items()
               if name != "self" and p.annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_public_signatures_are_annotated() -> None:
    """Every name in bf16opt.__all__: functions, constructors, and the public methods and
    properties its classes define in the public modules."""
    problems = {}
    for name in bf16opt.__all__:
        obj = getattr(bf16opt, name)
        if inspect.isfunction(obj):
            problems[name] = unannotated(obj)
        elif inspect.isclass(obj):
            problems[f"{name}()"] = unannotated(obj)
            for attribute, value in vars(obj).items():
                if attribute.startswith("_") and attribute not in ("__init__", "_repr_html_"):
                    continue
                if isinstance(value, property) and value.fget is not None:
                    value = value.fget
                if inspect.isfunction(value) and value.__module__ in PUBLIC_MODULES:
                    problems[f"{name}.{attribute}"] = unannotated(value)
    assert not {name: missing for name, missing in problems.items() if missing}


# ---------------------------------------------------------------- py.typed and LICENSE
def test_package_is_marked_typed() -> None:
    assert importlib.resources.files("bf16opt").joinpath("py.typed").is_file()


# the SHA-256 of https://www.apache.org/licenses/LICENSE-2.0.txt
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_file_is_the_declared_license() -> None:
    """(That the wheel ships it and py.typed: tests/test_packaging.py, on the wheel it builds.)"""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_bytes()
    assert b"Apache License\n                           Version 2.0, January 2004" in text
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256, "not the standard Apache License 2.0 text"
