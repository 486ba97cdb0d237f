"""bf16opt: Adam, AdamW, Lion and SGD whose master weights and moments use chosen dtypes.

Swap ``torch.optim.AdamW(params, ...)`` for ``bf16opt.AdamW(params, ..., precision="bf16")``.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["Adam", "AdamW", "Lion", "SGD", "Precision", "PRESETS", "MemoryReport", "memory_report",
           "__version__"]

# Public name -> the submodule defining it, imported on first access (PEP 562): importing torch
# takes seconds, and `bf16opt --version` or a rejected command line must not pay for it.
_LAZY = {"Adam": "adam", "AdamW": "adam", "Lion": "lion", "SGD": "sgd", "Precision": "precision",
         "PRESETS": "precision", "MemoryReport": "memory", "memory_report": "memory"}

if TYPE_CHECKING:  # type checkers see plain imports (and no __getattr__ hiding misspelt names)
    from .adam import Adam, AdamW
    from .lion import Lion
    from .memory import MemoryReport, memory_report
    from .precision import PRESETS, Precision
    from .sgd import SGD
else:
    def __getattr__(name):
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later accesses are plain attribute look-ups
        return value

    def __dir__():
        return sorted(set(globals()) | set(__all__))

del TYPE_CHECKING
