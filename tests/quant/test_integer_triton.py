"""The integer formats' Triton kernels against their torch paths, in Triton's interpreter, in a process of its own
(`TRITON_INTERPRET` is read as a kernel is defined). INT8 W8A8 in two kernels (`w8a8_triton`) against
`int8._w8a8_torch`: the same float32 bits, rows of each dtype, a row of zeros (the smallest scale), and a row whose
values divide to exact halves (ties round to even). ConvRot INT4's rotated weight in one kernel (`int4_triton`)
against `int4._rotated_weight` and the cast: the same bits in each dtype. Plants tried: ties rounded away from zero,
the row scale's division approximate (x * (1 / scale)), INT4's nibbles swapped within a byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = r"""
import json
import torch
from streamwise.runtime.quant import int8, w8a8_triton

results = {}
generator = torch.Generator().manual_seed(0)
q = torch.randint(-127, 128, (40, 96), dtype=torch.int8, generator=generator)
scale = torch.rand(40, generator=generator) / 100
for name in ("float32", "bfloat16", "float16"):
    rows = torch.randn(35, 96, generator=generator) * 3
    rows[3] = 0  # the smallest scale
    rows[5] = 0
    rows[5, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5])  # scale 1: exact halves, ties to even
    rows = rows.to(getattr(torch, name))
    got, expected = w8a8_triton.w8a8(rows, q, scale), int8._w8a8_torch(rows, q, scale)
    results[name] = {"ran": got is not None, "same_bits": got is not None and bool(torch.equal(got, expected)),
                     "dtype": str(got.dtype) if got is not None else None}
targets = []  # W8A8 in a compiled graph: the two kernels as one operator, the same bits


def backend(graph, inputs):
    targets.extend(str(node.target) for node in graph.graph.nodes)
    return graph.forward


got = torch.compile(int8._w8a8, fullgraph=True, backend=backend)(rows, q, scale)
results["compiled"] = {"operator": any("int8_w8a8" in target for target in targets),
                       "same_bits": bool(torch.equal(got, int8._w8a8_torch(rows, q, scale)))}
torch.library.opcheck(torch.ops.streamwise.int8_w8a8.default, (rows, q, scale))  # the meta against the kernels
from streamwise.runtime.quant import int4, int4_triton
weight = torch.randn(48, 256, generator=generator)
for group_size in (16, 256):  # scale groups of 16 (the rotation's), and of 64
    packed, scales = int4.quantize_int4(weight, group_size)
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        got = int4_triton.rotated_weight(packed, scales, int4.scale_group_for(group_size), dtype)
        expected = int4._rotated_weight(packed, scales, group_size).to(dtype)
        results[f"int4-{group_size}-{name}"] = {"ran": got is not None, "same_bits": got is not None and bool(
            torch.equal(got.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                        expected.view(torch.int16 if dtype.itemsize == 2 else torch.int32)))}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_w8a8_in_two_kernels_gives_the_torch_paths_bits(interpreted, dtype):
    assert interpreted[dtype] == {"ran": True, "same_bits": True, "dtype": "torch.float32"}, interpreted[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("group_size", [16, 256])
def test_convrot_int4_expands_in_one_kernel_with_the_torch_paths_bits(interpreted, group_size, dtype):
    assert interpreted[f"int4-{group_size}-{dtype}"] == {"ran": True, "same_bits": True}


def test_a_compiled_graph_runs_w8a8_as_the_kernels_operator(interpreted):
    """`streamwise::int8_w8a8` in a graph traced whole (fullgraph): the two kernels inside it, their bits."""
    assert interpreted["compiled"] == {"operator": True, "same_bits": True}, interpreted["compiled"]
