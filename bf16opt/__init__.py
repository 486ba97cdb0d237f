"""bf16opt: Adam, AdamW and Lion whose master weights and moments use chosen dtypes.

Swap ``torch.optim.AdamW(params, ...)`` for ``bf16opt.AdamW(params, ..., precision="bf16")``.
"""

from .adam import Adam, AdamW
from .lion import Lion
from .memory import MemoryReport, memory_report
from .precision import PRESETS, Precision

__version__ = "0.1.0"

__all__ = ["Adam", "AdamW", "Lion", "Precision", "PRESETS", "MemoryReport", "memory_report",
           "__version__"]
