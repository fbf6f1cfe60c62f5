"""Every extension table refuses a second entry under a taken name, and says what to do."""

from __future__ import annotations

import pytest

from streamwise.runtime.engine.kinds import COMPUTE_KINDS, compute_kind
from streamwise.runtime.quant.formats import FORMATS, QuantFormat, quant_format
from streamwise.runtime.quant.gguf_dequant import DEQUANTIZERS, QType
from streamwise.runtime.registry import Registry


@pytest.mark.parametrize("register", [
    lambda: compute_kind("linear", dtype="input")(lambda *args: None),
    lambda: quant_format("int8")(type("Again", (QuantFormat,), {"dequantize": lambda *args: None})),
    lambda: DEQUANTIZERS.register(QType.Q8_0, lambda fields, blocks, out: None),
])
def test_a_taken_name_is_refused(register):
    before = (len(COMPUTE_KINDS), len(FORMATS), len(DEQUANTIZERS))
    with pytest.raises(ValueError, match="is already registered; register yours under another name"):
        register()
    assert (len(COMPUTE_KINDS), len(FORMATS), len(DEQUANTIZERS)) == before


def test_newest_first_registries_iterate_the_latest_entry_first():
    builders = Registry("builder", order="newest-first")
    builders.register("a", 1)
    builders.register("b", 2)
    assert builders.values() == [2, 1] and list(builders) == ["b", "a"]
    assert Registry("plain").register("x", 3) == 3
