"""Stage 5, lazy regional `torch.compile` of a converted (or any) tree, host-agnostic."""

from .arm import CompileStats, compile_stats, disarm, lazy_compile

__all__ = ["CompileStats", "compile_stats", "disarm", "lazy_compile"]
