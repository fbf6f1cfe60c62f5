"""The repository loads through ComfyUI's own custom-node loader and its nodes run headless."""

from __future__ import annotations

from pathlib import Path

import torch

from comfy_harness import load_custom_node
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
    (adopted,) = apply_node().apply(patcher, "decoder-llm")  # the same classes: re-applying changes nothing
    assert adopted.model is model


def test_policy_check_node_reads_user_policies_without_restart(comfy_nodes):
    import folder_paths

    load_custom_node(comfy_nodes, REPO)
    node = comfy_nodes.NODE_CLASS_MAPPINGS["StreamwisePolicyCheck"]
    shipped = ["any-module", "decoder-llm", "transformers", "vibevoice"]
    assert node.INPUT_TYPES()["required"]["policy"][0] == shipped

    policies = Path(folder_paths.get_user_directory()) / "streamwise" / "policies"
    path = write_policy(policies, "vibevoice", 'extends = "decoder-llm"\n\n[compile]\nmode = "fastest"\n')
    try:
        assert node.INPUT_TYPES()["required"]["policy"][0] == shipped  # the user copy shadows the shipped one
        report = node().check("vibevoice")["result"][0]
        assert report.startswith("error[invalid-value]: `mode` must be one of the allowed values")
        assert "vibevoice.toml:8:8" in report
        # Never equal to itself, so ComfyUI re-runs the node after an edit anywhere in the extends chain.
        assert node.IS_CHANGED("vibevoice") != node.IS_CHANGED("vibevoice")
        path.write_text(path.read_text().replace('"fastest"', '"max-autotune"'))
        assert node().check("vibevoice")["result"] == ("policy `vibevoice` is valid",)
    finally:
        path.unlink()
