"""memory_report: bytes held by an optimizer, counted from its live tensors."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .distributed import local
from .precision import SHORT_NAME

__all__ = ["MemoryReport", "format_table", "html_table", "memory_report"]

# Listed for any torch optimizer, in this order; a bf16opt optimizer lists its algorithm's
# buffers instead (``components``).  Any other state tensor is appended under its own name.
COMPONENTS = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "compensation",
              "remainder")
# Components that are the optimizer's own (not the model's params and grads).
MODEL_COMPONENTS = ("params", "grads")


@dataclass
class MemoryReport:
    """Bytes per component; ``bytes_per_param`` divides by the number of parameters."""

    bytes: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, set[str]] = field(default_factory=dict)
    num_params: int = 0
    #: where the optimizer's own bytes are: on the params' device, or in host RAM (offloaded
    #: groups; ``pinned_bytes`` of those page-locked)
    device_bytes: int = 0
    host_bytes: int = 0
    pinned_bytes: int = 0
    #: host buffers of the offload pipeline ({"param_mirror": b, "grad_staging": b}), not state
    staging: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def optimizer_bytes(self) -> int:
        """Bytes the optimizer adds on top of the model's params and grads."""
        return sum(b for name, b in self.bytes.items() if name not in MODEL_COMPONENTS)

    @property
    def bytes_per_param(self) -> dict[str, float]:
        n = max(self.num_params, 1)
        return {name: b / n for name, b in self.bytes.items()}

    @property
    def total_per_param(self) -> float:
        return self.total / max(self.num_params, 1)

    @property
    def optimizer_bytes_per_param(self) -> float:
        return self.optimizer_bytes / max(self.num_params, 1)

    def _table(self) -> tuple[str, list[str], list[list[str]]]:
        """(title, header, rows of text cells): what ``str()`` and Jupyter show."""
        header = ["Component", "Dtype", "Bytes", "Bytes/param"]
        rows: list[list[str]] = []
        per_param = self.bytes_per_param
        for name, nbytes in self.bytes.items():
            dtypes = "+".join(sorted(self.dtypes.get(name, ()))) or "-"
            rows.append([name, dtypes, f"{nbytes:,}", f"{per_param[name]:.2f}"])
        rows.append(["optimizer (not params/grads)", "", f"{self.optimizer_bytes:,}",
                     f"{self.optimizer_bytes_per_param:.2f}"])
        rows.append(["Total", "", f"{self.total:,}", f"{self.total_per_param:.2f}"])
        if self.host_bytes or self.staging:
            rows.append(["optimizer state on the params' device", "", f"{self.device_bytes:,}",
                         f"{self.device_bytes / max(self.num_params, 1):.2f}"])
            rows.append([f"optimizer state in host RAM ({self.pinned_bytes:,} page-locked)", "",
                         f"{self.host_bytes:,}", f"{self.host_bytes / max(self.num_params, 1):.2f}"])
            for name, nbytes in self.staging.items():
                rows.append([f"offload staging: {name} (host)", "", f"{nbytes:,}",
                             f"{nbytes / max(self.num_params, 1):.2f}"])
        return f"Memory breakdown for N = {self.num_params:,} parameters", header, rows

    def __str__(self) -> str:
        title, header, rows = self._table()
        return title + "\n" + format_table(header, rows, align="llrr")

    def _repr_html_(self) -> str:
        """Jupyter shows the report as an HTML table."""
        title, header, rows = self._table()
        return html_table(header, rows, align="llrr", caption=title)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython's text display (terminal IPython, text-only frontends): the same table as ``str()``."""
        printer.text(str(self))


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A Markdown table padded for reading as plain text.

    ``align`` has one letter per column, ``l`` or ``r`` (default ``l``); cells are ``str()``-ed.
    """
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    count = len(cells[0])
    align = align.ljust(count, "l")
    widths = [max(len(row[i]) for row in cells) for i in range(count)]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(cell.rjust(width) if side == "r" else cell.ljust(width)
                                 for cell, width, side in zip(row, widths, align)) + " |"

    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def html_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str = "",
               caption: str | None = None) -> str:
    """The same table as :func:`format_table`, as HTML (for Jupyter's ``_repr_html_``)."""
    count = len(header)
    align = align.ljust(count, "l")

    def cell(tag: str, value: object, side: str) -> str:
        style = f"text-align: {'right' if side == 'r' else 'left'}"
        return f'<{tag} style="{style}">{html.escape(str(value))}</{tag}>'

    parts = ["<table>"]
    if caption:
        parts.append(f"<caption>{html.escape(caption)}</caption>")
    parts.append("<thead><tr>" + "".join(cell("th", h, a) for h, a in zip(header, align)) + "</tr></thead>")
    parts.append("<tbody>")
    for row in rows:
        parts.append("<tr>" + "".join(cell("td", c, a) for c, a in zip(row, align)) + "</tr>")
    parts.append("</tbody></table>")
    return "\n".join(parts)


def components(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The components a report of ``optimizer`` always lists: params, grads, the master
    policy's buffers and the algorithm's moments (every buffer its kernels can have)."""
    algorithm = getattr(optimizer, "algorithm", None)
    if algorithm is None:
        return COMPONENTS
    moments = tuple(role.name for role in algorithm.moment_roles)
    return ("params", "grads", "master", *moments, "compensation", "remainder")


def memory_report(optimizer: torch.optim.Optimizer) -> MemoryReport:
    """Bytes of params, grads, master copies, moments and any other state buffer.

    Counted from the tensors that exist now: optimizer state is created at the first
    ``step()``, so call this after one step to see the steady-state footprint.  A DTensor
    (FSDP2) counts its local shard: the report is this rank's.
    """
    report = MemoryReport(bytes={name: 0 for name in components(optimizer)})
    seen = set()

    def add(name: str, tensor: torch.Tensor) -> int:
        tensor = local(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        report.bytes[name] = report.bytes.get(name, 0) + nbytes
        report.dtypes.setdefault(name, set()).add(SHORT_NAME.get(tensor.dtype, str(tensor.dtype)))
        return nbytes

    for group in optimizer.param_groups:
        offloaded = group.get("offload") == "cpu"
        for param in group["params"]:
            if id(param) in seen:
                continue
            seen.add(id(param))
            report.num_params += local(param).numel()
            add("params", param)
            if param.grad is not None:
                add("grads", param.grad)
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    nbytes = add(key, value)
                    if offloaded:
                        report.host_bytes += nbytes
                        report.pinned_bytes += nbytes if value.is_pinned() else 0
                    else:
                        report.device_bytes += nbytes
    offloader = getattr(optimizer, "__dict__", {}).get("_offloader_instance")
    if offloader is not None:
        report.staging = offloader.host_bytes()
    return report
