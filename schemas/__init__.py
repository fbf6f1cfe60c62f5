"""The policy format: pydantic models, the fixed vocabularies and the selector syntax."""

from .policy import (
    SCHEMA_VERSION,
    CompileSettings,
    Match,
    Policy,
    PolicyInfo,
    QuantRule,
    QuantSection,
    RelocateRule,
    RelocateSection,
    Selector,
    StreamRule,
    StreamSection,
)

__all__ = [
    "SCHEMA_VERSION",
    "CompileSettings",
    "Match",
    "Policy",
    "PolicyInfo",
    "QuantRule",
    "QuantSection",
    "RelocateRule",
    "RelocateSection",
    "Selector",
    "StreamRule",
    "StreamSection",
]
