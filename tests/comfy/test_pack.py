"""The repository loads through ComfyUI's own custom-node loader and its nodes run headless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comfy_harness import generate_text, load_custom_node
from helpers import REPO, tiny_qwen2, write_policy


def test_pack_loads_through_comfyuis_loader(comfy_nodes):
    assert load_custom_node(comfy_nodes, REPO) is True
    assert comfy_nodes.NODE_CLASS_MAPPINGS["StreamwisePolicyCheck"].__name__ == "StreamwisePolicyCheck"
    assert comfy_nodes.NODE_DISPLAY_NAME_MAPPINGS["StreamwisePolicyCheck"] == "Streamwise Policy Check"


def test_an_installed_streamwise_and_the_pack_share_one_engine(comfy_nodes):
    """Other packs `import streamwise`; the nodes must take the MODELs that import makes."""
    import streamwise

    load_custom_node(comfy_nodes, REPO)  # the checkout's folder, a module named after it, not `streamwise`
    apply_node = comfy_nodes.NODE_CLASS_MAPPINGS["ApplyStreamwisePolicy"]
    assert apply_node.__module__ == "streamwise.comfy_nodes.apply_policy"
    model = tiny_qwen2()
    patcher = streamwise.model_patcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                                       policy="decoder-llm")
    (adopted,) = apply_node.execute(patcher, "decoder-llm").args  # a copy of its tree, converted the same way
    assert adopted.model is not model and type(adopted.model.lm_head) is type(model.lm_head)


def test_policy_check_node_reads_user_policies_without_restart(comfy_nodes):
    import folder_paths

    load_custom_node(comfy_nodes, REPO)
    node = comfy_nodes.NODE_CLASS_MAPPINGS["StreamwisePolicyCheck"]
    shipped = ["any-module", "decoder-llm", "transformers", "vibevoice"]
    assert node.INPUT_TYPES()["required"]["policy"][1]["options"] == shipped

    policies = Path(folder_paths.get_user_directory()) / "streamwise" / "policies"
    path = write_policy(policies, "vibevoice", 'extends = "decoder-llm"\n\n[compile]\nmode = "fastest"\n')
    try:
        # The user copy shadows the shipped one.
        assert node.INPUT_TYPES()["required"]["policy"][1]["options"] == shipped
        report = node.execute("vibevoice").args[0]
        assert report.startswith("error[invalid-value]: `mode` must be one of the allowed values")
        assert "vibevoice.toml:8:8" in report
        # The content of the policy and of its extends chain: unchanged, the node stays cached; edited, it re-runs.
        before = node.fingerprint_inputs(policy="vibevoice")
        assert node.fingerprint_inputs(policy="vibevoice") == before
        path.write_text(path.read_text().replace('"fastest"', '"max-autotune"'))
        assert node.fingerprint_inputs(policy="vibevoice") != before
        assert node.execute("vibevoice").args == ("policy `vibevoice` is valid",)
    finally:
        path.unlink()


def test_the_loader_reads_models_llm_and_picks_a_gguf_beside_a_config(comfy_nodes, tmp_path):
    """No core registers `LLM`; the pack does, so models/LLM is read as the tooltip says, file by file."""
    import folder_paths

    from streamwise.runtime.cli.streamwise import main

    load_custom_node(comfy_nodes, REPO)
    loader = comfy_nodes.NODE_CLASS_MAPPINGS["StreamwiseModelLoader"]
    model_input = loader.INPUT_TYPES()["required"]["model"]
    assert Path(folder_paths.models_dir) / "LLM" in map(Path, folder_paths.get_folder_paths("LLM"))
    assert all(key in model_input[1]["tooltip"] for key in ("streamwise", "text_encoders", "LLM", "models/LLM"))

    tiny_qwen2().save_pretrained(tmp_path / "qwen")
    assert main(["quantize", str(tmp_path / "qwen"), str(tmp_path / "qwen" / "model.gguf"), "--policy",
                 "decoder-llm"]) == 0
    (tmp_path / "loose.gguf").write_bytes(b"no config.json beside it")
    folder_paths.add_model_folder_path("LLM", str(tmp_path))
    try:
        choices = loader.INPUT_TYPES()["required"]["model"][1]["options"]
        assert {"LLM/qwen", "LLM/qwen/model.gguf", "LLM/qwen/model.safetensors"} <= set(choices)
        assert "LLM/loose.gguf" not in choices
        _, report = loader.execute("LLM/qwen/model.gguf", "auto", "auto").args
        assert "picked `decoder-llm`" in report and "from model.gguf" in report and "kept quantized (Q8_0 x" in report
    finally:
        folder_paths.folder_names_and_paths["LLM"][0].remove(str(tmp_path))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_a_loose_llama_cpp_gguf_is_offered_loads_quantized_and_speaks_with_its_own_tokenizer(comfy_nodes, tmp_path,
                                                                                          family):
    """A `.gguf` as downloaded, alone in models/LLM: no config.json, its tokenizer in its metadata."""
    import folder_paths
    import gguf

    from llama_cpp_files import CORPUS, float_model, train_tokenizer_parts, write_llama_cpp_gguf

    load_custom_node(comfy_nodes, REPO)
    mappings = comfy_nodes.NODE_CLASS_MAPPINGS
    parts = train_tokenizer_parts()
    name = f"tiny-{family}.Q8_0.gguf"
    expected = write_llama_cpp_gguf(float_model(family, len(parts[0]), parts[2]), tmp_path / name, family,
                                    gguf.GGMLQuantizationType.Q8_0, parts)
    folder_paths.add_model_folder_path("LLM", str(tmp_path))
    try:
        loader = mappings["StreamwiseModelLoader"]
        assert f"LLM/{name}" in loader.INPUT_TYPES()["required"]["model"][1]["options"]
        patcher, report = loader.execute(f"LLM/{name}", "auto", "auto").args
        assert "`auto` picked `" in report and "kept quantized (Q8_0 x" in report and "residents gguf x" in report
        ((text,),) = generate_text(mappings, patcher, CORPUS[0], 6).args
    finally:
        folder_paths.folder_names_and_paths["LLM"][0].remove(str(tmp_path))
    from streamwise.runtime.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(tmp_path / name)
    ids = tokenizer(CORPUS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        reference = expected.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=parts[2])
    assert text == tokenizer.decode(reference[0, ids.shape[1]:], skip_special_tokens=True)
