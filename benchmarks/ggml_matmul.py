"""`ggml_mul_mat` of the libggml that llama-cpp-python built, called through ctypes on raw GGML blocks: the peer of
each Streamwise CPU kernel on the same blocks and inputs (bench_llama_cpp.py).

Blocks are used as they are, not repacked as llama.cpp repacks some types at load (`REPACK` in its system info), so
llama.cpp itself may be faster still. One graph holds `repeat` products of the same operands, so that the
thread pool ggml starts for each computation is paid once per `repeat` matmuls.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}


class _Parameters(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """libggml-base and libggml-cpu from `folder` (llama-cpp-python's `lib`, or where `LLAMA_CPP_LIB_PATH` points)."""

    def __init__(self, folder: Path) -> None:
        pointer = ctypes.c_void_p
        self.base = ctypes.CDLL(str(folder / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(folder / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        for name, arguments, result in (
                ("ggml_init", [_Parameters], pointer), ("ggml_free", [pointer], None),
                ("ggml_new_tensor_2d", [pointer, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], pointer),
                ("ggml_mul_mat", [pointer, pointer, pointer], pointer), ("ggml_new_graph", [pointer], pointer),
                ("ggml_build_forward_expand", [pointer, pointer], None), ("ggml_get_data", [pointer], pointer)):
            function = getattr(self.base, name)
            function.argtypes, function.restype = arguments, result
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [pointer, pointer, ctypes.c_int]
        self.cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        self.cpu.ggml_cpu_init()

    def matmul(self, blocks: np.ndarray, qtype: str, out_features: int, x: np.ndarray, threads: int, repeat: int,
               runs: int) -> tuple[np.ndarray, list[float]]:
        """x (M, K) float32 · Wᵀ, W given as raw `qtype` blocks of `out_features` rows: the product and the seconds
        of each of `runs` timed matmuls (each the mean of `repeat` in one graph)."""
        m, k = x.shape
        base = self.base
        context = base.ggml_init(_Parameters(blocks.nbytes + x.nbytes + repeat * m * out_features * 4 + 2**26, None,
                                             False))
        try:
            weight = base.ggml_new_tensor_2d(context, _TYPES[qtype], k, out_features)
            rows = base.ggml_new_tensor_2d(context, _TYPES["F32"], k, m)
            ctypes.memmove(base.ggml_get_data(weight), blocks.ctypes.data, blocks.nbytes)
            ctypes.memmove(base.ggml_get_data(rows), np.ascontiguousarray(x, np.float32).ctypes.data, x.nbytes)
            graph = base.ggml_new_graph(context)
            products = [base.ggml_mul_mat(context, weight, rows) for _ in range(repeat)]
            for product in products:
                base.ggml_build_forward_expand(graph, product)
            seconds = []
            for _ in range(runs):
                start = time.perf_counter()
                self.cpu.ggml_graph_compute_with_ctx(context, graph, threads)
                seconds.append((time.perf_counter() - start) / repeat)
            data = ctypes.cast(base.ggml_get_data(products[0]), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(data, (m, out_features)).copy(), seconds
        finally:
            base.ggml_free(context)
