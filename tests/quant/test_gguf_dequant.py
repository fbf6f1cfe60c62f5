"""The GGML dequantizers against gguf's numpy reference: bit-exact float32 on every type gguf dequantizes.

Bit-exact means the same float32 bits, compared as int32 so NaN payloads and signs count too: random
blocks with finite scales, and fully random bytes (NaN, Inf, subnormal and negative-zero scales). On the CPU both
paths are held to it: the torch kernels of every type, and numba's fused kernels of the types that have one.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys

import gguf
import numpy as np
import pytest
import torch
from forked import in_forked_child
from gguf_blocks import FLOATS, SCALE_OFFSETS, Q, as_on_a_gpu, random_bytes

import streamwise
from streamwise.runtime.quant import gguf_dequant, gguf_tables, numba_kernels, torch_openmp
from streamwise.runtime.quant.gguf_dequant import DEQUANTIZERS, STORED_FLOATS, UnsupportedQuantType, dequantize


def reference_dequantizes(qtype: Q) -> bool:
    """Whether the installed gguf package can dequantize `qtype` (the authoritative list)."""
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


GGUF_TYPES = [qtype for qtype in gguf.GGML_QUANT_SIZES if reference_dequantizes(qtype)]
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.TQ1_0, Q.TQ2_0, Q.MXFP4)  # gguf.quants.quantize has these
SHAPES = [(4, 256), (3, 512)]
SUPPORTED = [*FLOATS, *SCALE_OFFSETS]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
by_name = {"ids": lambda t: t.name}


try:
    from streamwise.runtime.quant import gguf_fused_cpu
except ImportError:  # numba is in the test extra: test_numba_is_installed_for_the_tests says so
    gguf_fused_cpu = None
FUSED = gguf_fused_cpu.TYPES if gguf_fused_cpu is not None else frozenset()


def on_each_cpu_path(qtypes) -> list:
    """(qtype, path) for the torch kernels of every type, and for numba's fused kernel of each type that has one."""
    return [pytest.param(qtype, path, id=f"{qtype.name}-{path}")
            for qtype in qtypes for path in ("torch", "fused") if path == "torch" or qtype in FUSED]


@pytest.fixture
def take(monkeypatch):
    """Makes `dequantize` on the CPU take the torch kernels, or the fused ones (and checks that they ran)."""
    fused_calls: list[str] = []

    def take(path: str) -> None:
        if path == "torch":
            monkeypatch.setattr(numba_kernels, "fused_dequant", lambda: None)
            return
        real = gguf_fused_cpu.dequantize
        monkeypatch.setattr(gguf_fused_cpu, "dequantize", lambda *args: real(*args) or fused_calls.append("ran"))
        fused_calls.append("expected")

    yield take
    assert "expected" not in fused_calls or "ran" in fused_calls, "the fused kernel never ran"


def same_bits(result: torch.Tensor, expected: torch.Tensor) -> bool:
    return result.shape == expected.shape and torch.equal(result.view(torch.int32), expected.view(torch.int32))


def reference(raw: np.ndarray, qtype: Q, finite: bool = True) -> torch.Tensor:
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.dequantize(raw, qtype)
    assert np.isnan(expected).any() != finite or qtype in (Q.MXFP4, Q.NVFP4)  # their scales have no NaN
    return torch.from_numpy(np.ascontiguousarray(expected))


def test_every_type_gguf_dequantizes_is_supported_and_nothing_else():
    assert len(GGUF_TYPES) == 26  # gguf 0.19; a newer gguf with more types fails here first
    assert set(STORED_FLOATS) == set(FLOATS)
    assert set(DEQUANTIZERS) == set(SCALE_OFFSETS) == set(GGUF_TYPES) - set(FLOATS)


def test_numba_is_installed_for_the_tests():
    assert gguf_fused_cpu is not None, "numba (in the test extra) is needed to test the fused CPU kernels"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("qtype", "path"), on_each_cpu_path(SUPPORTED))
def test_random_blocks_match_reference_bit_exactly(take, qtype, path, shape):
    take(path)
    raw = random_bytes(qtype, shape)
    result = dequantize(torch.from_numpy(raw), qtype, shape)
    assert result.dtype == torch.float32 and result.shape == shape
    assert same_bits(result, reference(raw, qtype))


def same_bits_and_nan_places(result: torch.Tensor, expected: torch.Tensor) -> bool:
    nan = expected.isnan()
    return torch.equal(result.isnan(), nan) and same_bits(result.masked_fill(nan, 0), expected.masked_fill(nan, 0))


@pytest.mark.parametrize(("qtype", "path"), on_each_cpu_path(SUPPORTED))
def test_fully_random_bytes_match_reference_bit_for_bit(take, qtype, path):
    """NaN and Inf scales, and subnormal ones: every NaN keeps the reference's sign and payload.

    Stored F16 values are NaN where the reference's are, but widened by torch's own conversion (fast),
    which quiets signalling NaNs; every other value is bit-exact.
    """
    take(path)
    raw = random_bytes(qtype, (4, 512), seed=3, finite=False)
    result, expected = dequantize(torch.from_numpy(raw), qtype, (4, 512)), reference(raw, qtype, finite=False)
    assert (same_bits_and_nan_places if qtype == Q.F16 else same_bits)(result, expected)


@pytest.mark.parametrize(("qtype", "path"), on_each_cpu_path(QUANTIZABLE))
def test_quantized_data_matches_reference_bit_exactly(take, qtype, path):
    take(path)
    data = np.random.default_rng(1).standard_normal((4, 256), dtype=np.float32)
    raw = gguf.quants.quantize(data, qtype)
    assert same_bits(dequantize(torch.from_numpy(raw), qtype, data.shape), reference(raw, qtype))


needs_fused = pytest.mark.skipif(gguf_fused_cpu is None, reason="needs numba (test_numba_is_installed_for_the_tests)")


@needs_fused
def test_the_fused_kernels_split_a_large_tensor_over_torch_threads_and_leave_torch_its_thread_count(monkeypatch):
    """Ranges of blocks run on torch's own OpenMP workers, as many as torch uses, claimed as they go."""
    raw = random_bytes(Q.Q4_K, (64, 16384), finite=False)  # 4096 blocks: room for two threads' ranges
    expected = reference(raw, Q.Q4_K, finite=False)
    asked, run = [], torch_openmp.run
    monkeypatch.setattr(torch_openmp, "run", lambda task, data, threads: run(task, data, threads) or asked.append(
        threads))
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            assert same_bits(dequantize(torch.from_numpy(raw), Q.Q4_K, (64, 16384)), expected)
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert asked == [2, 1]


@needs_fused
def test_the_fused_kernels_refuse_arrays_they_would_run_past():
    """The native task trusts its descriptor: a wrong output or stride is refused before it runs."""
    blocks = random_bytes(Q.Q8_0, (4, 256)).reshape(-1, 34)
    half = gguf_tables.CPU_TABLES["f16"].numpy()
    for wrong_out in (np.empty((31, 32), np.float32), np.empty((32, 32), np.float64),
                      np.empty((32, 64), np.float32)[:, ::2]):
        with pytest.raises(ValueError, match="Q8_0 dequant needs C-contiguous"):
            gguf_fused_cpu.dequantize(Q.Q8_0, blocks, wrong_out, half)
    with pytest.raises(ValueError, match="strided"):
        gguf_fused_cpu.dequantize(Q.Q8_0, np.repeat(blocks, 2, axis=0)[::2], np.empty((32, 32), np.float32), half)


def test_a_tracer_records_the_torch_kernels():
    """make_fx traces real tensors through a dispatch mode: a native call there would leave an empty buffer in the
    graph, so the torch kernels run and the traced graph computes the values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    raw = random_bytes(Q.Q4_K, (4, 512), seed=3)
    graph = make_fx(lambda b: dequantize(b, Q.Q4_K, (4, 512)))(torch.from_numpy(raw))
    assert same_bits(graph(torch.from_numpy(raw)), reference(raw, Q.Q4_K))


@needs_fused
def test_the_fused_kernels_are_right_on_concurrent_threads():
    raws = {qtype: random_bytes(qtype, (32, 16384), seed=5) for qtype in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS)}

    def check(qtype):
        blocks, expected = torch.from_numpy(raws[qtype]), reference(raws[qtype], qtype)
        return all(same_bits(dequantize(blocks, qtype, (32, 16384)), expected) for _ in range(4))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, raws))


def test_without_numba_the_torch_kernels_expand_every_type(monkeypatch):
    """numba is optional: where it is missing (or not built for this numpy), the import fails and the torch kernels
    serve every type, with the same bits."""
    import streamwise.runtime.quant as quant

    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.delitem(sys.modules, "streamwise.runtime.quant.gguf_fused_cpu", raising=False)
    monkeypatch.delattr(quant, "gguf_fused_cpu", raising=False)
    numba_kernels.fused_dequant.cache_clear()
    try:
        for qtype in FUSED or SCALE_OFFSETS:
            raw = random_bytes(qtype, (4, 512), seed=3, finite=False)
            assert same_bits(dequantize(torch.from_numpy(raw), qtype, (4, 512)), reference(raw, qtype, finite=False))
        assert numba_kernels.fused_dequant() is None
    finally:
        numba_kernels.fused_dequant.cache_clear()


@needs_fused
def test_a_numba_that_cannot_build_the_kernels_leaves_the_torch_kernels_and_says_so(monkeypatch, caplog):
    import numba

    import streamwise.runtime.quant as quant

    def failing(*args, **kwargs):
        raise ValueError("LLVM could not compile it")

    monkeypatch.setattr(numba, "cfunc", failing)
    monkeypatch.delitem(sys.modules, "streamwise.runtime.quant.gguf_fused_cpu")
    monkeypatch.delattr(quant, "gguf_fused_cpu")
    numba_kernels.fused_dequant.cache_clear()
    try:
        raw = random_bytes(Q.Q4_K, (4, 512), seed=3)
        with caplog.at_level("WARNING", logger="streamwise.quant"):
            assert same_bits(dequantize(torch.from_numpy(raw), Q.Q4_K, (4, 512)), reference(raw, Q.Q4_K))
        assert "LLVM could not compile it" in caplog.text and "the torch kernels" in caplog.text
    finally:
        numba_kernels.fused_dequant.cache_clear()


def _dequantize_in_child(raw: np.ndarray) -> np.ndarray:
    torch.set_num_threads(2)  # asks for torch's workers, whatever the machine
    return dequantize(torch.from_numpy(raw), Q.Q4_K, (64, 16384)).numpy()


@needs_fused
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_process_forked_after_the_fused_kernels_ran_on_threads_can_still_dequantize():
    """An OpenMP runtime's workers are not carried over a fork: the child runs the kernels on its one thread."""
    raw = random_bytes(Q.Q4_K, (64, 16384))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        dequantize(torch.from_numpy(raw), Q.Q4_K, (64, 16384))  # the parent's threads started
    finally:
        torch.set_num_threads(before)
    exitcode, result = in_forked_child(_dequantize_in_child, raw)
    assert exitcode == 0 and result is not None
    assert same_bits(torch.from_numpy(result), reference(raw, Q.Q4_K))


def test_flat_blocks_give_the_same_values():
    raw = random_bytes(Q.Q4_K, (3, 512))
    flat = torch.from_numpy(raw).reshape(-1)
    assert torch.equal(dequantize(flat, Q.Q4_K, (3, 512)), dequantize(torch.from_numpy(raw), Q.Q4_K, (3, 512)))


@pytest.mark.parametrize("n_blocks", [1, 3], ids=lambda n: f"{n}-blocks")
@pytest.mark.parametrize(("qtype", "path"), on_each_cpu_path(SUPPORTED))
def test_blocks_at_an_odd_offset_or_stride_give_the_same_values(take, qtype, path, n_blocks):
    """Bytes sliced out of a larger buffer (a file map, a packed record): no alignment is promised."""
    take(path)
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    shape = (n_blocks, block_size)
    raw = random_bytes(qtype, shape)
    expected = reference(raw, qtype)
    flat = torch.from_numpy(raw.copy()).reshape(-1)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]
    strided = torch.stack([flat, torch.zeros_like(flat)], dim=1).reshape(-1)[::2]
    assert shifted.storage_offset() == 1 and strided.stride() == (2,)
    assert same_bits(dequantize(shifted, qtype, shape), expected)
    assert same_bits(dequantize(strided, qtype, shape), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ2_S, Q.IQ4_XS, Q.NVFP4, Q.BF16], **by_name)
def test_output_dtype_is_the_float32_result_cast(qtype, dtype):
    blocks = torch.from_numpy(random_bytes(qtype, (4, 256)))
    result = dequantize(blocks, qtype, (4, 256), dtype=dtype)
    assert result.dtype == dtype
    assert torch.equal(result, dequantize(blocks, qtype, (4, 256)).to(dtype))


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.Q8_K, Q.F64], **by_name)
def test_unsupported_type_is_named(qtype):
    with pytest.raises(UnsupportedQuantType, match=qtype.name) as error:
        dequantize(torch.zeros(1024, dtype=torch.uint8), qtype, (4, 256))
    assert isinstance(error.value, ValueError)
    assert "IQ4_XS" in str(error.value) and "BF16" in str(error.value)


@pytest.mark.parametrize("qtype", SUPPORTED, **by_name)
def test_empty_tensor_gives_an_empty_result(qtype):
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    result = dequantize(torch.zeros(0, dtype=torch.uint8), qtype, (0, block_size), dtype=torch.bfloat16)
    assert result.shape == (0, block_size) and result.dtype == torch.bfloat16


def test_wrong_byte_count_is_rejected():
    raw = torch.from_numpy(random_bytes(Q.Q8_0, (4, 256)))
    with pytest.raises(streamwise.Error, match="needs 1088 bytes, got 1054") as caught:
        dequantize(raw.reshape(-1)[:-34], Q.Q8_0, (4, 256))
    assert isinstance(caught.value, ValueError)  # as it was before it was a streamwise.Error


def test_rows_must_hold_whole_blocks():
    with pytest.raises(streamwise.Error, match="blocks of 256"):
        dequantize(torch.zeros(144 * 2, dtype=torch.uint8), Q.Q4_K, (4, 128))


def test_blocks_must_be_bytes():
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(256, dtype=torch.int8), Q.Q8_0, (8, 32))


@CUDA
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "random-bytes"])
@pytest.mark.parametrize("qtype", SUPPORTED, **by_name)
def test_cuda_matches_reference_bit_exactly(qtype, finite):
    """The same code on CUDA tensors. CUDA arithmetic returns one canonical NaN, so there NaNs match by place."""
    raw = random_bytes(qtype, (3, 512), seed=2, finite=finite)
    result = dequantize(torch.from_numpy(raw).cuda(), qtype, (3, 512))
    assert result.is_cuda
    expected = reference(raw, qtype, finite)
    if finite:
        assert same_bits(result.cpu(), expected)
    else:
        assert same_bits_and_nan_places(result.cpu(), expected)


@CUDA
@pytest.mark.parametrize("qtype", SCALE_OFFSETS, **by_name)
def test_cuda_kernels_compiled_by_inductor_have_no_graph_break_and_the_same_bits(qtype):
    """Where a compiled model dequantizes on a GPU: with its tables on the device (a compiled region copies them
    first), no graph break, and inductor's fused kernels give the eager bits (a fused multiply-add would not)."""
    blocks = torch.from_numpy(random_bytes(qtype, (64, 256), seed=4)).cuda()
    gguf_dequant.prepare(blocks.device)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda b: dequantize(b, qtype, (64, 256)))(blocks)
    assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    compiled = torch.compile(lambda b: dequantize(b, qtype, (64, 256)))(blocks)
    assert same_bits(compiled.cpu(), dequantize(blocks, qtype, (64, 256)).cpu())


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "random-bytes"])
@pytest.mark.parametrize("qtype", SCALE_OFFSETS, **by_name)
def test_the_gpu_kernels_compute_the_same_numbers_on_the_cpu(monkeypatch, qtype, finite):
    """What runs on a GPU (scales widened by torch's own conversion, integers cast inside the product), run here:
    bit-exact but for NaN payloads, which a GPU's arithmetic does not keep."""
    as_on_a_gpu(monkeypatch)
    raw = random_bytes(qtype, (3, 512), seed=3, finite=finite)
    result = dequantize(torch.from_numpy(raw), qtype, (3, 512))
    expected = reference(raw, qtype, finite)
    assert same_bits(result, expected) if finite else same_bits_and_nan_places(result, expected)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.TQ2_0],
                         **by_name)
def test_the_gpu_kernels_of_the_common_types_trace_without_graph_breaks(monkeypatch, qtype):
    """Off the CPU the legacy and K-quant kernels read no lookup table in a compiled graph (a device's table is made
    outside it, which breaks the graph): their fields' shifts are made in the graph."""
    as_on_a_gpu(monkeypatch, tables_as_a_devices=True)
    blocks = torch.from_numpy(random_bytes(qtype, (4, 256)))
    explained = torch._dynamo.explain(lambda b: dequantize(b, qtype, (4, 256)))(blocks)
    assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    compiled = torch.compile(lambda b: dequantize(b, qtype, (4, 256)), backend="aot_eager")(blocks)
    assert same_bits(compiled, reference(blocks.numpy(), qtype, True))


@pytest.mark.parametrize("qtype", [Q.IQ1_S, Q.IQ2_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.NVFP4], **by_name)
def test_the_gpu_lookup_kernels_trace_without_graph_breaks_once_their_tables_are_on_the_device(monkeypatch, qtype):
    """A device's lookup tables are copied there outside any graph, once; a graph traced after that reads them as
    inputs, with no break."""
    as_on_a_gpu(monkeypatch, tables_as_a_devices=True)
    blocks = torch.from_numpy(random_bytes(qtype, (4, 256)))
    dequantize(blocks, qtype, (4, 256))  # an eager call copies them
    explained = torch._dynamo.explain(lambda b: dequantize(b, qtype, (4, 256)))(blocks)
    assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    compiled = torch.compile(lambda b: dequantize(b, qtype, (4, 256)), backend="aot_eager")(blocks)
    assert same_bits(compiled, reference(blocks.numpy(), qtype, True))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.IQ2_S, Q.IQ4_XS, Q.TQ1_0, Q.NVFP4], **by_name)
def test_table_and_tq_kernels_trace_without_graph_breaks(qtype):
    """Residents compile: the lookup tables (float16 scales widen through one on CPU) are module constants there,
    and no op writes a strided `out=`."""
    blocks = torch.from_numpy(random_bytes(qtype, (4, 256)))
    explained = torch._dynamo.explain(lambda b: dequantize(b, qtype, (4, 256)))(blocks)
    assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.F16, Q.BF16], ids=by_name["ids"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_expansion_given_room_is_written_there_with_the_same_bits(qtype, dtype):
    """`out`: bytes a caller reuses (a tree's expansion buffer), larger than the weight; stored floats read as their
    own dtype stay a view of the blocks."""
    raw = torch.from_numpy(random_bytes(qtype, (4, 256)))
    room = torch.full((4 * 256 * 4 + 100,), 0xAB, dtype=torch.uint8)
    result = dequantize(raw, qtype, (4, 256), dtype, out=room)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32  # NaN payloads and signs count
    assert torch.equal(result.view(bits), dequantize(raw, qtype, (4, 256), dtype).view(bits))
    viewed = STORED_FLOATS.get(qtype) == dtype
    assert (result.data_ptr() == room.data_ptr()) != viewed
    assert room[result.nbytes:].eq(0xAB).all()  # nothing past the weight written
