"""Stage 5, lazy regional `torch.compile` of a converted (or any) tree; host-agnostic (hosts adapt their models)."""

from .arm import INT4_MESSAGE, compile_stats, disarm, is_armed, lazy_compile
from .regions import CompileStats

__all__ = ["INT4_MESSAGE", "CompileStats", "compile_stats", "disarm", "is_armed", "lazy_compile"]
