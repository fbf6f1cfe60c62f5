"""`streamwise demo`: the whole pipeline on small real models, offline, in well under a minute.

A tiny transformers Qwen2 and a tiny VibeVoice acoustic tokenizer get random weights, are saved
as safetensors and as GGUF Q8_0, and are loaded back into skeletons with the shipped policies
under a small memory budget with the standalone host. Each is run against its eager reference.
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

import torch

from ...schemas import Policy, QuantRule, QuantSection, Selector
from ..checkpoint.fill import load
from ..checkpoint.gguf_writer import quantize_to_gguf
from ..checkpoint.skeleton import skeleton
from ..hosts.standalone import offload
from ..plan.resolve import resolve
from ..policy.load import load_policy


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


def _run_qwen(model, inputs):
    return model.generate(inputs, max_new_tokens=16, do_sample=False)


def _run_tokenizer(model, audio):
    latents = model.encode(audio, sample=False).latents
    return model.decode(latents).audio


def with_q8_0(policy: Policy) -> Policy:
    """The shipped policy plus a rule that keeps every Linear as a GGUF Q8_0 resident."""
    rule = QuantRule(id="demo-q8_0", select=Selector(**{"class": "Linear"}), format="gguf", gguf_type="Q8_0")
    return policy.model_copy(update={"quant": QuantSection(rule=(rule,))})


CASES = {
    "qwen2": (
        _qwen2, "decoder-llm",
        lambda: torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0)), _run_qwen,
    ),
    "vibevoice-tokenizer": (
        _tokenizer, "vibevoice",
        lambda: torch.randn(1, 1, 512, generator=torch.Generator().manual_seed(0)), _run_tokenizer,
    ),
}


def run_demo(print=print, budget_fraction: float = 0.25) -> dict:
    torch.manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode(False), torch.no_grad():
        for name, (build, policy_name, make_input, run) in CASES.items():
            policy = load_policy(policy_name)
            reference_model = build()
            inputs = make_input()
            start = time.perf_counter()
            expected = run(reference_model, inputs)
            eager_seconds = time.perf_counter() - start
            directory = Path(folder) / name
            reference_model.save_pretrained(directory)
            gguf_path = directory / "model-q8_0.gguf"
            quantized = with_q8_0(policy)
            quantize_to_gguf(directory / "model.safetensors", gguf_path, quantized, reference_model)
            plan = resolve(policy, reference_model)
            summary = plan.summary()
            print(f"\n== {name}: policy `{policy.name}` on {plan.root_class.rsplit('.', 1)[-1]}")
            for role, classes in summary["modules"].items():
                print(f"   {role:<24} " + ", ".join(f"{c} x{n}" for c, n in classes.items()))
            print(f"   coverage {plan.coverage.fraction:.0%}: streamed {summary['bytes']['streamed']} B, "
                  f"relocated {summary['bytes']['relocated']} B, stranded {summary['bytes']['stranded']} B")
            total = summary["bytes"]["streamed"]
            for label, path, used in (
                ("safetensors", directory / "model.safetensors", policy),
                ("gguf q8_0", gguf_path, quantized),
            ):
                with skeleton():
                    model = build()
                loaded = load(model, path, used)
                report = offload(model, used, device="cpu", budget=int(total * budget_fraction))
                start = time.perf_counter()
                output = run(model, inputs)
                seconds = time.perf_counter() - start
                identical = bool(torch.equal(output, expected))
                if identical:
                    error = 0.0
                else:
                    error = float((output.float() - expected.float()).norm() / expected.float().norm())
                results[f"{name}/{label}"] = {"identical": identical, "relative_error": error, "seconds": seconds}
                print(f"   {label:<12} {path.stat().st_size:>9} B  residents {loaded.residents or '-'}  "
                      f"resident/streamed leaves {report.resident_modules}/{report.streamed_modules}  "
                      f"{'identical to eager' if identical else f'relative error {error:.2e} vs eager'}  "
                      f"{seconds * 1e3:.0f} ms (eager {eager_seconds * 1e3:.0f} ms)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak resident memory of this process: {peak:.0f} MiB")
    results["peak_rss_mib"] = peak
    return results
