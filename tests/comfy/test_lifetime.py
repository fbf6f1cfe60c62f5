"""A dropped MODEL frees its tree by reference counting alone, so ComfyUI never suspects a leak.

Core's `LoadedModel` holds its patcher and model weakly; `cleanup_models_gc` logs "Potential memory leak" when the
patcher is gone but the model lives on, which is what a reference cycle through the model does.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from comfy_harness import generate_text, load_custom_node
from helpers import REPO, tiny_qwen2

CPU = torch.device("cpu")
COMPILE = dict(backend="aot_eager", fullgraph=False, mode="default", dynamic_shape_tracing=False,
               dynamo_cache_size_limit=64, use_guard_filter=True, disable_dynamic_vram=False, verbose=False)


def save_tokenizer(folder) -> None:
    """A word-level tokenizer for every id of tiny_qwen2's 128-token vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[PAD]", "[EOS]", "a", "cat", "sat"] + [f"w{i}" for i in range(122)]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
    ).save_pretrained(folder)


@pytest.fixture(scope="module")
def mappings(comfy_nodes, tmp_path_factory):
    import folder_paths

    assert load_custom_node(comfy_nodes, REPO)
    root = tmp_path_factory.mktemp("lifetime-models")
    tiny_qwen2().save_pretrained(root / "lifetime-qwen2")
    save_tokenizer(root / "lifetime-qwen2")
    folder_paths.add_model_folder_path("streamwise", str(root))
    return comfy_nodes.NODE_CLASS_MAPPINGS


def through_the_loader(mappings, compiled: bool) -> list:
    """Loader (-> Compile) -> Generate Text, as a workflow runs them."""
    patcher, _ = mappings["StreamwiseModelLoader"].execute("streamwise/lifetime-qwen2", "decoder-llm", "auto").args
    outputs = [patcher]
    if compiled:
        outputs += mappings["INT8LazyTorchCompile"].execute(patcher, True, **COMPILE).args
    ((text,),) = generate_text(mappings, outputs[-1], "a cat sat", 4).args
    assert text
    return outputs


def through_apply(mappings, compiled: bool) -> list:
    """A foreign MODEL -> Apply (-> Compile), loaded by core and run."""
    import comfy.model_management
    import comfy.model_patcher

    foreign = comfy.model_patcher.ModelPatcher(tiny_qwen2(), load_device=CPU, offload_device=CPU)
    outputs = [foreign, *mappings["ApplyStreamwisePolicy"].execute(foreign, "auto").args]
    if compiled:
        outputs += mappings["INT8LazyTorchCompile"].execute(outputs[-1], True, **COMPILE).args
    comfy.model_management.load_models_gpu([outputs[-1]])
    with torch.no_grad():
        outputs[-1].model(torch.tensor([[3, 4, 5]]), use_cache=False)
    return outputs


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
@pytest.mark.parametrize("run", [through_the_loader, through_apply], ids=["loader", "apply"])
def test_a_dropped_model_is_freed_without_a_leak_warning(mappings, run, compiled, caplog):
    import comfy.model_management

    outputs = run(mappings, compiled)
    model = weakref.ref(outputs[0].model)
    assert any(loaded.model is outputs[-1] for loaded in comfy.model_management.current_loaded_models)
    gc.collect()
    caplog.set_level(logging.INFO)
    gc.disable()
    try:
        del outputs  # ComfyUI's cache letting go of the node outputs
        freed = model() is None
        comfy.model_management.cleanup_models_gc()
    finally:
        gc.enable()
    assert "memory leak" not in caplog.text
    assert freed, "the tree outlived its MODELs: a reference cycle runs through it"
