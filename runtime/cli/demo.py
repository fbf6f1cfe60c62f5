"""`streamwise demo`: the whole pipeline on small real models, offline, in well under a minute.

A tiny transformers Qwen2 and a tiny VibeVoice acoustic tokenizer get random weights, are saved
as safetensors and as GGUF Q8_0, and are loaded back into skeletons with the shipped policies
under a small memory budget with the standalone host. Each is compared with its eager reference
the same way:
- the outputs of one forward: max and relative error (0 and 0: identical);
- for the LLM also greedy generation: how many new tokens agree;
- warm timings on both sides: the median of `RUNS` calls after one untimed call.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from ...schemas import Policy, QuantRule, QuantSection, Selector
from ..builders.skeleton import skeleton
from ..checkpoint.fill import load
from ..checkpoint.gguf_writer import quantize_to_gguf
from ..hosts.standalone import offload
from ..plan.resolve import resolve
from ..policy.load import load_policy
from ..sizes import human

RUNS = 5
NEW_TOKENS = 16


def _qwen2():
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


def _tokenizer():
    import transformers

    config = transformers.VibeVoiceAcousticTokenizerConfig(
        hidden_size=16, num_filters=8, downsampling_ratios=[2, 4], depths=[1, 1, 1], kernel_size=3,
        layer_scale_init_value=0.5,
    )
    return transformers.VibeVoiceAcousticTokenizerModel(config).eval()


def _qwen_forward(model, inputs):
    return model(inputs).logits


def _qwen_tokens(model, inputs):
    return model.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs.shape[1]:]


def _tokenizer_forward(model, audio):
    latents = model.encode(audio, sample=False).latents
    return model.decode(latents).audio


def with_q8_0(policy: Policy) -> Policy:
    """The shipped policy plus a rule that keeps every Linear as a GGUF Q8_0 resident."""
    rule = QuantRule(id="demo-q8_0", select=Selector(**{"class": "Linear"}), format="gguf", gguf_type="Q8_0")
    return policy.model_copy(update={"quant": QuantSection(rule=(rule,))})


class Case(NamedTuple):
    """One model of the demo: how to build it, its policy and input, its forward and (LLMs) its greedy tokens."""

    build: Callable[[], torch.nn.Module]
    policy: str
    make_input: Callable[[], torch.Tensor]
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    tokens: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None


CASES = {
    "qwen2": Case(_qwen2, "decoder-llm",
                  lambda: torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0)),
                  _qwen_forward, _qwen_tokens),
    "vibevoice-tokenizer": Case(_tokenizer, "vibevoice",
                                lambda: torch.randn(1, 1, 512, generator=torch.Generator().manual_seed(0)),
                                _tokenizer_forward),
}


def warm_seconds(call: Callable[[], object]) -> float:
    """The median of `RUNS` timed calls after one untimed call (which pays for first-call work on either side)."""
    call()
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(output: torch.Tensor, expected: torch.Tensor) -> dict:
    """Max and relative error of `output` against `expected` (both 0.0 when they are identical)."""
    difference = (output.float() - expected.float())
    return {"identical": bool(torch.equal(output, expected)), "max_error": float(difference.abs().max()),
            "relative_error": float(difference.norm() / expected.float().norm())}


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Other libraries' progress bars and notices off for the report (transformers' saving and generation)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def run_demo(print=print, budget_fraction: float = 0.25) -> dict:
    """Run every case; returns per case and format the comparison with eager and both warm timings."""
    torch.manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode(False), torch.no_grad(), quiet_libraries():
        for name, case in CASES.items():
            policy = load_policy(case.policy)
            reference_model = case.build()
            inputs = case.make_input()
            expected = case.forward(reference_model, inputs)
            expected_tokens = case.tokens(reference_model, inputs) if case.tokens else None
            eager_seconds = warm_seconds(functools.partial(case.forward, reference_model, inputs))
            directory = Path(folder) / name
            reference_model.save_pretrained(directory)
            gguf_path = directory / "model-q8_0.gguf"
            quantized = with_q8_0(policy)
            quantize_to_gguf(directory / "model.safetensors", gguf_path, quantized, reference_model)
            plan = resolve(policy, reference_model)
            budget = int(plan.coverage.bytes["streamed"] * budget_fraction)
            print(f"\n== {name}: " + plan.render(rules=False).replace("\n", "\n   "))
            print(f"   budget {human(budget)} ({budget_fraction:.0%} of the streamed bytes); eager forward "
                  f"{eager_seconds * 1e3:.1f} ms (warm, median of {RUNS})")
            for label, path, used in (
                ("safetensors", directory / "model.safetensors", policy),
                ("gguf q8_0", gguf_path, quantized),
            ):
                with skeleton():
                    model = case.build()
                loaded = load(model, path, used, progress=lambda done, total: None)
                report = offload(model, used, device="cpu", budget=budget)
                result = compare(case.forward(model, inputs), expected)
                result["seconds"] = warm_seconds(functools.partial(case.forward, model, inputs))
                result["eager_seconds"] = eager_seconds
                agreement = ""
                if expected_tokens is not None:
                    tokens = case.tokens(model, inputs)
                    result["tokens_agree"] = int((tokens == expected_tokens).sum())
                    agreement = f", {result['tokens_agree']}/{len(expected_tokens)} greedy tokens agree"
                results[f"{name}/{label}"] = result
                print(f"   {label:<12} {human(path.stat().st_size):>10}  residents {loaded.residents or '-'}  "
                      f"leaves resident/streamed {report.resident_modules}/{report.streamed_modules}  "
                      f"forward {result['seconds'] * 1e3:.1f} ms  max error {result['max_error']:.2e}, relative "
                      f"{result['relative_error']:.2e}{agreement}")
    peak = peak_rss_mib()
    shown = "unknown on this platform" if peak is None else f"{peak:.0f} MiB"
    print(f"\npeak resident memory of this process: {shown}")
    results["peak_rss_mib"] = peak
    return results


def peak_rss_mib() -> float | None:
    """This process's peak resident memory in MiB: `getrusage` on Unix (KiB on Linux, bytes on macOS), psutil's peak
    working set on Windows; None where neither is there."""
    try:
        import resource
    except ImportError:
        resource = None
    if resource is not None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1 << 20 if sys.platform == "darwin" else 1 << 10)
    try:
        import psutil
    except ImportError:
        return None
    try:
        peak = getattr(psutil.Process().memory_info(), "peak_wset", None)  # Windows' own peak figure
    except (psutil.Error, OSError):
        return None
    return None if peak is None else peak / (1 << 20)
