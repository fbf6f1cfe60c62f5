"""The quantized zoo (#34): every transformers `*ForCausalLM`, `*ForConditionalGeneration` and base-model class, and
every diffusers model class, shrunk to widths of 256, under every quant format by the route users take, compared with
the float model; plus the hand-built cases of `tests/quantized_zoo.py` (encoder-decoder, encoders, vision, speech,
diffusers).

    python benchmarks/quantized_zoo.py --out benchmarks/results/quantized_zoo-DATE [--families causal-lm ...]
        [--limit N] [--timeout S]

Each class runs its formats in a child process bounded by `--timeout` seconds a case, each result one JSON line
appended to `OUT.jsonl`, so a run that stops resumes at the next class; `OUT.md` is written from all lines after
every class: per format, the classes tried, within the envelope, outside (with the cosine), errors (a refusal's
message or a failure's), timeouts, and per case the share of weight bytes quantized. Every class gets token ids
(and decoder ids where its config is an encoder-decoder's); a diffusers class gets the first of a few input layouts
it runs on (`diffusers_inputs`). A class whose default config does not build, or does not run on those inputs, at the
small size (`no-build`: the library's own constraints, or a model that needs images or audio) is listed, never hidden.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SMALL = {  # on the config and every sub-config holding the attribute: widths of 256, two layers
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim"), 256),
    **dict.fromkeys(("intermediate_size", "d_ff", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim"), 512),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 256),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), 4),
    "num_key_value_heads": 2, "head_dim": 64, "d_kv": 64, "vocab_size": 512,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4), "num_experts_per_tok": 2,
}


DIFFUSERS_SMALL = {  # on a diffusers model's `__init__` argument whose default is an int
    **dict.fromkeys(("num_layers", "num_single_layers", "num_refiner_layers", "num_blocks", "depth", "n_layers",
                     "n_refiner_layers", "num_transformer_layers", "num_encoder_layers", "num_decoder_layers",
                     "num_noise_refiner_layers", "num_context_refiner_layers", "num_visual_blocks", "num_text_blocks",
                     "num_text_layers"), 2),
    **dict.fromkeys(("layers_per_block", "transformer_layers_per_block"), 1),
    **dict.fromkeys(("cross_attention_dim", "joint_attention_dim", "caption_channels", "text_dim", "text_embed_dim",
                     "pooled_projection_dim", "caption_projection_dim", "encoder_hid_dim", "hidden_size", "inner_dim",
                     "freq_dim", "time_embed_dim", "cap_feat_dim", "text_hidden_dim", "context_dim", "context_in_dim",
                     "dim", "model_dim", "in_text_dim", "in_text_dim2", "time_dim"), 256),
    **dict.fromkeys(("ffn_dim", "intermediate_size", "ff_inner_dim", "mlp_hidden_dim", "ff_dim",
                     "text_intermediate_size"), 512),
    "sample_size": 8, "max_text_seq_len": 8,
}
"""Two layers and widths of 256; every head count is then set so that heads x the head width is 256 (`HEADS`)."""
HEADS = ("num_attention_heads", "num_heads", "n_heads", "n_kv_heads", "num_key_value_heads",
         "text_num_attention_heads", "text_num_key_value_heads")
"""Head counts: the head width stays the class's own (`attention_head_dim`, else the sum of its rotary axes, which
are sized to it, else 64)."""

FAMILIES = ("causal-lm", "conditional-generation", "base-model", "diffusers")


def class_names(family: str) -> list[str]:
    """The transformers classes of `family`, by name."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    if family == "diffusers":
        import diffusers

        return sorted(name for name in dir(diffusers) if isinstance(getattr(diffusers, name, None), type)
                      and issubclass(getattr(diffusers, name), diffusers.ModelMixin)
                      and getattr(diffusers, name) is not diffusers.ModelMixin)
    if family == "base-model":
        names = {name for value in MODEL_MAPPING_NAMES.values()
                 for name in ((value,) if isinstance(value, str) else value)}
    else:
        suffix = "ForCausalLM" if family == "causal-lm" else "ForConditionalGeneration"
        names = {name for name in dir(transformers) if name.endswith(suffix)}
    return sorted(name for name in names if not name.startswith("Auto") and hasattr(transformers, name))


def sample(names: list[str], count: int | None) -> list[str]:
    """`count` of `names`, evenly spaced (all without a count)."""
    if count is None or count >= len(names):
        return names
    return [names[index * len(names) // count] for index in range(count)]


def small_model(name: str):
    """The class at a small size, and one forward's inputs; raises where the library's config does not shrink."""
    import torch
    import transformers

    cls = getattr(transformers, name)
    config = cls.config_class()
    for holder in [config, *(v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig))]:
        for key, value in SMALL.items():
            if isinstance(getattr(holder, key, None), int):
                setattr(holder, key, value)
        for key, value in list(vars(holder).items()):  # per-layer lists (`layer_types`, `mlp_layer_types`)
            if key.endswith("layer_types") and isinstance(value, list):
                setattr(holder, key, value[:2])
    torch.manual_seed(0)
    model = cls(config).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    inputs = dict(input_ids=ids)
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids[:, :4]
    return model, inputs


def small_diffusers(name: str):
    """A diffusers model class at a small size (`DIFFUSERS_SMALL` on its defaults), and the first input layout it runs
    on; raises with the last layout's error where none does."""
    import inspect

    import diffusers
    import torch

    cls = getattr(diffusers, name)
    defaults = {key: p.default for key, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    config = {key: DIFFUSERS_SMALL[key] for key, value in defaults.items()
              if key in DIFFUSERS_SMALL and isinstance(value, int) and not isinstance(value, bool)}
    channels = defaults.get("block_out_channels")
    if isinstance(channels, tuple) and channels and all(isinstance(c, int) for c in channels):
        config["block_out_channels"] = (256,) * len(channels)
    head = defaults.get("attention_head_dim")
    rope = next((defaults[k] for k in ("axes_dims_rope", "axes_dims", "rope_dim_list")
                 if isinstance(defaults.get(k), (tuple, list))), None)
    width = head if isinstance(head, int) and head >= 32 else sum(rope) if rope else 64
    config.update({heads: max(1, 256 // width) for heads in HEADS if isinstance(defaults.get(heads), int)})
    torch.manual_seed(0)
    model = cls(**config).eval()
    errors = []
    for layout, inputs in diffusers_inputs(model):
        try:
            with torch.no_grad():
                model(**inputs)
            return model, inputs
        except Exception as exc:  # the next layout
            errors.append(f"as {layout}: {type(exc).__name__}: {str(exc)[:100]}")
    raise ValueError("; ".join(errors))


def diffusers_inputs(model):
    """(name, inputs) layouts for a diffusers model's forward, by its parameters' names: the latents as an image, a
    video (channels or frames first), a token sequence and a signal (8 x 8 pixels, 2 frames, 16 tokens, 64 samples),
    8 text tokens as wide as the config's text width, a timestep, and where named: pooled text, rotary ids, guidance
    (where the config embeds it), masks."""
    import inspect

    import torch

    config, wanted = model.config, inspect.signature(model.forward).parameters
    channels = next((config[k] for k in ("in_channels", "latent_channels", "num_channels") if
                     isinstance(config.get(k), int)), 4)
    text = next((config[k] for k in ("joint_attention_dim", "cross_attention_dim", "caption_channels", "text_dim",
                                     "text_embed_dim", "encoder_hid_dim", "cap_feat_dim", "context_dim")
                 if isinstance(config.get(k), int)), 256)
    pooled = next((config[k] for k in ("pooled_projection_dim", "projection_class_embeddings_input_dim")
                   if isinstance(config.get(k), int)), 256)
    latent_key = next((k for k in ("hidden_states", "sample", "x", "latents") if k in wanted), None)
    for layout, latents, tokens in (("an image", (1, channels, 8, 8), 16), ("a video", (1, channels, 2, 8, 8), 32),
                                    ("frames", (1, 2, channels, 8, 8), 32), ("tokens", (1, 16, channels), 16),
                                    ("a signal", (1, channels, 64), 16)):
        g = torch.Generator().manual_seed(1)
        inputs = {latent_key: torch.randn(*latents, generator=g)} if latent_key else {}
        extras = {
            "timestep": torch.tensor([10.0]), "timesteps": torch.tensor([10.0]),
            "encoder_hidden_states": torch.randn(1, 8, text, generator=g),
            "pooled_projections": torch.randn(1, pooled, generator=g),
            "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(8, 3),
            "encoder_attention_mask": torch.ones(1, 8),
            **({"guidance": torch.tensor([3.5])} if config.get("guidance_embeds") else {}),
        }
        inputs.update({k: v for k, v in extras.items() if k in wanted})
        missing = [k for k, p in wanted.items() if p.default is inspect.Parameter.empty and k not in inputs
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if missing:
            raise ValueError(f"its forward needs {', '.join(missing)}, which no input layout here gives")
        yield layout, inputs


MEMORY = 6 << 30
"""The most a case's process may allocate: a class the generic shrink leaves huge (Qwen3-Omni-MoE's talker took 23 GB
and the kernel's OOM killer) fails alone with a MemoryError, instead of starving everything else on the machine."""


def _child(name: str, queue) -> None:
    """Every format for one class, in one process (imports once), its memory bounded; each result put as it comes."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (MEMORY, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    except (ImportError, ValueError, OSError):  # not on this platform: bounded by time alone
        pass
    import quantized_zoo

    if name not in quantized_zoo.CASES:
        import transformers

        small = small_model if hasattr(transformers, name) else small_diffusers
        try:
            quantized_zoo.output(*small(name))  # the float model itself must build and run small
        except Exception as exc:
            queue.put(dict(case=name, format="*", outcome="no-build", detail=f"{type(exc).__name__}: {exc}"[:200]))
            return
        quantized_zoo.CASES[name] = lambda: small(name)
    for fmt in quantized_zoo.FORMATS:
        try:
            with tempfile.TemporaryDirectory() as workdir:
                result = quantized_zoo.run_case(name, fmt, Path(workdir))
            result["outcome"] = "within" if result.pop("within") else "outside"
        except Exception as exc:  # a refusal with its message, or a failure: both recorded with what was said
            result = dict(case=name, format=fmt, outcome="error", detail=f"{type(exc).__name__}: {exc}"[:300])
        queue.put(result)


def run(name: str, timeout: float) -> list[dict]:
    """The results of `name` under every format, within `timeout` seconds for all of them."""
    import quantized_zoo

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child, args=(name, queue))
    child.start()
    results, deadline = [], time.monotonic() + timeout
    expected = len(quantized_zoo.FORMATS)
    while len(results) < expected and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=max(0.1, min(1.0, deadline - time.monotonic()))))
        except Exception:  # nothing yet (queue.Empty), or the child is gone
            if not child.is_alive() and queue.empty():
                break
        if results and results[-1]["outcome"] == "no-build":
            break
    timed_out = child.is_alive()
    if timed_out:
        child.kill()
    child.join()
    finished = {r["format"] for r in results}
    if not (results and results[-1]["outcome"] == "no-build"):
        results += [dict(case=name, format=fmt, outcome="timeout" if timed_out else "error",
                         detail=f"unfinished (exit {child.exitcode})")
                    for fmt in quantized_zoo.FORMATS if fmt not in finished]
    return results


def report(lines: list[dict]) -> str:
    import quantized_zoo

    formats = quantized_zoo.FORMATS
    out = ["# Quantized zoo", "", "Envelope (cosine with the float model): "
           + ", ".join(f"{f} >= {quantized_zoo.ENVELOPE[f]}" for f in formats), "",
           "| format | tried | within | outside | error | timeout |", "|---|---|---|---|---|---|"]
    for fmt in formats:
        counts = {k: sum(1 for r in lines if r["format"] == fmt and r["outcome"] == k)
                  for k in ("within", "outside", "error", "timeout")}
        out.append(f"| {fmt} | {sum(counts.values())} | {counts['within']} | {counts['outside']} | {counts['error']} "
                   f"| {counts['timeout']} |")
    no_build = sorted(r["case"] for r in lines if r["outcome"] == "no-build")
    out += ["", f"Classes that do not build or run at the small size (the library's own constraints): "
            f"{len(no_build)}: " + ", ".join(no_build)]
    out += ["", "| case | format | outcome | cosine | quantized share | budget 0 = resident | detail |",
            "|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in lines if r["outcome"] != "no-build"),
                    key=lambda r: (r["outcome"] == "within", r["case"], r["format"])):
        cos = f"{r['cosine']:.5f}" if "cosine" in r else "-"
        share = f"{r['quantized_share']:.2f}" if "quantized_share" in r else "-"
        out.append(f"| {r['case']} | {r['format']} | {r['outcome']} | {cos} | {share} | "
                   f"{r.get('budget0_identical', '-')} | {r.get('detail', '')} |")
    return "\n".join(out) + "\n"


def main() -> None:
    import quantized_zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results base path (.jsonl and .md appended)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--limit", type=int, default=None,
                        help="N classes of each family, evenly spaced in name order (a sample)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds per case (a class: every format's)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = Path(args.out + ".jsonl")
    done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    seen = {(r["case"], r["format"]) for r in done}
    names = [*quantized_zoo.CASES,
             *(name for family in args.families for name in sample(class_names(family), args.limit))]
    for name in dict.fromkeys(names):
        if any(case == name for case, _ in seen):
            continue
        for result in run(name, args.timeout * len(quantized_zoo.FORMATS)):
            done.append(result)
            with results.open("a") as handle:
                handle.write(json.dumps(result) + "\n")
            print(f"{name} {result['format']}: {result['outcome']} {result.get('cosine', '')}", flush=True)
        Path(args.out + ".md").write_text(report(done))  # after every class: a run stopped anywhere has its table
    Path(args.out + ".md").write_text(report(done))
    print(f"wrote {args.out}.jsonl and {args.out}.md")


if __name__ == "__main__":
    main()
