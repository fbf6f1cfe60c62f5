"""The Triton kernels of `gguf_triton` against the torch kernels (bit-exact with gguf's numpy reference): float32
with the same bits, bfloat16 and float16 their round to nearest even, NaNs by place, on random blocks whose first
scales are NaN, infinities, subnormals and signed zeros. On a CPU the kernels run in Triton's interpreter, in a
process of their own (`TRITON_INTERPRET` is read as a kernel is defined); where CUDA is present, also compiled, in a
process without it. Plants tried: Q5_0's high bits read one byte late, Q4_1's offset added to the quants before the
scale's product, Q6_K's top bits shifted by 3, Q4_K's upper mins masked to 5 bits, Q3_K's scales' top bits all read
from one byte, Q5_K's fifth bits from the wrong bit, IQ4_XS's scale tops from the wrong field, IQ4_NL's table halves
swapped (each fails its types)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_blocks import random_bytes

from streamwise.runtime.quant import gguf_dequant, gguf_triton, triton_support

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CHECK = r"""
import json, sys
import numpy as np
import torch
from gguf_blocks import random_bytes
from gguf import GGML_QUANT_SIZES
from streamwise.runtime.quant import gguf_dequant, gguf_triton
from streamwise.runtime.quant.gguf_dequant import QType, dequantize

device, names, dtypes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
results = {}
for name in names:
    qtype = QType[name]
    # finite scales, then the special ones first: 160 or 20 blocks, more than one program, a partial last one
    rows = (5, 512) if GGML_QUANT_SIZES[qtype][0] == 32 else (5, 2560)
    raw = torch.from_numpy(np.concatenate([random_bytes(qtype, rows), random_bytes(qtype, rows, 1, False)]))
    values, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(-1, type_size).to(device)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        out = torch.empty(blocks.shape[0], values, dtype=dtype, device=device)
        ran = gguf_triton.dequantize(qtype, blocks, out)
        expected = dequantize(raw, qtype, (10, rows[1]), dtype).view(-1, values)
        got, nan = out.cpu(), expected.isnan()
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        results[f"{name}-{dtype_name}"] = {
            "ran": ran, "nan_places": bool(torch.equal(got.isnan(), nan)),
            "same_bits": bool(torch.equal(got.masked_fill(nan, 0).view(bits), expected.masked_fill(nan, 0).view(bits))),
            "nans": int(nan.sum()),
        }
for name in names:  # decode: a few rows against finite blocks, 40 output features (a partial last program)
    qtype = QType[name]
    raw = torch.from_numpy(random_bytes(qtype, (40, 512)))
    if name == "MXFP4":  # exponents near 1, as trained weights have (random ones overflow any product)
        blocks = raw.view(-1, 17)
        blocks[:, 0] = 124 + blocks[:, 0] % 8
    weight = dequantize(raw, qtype, (40, 512))
    for rows in (1, 3, 8):
        for dtype_name in dtypes:
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(getattr(torch, dtype_name))
            got = gguf_triton.matmul(x.to(device), raw.to(device), qtype, 40)
            expected = torch.nn.functional.linear(x.float(), weight)
            error = float((got.cpu() - expected).norm() / expected.norm()) if got is not None else None
            results[f"matmul-{name}-{rows}-{dtype_name}"] = {"ran": got is not None, "error": error,
                                                             "dtype": str(got.dtype) if got is not None else None}
for name in ("Q8_0", "Q4_K"):  # decode in a compiled graph: the kernel as an operator (on CUDA reached by the route)
    qtype = QType[name]
    raw = torch.from_numpy(random_bytes(qtype, (40, 512))).to(device)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    targets = []

    def backend(graph, inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes)
        return graph.forward

    if device == "cuda":
        decode = lambda x, raw: gguf_dequant.gpu_matmul(x, raw, qtype, 40)
    else:
        decode = lambda x, raw: torch.ops.streamwise.gguf_decode(x, raw, int(qtype), 40)
    torch._dynamo.reset()
    got = torch.compile(decode, fullgraph=True, backend=backend)(x, raw)
    expected = torch.nn.functional.linear(x.float(), dequantize(raw, qtype, (40, 512)))
    results[f"compiled-{name}"] = {"operator": any("gguf_decode" in target for target in targets),
                                   "error": float((got - expected).norm() / expected.norm()), "dtype": str(got.dtype)}
    if device == "cpu":  # torch's operator checks: the meta's shape and dtype against the kernel's
        torch.library.opcheck(torch.ops.streamwise.gguf_decode.default, (x, raw, int(qtype), 40))
print(json.dumps(results))
"""


def _checked(device: str, environment: dict) -> dict:
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", CHECK, device, ",".join(TYPES), ",".join(DTYPES)],
                          capture_output=True, text=True, timeout=600, cwd=tests, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    import os

    return _checked("cpu", {**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TYPES)
def test_each_kernel_writes_the_torch_kernels_bits_in_the_interpreter(interpreted, name, dtype):
    result = interpreted[f"{name}-{dtype}"]
    assert result["ran"] and result["nan_places"] and result["same_bits"], result
    assert result["nans"] > 0 or name == "MXFP4", result  # the special scales reached the output (E8M0 has no NaN)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TYPES)
def test_decode_multiplies_by_the_blocks_without_expanding_them_in_the_interpreter(interpreted, name, dtype):
    """A few rows times the weight's blocks, each expanded in registers: within 1e-5 (relative L2) of dequantize and
    `F.linear` in float32, the sum's order aside."""
    for rows in (1, 3, 8):
        result = interpreted[f"matmul-{name}-{rows}-{dtype}"]
        assert result["ran"] and result["dtype"] == "torch.float32" and result["error"] <= 1e-5, (rows, result)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_a_compiled_graph_decodes_through_the_kernels_operator(interpreted, name):
    """`streamwise::gguf_decode` in a graph traced whole (fullgraph), the decode kernel inside it (here in the
    interpreter; on CUDA reached through the GGUF layers' route, `gpu_matmul`), within the eager kernel's bound."""
    result = interpreted[f"compiled-{name}"]
    assert result["operator"] and result["dtype"] == "torch.float32" and result["error"] <= 1e-5, result


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need CUDA: the interpreter checks "
                    "the same kernels above")
def test_each_kernel_compiled_writes_the_torch_kernels_bits_on_cuda():
    import os

    results = _checked("cuda", {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"})
    failed = {key: result for key, result in results.items() if not result.get("ran", result.get("operator")) or (
        result["error"] > 1e-5 if key.startswith(("matmul-", "compiled-"))
        else not (result["nan_places"] and result["same_bits"]))}
    assert not failed, failed


def test_a_cpu_never_takes_the_triton_kernels(monkeypatch):
    """Even with Triton installed: there it would run as its interpreter."""
    taken = []
    monkeypatch.setattr(gguf_triton, "dequantize", lambda *args: taken.append(args) or False)
    monkeypatch.setattr(gguf_triton, "matmul", lambda *args: taken.append(args))
    raw = torch.zeros(34 * 8, dtype=torch.uint8)
    gguf_dequant.dequantize(raw, gguf_dequant.QType.Q8_0, (8, 32))
    assert gguf_dequant.gpu_matmul(torch.ones(1, 32), raw, gguf_dequant.QType.Q8_0, 8) is None
    assert taken == [] and triton_support.available()  # in the test extra: installed, and still not taken
    assert {gguf_dequant.QType[name] for name in TYPES} <= gguf_triton.types()


def test_a_type_without_a_kernel_or_a_failing_kernel_leaves_the_torch_kernels(monkeypatch, caplog):
    """The caller expands with the torch kernels: a type no kernel here has, or a kernel that raises (said once)."""
    out = torch.empty(8, 256)
    assert not gguf_triton.dequantize(gguf_dequant.QType.IQ2_XXS, torch.zeros(8, 66, dtype=torch.uint8), out)

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no driver")
            return launch

    monkeypatch.setattr(gguf_triton._kernels(), "dequantize", Failing())
    monkeypatch.setattr(triton_support, "_failures", set())
    blocks = torch.zeros(8, 34, dtype=torch.uint8)
    for _ in range(2):
        assert not gguf_triton.dequantize(gguf_dequant.QType.Q8_0, blocks, torch.empty(8, 32))
    assert caplog.text.count("failed (no driver)") == 1


def test_the_expansion_is_an_operator_a_compiled_graph_calls_without_a_break():
    """`streamwise::gguf_expand`: its meta gives the output's shape and dtype, so a graph calls it opaquely (on CUDA
    the Triton kernel runs inside it; here the CPU kernels), the same numbers as eager, torch's operator checks pass."""
    raw = torch.from_numpy(random_bytes(gguf_dequant.QType.Q4_K, (4, 512)))

    def expand(blocks):
        return torch.ops.streamwise.gguf_expand(blocks, int(gguf_dequant.QType.Q4_K), 4, 512, torch.bfloat16)

    explained = torch._dynamo.explain(expand)(raw)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(expand, fullgraph=True, backend="aot_eager")
    expected = gguf_dequant.dequantize(raw, gguf_dequant.QType.Q4_K, (4, 512), torch.bfloat16)
    assert torch.equal(compiled(raw).view(torch.int16), expected.view(torch.int16))
    torch.library.opcheck(torch.ops.streamwise.gguf_expand.default, (raw, int(gguf_dequant.QType.Q4_K), 4, 512,
                                                                     torch.bfloat16))


def test_the_dequant_benchmark_runs_its_gpu_path_on_the_cpu():
    """`benchmarks/bench_dequant.py --dry-run`: the Triton kernels chosen as on a GPU, in their interpreter, timed
    beside the torch kernels, a copy and ComfyUI-GGUF's `dequant.py` (among the benchmark's inputs), every output
    checked: a GPU run cannot fail on a typo."""
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    done = subprocess.run([sys.executable, "bench_dequant.py", "--dry-run", "--types", "Q8_0", "Q4_K"], cwd=benchmarks,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "float32 at the copy's rate" in done.stdout and "4 of 4 bit-exact" in done.stdout, done.stdout[-2000:]
    assert "ComfyUI-GGUF: 795e451" in done.stdout and "comfyui bf16" in done.stdout, done.stdout[-2000:]  # its input
