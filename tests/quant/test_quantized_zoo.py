"""A sample of the quantized zoo (`quantized_zoo`): real model classes at a small size, each format by the route
users take, within the format's envelope of the float model, budget 0 identical to resident. The whole zoo is
`benchmarks/quantized_zoo.py`."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from quantized_zoo import CASES, FORMATS, run_case


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(CASES))
def test_a_quantized_model_computes_within_its_formats_envelope(tmp_path, name, fmt):
    result = run_case(name, fmt, tmp_path)
    assert result["residents"] and result["quantized_share"] > 0.3, result  # layers really are quantized
    assert result["within"], result
