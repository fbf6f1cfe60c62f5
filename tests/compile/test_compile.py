"""Quantized Lazy Torch Compile: lazy, regional, streaming-friendly, quant-aware, never fatal."""

from __future__ import annotations

import copy
import inspect
import logging
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import streamwise
from streamwise.runtime.compile import INT4_MESSAGE, compile_stats, disarm, regions
from streamwise.runtime.engine import protocol
from streamwise.runtime.hosts.comfyui.compile import DYNAMIC_VRAM_MESSAGE, PER_CALL_DICTS

from helpers import force_streaming, make_policy, stream_rule
from toy_blocks import Block, Net

POLICY = make_policy(
    stream={"rule": [
        stream_rule("linear", "linear", **{"class": "Linear"}),
        stream_rule("norm", "layer_norm", **{"class": "LayerNorm"}),
    ]},
    compile={"blocks": {"class": "Block"}},
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(model, *inputs):
    with torch.no_grad():
        return model(*inputs)


def test_nothing_is_traced_until_the_first_forward():
    model = Net()
    streamwise.lazy_compile(model, POLICY, backend="aot_eager")
    stats = compile_stats(model)
    assert (stats.applied, stats.units, stats.regions, stats.graphs, stats.compile_seconds) == (True, 12, 1, 0, 0.0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_twelve_identical_blocks_compile_into_one_graph(backend, monkeypatch):
    ticks = iter(range(0, 10_000, 10))
    monkeypatch.setattr(regions, "perf_counter", lambda: next(ticks))  # each reading 10 s after the last
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 32)
    expected = run(model, x)
    streamwise.lazy_compile(model, POLICY, backend=backend)
    assert torch.allclose(run(model, x), expected, atol=1e-5)
    assert torch.allclose(run(model, x), expected, atol=1e-5)
    stats = compile_stats(model)
    assert (stats.graphs, stats.graph_breaks, stats.fallbacks) == (1, 0, [])
    assert stats.compile_seconds == 10  # the one call that compiled: read before it and after it


def test_a_streaming_tree_still_compiles_into_one_graph():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 32)
    expected = run(model, x)
    streamwise.apply(streamwise.resolve(POLICY, model), model)
    force_streaming(model)  # every leaf fetches its weights inside the compiled block
    streamwise.lazy_compile(model, POLICY, backend="aot_eager")
    assert torch.allclose(run(model, x), expected, atol=1e-5)
    stats = compile_stats(model)
    assert (stats.graphs, stats.graph_breaks) == (1, 0)


def test_a_tree_reading_its_blocks_from_the_file_compiles_and_computes_the_same(tmp_path):
    """A compiled block cannot read a file: each read from the file tier runs eagerly at a graph break (traced, the
    tier's bookkeeping made a block compute with another unit's weights)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 32)
    expected = run(model, x)
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, tmp_path / "net.safetensors")
    fresh = Net()
    report = streamwise.load(fresh, tmp_path / "net.safetensors", POLICY, max_memory={"cpu": 40_000},
                             progress=False)
    assert report.tiers.file_units >= 12
    streamwise.lazy_compile(fresh, POLICY, backend="aot_eager")
    for _ in range(3):
        assert torch.allclose(run(fresh, x), expected, atol=1e-5)
    stats = compile_stats(fresh)
    assert stats.graphs >= 1 and stats.fallbacks == []


@pytest.mark.parametrize("fmt", ["int8", "convrot_int8"])
def test_int8_residents_compile(fmt):
    model = Net()
    rule = {
        "id": "q", "select": {"path": "blocks.*.up"}, "format": fmt,
        **({"group_size": 16} if "convrot" in fmt else {}),
    }
    policy = POLICY.model_copy(update={"quant": make_policy(quant={"rule": [rule]}).quant})
    streamwise.apply(streamwise.resolve(policy, model), model)
    x = torch.randn(2, 32)
    expected = run(model, x)
    streamwise.lazy_compile(model, policy)  # inductor, the default: it calls the CPU kernel as an opaque op
    assert torch.allclose(run(model, x), expected, atol=1e-4)
    assert compile_stats(model).fallbacks == [] and compile_stats(model).graphs >= 1


def test_a_patched_resident_compiles_without_graph_breaks():
    model = Net(blocks=2)
    rule = {"id": "q", "select": {"path": "blocks.*.up"}, "format": "int8"}
    policy = POLICY.model_copy(update={"quant": make_policy(quant={"rule": [rule]}).quant})
    streamwise.apply(streamwise.resolve(policy, model), model)
    delta = torch.randn(128, 32) * 0.01
    for block in model.blocks:
        block.up.weight_function = [lambda w: w + delta]  # a LoRA patch, as a host attaches it
    x = torch.randn(2, 32)
    expected = run(model, x)
    streamwise.lazy_compile(model, policy, backend="aot_eager")
    assert torch.allclose(run(model, x), expected, atol=1e-5)
    assert compile_stats(model).graph_breaks == 0


def test_half_precision_gguf_residents_compile_without_graph_breaks(tmp_path):
    from streamwise.runtime.cli.streamwise import main

    from helpers import gguf_policy, tiny_qwen2

    torch.manual_seed(0)
    tiny_qwen2().save_pretrained(tmp_path)
    policy = gguf_policy(tmp_path, "F16")
    assert main(["quantize", str(tmp_path), str(tmp_path / "f16.gguf"), "--policy", str(policy)]) == 0
    with streamwise.skeleton():
        model = tiny_qwen2()
    assert streamwise.load(model, tmp_path / "f16.gguf", policy).residents == {"gguf": 15}
    ids = torch.tensor([[1, 2, 3]])
    expected = run(model, ids).logits
    streamwise.lazy_compile(model, policy, backend="aot_eager")
    assert torch.allclose(run(model, ids).logits, expected, atol=1e-5)
    assert compile_stats(model).graph_breaks == 0 and compile_stats(model).fallbacks == []


def test_convrot_int4_residents_keep_the_model_eager():
    model = Net()
    rule = {"id": "q", "select": {"path": "blocks.*.up"}, "format": "convrot_int4", "group_size": 16}
    policy = POLICY.model_copy(update={"quant": make_policy(quant={"rule": [rule]}).quant})
    streamwise.apply(streamwise.resolve(policy, model), model)
    x = torch.randn(2, 32)
    expected = run(model, x)
    with pytest.warns(UserWarning, match=INT4_MESSAGE):
        streamwise.lazy_compile(model, policy, backend="aot_eager")
    assert torch.equal(run(model, x), expected)
    stats = compile_stats(model)
    assert (stats.applied, stats.reason, stats.graphs) == (False, INT4_MESSAGE, 0)


def test_a_compile_error_falls_back_to_eager_once():
    calls = []

    def broken_backend(graph, inputs):
        calls.append(1)
        raise RuntimeError("backend exploded")

    torch._dynamo.register_backend(broken_backend, name="sw_broken_test")
    model = Net(blocks=3)
    x = torch.randn(2, 32)
    expected = run(model, x)
    with pytest.warns(UserWarning, match="running it eagerly"):
        streamwise.lazy_compile(model, POLICY, backend="sw_broken_test")
        result = run(model, x)
    assert torch.allclose(result, expected)
    assert torch.allclose(run(model, x), expected)
    assert len(calls) == 1  # remembered: never retried
    assert compile_stats(model).fallbacks and "backend exploded" in compile_stats(model).fallbacks[0]


def test_a_wrong_input_is_the_callers_error_and_compilation_stays_on():
    model = Net(blocks=2)
    streamwise.lazy_compile(model, POLICY, backend="aot_eager")
    with pytest.raises(RuntimeError) as raised:
        run(model, torch.randn(2, 31))
    assert not isinstance(raised.value, torch._dynamo.exc.TorchDynamoException)  # the eager forward's own error
    assert raised.value.__context__ is None  # not chained to dynamo's traceback
    run(model, torch.randn(2, 32))
    stats = compile_stats(model)
    assert stats.graphs >= 1 and stats.fallbacks == []


def test_a_mode_reaches_inductor(monkeypatch):
    from torch._inductor import list_mode_options

    compiled_with = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compiled_with.append(dict(kwargs["options"]))
                        or real_compile(*args, **kwargs))  # copied: torch pops the guard filter out of it
    model = Net(blocks=2)
    x = torch.randn(2, 32)
    expected = run(model, x)
    streamwise.lazy_compile(model, POLICY, mode="reduce-overhead")  # guard filter on: torch takes options, not both
    assert torch.allclose(run(model, x), expected, atol=1e-5)
    assert compile_stats(model).graphs >= 1 and compile_stats(model).fallbacks == []
    (options,) = compiled_with
    assert list_mode_options("reduce-overhead").items() <= options.items() and "guard_filter_fn" in options
    with pytest.raises(ValueError, match="an inductor setting; backend `aot_eager` takes none"):
        streamwise.lazy_compile(Net(blocks=1), POLICY, backend="aot_eager", mode="reduce-overhead")


def test_a_per_instance_forward_is_compiled_and_restored():
    import types

    model = Net(blocks=2)
    own = types.MethodType(lambda self, x: 2 * Block.forward(self, x), model.blocks[0])
    model.blocks[0].forward = own  # what hooks (accelerate's, say) install
    x = torch.randn(2, 32)
    expected = run(model, x)
    streamwise.lazy_compile(model, POLICY, backend="aot_eager")
    assert torch.allclose(run(model, x), expected, atol=1e-5)
    assert (compile_stats(model).regions, compile_stats(model).graphs) == (2, 2)  # its own forward, compiled too
    disarm(model)
    assert model.blocks[0].forward is own and "forward" not in model.blocks[1].__dict__


def test_graphs_are_counted_once_and_on_the_copy_that_compiles():
    import copy

    model = Net(blocks=3)
    streamwise.lazy_compile(model, POLICY, backend="aot_eager", dynamic=True)
    run(model, torch.randn(2, 32))
    assert compile_stats(model).graphs == 1  # dynamo restarting its analysis is not a second graph
    twin = copy.deepcopy(model)
    before = compile_stats(model).graphs
    twin(torch.randn(2, 32, requires_grad=True))  # grad mode and a grad input: the twin compiles a new graph
    assert (compile_stats(twin).graphs, compile_stats(model).graphs) == (before + 1, before)


def test_recompiles_are_counted_with_their_reasons():
    model = Net(blocks=2)
    streamwise.lazy_compile(model, POLICY, backend="aot_eager", dynamic=False)
    run(model, torch.randn(2, 32))
    run(model, torch.randn(5, 32))
    stats = compile_stats(model)
    assert stats.graphs == 2 and len(stats.recompiles) == 1
    assert "size" in stats.recompiles[0]


def test_without_blocks_the_whole_model_compiles_with_a_warning():
    model = Net(blocks=2)
    with pytest.warns(UserWarning, match="compiling the whole model"):
        streamwise.lazy_compile(model, backend="aot_eager")
    assert compile_stats(model).units == 1
    model2 = Net(blocks=2)
    with pytest.warns(UserWarning, match="compiling the whole model"):
        streamwise.lazy_compile(model2, POLICY, backend="aot_eager", compile_transformer_blocks_only=False)


def test_without_a_policy_the_converting_plans_blocks_compile():
    model = Net(blocks=3)
    streamwise.apply(streamwise.resolve(POLICY, model), model)  # POLICY (`test`) is on no policy path
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compiling the whole model" fallback
        streamwise.lazy_compile(model, backend="aot_eager")
    stats = compile_stats(model)
    assert (stats.applied, stats.units, stats.regions) == (True, 3, 1)


def test_only_backends_that_can_run_here_are_offered_and_accepted(monkeypatch):
    """torch lists `tvm` and `openxla` whether or not their packages are installed, and `cudagraphs` without CUDA."""
    import importlib.util

    from streamwise.runtime.compile.settings import runnable_backends

    installed = {"tvm": None, "torch_xla": None}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: installed.get(name, real_find_spec(name, *a)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    offered = runnable_backends()  # other tests may register backends of their own
    assert {"aot_eager", "eager", "inductor"} <= set(offered) and not {"tvm", "openxla", "cudagraphs"} & set(offered)
    model = Net(blocks=1)
    needs_of = {"tvm": "the `tvm` package", "openxla": "the `torch_xla` package", "cudagraphs": "CUDA"}
    for backend, needs in needs_of.items():
        with pytest.raises(ValueError, match=f"backend `{backend}` needs {re.escape(needs)}"):
            streamwise.lazy_compile(model, POLICY, backend=backend)
    assert not any("forward" in block.__dict__ for block in model.blocks)  # nothing armed
    installed["tvm"] = object()  # a spec: the package is there
    assert "tvm" in runnable_backends()


def test_settings_are_validated():
    with pytest.raises(ValueError, match="not a torch.compile backend"):
        streamwise.lazy_compile(Net(blocks=1), POLICY, backend="inducter")
    armed = streamwise.lazy_compile(Net(blocks=2), POLICY, backend="aot_eager")
    with pytest.raises(ValueError, match="not a torch.compile backend"):
        streamwise.lazy_compile(armed, POLICY, backend="inducter")
    stats = compile_stats(armed)
    assert (stats.applied, stats.units) == (True, 2)
    assert all("forward" in block.__dict__ for block in armed.blocks)
    with pytest.raises(ValueError, match="compile mode `turbo`"):
        streamwise.lazy_compile(Net(blocks=1), POLICY, mode="turbo")
    with pytest.raises(TypeError, match="unknown compile setting"):
        streamwise.lazy_compile(Net(blocks=1), POLICY, fullgraf=True)


class Tagged(nn.Module):
    """A block that recompiles for every new `tag` (a string: no dynamic shape can absorb it)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x, tag: str):
        return self.block(x) + len(tag)


def in_a_thread(function):
    """Run `function` in a fresh thread, as ComfyUI runs a prompt: a fresh context, none of the caller's config."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(function).result()


def test_the_cache_limit_set_at_arming_holds_in_the_thread_that_runs_the_forward():
    model = Tagged()
    streamwise.lazy_compile(model, make_policy(compile={"blocks": {"class": "Tagged"}}), backend="aot_eager",
                            dynamo_cache_size_limit=12)
    in_a_thread(lambda: [run(model, torch.randn(2, 32), tag) for tag in "abcdefghij"])
    stats = compile_stats(model)
    assert (stats.graphs, stats.fallbacks) == (10, [])  # torch's default limit (8) would have stopped at 8
    assert torch._dynamo.config.recompile_limit == 8  # and no setting of this thread's changed


def test_hitting_the_limit_is_recorded_told_and_does_not_stop_the_next_arming():
    policy = make_policy(compile={"blocks": {"class": "Tagged"}})
    model = Tagged()
    x = torch.randn(2, 32)
    streamwise.lazy_compile(model, policy, backend="aot_eager", dynamo_cache_size_limit=2)
    with pytest.warns(UserWarning, match=r"stopped compiling: Tagged: hit the recompile limit \(2 graphs\)"):
        results = [run(model, x, tag) for tag in "abcd"]
    expected = run(model.block, x)  # the eager block: the unit is the Tagged module around it
    assert all(torch.allclose(result, expected + len(tag)) for result, tag in zip(results, "abcd", strict=True))
    stats = compile_stats(model)
    assert stats.graphs == 2 and len(stats.fallbacks) == 1 and "dynamo_cache_size_limit" in stats.fallbacks[0]
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:  # torch 2.13+: each arming its own
        streamwise.lazy_compile(model, policy, backend="aot_eager", dynamo_cache_size_limit=2)
        run(model, x, "e")
        assert (compile_stats(model).graphs, compile_stats(model).fallbacks) == (1, [])


def greedy(model, tokens: int):
    with torch.no_grad():
        return model.generate(torch.tensor([[1, 2, 3, 4, 5, 6]]), max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False)


def test_a_decoder_compiles_a_fixed_number_of_graphs_however_many_tokens_it_decodes():
    from helpers import tiny_qwen2

    torch.manual_seed(0)
    model = tiny_qwen2()
    expected = greedy(model, 32)
    streamwise.lazy_compile(model, "decoder-llm", backend="aot_eager")  # dynamic_shape_tracing off, the default
    assert torch.equal(greedy(model, 8), expected[:, :14])
    graphs = compile_stats(model).graphs
    assert torch.equal(greedy(model, 32), expected)
    stats = compile_stats(model)
    # the prompt (the layer index static, then unspecialized from the second layer on), the first step, then the
    # step that makes the KV length dynamic; none for the 24 further tokens
    assert stats.graphs == graphs <= 4 and stats.graph_breaks == 0 and stats.fallbacks == []
    assert any("size mismatch" in reason for reason in stats.recompiles)


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_every_layer_shares_the_decoders_graphs_whatever_its_depth(streamed):
    from helpers import tiny_qwen2

    counted = []
    for layers in (2, 6):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = tiny_qwen2(num_hidden_layers=layers)
        expected = greedy(model, 8)
        if streamed:
            streamwise.offload(model, "decoder-llm", device="cpu", budget=0)  # every leaf fetches in the graph
        streamwise.lazy_compile(model, "decoder-llm", backend="aot_eager")
        assert torch.equal(greedy(model, 8), expected)
        stats = compile_stats(model)
        assert (stats.graph_breaks, stats.fallbacks) == (0, [])
        counted.append(stats.graphs)
    assert counted[0] == counted[1]


class Looped(nn.Module):
    """A block run at several depths, as looped and shared-block models run theirs: its cache slot is its
    `layer_idx` plus the call's offset."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_idx = 0
        self.proj = nn.Linear(8, 8)

    def forward(self, x, cache, offset: int = 0):
        keys, values = cache.update(self.proj(x), x, self.layer_idx + offset)
        return x + keys.mean(-2, keepdim=True) + values.mean(-2, keepdim=True)


def test_a_block_that_updates_another_layers_slot_reaches_that_slot():
    from transformers.cache_utils import Cache, DynamicLayer

    torch.manual_seed(0)
    block = Looped()
    twin = Looped()
    twin.load_state_dict(block.state_dict())
    caches = [Cache(layers=[DynamicLayer(), DynamicLayer()]) for _ in range(2)]
    streamwise.lazy_compile(block, make_policy(compile={"blocks": {"class": "Looped"}}), backend="aot_eager")
    for x in torch.randn(3, 1, 2, 1, 8):
        for offset in (0, 1):  # slot 0 is the block's own, slot 1 another layer's
            assert torch.equal(run(block, x, caches[0], offset), run(twin, x, caches[1], offset))
    for compiled, eager in zip(*(cache.layers for cache in caches), strict=True):
        assert torch.equal(compiled.keys, eager.keys) and torch.equal(compiled.values, eager.values)
        assert compiled.keys.shape[-2] == 3
    assert compile_stats(block).fallbacks == []


def test_a_blocks_view_of_the_cache_is_the_shared_cache_seen_from_its_slot():
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    from streamwise.runtime.compile.cache_slots import CacheSlots

    block, cache = Looped(), DynamicCache(config=transformers_config(layers=3))
    block.layer_idx = 1
    args, kwargs, viewed = CacheSlots().bind(block, (torch.ones(1),), {"cache": cache})
    view = kwargs["cache"]
    assert viewed and isinstance(view, DynamicCache) and view is not cache and torch.equal(args[0], torch.ones(1))
    assert [view.layers[i] for i in range(3)] == cache.layers and len(view.layers) == 3
    mine, other = DynamicLayer(), DynamicLayer()
    view.layers[1], view.layers[2] = mine, other  # writes reach the shared list, and the slot follows its own
    assert cache.layers[1:] == [mine, other] and view.layers[1] is mine
    keys = torch.ones(1, 2, 3, 4)
    view.update(keys, keys, 1)
    assert torch.equal(cache.layers[1].keys, keys) and not cache.layers[2].is_initialized
    assert CacheSlots().bind(nn.Linear(2, 2), (), {"cache": cache})[2] is False  # no layer_idx: passed as it is
    assert CacheSlots().bind(block, (), {"cache": Cache(layers=[DynamicLayer()])})[2] is False  # no slot 1


def transformers_config(layers: int):
    import transformers

    return transformers.Qwen2Config(num_hidden_layers=layers, hidden_size=8, num_attention_heads=2,
                                    num_key_value_heads=2)


def test_disarm_restores_eager_forwards():
    model = Net(blocks=2)
    streamwise.lazy_compile(model, POLICY, backend="aot_eager")
    assert "forward" in model.blocks[0].__dict__
    disarm(model)
    assert "forward" not in model.blocks[0].__dict__


def test_verbose_logs_preparation_and_graph_growth(caplog):
    model = Net(blocks=2)
    with caplog.at_level(logging.INFO, logger="streamwise.compile"):
        streamwise.lazy_compile(model, POLICY, backend="aot_eager", verbose=True)
        run(model, torch.randn(2, 32))
    text = caplog.text
    assert "armed 2 unit(s) in 1 region(s)" in text and "1 new graph(s)" in text


def test_guard_filter_drops_guards_on_comfyuis_per_call_dicts():
    class Entry:
        def __init__(self, name):
            self.name = name

    entries = [Entry("L['x']"), Entry("L['kwargs']['transformer_options']['sigmas']"), Entry("L['self'].up.weight")]
    assert regions.guard_filter(PER_CALL_DICTS)(entries) == [True, False, True]


class FakePatcher:
    """Just what lazy_compile uses of a ComfyUI MODEL: dynamic VRAM cannot run on a CPU core."""

    def __init__(self, dynamic: bool) -> None:
        self.model, self.load_device, self.dynamic, self.clones = Net(blocks=2), torch.device("cpu"), dynamic, []
        self.object_patches = {}

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def is_dynamic(self):
        return self.dynamic

    def clone(self, disable_dynamic=False):
        self.clones.append(disable_dynamic)
        return FakePatcher(dynamic=not disable_dynamic)


def test_a_model_no_host_recognizes_is_refused_naming_the_registered_hosts():
    with pytest.raises(TypeError, match=r"cannot compile a str: .* \(registered: comfyui\)"):
        streamwise.lazy_compile("a model", POLICY)


def test_the_compile_stage_imports_no_host():
    """Hosts hand their targets to the compile stage (ComfyUI's registers itself), never the other way round."""
    import ast

    from helpers import REPO

    imported = set()
    for path in (REPO / "runtime" / "compile").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):  # relative to streamwise.runtime.compile
                base = ["streamwise", "runtime", "compile"][:4 - node.level] if node.level else []
                imported.add(".".join([*base, *filter(None, [node.module])]))
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert "streamwise.runtime.engine" in imported  # the check reads relative imports
    assert not [name for name in imported if name.startswith(("streamwise.runtime.hosts", "hosts"))]


def test_dynamic_vram_is_warned_about_or_demoted():
    patcher = FakePatcher(dynamic=True)
    with pytest.warns(UserWarning, match=re.escape(DYNAMIC_VRAM_MESSAGE)):
        assert streamwise.lazy_compile(patcher, POLICY, backend="aot_eager") is patcher
    demoted = streamwise.lazy_compile(patcher, POLICY, backend="aot_eager", disable_dynamic_vram=True)
    assert patcher.clones == [True] and demoted is not patcher and not demoted.is_dynamic()
    assert compile_stats(demoted).units == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streamwise.lazy_compile(FakePatcher(dynamic=False), POLICY, backend="aot_eager")


def test_arming_a_second_model_over_a_loaded_armed_tree_compiles_the_blocks_own_forward():
    first = FakePatcher(dynamic=False)
    streamwise.lazy_compile(first, POLICY, backend="aot_eager")
    for path, forward in first.object_patches.items():  # what ComfyUI does while `first` is loaded
        first.model.get_submodule(path.removesuffix(".forward")).forward = forward
    second = FakePatcher(dynamic=False)
    second.model = first.model  # a clone: same tree
    streamwise.lazy_compile(second, POLICY, backend="aot_eager")
    (region,) = {forward.func for forward in second.object_patches.values()}
    assert region.function is Block.forward and region is not next(iter(first.object_patches.values())).func


def test_a_model_left_eager_for_int4_still_reports_why():
    patcher = FakePatcher(dynamic=False)
    rule = {"id": "q", "select": {"path": "blocks.*.up"}, "format": "convrot_int4", "group_size": 16}
    policy = POLICY.model_copy(update={"quant": make_policy(quant={"rule": [rule]}).quant})
    streamwise.apply(streamwise.resolve(policy, patcher.model), patcher.model)
    with pytest.warns(UserWarning, match=INT4_MESSAGE):
        streamwise.lazy_compile(patcher, policy, backend="aot_eager")
    assert (compile_stats(patcher).applied, compile_stats(patcher).reason) == (False, INT4_MESSAGE)


def test_a_converted_dynamic_model_is_not_demoted():
    """Core demotes by rebuilding the model from its file, which would silently drop the conversion."""
    patcher = FakePatcher(dynamic=True)
    streamwise.apply(streamwise.resolve(POLICY, patcher.model), patcher.model)
    with pytest.warns(UserWarning, match="a Streamwise-converted MODEL is not demoted"):
        assert streamwise.lazy_compile(patcher, POLICY, backend="aot_eager", disable_dynamic_vram=True) is patcher
    assert patcher.clones == []


@pytest.mark.parametrize(("arm_first", "backend"), [(True, "aot_eager"), (False, "inductor")],
                         ids=["armed-then-offloaded", "offloaded-then-armed-inductor"])
def test_compiled_blocks_stream_by_units_with_copies_ahead(monkeypatch, arm_first, backend):
    """Streaming by units (CUDA; here the recording fake): each block's unit is entered around its graph, which
    reads the slot's views as inputs: one graph for every block, no break, the next block's copy issued before this
    block's graph runs, the numbers of the eager resident model."""
    from recording_device import RecordingOps

    from streamwise.runtime.engine.stream.streamer import UnitStreamer
    from streamwise.runtime.hosts import standalone

    ops = RecordingOps()
    monkeypatch.setattr(standalone, "device_ops", lambda device: ops)
    torch.manual_seed(0)
    model = Net(blocks=4)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 32)
    if arm_first:
        streamwise.lazy_compile(model, POLICY, backend=backend)
    streamwise.offload(model, POLICY, device="cpu", budget=0)
    if not arm_first:
        streamwise.lazy_compile(model, POLICY, backend=backend)
    fetcher = streamwise.runtime.convert.applied_state(model).tree.fetcher
    assert isinstance(fetcher, UnitStreamer) and len(fetcher.unit_of_block) == 4
    same = torch.equal if backend == "aot_eager" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert same(run(model, x), reference(x))
        settled = len(ops.log)
        assert same(run(model, x), reference(x))
    stats = compile_stats(model)
    assert stats.graphs == 1 and stats.graph_breaks == 0 and stats.recompiles == []
    forward = ops.log[settled:]
    waits = [i for i, entry in enumerate(forward) if entry[0] == "compute_after"]
    copies = [i for i, entry in enumerate(forward) if entry[0] == "copy"]
    assert len(copies) == len(fetcher.units)  # one per unit: every block's copy made ahead of it
    assert all(any(w < c < next_w for c in copies) for w, next_w in zip(waits, waits[1:], strict=False))
    assert not any(protocol.VIEWS in m.__dict__ for m in model.modules())  # handed over only while a graph runs


def test_a_policy_with_compile_enabled_arms_the_standalone_host():
    settings = POLICY.compile.model_copy(update={"enabled": True, "backend": "aot_eager"})
    policy = POLICY.model_copy(update={"compile": settings})
    model = Net(blocks=2)
    streamwise.offload(model, policy, device="cpu", budget=0)
    run(model, torch.randn(2, 32))
    assert compile_stats(model).graphs == 1


def test_gguf_residents_compile():
    import gguf

    from streamwise.runtime.quant.residents import make_resident

    model = Net(blocks=2)
    streamwise.apply(streamwise.resolve(POLICY, model), model)
    for block in model.blocks:
        blocks = gguf.quants.quantize(block.up.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
        make_resident(block.up, "gguf", {"weight": torch.from_numpy(blocks).reshape(-1)},
                      {"gguf_qtype": gguf.GGMLQuantizationType.Q8_0, "gguf_shape": tuple(block.up.weight.shape)})
    x = torch.randn(2, 32)
    expected = run(model, x)
    streamwise.lazy_compile(model, POLICY, backend="aot_eager")
    assert torch.allclose(run(model, x), expected, atol=1e-5)
    stats = compile_stats(model)
    assert stats.graphs == 1 and stats.graph_breaks == 0 and stats.fallbacks == []


def test_a_gguf_lookup_kernel_compiled_on_its_first_call_on_a_device_has_no_graph_break(monkeypatch):
    """Lookup tables are copied to a device outside any graph: the region's first call on it has the residents'
    format copy them before its graph is traced, so even a first call compiled before any eager one runs with no
    break (simulated here as a GPU runs it: the kernels' off-CPU path, every table as a device's)."""
    import gguf
    from gguf_blocks import as_on_a_gpu, random_bytes

    from streamwise.runtime.quant import gguf_tables
    from streamwise.runtime.quant.residents import make_resident

    as_on_a_gpu(monkeypatch, tables_as_a_devices=True)
    monkeypatch.setattr(gguf_tables, "_DEVICE_TABLES", {})  # no table copied yet
    model = Net(blocks=2)
    streamwise.apply(streamwise.resolve(POLICY, model), model)
    iq4_nl, mxfp4 = gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.MXFP4
    first, second = (tuple(block.up.weight.shape) for block in model.blocks)
    nibbles = random_bytes(iq4_nl, first).reshape(-1, 18)
    nibbles[:, :2] = np.full(len(nibbles), 0.002, np.float16).view(np.uint8).reshape(-1, 2)  # small scales
    quantized = gguf.quants.quantize(model.blocks[1].up.weight.detach().numpy(), mxfp4)
    for block, qtype, raw, shape in [(model.blocks[0], iq4_nl, nibbles, first),
                                     (model.blocks[1], mxfp4, quantized, second)]:
        make_resident(block.up, "gguf", {"weight": torch.from_numpy(raw).reshape(-1)},
                      {"gguf_qtype": qtype, "gguf_shape": shape})
    x = torch.randn(2, 32)
    streamwise.lazy_compile(model, POLICY, backend="aot_eager")
    compiled = run(model, x)
    stats = compile_stats(model)
    assert stats.graph_breaks == 0 and stats.fallbacks == [], stats
    disarm(model)
    assert torch.allclose(compiled, run(model, x), atol=1e-5)

