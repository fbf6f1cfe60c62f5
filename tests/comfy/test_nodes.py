"""Every node headless on CPU, through ComfyUI's own loader, and the example workflows in graph order."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import streamwise
from streamwise.runtime.convert import applied_state
from streamwise.runtime.engine import file_tier, protocol
from streamwise.runtime.generation import Sampling, generation_config
from streamwise.schemas import Policy

from comfy_harness import generate_text, load_custom_node
from helpers import REPO, reference_text, tiny_llava, tiny_qwen2, tiny_t5, tiny_tokenizer, write_policy

COMPILE = dict(backend="aot_eager", fullgraph=False, mode="default", dynamic_shape_tracing=False,
               dynamo_cache_size_limit=64, use_guard_filter=True, disable_dynamic_vram=False, verbose=False)


@pytest.fixture(scope="module")
def nodes(comfy_nodes, tmp_path_factory):
    """The pack loaded by ComfyUI, with a tiny Qwen2 (+ tokenizer) in a registered `streamwise` model folder."""
    import folder_paths

    assert load_custom_node(comfy_nodes, REPO)
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    model = tiny_qwen2()
    model.save_pretrained(root / "tiny-qwen2")
    tiny_tokenizer().save_pretrained(root / "tiny-qwen2")
    folder_paths.add_model_folder_path("streamwise", str(root), is_default=True)
    return comfy_nodes.NODE_CLASS_MAPPINGS, root


def test_loader_lists_models_and_policies_and_picks_a_policy(nodes):
    mappings, _ = nodes
    inputs = mappings["StreamwiseModelLoader"].INPUT_TYPES()["required"]
    assert "streamwise/tiny-qwen2" in inputs["model"][1]["options"]
    assert inputs["policy"][1]["options"] == ["auto", "any-module", "decoder-llm", "transformers", "vibevoice"]
    patcher, report = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "auto", "auto").args
    assert "`auto` picked `decoder-llm` by root class `Qwen2ForCausalLM`" in report
    assert type(patcher).__name__.startswith("Streamwise")
    patcher.load(torch.device("cpu"), lowvram_model_memory=30_000)  # partial load: streamed leaves flagged
    assert patcher.model.model_lowvram
    assert any(getattr(m, "comfy_cast_weights", False) for m in patcher.model.modules())


def run_workflow(mappings, workflow: dict) -> dict:
    """Execute an API-format workflow by calling its nodes in graph order."""
    outputs: dict[str, tuple] = {}

    def run(node_id: str) -> tuple:
        if node_id not in outputs:
            node = workflow[node_id]
            cls = mappings[node["class_type"]]
            inputs = {k: run(v[0])[v[1]] if isinstance(v, list) else v for k, v in node["inputs"].items()}
            outputs[node_id] = cls.execute(**inputs)
        return outputs[node_id]

    for node_id in workflow:
        run(node_id)
    return outputs


def test_the_generate_text_workflow(nodes):
    mappings, root = nodes
    workflow = json.loads((REPO / "examples" / "workflows" / "streamwise_generate_text.json").read_text())
    workflow["2"]["inputs"]["system"] = ""  # this tiny-qwen2's tokenizer has no chat template (the example's has)
    outputs = run_workflow(mappings, workflow)
    ((text,),) = outputs["2"].args
    assert text and text == reference_text(root / "tiny-qwen2", "a cat sat on the mat", 8)


def test_the_compile_workflow(nodes):
    mappings, root = nodes
    workflow = json.loads((REPO / "examples" / "workflows" / "streamwise_compile.json").read_text())
    workflow["2"]["inputs"]["backend"] = "aot_eager"  # inductor: tests/compile/test_compile.py; keep this quick
    del workflow["3"]  # its Generate Text would load the MODEL; test_a_compiled_model_generates_text runs that
    outputs = run_workflow(mappings, workflow)
    loaded, compiled = outputs["1"][0], outputs["2"][0]
    blocks = compiled.model.model.layers
    ids = torch.tensor([[3, 4, 5, 6]])
    import comfy.model_management
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(root / "tiny-qwen2", local_files_only=True).eval()
    assert not any(isinstance(block.forward, functools.partial) for block in blocks)  # armed only while loaded
    with pytest.raises(ValueError, match="not armed"):
        streamwise.compile_stats(loaded)  # the input MODEL stays as it was
    comfy.model_management.load_models_gpu([compiled])
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits
        assert streamwise.compile_stats(compiled).graphs == 0  # lazy: nothing until the first forward
        result = compiled.model(ids, use_cache=False).logits
    stats = streamwise.compile_stats(compiled)
    assert stats.applied and stats.units == 2 and stats.graphs == 1 and stats.fallbacks == []
    assert torch.allclose(result, expected, atol=1e-5)
    compiled.unpatch_model()
    assert not any(isinstance(block.forward, functools.partial) for block in blocks)


def test_a_compiled_model_generates_text(nodes):
    mappings, root = nodes
    workflow = json.loads((REPO / "examples" / "workflows" / "streamwise_compile.json").read_text())
    workflow["2"]["inputs"]["backend"] = "aot_eager"
    compiled = run_workflow(mappings, workflow)["2"][0]
    ((text,),) = generate_text(mappings, compiled, "a cat sat on the mat", 8).args
    assert text and text == reference_text(root / "tiny-qwen2", "a cat sat on the mat", 8)
    assert streamwise.compile_stats(compiled).graphs >= 1 and streamwise.compile_stats(compiled).fallbacks == []


def test_the_compile_node_never_changes_its_input(nodes):
    """The compile node arms a copy of the tree, converted as its input is, over the same weights: while the compiled
    MODEL is loaded and runs, its input's blocks run their own forward, the input's file-tier reads stay eager, and
    the input computes as before."""
    import comfy.model_management

    mappings, root = nodes
    loaded, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "decoder-llm", "auto", False,
                                                          "160KiB").args  # most blocks stay in their file
    (compiled,) = mappings["INT8LazyTorchCompile"].execute(loaded, True, **COMPILE).args
    source, tree = loaded.model, compiled.model
    assert tree is not source and type(tree.model.layers[1]) is type(source.model.layers[1])  # converted alike
    held = {name: t for name, t in source.named_parameters() if file_tier.in_memory(t)}
    copy = dict(tree.named_parameters())
    assert held and all(copy[name].data_ptr() == t.data_ptr() for name, t in held.items())  # one set of weights
    left = [path for path, module in source.named_modules() if file_tier.in_file(module)]
    assert left and left == [path for path, module in tree.named_modules() if file_tier.in_file(module)]
    assert all(tree.get_submodule(path).comfy_cast_weights for path in left)  # they read their file at each forward
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        expected = streamwise.load_pretrained(root / "tiny-qwen2", "decoder-llm", progress=False).model(
            ids, use_cache=False).logits
        comfy.model_management.load_models_gpu([compiled])
        result = compiled.model(ids, use_cache=False).logits
        assert streamwise.compile_stats(compiled).graphs >= 1
        assert not any(isinstance(layer.__dict__.get("forward"), functools.partial) for layer in source.model.layers)
        assert "read" not in vars(applied_state(source).tree.file_tier)  # not wrapped to break graphs: eager
        with pytest.raises(ValueError, match="not armed"):
            streamwise.compile_stats(loaded)
        comfy.model_management.load_models_gpu([loaded])
        again = loaded.model(ids, use_cache=False).logits
    assert torch.allclose(result, expected, atol=1e-5) and torch.equal(again, expected)


@pytest.mark.parametrize("node", ["ApplyStreamwisePolicy", "INT8LazyTorchCompile"])
def test_a_copy_keeps_its_own_backups_so_its_patched_input_unpatches_right(nodes, node):
    """Core's clone shares its backups with the patcher it came from (both patch one tree). A copy's are its own:
    sharing them, the copy's unload would empty the input's, and the input, patched meanwhile, would keep its LoRA
    merged for good."""
    import comfy.model_patcher

    mappings, _ = nodes
    cpu = torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    plain = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    original = model[0].weight.detach().clone()
    plain.add_patches({"0.weight": ("diff", (torch.ones(8, 8),))}, 1.0)
    plain.patch_model(device_to=cpu)
    assert torch.equal(model[0].weight, original + 1)  # the input is loaded, its LoRA merged
    inputs = {"policy": "any-module"} if node == "ApplyStreamwisePolicy" else dict(
        compile_transformer_blocks_only=True, **COMPILE)
    (copy,) = mappings[node].execute(plain, **inputs).args
    assert plain.loaded_size() > 0 and copy.loaded_size() == 0  # the copy is loaded nowhere yet
    assert torch.equal(copy.model[0].weight, original)  # the copy starts from the unpatched weight
    copy.patch_model(device_to=cpu)
    x = torch.randn(2, 8)
    expected = model[1](x @ (original + 1).T + model[0].bias)
    with torch.no_grad():
        assert torch.allclose(copy.model(x), expected, atol=1e-6)  # the copy applies its LoRA too
    copy.unpatch_model(cpu)
    assert torch.equal(copy.model[0].weight, original) and torch.equal(model[0].weight, original + 1)
    plain.unpatch_model(cpu)
    assert torch.equal(model[0].weight, original)


def test_gguf_files_load_through_the_loader(nodes, tmp_path):
    import shutil

    mappings, root = nodes
    folder = root / "tiny-qwen2-gguf"
    folder.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (root / "tiny-qwen2" / name).exists():
            shutil.copy(root / "tiny-qwen2" / name, folder / name)
    from streamwise.runtime.cli.streamwise import main

    assert main(["quantize", str(root / "tiny-qwen2"), str(folder / "model.gguf"), "--policy", "decoder-llm"]) == 0
    loader = mappings["StreamwiseModelLoader"]
    patcher, report = loader.execute("streamwise/tiny-qwen2-gguf", "decoder-llm", "auto").args
    assert "model.gguf" in report
    ((text,),) = generate_text(mappings, patcher, "a cat", 4).args
    assert text and text == reference_text(root / "tiny-qwen2", "a cat", 4)  # Q8_0 keeps greedy decoding here
    with pytest.raises(ValueError, match="^prompt: tokenizes to no tokens"):
        generate_text(mappings, patcher, "", 4)  # the node's default


def test_a_loose_gguf_streamwise_wrote_is_listed_and_generates_alone(nodes):
    from streamwise.comfy_nodes.folders import model_roots
    from streamwise.runtime.checkpoint.discover import list_models
    from streamwise.runtime.cli.streamwise import main

    mappings, root = nodes
    assert main(["quantize", str(root / "tiny-qwen2"), str(root / "tiny-qwen2.Q8_0.gguf"), "--policy",
                 "decoder-llm"]) == 0
    assert "streamwise/tiny-qwen2.Q8_0.gguf" in list_models(model_roots())  # nothing beside it
    patcher, report = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2.Q8_0.gguf", "auto",
                                                                "auto").args
    assert "tiny-qwen2.Q8_0.gguf" in report
    ((text,),) = generate_text(mappings, patcher, "a cat", 4).args
    assert text and text == reference_text(root / "tiny-qwen2", "a cat", 4)


def test_a_diffusers_model_folder_is_listed_and_loads_through_the_loader(nodes):
    pytest.importorskip("diffusers")
    from helpers import tiny_diffusers

    mappings, root = nodes
    model, inputs = tiny_diffusers("vae")
    model.eval().save_pretrained(root / "tiny-vae")
    with torch.no_grad():
        expected = model(**inputs).sample
    loader = mappings["StreamwiseModelLoader"]
    assert "streamwise/tiny-vae" in loader.INPUT_TYPES()["required"]["model"][1]["options"]
    patcher, report = loader.execute("streamwise/tiny-vae", "auto", "auto").args
    assert report.startswith("`auto` picked `any-module`") and "built AutoencoderKL (diffusers `_class_name`)" in report
    patcher.load(torch.device("cpu"), lowvram_model_memory=1)  # every streamed leaf fetching
    with torch.no_grad():
        assert torch.equal(patcher.model(**inputs).sample, expected)


def test_apply_policy_node_converts_a_foreign_models_tree(nodes):
    import comfy.model_patcher

    mappings, _ = nodes
    tree = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    plain = comfy.model_patcher.ModelPatcher(tree, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    plain.add_patches({"0.weight": ("diff", (torch.ones(8, 8),))}, 1.0)
    plain.model_options.setdefault("transformer_options", {})["probe"] = 1
    on_load = []
    plain.add_callback("on_load", lambda *args: on_load.append(1))  # another pack's hook
    user = Path(__import__("folder_paths").get_user_directory()) / "streamwise" / "policies"
    user.mkdir(parents=True, exist_ok=True)
    (user / "tiny-mlp.toml").write_text(
        'schema_version = 1\n[policy]\nname = "tiny-mlp"\n'
        '[[stream.rule]]\nid = "l"\nkind = "linear"\nselect = { class = "Linear" }\n'
        '[[stream.rule]]\nid = "n"\nkind = "layer_norm"\nselect = { class = "LayerNorm" }\n'
    )
    try:
        assert "tiny-mlp" in mappings["ApplyStreamwisePolicy"].INPUT_TYPES()["required"]["policy"][1]["options"]
        (converted,) = mappings["ApplyStreamwisePolicy"].execute(plain, "tiny-mlp").args
    finally:
        (user / "tiny-mlp.toml").unlink()
    assert type(tree[0]) is torch.nn.Linear and applied_state(tree) is None  # the input stays as it was
    copy = converted.model
    assert type(copy[0]).__name__ == "StreamedLinear" and list(converted.patches) == ["0.weight"]
    assert copy[0].weight is not tree[0].weight and copy[0].weight.data_ptr() == tree[0].weight.data_ptr()
    assert type(plain) is comfy.model_patcher.ModelPatcher and isinstance(converted, type(plain))
    assert converted.model_options["transformer_options"]["probe"] == 1  # all a clone carries is kept
    assert len(converted.get_all_callbacks("on_load")) == 1
    weight = tree[0].weight.detach().clone()
    for lowvram in (1, 0):  # streamed (patched at each fetch), then loaded whole (core merges the patch)
        converted.load(torch.device("cpu"), lowvram_model_memory=lowvram, force_patch_weights=True)
        x = torch.randn(2, 8)
        linear = x @ (weight + 1).T + tree[0].bias
        expected = torch.nn.functional.layer_norm(linear, (8,), tree[1].weight, tree[1].bias)
        assert torch.allclose(copy(x), expected, atol=1e-5)
        assert torch.equal(tree[0].weight, weight)  # never merged into the weight the input shares
        converted.unpatch_model(torch.device("cpu"))


def test_apply_never_changes_its_input_and_converts_it_again_under_any_policy(nodes, tmp_path):
    """Two workflows share one cached MODEL; each Apply converts its own copy, under any policy, again and again."""
    import comfy.model_patcher

    mappings, _ = nodes
    node = mappings["ApplyStreamwisePolicy"]
    model = tiny_qwen2()
    plain = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        expected = model(ids).logits
    tensors = {name: (t, t.dtype, t.detach().clone()) for name, t in model.state_dict(keep_vars=True).items()}
    user = Path(__import__("folder_paths").get_user_directory()) / "streamwise" / "policies"
    int8 = write_policy(user, "int8-linears", 'extends = "decoder-llm"\n\n[[quant.rule]]\nid = "q"\n'
                                              'select = { class = "Linear" }\nformat = "int8"\n')
    try:
        outputs = {policy: node.execute(plain, policy).args[0]
                   for policy in ("int8-linears", "decoder-llm", "any-module", "auto")}
        outputs["again"] = node.execute(outputs["int8-linears"], "any-module").args[0]  # a converted input
    finally:
        int8.unlink()
    assert applied_state(model) is None and all(type(m) is protocol.original_class(type(m)) for m in model.modules())
    for name, (tensor, dtype, values) in tensors.items():
        now = model.state_dict(keep_vars=True)[name]
        assert now is tensor and now.dtype == dtype and torch.equal(now, values), name
    for policy, converted in outputs.items():
        converted.load(torch.device("cpu"), lowvram_model_memory=1)
        with torch.no_grad():
            logits = converted.model(ids).logits
        if policy in ("int8-linears", "again"):
            assert converted.model.lm_head._parameters["weight"].dtype == torch.int8
            assert torch.nn.functional.cosine_similarity(logits.flatten(), expected.flatten(), dim=0) > 0.999
        else:
            assert torch.equal(logits, expected), policy
    assert applied_state(outputs["again"].model).plan.policy == "any-module"
    assert applied_state(outputs["int8-linears"].model).plan.policy == "int8-linears"


@pytest.mark.parametrize("unload", ["unpatch_model", "partially_unload"])
def test_an_unloaded_copy_shares_its_weights_with_its_input_again(nodes, unload):
    """Core moves a weight back from a device as a new host tensor: a copy unloaded from a GPU would hold a second
    host copy of every weight. Simulated here (no GPU): the copy's weights replaced by equal new tensors, as an unload
    leaves them; after core's unload each shares its input's tensor again, but a weight whose values differ does not."""
    import comfy.model_patcher

    mappings, _ = nodes
    model = tiny_qwen2()
    plain = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    copy = mappings["ApplyStreamwisePolicy"].execute(plain, "decoder-llm").args[0]
    copy.load(torch.device("cpu"))
    source = dict(model.named_parameters())
    copied = dict(copy.model.named_parameters())
    assert all(copied[name].data_ptr() == tensor.data_ptr() for name, tensor in source.items())  # one copy to start
    for tensor in copied.values():
        tensor.data = tensor.data.clone()  # as an unload from a device leaves them
    changed = "model.layers.0.mlp.up_proj.weight"
    copied[changed].data += 1
    if unload == "unpatch_model":
        copy.unpatch_model(device_to=torch.device("cpu"))
    else:
        copy.partially_unload(torch.device("cpu"), 0)
    apart = sorted(name for name, tensor in source.items() if copied[name].data_ptr() != tensor.data_ptr())
    assert apart == [changed]


def test_a_copy_unloaded_before_its_input_shares_the_inputs_new_host_tensors(nodes):
    """The other order, as core's unload of every model takes them: the copy comes back while its input is still on
    the device (simulated: the input's weights are other tensors, of other values), then the input comes back as new
    host tensors, which the copy takes, so host memory again holds one copy of the weights."""
    mappings, _ = nodes
    source = streamwise.model_patcher(tiny_qwen2(), load_device=torch.device("cpu"),
                                      offload_device=torch.device("cpu"), policy="decoder-llm")
    copy = mappings["ApplyStreamwisePolicy"].execute(source, "decoder-llm").args[0]
    mine, theirs = dict(source.model.named_parameters()), dict(copy.model.named_parameters())
    values = {name: tensor.detach().clone() for name, tensor in mine.items()}
    for name, tensor in mine.items():
        tensor.data = values[name] + 1  # the input, loaded on the device: not these host tensors
        theirs[name].data = values[name].clone()  # the copy, back from the device
    copy.unpatch_model(device_to=torch.device("cpu"))
    assert not any(theirs[name].data_ptr() == tensor.data_ptr() for name, tensor in mine.items())
    for name, tensor in mine.items():
        tensor.data = values[name].clone()  # the input, back from the device
    source.unpatch_model(device_to=torch.device("cpu"))
    assert all(theirs[name].data_ptr() == tensor.data_ptr() for name, tensor in mine.items())
    assert all(torch.equal(tensor, values[name]) for name, tensor in theirs.items())


def test_a_device_without_an_index_is_the_current_one_so_core_unloads_it(nodes, monkeypatch):
    """Core unloads only models whose load device equals its own `cuda:0`, and `cuda` does not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    patcher = streamwise.model_patcher(tiny_qwen2(), load_device=torch.device("cuda"),
                                       offload_device=torch.device("cpu"), policy="decoder-llm")
    assert patcher.load_device == torch.device("cuda", 0) and patcher.offload_device == torch.device("cpu")


def test_a_stranding_plan_is_refused_by_model_patcher_and_the_apply_node_unless_accepted(nodes):
    import comfy.model_patcher

    mappings, _ = nodes
    cpu = torch.device("cpu")
    tree = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    linears = {"schema_version": 1, "policy": {"name": "linears"},
               "stream": {"rule": [{"id": "l", "kind": "linear", "select": {"class": "Linear"}}]}}
    policy = Policy.model_validate(linears)
    refused = (r"(?s)error\[stranded-tensors\]: policy `linears` on `Sequential`: 2 tensors .*allow_stranded"
               r".*`LayerNorm` x2")
    with pytest.raises(streamwise.PolicyError, match=refused):
        streamwise.model_patcher(tree, load_device=cpu, offload_device=cpu, policy=policy)
    assert type(tree[0]) is torch.nn.Linear and applied_state(tree) is None  # refused before any change
    streamwise.model_patcher(tree, load_device=cpu, offload_device=cpu, policy=policy, allow_stranded=True)
    assert type(tree[0]).__name__ == "StreamedLinear"
    with pytest.raises(streamwise.PolicyError, match="stranded-tensors"):  # converted elsewhere: refused too
        streamwise.model_patcher(tree, load_device=cpu, offload_device=cpu)

    foreign = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    plain = comfy.model_patcher.ModelPatcher(foreign, load_device=cpu, offload_device=cpu)
    node = mappings["ApplyStreamwisePolicy"]
    assert node.INPUT_TYPES()["optional"]["allow_stranded"][1]["default"] is False
    (converted,) = node.execute(plain, "any-module").args  # nothing stranded: no opt-in needed
    assert applied_state(converted.model).plan.coverage.complete


def test_errors_reach_the_ui_as_rendered_diagnostics(nodes):
    mappings, _ = nodes
    with pytest.raises(streamwise.PolicyError) as raised:  # the package's own class, however ComfyUI named the pack
        mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "vibevoice", "auto")
    assert str(raised.value).startswith("error[unmatched-rule]") and "vibevoice.toml:46:1" in str(raised.value)


def test_apply_policy_node_picks_the_policy_by_auto(nodes):
    import comfy.model_patcher

    mappings, _ = nodes
    model = tiny_qwen2()
    plain = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    (converted,) = mappings["ApplyStreamwisePolicy"].execute(plain, "auto").args
    assert applied_state(converted.model).plan.policy == "decoder-llm" and applied_state(model) is None
    assert type(converted.model.lm_head).__name__ == "StreamedLinear" and type(model.lm_head) is torch.nn.Linear


def recording_progress_bar(monkeypatch, on_update=lambda value: None):
    """Swap in a ComfyUI ProgressBar that records every update (the hook of newer cores is throttled)."""
    import comfy.utils

    bars = []

    class Recording(comfy.utils.ProgressBar):
        def __init__(self, total, node_id=None):
            super().__init__(total, node_id)
            self.values = []
            bars.append(self)

        def update_absolute(self, value, total=None, preview=None):
            super().update_absolute(value, total, preview)
            self.values.append(value)
            on_update(value)

    monkeypatch.setattr(comfy.utils, "ProgressBar", Recording)
    return bars


def test_generate_text_is_an_output_node_with_tooltips(nodes):
    mappings, root = nodes
    cls = mappings["StreamwiseGenerateText"]
    assert cls.OUTPUT_NODE is True and list(cls.RETURN_NAMES) == ["text"]
    inputs = cls.INPUT_TYPES()["required"]
    assert list(inputs) == ["model", "prompt", "system", "chat", "max_new_tokens", "seed", "sampling", "temperature",
                            "top_p", "top_k"]
    assert list(cls.INPUT_TYPES()["optional"]) == ["image"] and list(cls.OUTPUT_IS_LIST) == [True]
    assert inputs["sampling"][1]["options"] == ["model default", "greedy", "custom"]
    assert inputs["sampling"][1]["default"] == "model default" and inputs["chat"][1]["default"] is True
    assert all(spec[1].get("tooltip") for spec in [*inputs.values(), *cls.INPUT_TYPES()["optional"].values()])
    patcher, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "auto", "auto").args
    out = generate_text(mappings, patcher, "a cat sat on the mat", 8)
    assert out.ui == {"text": out.args[0]}
    assert out.args == ([reference_text(root / "tiny-qwen2", "a cat sat on the mat", 8)],)
    chat = generate_text(mappings, patcher, "a cat sat on the mat", 8, chat=True, sampling="model default")
    assert chat.args == out.args  # tiny_tokenizer has no chat template: continued as it is, greedy by its config


def test_generate_text_moves_the_progress_bar_once_per_token(nodes, monkeypatch):
    mappings, root = nodes
    patcher, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "auto", "auto").args
    bars = recording_progress_bar(monkeypatch)
    ((text,),) = generate_text(mappings, patcher, "a cat", 12).args
    (bar,) = bars
    assert bar.total == 12 and bar.values == list(range(1, 13))  # the tiny model has no end-of-text: all 12 tokens
    assert text == reference_text(root / "tiny-qwen2", "a cat", 12)


def test_generate_text_stops_within_a_token_of_an_interrupt(nodes, monkeypatch):
    import comfy.model_management

    mappings, root = nodes
    patcher, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "auto", "auto").args
    after = 3
    bars = recording_progress_bar(
        monkeypatch, lambda value: value == after and comfy.model_management.interrupt_current_processing(True))
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            generate_text(mappings, patcher, "a cat", 500)
        assert not comfy.model_management.processing_interrupted()  # raised the way ComfyUI's own check does
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert after <= len(bars[0].values) < after + 3
    monkeypatch.undo()
    ((text,),) = generate_text(mappings, patcher, "a cat", 4).args  # the model is still usable
    assert text == reference_text(root / "tiny-qwen2", "a cat", 4)


@pytest.mark.parametrize("build", [tiny_t5, tiny_llava], ids=["encoder-decoder", "vision-language"])
def test_generate_text_equals_transformers_greedy_and_sampled(nodes, build):
    """T5's output is the decoder's alone (none of it cut off as if it began with the prompt); a vision-language
    model (Llava) generates from a text prompt alone, bounded by its text decoder's context."""
    import transformers

    mappings, root = nodes
    folder = root / f"tiny-{build.__name__}"
    torch.manual_seed(0)
    build().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    patcher, _ = mappings["StreamwiseModelLoader"].execute(f"streamwise/{folder.name}", "auto", "auto").args
    reference = transformers.AutoModelForImageTextToText if build is tiny_llava else transformers.AutoModelForSeq2SeqLM
    reference = reference.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    prompt = "a cat sat on the mat and looked at the dog " * 3  # longer than the output: all of it was cut before
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    for do_sample in (False, True):
        sampling = "custom" if do_sample else "greedy"
        ((text,),) = generate_text(mappings, patcher, prompt, 8, seed=7, sampling=sampling).args
        torch.manual_seed(7)
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=8, do_sample=do_sample, pad_token_id=tokenizer.pad_token_id,
                                     **(dict(temperature=0.7, top_p=0.9, top_k=50) if do_sample else {}))
        made = out[0] if build is tiny_t5 else out[0, ids.shape[1]:]
        expected = tokenizer.decode(made, skip_special_tokens=True)
        assert text and text == expected, do_sample


def test_generate_text_refuses_a_prompt_past_the_context_before_any_forward(nodes, monkeypatch):
    mappings, _ = nodes
    patcher, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "auto", "auto").args
    forwards = []
    patcher.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    context = patcher.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"^prompt: 2000000 characters, more than {32 * context} .*context of "
                                         rf"{context}"):
        generate_text(mappings, patcher, "x" * 2_000_000, 8)
    with pytest.raises(ValueError, match=r"^prompt: holds a lone surrogate \(U\+DC00\) at character 3"):
        generate_text(mappings, patcher, "ab\udc00", 8)
    assert forwards == []
    patcher.model.config.max_position_embeddings = 16  # a small context: max_new_tokens clipped, said on the node
    try:
        result = generate_text(mappings, patcher, "a cat", 8192)
    finally:
        patcher.model.config.max_position_embeddings = context
    ((text,),) = result.args
    assert "max_new_tokens clipped from 8192 to" in result.ui["text"][0] and text


def test_a_broken_user_policy_fails_auto_naming_the_file_unless_skipped_and_then_reported(nodes):
    mappings, _ = nodes
    user = Path(__import__("folder_paths").get_user_directory()) / "streamwise" / "policies"
    broken = write_policy(user, "mine", '\n[match]\nclasses = ["Qwen2ForCausalLM"\n')  # a TOML syntax error
    try:
        for node, args in ((mappings["StreamwiseModelLoader"], ("streamwise/tiny-qwen2", "auto", "auto")),
                           (mappings["ApplyStreamwisePolicy"], (mappings["StreamwiseModelLoader"].execute(
                               "streamwise/tiny-qwen2", "decoder-llm", "auto").args[0], "auto"))):
            with pytest.raises(streamwise.PolicyError) as raised:
                node.execute(*args)
            assert f"{broken}:" in str(raised.value) and "error[unreadable-policy]" in str(raised.value)
            out = node.execute(*args, skip_unreadable_policies=True)
            assert f"skipped unreadable {broken}" in out.ui.as_dict()["text"][0]
    finally:
        broken.unlink()


def test_generate_text_passes_only_the_flags_that_apply(nodes):
    import io
    import logging

    from transformers.utils import logging as transformers_logging

    mappings, _ = nodes
    patcher, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "auto", "auto").args
    # A checkpoint's generation_config.json that samples (as instruction-tuned Qwen2.5 ships) must stay quiet too.
    patcher.model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.8, top_k=20)
    sampled = generation_config(patcher.model, 8, 1, Sampling("custom", temperature=0.7, top_p=0.9, top_k=40))
    assert (sampled.do_sample, sampled.temperature, sampled.top_p, sampled.top_k) == (True, 0.7, 0.9, 40)
    assert generation_config(patcher.model, 8, 1, Sampling("greedy", 0.7, 0.9, 40)).do_sample is False
    default = generation_config(patcher.model, 8, 1, Sampling("model default", 0.7, 0.9, 40))
    assert (default.do_sample, default.temperature, default.top_p, default.top_k) == (True, 0.6, 0.8, 20)
    assert patcher.model.generation_config.temperature == 0.6  # the model's own config is left as it was
    captured = io.StringIO()
    handler = logging.StreamHandler(captured)
    library = transformers_logging.get_logger("transformers")  # its records do not propagate to caplog
    library.addHandler(handler)
    try:
        transformers_logging.warning_once.cache_clear()  # it logs each message once per process
        patcher.model.generate(torch.tensor([[3, 4]]), max_new_tokens=2, do_sample=False, temperature=0.7)
        assert "generation flags are not valid" in captured.getvalue()  # the capture sees the warning
        transformers_logging.warning_once.cache_clear()
        captured.truncate(0)
        for sampling in ("greedy", "custom", "model default"):
            generate_text(mappings, patcher, "a cat", 4, sampling=sampling)
    finally:
        library.removeHandler(handler)
    assert "not valid" not in captured.getvalue()


def test_a_previous_model_gives_its_host_memory_back_and_still_computes_the_same(nodes):
    """What a loader node run again does with its previous model before a load is refused for memory: its weights
    go back to their file, and it computes what it computed."""
    from streamwise.runtime.checkpoint.tiers import HostBudgetError
    from streamwise.runtime.hosts.comfyui import give_back_host_memory, load_again

    mappings, root = nodes
    patcher, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "decoder-llm", "auto").args
    ((before,),) = generate_text(mappings, patcher, "a cat sat on the mat", 8).args
    tree = patcher.model
    held = sum(p.nbytes for p in tree.parameters() if file_tier.in_memory(p))
    given = give_back_host_memory(patcher)
    assert given > held // 2 and file_tier.in_file(tree.lm_head) and file_tier.in_file(tree.model.layers[0].mlp.up_proj)
    ((after,),) = generate_text(mappings, patcher, "a cat sat on the mat", 8).args
    assert after == before == reference_text(root / "tiny-qwen2", "a cat sat on the mat", 8)
    again, _ = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-qwen2", "decoder-llm", "auto").args
    tries = []

    def load():  # refused for memory while the node's previous model holds it
        tries.append(file_tier.in_file(again.model.lm_head))
        if len(tries) == 1:
            raise HostBudgetError(["a test's budget"])
        return again, "loaded"

    load_again("7", lambda: (again, "first"))
    assert load_again("7", load) == (again, "loaded") and tries == [False, True]  # it gave its memory back first

    def refused():
        raise HostBudgetError(["a test's budget"])

    with pytest.raises(HostBudgetError):
        load_again("8", refused)  # no previous model of that node to make room: the refusal stands
