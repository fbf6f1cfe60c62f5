"""What only a GPU shows of the ComfyUI host, on a real core: copies beside their input through a real CUDA load
and unload, and a tree reading from its file loaded by core onto CUDA.

1. A tiny Qwen2 MODEL as the loader makes it (converted by `decoder-llm`) carrying a LoRA-style patch, and three
   copies of it: Apply under a float policy and under an
   int8 one (`adopt`), and the compile node's copy (`copied`). Core loads the input and the copies onto CUDA
   together (whole, then one copy in low-VRAM mode), every forward is compared, and after core unloads them all:
   the input's host weights are bit-identical to what they were, each float copy's weights share the input's host
   tensors again, and CUDA holds nothing of them.
2. The same model saved with `save_pretrained` and loaded under a host budget that leaves most blocks in their file:
   core loads it onto CUDA and it generates the tokens transformers' resident model does there.
3. The same model loaded whole with its host tier leased (viewing the page cache), loaded by core in low-VRAM mode
   (core v0.33+ pins offloaded weights where they lie, `cudaHostRegister`), then its file overwritten with zeros:
   the tokens stay transformers', and core's pins and unpins report no error.

Run on a CUDA machine, once per core (one core per process):

    python benchmarks/gpu_comfy.py --core PATH/TO/ComfyUI [--dynamic-vram] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import logging
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from leases import file_system, lease_folder, rewrite, viewing_file  # this folder's, as report's
from report import emit, section  # this folder's: every GPU benchmark hands over its figures alike

import streamwise  # before core is on the path: the engine alone, not the nodes (which need core's front end)
from streamwise.runtime.engine import file_tier as tier
from streamwise.runtime.hosts.comfyui import adopt, copied
from streamwise.runtime.policy.load import load_policy

CPU = torch.device("cpu")
INT8 = """schema_version = 1
[policy]
name = "int8-linears"
extends = "decoder-llm"
[[quant.rule]]
id = "q"
select = { class = "Linear" }
format = "int8"
"""


def boot(core: Path, device: torch.device, dynamic_vram: bool):
    """Core's model management and patcher, on `device` (`--cpu` where there is no GPU: a dry run of this script);
    with `dynamic_vram`, core's dynamic-VRAM patcher switched on as its `main.py` does (newer cores, CUDA)."""
    sys.path.insert(0, str(core))
    import comfy.cli_args

    comfy.cli_args.args.cpu = device.type == "cpu"
    if dynamic_vram:  # before CUDA starts, as core's main.py does
        import comfy_aimdo.control

        comfy_aimdo.control.init()
    import comfy.model_management
    import comfy.model_patcher

    if dynamic_vram:
        import comfy.memory_management

        devices = comfy.model_management.get_all_torch_devices()
        headroom = int(comfy.cli_args.args.vram_headroom * 1024**3)
        try:
            ready = comfy_aimdo.control.init_devices((d.index, headroom) for d in devices)
        except TypeError:  # comfy-aimdo 0.4.9 takes the indices alone
            ready = comfy_aimdo.control.init_devices(d.index for d in devices)
        if not ready:
            raise SystemExit("comfy-aimdo found no device to manage")
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    return comfy.model_management, comfy.model_patcher


def tiny(seed: int = 0) -> torch.nn.Module:
    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def logits(patcher, device: torch.device, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return patcher.model(ids.to(device)).logits.float().cpu()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def copies(mm, device: torch.device, ids: torch.Tensor) -> dict:
    model = tiny()
    key = "model.layers.1.mlp.down_proj.weight"
    diff = torch.randn_like(model.state_dict()[key]) * 0.02
    original = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    with torch.inference_mode():
        patched = tiny()
        patched.state_dict()[key].add_(diff)
        expected = patched.to(device)(ids.to(device)).logits.float().cpu()
    del patched
    plain = streamwise.model_patcher(model, load_device=device, offload_device=CPU, policy="decoder-llm")
    plain.add_patches({key: ("diff", (diff,))}, 1.0)
    with tempfile.TemporaryDirectory() as folder:
        policy = Path(folder, "int8-linears.toml")
        policy.write_text(INT8, encoding="utf-8")
        int8 = load_policy(policy)
    made = {"apply float": adopt(plain, "decoder-llm"), "apply int8": adopt(plain, int8), "compile copy": copied(plain)}
    baseline = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    mm.load_models_gpu([plain, *made.values()])
    loaded = {entry.model.__class__.__name__ + str(index): entry.model_memory()
              for index, entry in enumerate(mm.current_loaded_models)}
    allocated = torch.cuda.memory_allocated() - baseline if device.type == "cuda" else None
    outputs = {"input": logits(plain, device, ids), **{name: logits(p, device, ids) for name, p in made.items()}}
    result = {
        "input equals the patched model": bool(torch.allclose(outputs["input"], expected, atol=1e-4)),
        "input max difference from the patched model": float((outputs["input"] - expected).abs().max()),
        "loaded models (core's accounting, bytes)": loaded,
        "device bytes allocated for them": allocated,
        "weights on the device": {name: str(next(iter(p.model.model.layers[0].mlp.up_proj._parameters.values())).device)
                                  for name, p in {"input": plain, **made}.items()},
    }
    for name in ("apply float", "compile copy"):
        result[f"{name} identical to the input"] = bool(torch.equal(outputs[name], outputs["input"]))
    result["apply int8 cosine with the input"] = cosine(outputs["apply int8"], outputs["input"])
    mm.unload_all_models()
    made["apply float"].load(made["apply float"].load_device, lowvram_model_memory=1)  # low-VRAM: all streamed
    streamed = logits(made["apply float"], device, ids)
    result["apply float streamed identical to the input"] = bool(torch.equal(streamed, outputs["input"]))
    result["apply float streamed max difference from the input"] = float((streamed - outputs["input"]).abs().max())
    made["apply float"].unpatch_model(CPU)
    mm.unload_all_models()
    gc.collect()
    result["models core still holds loaded after unloading all"] = len(mm.current_loaded_models)
    after = model.state_dict()
    result["input host weights bit-identical after unload"] = all(
        after[name].device == CPU and torch.equal(after[name], tensor) for name, tensor in original.items())
    mine = dict(model.named_parameters())
    for name in ("apply float", "compile copy"):
        theirs = dict(made[name].model.named_parameters())
        shared = sum(theirs[p].data_ptr() == mine[p].data_ptr() for p in mine if p in theirs)
        result[f"{name} weights sharing the input's host tensors after unload"] = f"{shared}/{len(mine)}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        result["device bytes still allocated after unload"] = torch.cuda.memory_allocated() - baseline
    return result


def file_tier(mm, device: torch.device, ids: torch.Tensor) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        tiny(1).save_pretrained(folder)
        reference = transformers.Qwen2ForCausalLM.from_pretrained(folder).eval().to(device)
        with torch.inference_mode():
            expected = reference.generate(ids.to(device), max_new_tokens=8, do_sample=False)[0].tolist()
        del reference
        loaded = streamwise.load_pretrained(folder, "auto", progress=False, max_memory={"cpu": 1 << 20})
        model = loaded.model
        left = [path for path, module in model.named_modules() if tier.in_file(module)]
        patcher = streamwise.model_patcher(model, load_device=device, offload_device=CPU)
        mm.load_models_gpu([patcher])
        with torch.inference_mode():
            tokens = model.generate(ids.to(device), max_new_tokens=8, do_sample=False)[0].tolist()
        mm.unload_all_models()
        return {"report": str(loaded.report).splitlines()[-1], "modules reading their file": len(left),
                "tokens equal transformers' resident model": tokens == expected,
                "still reading their file after unload": [p for p, m in model.named_modules() if tier.in_file(m)]
                == left}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def leased(mm, device: torch.device, ids: torch.Tensor) -> dict:
    warnings = _Warnings()
    logging.getLogger().addHandler(warnings)
    try:
        with lease_folder() as folder:
            tiny(2).save_pretrained(folder)
            file = Path(folder, "model.safetensors")
            reference = transformers.Qwen2ForCausalLM.from_pretrained(folder).eval().to(device)
            with torch.inference_mode():
                expected = reference.generate(ids.to(device), max_new_tokens=8, do_sample=False)[0].tolist()
            del reference
            model = streamwise.load_pretrained(folder, "auto", progress=False).model
            weights = list(model.parameters())
            result = {"file system": file_system(folder),
                      "weights viewing the file after the load": f"{viewing_file(weights, file)}/{len(weights)}"}
            patcher = streamwise.model_patcher(model, load_device=device, offload_device=CPU)
            patcher.load(patcher.load_device, lowvram_model_memory=1)  # low-VRAM: weights stay on the host, pinned
            with torch.inference_mode():
                before = model.generate(ids.to(device), max_new_tokens=8, do_sample=False)[0].tolist()
            host = [p for p in model.parameters() if p.device == CPU]
            result.update({
                "weights on the host": f"{len(host)}/{len(weights)}",
                "host weights pinned": f"{sum(p.is_pinned() for p in host)}/{len(host)}",
                "core's pinned bytes": getattr(mm, "TOTAL_PINNED_MEMORY", None),
                "weights viewing the file while loaded": f"{viewing_file(weights, file)}/{len(weights)}",
                "tokens equal transformers' before the rewrite": before == expected,
                "writer held for (s)": rewrite(file),
            })
            with torch.inference_mode():
                after = model.generate(ids.to(device), max_new_tokens=8, do_sample=False)[0].tolist()
            result["tokens equal transformers' after the rewrite"] = after == expected
            patcher.unpatch_model(CPU)
            mm.unload_all_models()
            gc.collect()
            result["core's pinned bytes after unload"] = getattr(mm, "TOTAL_PINNED_MEMORY", None)
            with torch.inference_mode():
                result["tokens equal transformers' after unload"] = model.generate(
                    ids, max_new_tokens=8, do_sample=False)[0].tolist() == expected
    finally:
        logging.getLogger().removeHandler(warnings)
    result["warnings"] = sorted(set(warnings.messages))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--dynamic-vram", action="store_true", help="core's dynamic-VRAM patcher (newer cores)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mm, mp = boot(args.core.resolve(), device, args.dynamic_vram)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "core": str(args.core), "dynamic VRAM": args.dynamic_vram,
               "core's cast_bias_weight takes offloadable": "offloadable" in inspect.signature(
                   importlib.import_module("comfy.ops").cast_bias_weight).parameters}
    section(results, "copies", copies, mm, device, ids)
    section(results, "file tier", file_tier, mm, device, ids)
    section(results, "leased host tier pinned by core", leased, mm, device, ids)
    emit(results, args.out)


if __name__ == "__main__":
    main()
