"""Quantized residents under real ComfyUI core: raw storage streams, LoRA applies exactly."""

from __future__ import annotations

import pytest
import torch

import streamwise
from streamwise.runtime.engine import protocol

from helpers import gguf_policy, make_policy, tiny_qwen2

CPU, META = torch.device("cpu"), torch.device("meta")
KEY = "model.layers.1.mlp.down_proj.weight"


def quantized_qwen(fmt: str, tmp_path) -> torch.nn.Module:
    """A tiny Qwen2 whose Linear layers are `fmt` residents (GGUF through a real .gguf file)."""
    torch.manual_seed(0)
    model = tiny_qwen2()
    rule = {"id": "q", "select": {"class": "Linear"}, "format": fmt, **({"group_size": 16} if "convrot" in fmt else {})}
    decoder = streamwise.load_policy("decoder-llm")
    policy = decoder.model_copy(update={"quant": make_policy(quant={"rule": [rule]}).quant})
    if fmt == "gguf":
        from streamwise.runtime.cli.streamwise import main

        model.save_pretrained(tmp_path)
        policy_file = gguf_policy(tmp_path, "Q8_0")
        assert main(["quantize", str(tmp_path), str(tmp_path / "m.gguf"), "--policy", str(policy_file)]) == 0
        with streamwise.skeleton():
            model = tiny_qwen2()
        streamwise.load(model, tmp_path / "m.gguf", policy_file)
    else:
        streamwise.apply(streamwise.resolve(policy, model), model)
    return model


def dequantized(module) -> torch.Tensor:

    handler = protocol.quant_handler(module)
    return handler.dequantize(module, {name: module._parameters[name] for name in handler.stored}, torch.float32)


@pytest.mark.parametrize("fmt", ["gguf", "int8", "convrot_int8"])
@pytest.mark.parametrize("budget", [20_000, 10**9], ids=["lowvram", "full-load"])
def test_lora_on_residents_equals_patching_the_dequantized_weight(comfy_nodes, tmp_path, fmt, budget):
    model = quantized_qwen(fmt, tmp_path)
    ids = torch.randint(0, 128, (1, 6))
    diff = torch.randn(64, 128) * 0.05
    layer = model.get_submodule(KEY.rsplit(".", 1)[0])
    merged = dequantized(layer) + diff
    with torch.no_grad():
        unpatched = model(ids).logits
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU)
    assert patcher.add_patches({KEY: ("diff", (diff,))}, 1.0) == [KEY]
    stored = model.state_dict(keep_vars=True)[KEY]  # the storage (`weight` shows the float weight)
    patcher.load(CPU, lowvram_model_memory=budget, full_load=budget > 10**6)
    seen = []
    hook = layer.register_forward_hook(lambda module, args, output: seen.append((args[0], output)))
    with torch.no_grad():
        patched = model(ids).logits
    hook.remove()
    (x, output), = seen
    assert torch.allclose(output, torch.nn.functional.linear(x, merged, layer.bias), atol=1e-5)
    assert not torch.allclose(patched, unpatched, atol=1e-4)
    assert model.state_dict(keep_vars=True)[KEY] is stored and not stored.is_floating_point()  # untouched
    patcher.detach()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, unpatched, atol=1e-6)  # the patch leaves with the unload


@pytest.mark.parametrize("fmt", ["gguf", "int8"])
def test_partial_load_on_meta_moves_residents_in_their_storage_dtype(comfy_nodes, tmp_path, fmt):
    model = quantized_qwen(fmt, tmp_path)
    patcher = streamwise.model_patcher(model, load_device=META, offload_device=CPU)
    patcher.load(META, lowvram_model_memory=60_000)
    dtypes = {m._parameters["weight"].dtype for m in model.modules() if protocol.is_resident(m)}
    assert dtypes == {torch.uint8 if fmt == "gguf" else torch.int8}
    assert model(torch.randint(0, 128, (1, 6)).to(META)).logits.is_meta


@pytest.mark.parametrize("fmt", ["gguf", "int8"])
def test_lora_on_residents_applies_once_through_load_and_unload_cycles(comfy_nodes, tmp_path, fmt):
    """Core tracks merged patches by weight backups, which raw storage never gets; the count must still hold."""
    model = quantized_qwen(fmt, tmp_path)
    layer = model.get_submodule(KEY.rsplit(".", 1)[0])
    weight, diff, x = dequantized(layer), torch.randn(64, 128) * 0.05, torch.randn(1, 3, 128)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU)
    patcher.add_patches({KEY: ("diff", (diff,))}, 1.0)

    def times_applied() -> int:
        with torch.no_grad():
            y = layer(x)
        return min(
            range(3), key=lambda k: (y - torch.nn.functional.linear(x, weight + k * diff, layer.bias)).abs().max(),
        )

    patcher.load(CPU, full_load=True)
    assert times_applied() == 1
    patcher.partially_unload(CPU, 10**9)  # was applied twice
    assert times_applied() == 1
    patcher.detach()
    assert times_applied() == 0
    patcher.load(CPU, lowvram_model_memory=10**9)
    assert times_applied() == 1
    patcher.partially_load(CPU, 10**9)  # was dropped
    assert times_applied() == 1
    patcher.detach()
    patcher.load(CPU, lowvram_model_memory=60_000)
    patcher.partially_load(CPU, 30_000)
    assert times_applied() == 1
    patcher.detach()
    assert times_applied() == 0


@pytest.mark.parametrize("fmt", ["gguf", "int8", "convrot_int8"])
def test_core_counts_a_quantized_model_by_its_storage_while_model_code_sees_float(comfy_nodes, tmp_path, fmt):
    """Core sizes tensors it does not know as shape x dtype: it must only ever meet the storage."""
    model = quantized_qwen(fmt, tmp_path)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU)
    storage = sum(t.nbytes for t in model.state_dict().values())
    assert patcher.model_size() == storage < sum(t.numel() * 4 for t in tiny_qwen2().state_dict().values())
    layer = model.get_submodule(KEY.rsplit(".", 1)[0])
    assert layer.weight.dtype == torch.float32 and layer.weight.shape == (64, 128)
    assert not layer._parameters["weight"].is_floating_point()
    patcher.load(CPU, full_load=True)
    assert patcher.model_size() == storage and not layer._parameters["weight"].is_floating_point()


def test_residents_copy_on_cores_offload_stream_and_compute_waits_for_it(comfy_nodes, tmp_path):
    """Raw storage moves as core's own layers' weights do: `cast_to` on core's offload stream (a CUDA stream; a
    stand-in here, where core has none for the CPU), then `sync_stream` before the compute reads it."""
    from streamwise.runtime.convert import applied_state

    model = quantized_qwen("int8", tmp_path)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU)
    patcher.load(CPU, lowvram_model_memory=20_000)
    fetcher = applied_state(model).tree.fetcher
    stream, log, cast = object(), [], fetcher._cast_to

    def cast_to(tensor, dtype, device, non_blocking=False, copy=False, stream=None):
        log.append(("copy", stream))
        return cast(tensor, dtype, device, non_blocking=non_blocking, copy=copy)

    fetcher._offload_stream = lambda device: stream
    fetcher._cast_to = cast_to
    fetcher._sync_stream = lambda device, waited: log.append(("sync", waited))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 6)))
    assert log and all(entry[1] is stream for entry in log)
    copies = [entry[0] for entry in log]
    assert copies[-1] == "sync" and "copy" in copies  # every fetch's copies, then the wait
    assert all(a != "sync" or b == "copy" for a, b in zip(copies, copies[1:], strict=False))
