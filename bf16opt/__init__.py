"""bf16opt: Adam, AdamW, Lion and SGD whose master weights and moments use chosen dtypes.

Swap ``torch.optim.AdamW(params, ...)`` for ``bf16opt.AdamW(params, ..., precision="bf16")``.
"""

from .adam import Adam, AdamW
from .lion import Lion
from .memory import MemoryReport, memory_report
from .precision import PRESETS, Precision
from .sgd import SGD

__version__ = "0.1.0"

__all__ = ["Adam", "AdamW", "Lion", "SGD", "Precision", "PRESETS", "MemoryReport", "memory_report",
           "__version__"]
