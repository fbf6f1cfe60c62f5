"""The shipped workflows through a real ComfyUI server: main.py --cpu in its own process group, driven over HTTP
(queue, history, cache, interrupt, free) as the frontend drives it. One server per module: a start takes 20-40 s."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO, module_from_file, reference_text

LAUNCHER = Path(__file__).with_name("launch_core.py")
WORKFLOWS = REPO / "examples" / "workflows"
PACK = "comfyui-streamwise"  # ComfyUI imports a pack as a module named after its folder: not `streamwise`
PACK_NODES = {"StreamwiseModelLoader", "ApplyStreamwisePolicy", "INT8LazyTorchCompile", "StreamwiseGenerateText",
              "StreamwiseGenerateSpeech", "StreamwisePolicyCheck"}
PROMPT = "a cat sat on the mat"


ui_format = module_from_file(WORKFLOWS / "ui_format.py")


def expected_text(folder: Path, graph: dict, node: str = "2") -> str:
    """transformers' text for the Generate Text node `node` of `graph` (its prompt, system turn, chat switch and
    max_new_tokens; the shipped workflows take the model's default sampling, the example models' greedy)."""
    inputs = graph[node]["inputs"]
    return reference_text(folder, inputs["prompt"], inputs["max_new_tokens"], inputs["system"], inputs["chat"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, base: Path):
        self.process, self.url, self.log = process, f"http://127.0.0.1:{port}", base / "server.log"
        self.model = base / "models" / "streamwise" / "tiny-qwen2"

    def request(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def queue(self, workflow: dict) -> str:
        try:
            return self.request("/prompt", {"prompt": workflow, "client_id": "streamwise-tests"})["prompt_id"]
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"/prompt refused the workflow: {exc.read().decode()}") from None

    def wait(self, prompt_id: str, timeout: float = 120) -> dict:
        """The prompt's /history entry once it has finished, whichever way."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.request(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                return entry
            time.sleep(0.05)
        raise AssertionError(f"prompt {prompt_id} still unfinished after {timeout} s\n{self.tail()}")

    def interrupted(self, workflow: dict) -> tuple[dict, float]:
        """Queue `workflow`, `/interrupt` it a second into its run; its /history entry and the seconds to its end."""
        prompt_id = self.queue(workflow)
        deadline = time.monotonic() + 60
        while not any(item[1] == prompt_id for item in self.request("/queue")["queue_running"]):
            assert time.monotonic() < deadline, self.tail()
            time.sleep(0.05)
        time.sleep(1.0)  # well into the token or frame loop
        ended = self.request(f"/history/{prompt_id}")
        assert not ended, f"the prompt ended before it could be interrupted: {json.dumps(ended)[-1500:]}"
        started = time.monotonic()
        self.request("/interrupt", {})
        entry = self.wait(prompt_id, timeout=10)
        assert entry["status"]["status_str"] == "error"
        assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]]
        return entry, time.monotonic() - started

    def run(self, workflow: dict) -> dict:
        entry = self.wait(self.queue(workflow))
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-3000:]
        return entry


def record(name: str, seconds: float) -> None:
    """Add a measured figure to the JSON file `STREAMWISE_BENCH_OUT` names (benchmarks/bench_bounded_prompts.py)."""
    out = os.environ.get("STREAMWISE_BENCH_OUT")
    if out:
        path = Path(out)
        figures = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**figures, name: round(seconds, 4)}, indent=2))


def cached_nodes(entry: dict) -> set[str]:
    return {node for kind, data in entry["status"]["messages"] if kind == "execution_cached" for node in data["nodes"]}


def core_arguments(root: Path, base: Path) -> list[str]:
    """Flags this core has (asked through --help) that keep every folder it writes under `base`."""
    shown = subprocess.run([sys.executable, str(LAUNCHER), str(root), "--help"], capture_output=True, text=True,
                           timeout=300).stdout
    folders = ("output", "user", "temp", "input")
    for name in folders:
        (base / name).mkdir(exist_ok=True)
    arguments = (["--base-directory", str(base)] if "--base-directory" in shown
                 else [flag for name in folders for flag in (f"--{name}-directory", str(base / name))])
    if "--database-url" in shown:
        arguments += ["--database-url", "sqlite:///:memory:"]  # the default file lies inside the core checkout
    return arguments


@pytest.fixture(scope="module")
def server(comfy_root, tmp_path_factory):
    """A ComfyUI server on a free loopback port with the pack in a temporary custom_nodes and the example models
    (`example-models`: the ones the workflows name) in its models folder; stopped, whole group, at the end."""
    base = tmp_path_factory.mktemp("comfy-base")
    with launched(comfy_root, base, prepared(comfy_root, base)) as started:
        yield started


def prepared(root: Path, base: Path) -> Path:
    """`base` made a ComfyUI base folder: the pack in its custom_nodes, the example models and a CLIP-L text encoder
    in its models folder, the core's example image in its input folder (as a fresh install has it); the
    extra_model_paths.yaml that names them, returned."""
    (base / "input").mkdir()
    shutil.copy(root / "input" / "example.png", base / "input")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK).symlink_to(REPO, target_is_directory=True)
    # the example models, written as a user of the ComfyUI install writes them: the pack's folder run as a command
    command = [sys.executable, str(base / "custom_nodes" / PACK), "example-models", str(base / "models")]
    written = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr[-3000:]
    zero_clip_l(base / "models" / "text_encoders" / "clip_l.safetensors")  # the one the caption workflow loads
    paths = base / "extra_model_paths.yaml"  # custom_nodes too: a core without --base-directory still finds the pack
    paths.write_text(f"streamwise_tests:\n  base_path: {base}\n  streamwise: models/streamwise\n  LLM: models/LLM\n"
                     "  text_encoders: models/text_encoders\n  custom_nodes: custom_nodes\n")
    return paths


def zero_clip_l(path: Path) -> None:
    """A CLIP-L text encoder of zeros, the shape core's CLIPLoader builds for `stable_diffusion`: enough for
    CLIPTextEncode to run, and 246 MB written in a second where random weights take many."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                         num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77)
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in transformers.CLIPTextModel(config).state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.zeros(shape, dtype=torch.float16) for name, shape in shapes.items()}, path)


@contextlib.contextmanager
def launched(root: Path, base: Path, paths: Path, preexec_fn=None):
    """A core's server on a free loopback port, its folders under `base`, answering; stopped, whole group, after."""
    port = free_port()
    command = [sys.executable, str(LAUNCHER), str(root), "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--extra-model-paths-config", str(paths), *core_arguments(root, base)]
    with open(base / "server.log", "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=os.environ.copy(), start_new_session=True, preexec_fn=preexec_fn)
    started = Server(process, port, base)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, f"the server exited with {process.returncode}\n{started.tail()}"
            assert time.monotonic() < deadline, f"the server did not answer within 300 s\n{started.tail()}"
            try:
                started.request("/system_stats")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        yield started
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already: killed for memory, say
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def object_info(server):
    return server.request("/object_info")


def workflow(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def test_the_server_lists_the_packs_nodes_and_the_tiny_model(object_info):
    assert PACK_NODES <= set(object_info)
    assert all(PACK in object_info[name]["python_module"] for name in PACK_NODES)
    assert "streamwise/tiny-qwen2" in object_info["StreamwiseModelLoader"]["input"]["required"]["model"][1]["options"]
    assert object_info["StreamwiseGenerateText"]["output_node"] is True


def test_every_node_describes_itself_and_names_its_outputs_by_type(object_info):
    """A description and display name on every node, a tooltip on every input, and one output name per type."""
    names = {}
    for node in map(object_info.get, sorted(PACK_NODES)):
        assert node["description"] and node["display_name"].startswith(("Streamwise", "Apply", "Quantized"))
        inputs = {**node["input"]["required"], **node["input"].get("optional", {})}  # `hidden` is ComfyUI's own
        untipped = [name for name, spec in inputs.items() if not spec[1].get("tooltip")]
        assert untipped == [], node["name"]
        for kind, name in zip(node["output"], node["output_name"], strict=True):
            names.setdefault(kind, set()).add(name)
    assert names == {"MODEL": {"model"}, "STRING": {"report", "text"}, "AUDIO": {"audio"}}


def test_an_error_names_its_type_by_the_package_not_the_folder(server):
    """ComfyUI shows an error's type as its module and name; the pack's folder path is no part of it."""
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["policy"] = "vibevoice"  # its rules match nothing in a Qwen2: a PolicyError
    entry = server.wait(server.queue(graph))
    (error,) = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert error["exception_type"] == "streamwise.runtime.policy.diagnostics.PolicyError"
    assert error["exception_message"].startswith("error[unmatched-rule]")


@pytest.mark.parametrize("path", ui_format.api_files(WORKFLOWS), ids=lambda p: p.stem)
def test_the_shipped_ui_workflow_is_what_the_server_makes_of_the_api_one(object_info, path):
    expected = ui_format.render(ui_format.to_ui(json.loads(path.read_text()), object_info))
    assert ui_format.ui_path(path).read_text() == expected, "regenerate: python examples/workflows/ui_format.py URL"


def caption_of(server, graph: dict, node: str) -> str:
    """transformers' text for the Generate Text node `node` of `graph`, given the image its LoadImage reads."""
    from PIL import Image

    from vision_language import transformers_caption

    inputs = graph[node]["inputs"]
    loader, load_image = graph[inputs["model"][0]]["inputs"], graph[inputs["image"][0]]["inputs"]
    picture = Image.open(server.log.parent / "input" / load_image["image"]).convert("RGB")
    folder = server.log.parent / "models" / loader["model"]
    return transformers_caption(folder, picture, inputs["prompt"], inputs["max_new_tokens"])


@pytest.mark.parametrize("path", ui_format.api_files(WORKFLOWS), ids=lambda p: p.stem)
def test_every_shipped_workflow_ends_in_an_output_node_and_runs(server, object_info, path):
    """Each ends in output nodes, but a CLIPTextEncode, whose prompt is for the user's own sampler; each output node
    shows what transformers makes (the text, the caption) or a playable audio file."""
    graph = json.loads(path.read_text())
    used = {value[0] for node in graph.values() for value in node["inputs"].values() if isinstance(value, list)}
    sinks = set(graph) - used
    assert all(object_info[graph[key]["class_type"]]["output_node"] or graph[key]["class_type"] == "CLIPTextEncode"
               for key in sinks)
    assert any(object_info[node["class_type"]]["output_node"] for node in graph.values())
    entry = server.run(graph)
    for key, node in graph.items():
        if node["class_type"] == "StreamwiseGenerateText":
            expected = caption_of(server, graph, key) if "image" in node["inputs"] else expected_text(
                server.model, graph, key)
            assert entry["outputs"][key]["text"] == [expected]
        elif node["class_type"] == "StreamwiseGenerateSpeech":
            (audio,) = entry["outputs"][key]["audio"]
            assert audio["filename"].endswith(".flac") and audio["type"] == "temp"


def test_a_changed_input_re_executes_only_what_depends_on_it(server):
    graph = workflow("streamwise_generate_text")
    server.run(graph)
    again = server.run(graph)
    assert cached_nodes(again) == {"1", "2"}  # nothing changed: nothing runs
    graph["2"]["inputs"]["max_new_tokens"] = 4
    changed = server.run(graph)
    assert cached_nodes(changed) == {"1"}
    assert changed["outputs"]["2"]["text"] == [expected_text(server.model, graph)]


@pytest.fixture(scope="module")
def long_context(server) -> dict:
    """A Qwen2 of 32,768 positions (8 thin layers) beside the tiny one, and a workflow generating with it."""
    import transformers

    folder = server.model.parent / "long-qwen2"
    vocabulary = json.loads((server.model / "config.json").read_text())["vocab_size"]  # its tokenizer's
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=vocabulary,
                                      max_position_embeddings=32768)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(server.model / name, folder / name)
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["model"] = "streamwise/long-qwen2"
    graph["2"]["inputs"].update(system="", chat=False)  # its tokenizer files hold no chat template
    return graph


def test_an_encoder_decoder_generates_the_text_transformers_does(server):
    """T5 through the loader and Generate Text: the decoder's tokens whole, as transformers' `generate` decodes them."""
    import torch
    import transformers

    folder = server.model.parent / "tiny-t5"
    vocabulary = json.loads((server.model / "config.json").read_text())["vocab_size"]
    torch.manual_seed(1)  # from seed 0 the random decoder repeats its start token, which decodes to nothing
    config = transformers.T5Config(vocab_size=vocabulary, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(server.model / name, folder / name)
    prompt = PROMPT + " and looked at the dog for a long while"  # longer than the output: all of it was cut before
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["model"] = "streamwise/tiny-t5"
    graph["2"]["inputs"].update(prompt=prompt, system="", chat=False)
    (text,) = server.run(graph)["outputs"]["2"]["text"]
    model = transformers.T5ForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        out = model.generate(tokenizer(prompt, return_tensors="pt").input_ids, max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert text and text == tokenizer.decode(out[0], skip_special_tokens=True)


def test_interrupt_ends_a_long_generation_within_a_second(server, long_context):
    long_context["2"]["inputs"]["max_new_tokens"] = 8192
    _, seconds = server.interrupted(long_context)
    record("interrupt during generation", seconds)
    assert seconds < 1.0  # within a token, plus the /history poll
    server.run(workflow("streamwise_generate_text"))  # the model stays ready for the next prompt


def test_interrupt_ends_a_long_prefill_within_a_second(server, long_context):
    """One forward over a long prompt: the interrupt is honoured before each of its blocks."""
    long_context["2"]["inputs"].update(prompt="a cat sat on the mat " * 1500, max_new_tokens=1)
    _, seconds = server.interrupted(long_context)
    record("interrupt during a long prefill", seconds)
    assert seconds < 1.0
    long_context["2"]["inputs"].update(prompt=PROMPT, max_new_tokens=4)
    server.run(long_context)


def test_a_prompt_past_the_context_is_refused_at_once_and_max_new_tokens_clipped_with_a_note(server):
    graph = workflow("streamwise_generate_text")  # tiny-qwen2: 128 positions
    graph["2"]["inputs"]["prompt"] = "a cat " * 400_000  # 2.4 MB
    started = time.monotonic()
    entry = server.wait(server.queue(graph), timeout=60)
    seconds = time.monotonic() - started
    record("2.4 MB prompt refused (queue to /history)", seconds)
    (error,) = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert error["exception_message"].startswith("prompt: 2400000 characters, more than 4096 (32 per position of "
                                                 "the model's context of 128")
    assert seconds < 30  # generous: the refusal itself takes no forward (the figure goes in the closing note)
    graph["2"]["inputs"].update(prompt=PROMPT, max_new_tokens=8192)
    entry = server.run(graph)
    (text,) = entry["outputs"]["2"]["text"]
    assert "(note: max_new_tokens clipped from 8192 to " in text and "context is 128 positions" in text


def test_a_cached_prompt_does_not_walk_a_symlinked_tree_again(server, tmp_path):
    """A link in the models folder to a large tree: the first listing walks it (within its bounds), a cached prompt
    only stats the folders it walked."""
    big = tmp_path / "big"
    for index in range(3000):
        (big / f"{index // 100:02d}" / f"{index % 100:02d}").mkdir(parents=True)
    link = server.model.parent / "elsewhere"
    link.symlink_to(big, target_is_directory=True)
    try:
        past = time.time() - 60  # settled: a listing trusts folders that have not changed in the last 2 s
        for folder in [big, *big.rglob("*"), server.model.parent]:
            os.utime(folder, (past, past), follow_symlinks=False)
        graph = workflow("streamwise_generate_text")
        graph["2"]["inputs"]["seed"] = 1234  # a prompt of its own, so the first run executes
        started = time.monotonic()
        server.run(graph)
        first = time.monotonic() - started
        started = time.monotonic()
        assert cached_nodes(server.run(graph)) == {"1", "2"}
        cached = time.monotonic() - started
    finally:
        link.unlink()
    record("first prompt with a link to 3,000 folders", first)
    record("the same prompt cached", cached)
    assert cached < 5  # generous: the walk it skips is the figure (benchmarks/bench_bounded_prompts.py)


def test_free_unloads_and_drops_the_cache(server):
    graph = workflow("streamwise_generate_text")
    server.run(graph)
    server.request("/free", {"unload_models": True, "free_memory": True})
    time.sleep(1.0)  # the worker takes the flags between prompts
    entry = server.run(graph)
    assert cached_nodes(entry) == set()
    assert entry["outputs"]["2"]["text"] == [expected_text(server.model, graph)]


def test_the_loader_refuses_a_stranding_plan_unless_told_to_accept_it(server):
    """`decoder-llm` covers VibeVoice's language model but not its tokenizers and diffusion head: the loader says
    which classes it would strand, and which rule covers them, before reading a weight."""
    graph = workflow("streamwise_generate_speech")
    graph["1"]["inputs"]["policy"] = "decoder-llm"
    graph["2"]["inputs"]["max_new_tokens"] = 2
    entry = server.wait(server.queue(graph))
    (error,) = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert error["node_type"] == "StreamwiseModelLoader"
    assert error["exception_type"] == "streamwise.runtime.policy.diagnostics.PolicyError"
    message = error["exception_message"]
    assert message.startswith("error[stranded-tensors]: policy `decoder-llm` on `VibeVoiceForConditionalGeneration`")
    assert "allow_stranded" in message and '[[stream.rule]] kind = "auto", select = { class = "Conv1d" }' in message
    graph["1"]["inputs"]["allow_stranded"] = True
    server.run(graph)  # accepted: it succeeds


def test_the_loader_refuses_a_model_larger_than_its_host_budget_naming_both_figures(server, object_info):
    """`host_budget` is an optional text input (`auto` by default); a model that does not fit it is the loader's
    error, naming what loading needs and the budget, before a weight is read."""
    (kind, spec) = object_info["StreamwiseModelLoader"]["input"]["optional"]["host_budget"]
    assert kind == "STRING" and spec["default"] == "auto" and spec["tooltip"]
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["host_budget"] = "4KiB"
    entry = server.wait(server.queue(graph))
    assert entry["status"]["status_str"] == "error"
    (error,) = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert error["node_type"] == "StreamwiseModelLoader"
    assert error["exception_type"] == "streamwise.runtime.checkpoint.tiers.HostBudgetError"  # a CheckpointError
    message = error["exception_message"]
    assert "loading needs at least" in message and "the host budget is 4.0 KiB" in message, message


def test_a_host_budget_below_the_model_leaves_blocks_in_their_file_and_generates_the_same(server):
    """Core hosts a tree whose blocks past the budget stay in their file: the same text, the report says so."""
    size = sum(path.stat().st_size for path in server.model.glob("*.safetensors"))
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["host_budget"] = f"{size // 2}B"
    entry = server.run(graph)
    assert entry["outputs"]["2"]["text"] == [expected_text(server.model, graph)]
    (report,) = entry["outputs"]["1"]["text"]
    assert ", file " in report and ", file 0 B" not in report, report


def test_a_loose_gguf_streamwise_quantize_wrote_is_offered_and_generates_alone(server):
    """The pack's own command writes a .gguf into models/LLM with nothing beside it; the loader offers it over HTTP and
    Generate Text from it gives the float model's text (Q8_0 keeps this greedy decoding)."""
    target = server.log.parent / "models" / "LLM" / "tiny-qwen2.streamwise.Q8_0.gguf"
    command = [sys.executable, str(server.log.parent / "custom_nodes" / PACK), "quantize", str(server.model),
               str(target), "--type", "Q8_0"]
    written = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert written.returncode == 0 and "it loads alone" in written.stdout, written.stderr[-3000:]
    loader = server.request("/object_info/StreamwiseModelLoader")["StreamwiseModelLoader"]
    assert "LLM/tiny-qwen2.streamwise.Q8_0.gguf" in loader["input"]["required"]["model"][1]["options"]
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["model"] = "LLM/tiny-qwen2.streamwise.Q8_0.gguf"
    entry = server.run(graph)
    assert entry["outputs"]["2"]["text"] == [expected_text(server.model, graph)]
    assert "kept quantized" in entry["outputs"]["1"]["text"][0]


def user_policies(server) -> Path:
    folder = server.log.parent / "user" / "default" / "streamwise" / "policies"
    if not folder.is_dir():  # a core whose user folder sits elsewhere: the pack created it on first use
        (folder,) = list(server.log.parent.rglob("streamwise/policies"))
    return folder


def test_an_edited_user_policy_re_runs_the_loader_and_an_unchanged_one_stays_cached(server):
    """The loader's fingerprint holds the content of its policy and of every policy it extends."""
    folder = user_policies(server)
    parent = folder / "my-base.toml"
    parent.write_text('schema_version = 1\n[policy]\nname = "my-base"\nextends = "decoder-llm"\n')
    (folder / "my-llm.toml").write_text('schema_version = 1\n[policy]\nname = "my-llm"\nextends = "my-base"\n')
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["policy"] = "my-llm"
    server.run(graph)
    assert cached_nodes(server.run(graph)) == {"1", "2"}  # unchanged: nothing runs
    parent.write_text(parent.read_text() + "\n[compile]\nfullgraph = true\n")  # an edit two files up the chain
    edited = server.run(graph)
    assert cached_nodes(edited) == set()  # the loader loads again, and what depends on it runs
    assert cached_nodes(server.run(graph)) == {"1", "2"}


def test_two_workflows_sharing_one_cached_loader_output_each_see_it_as_loaded(server):
    """One workflow quantizes the loader's MODEL through Apply; the next, given the same (cached) loader output,
    still computes with the float weights: Apply converted a copy."""
    folder = user_policies(server)
    policy = folder / "int4-linears.toml"
    policy.write_text('schema_version = 1\n[policy]\nname = "int4-linears"\nextends = "decoder-llm"\n'
                      '[[quant.rule]]\nid = "q"\nselect = { class = "Linear" }\nformat = "convrot_int4"\n'
                      'group_size = 16\n')
    sampled = workflow("streamwise_generate_text")
    # sampled text follows every change of the logits; the prompt continued as it is (the tiny model echoes a chat's
    # newline whatever its weights)
    sampled["2"]["inputs"].update(sampling="custom", seed=7, system="", chat=False, max_new_tokens=16, temperature=1.5)
    try:
        before = server.run(sampled)
        graph = json.loads(json.dumps(sampled))
        graph["3"] = {"class_type": "ApplyStreamwisePolicy", "inputs": {"model": ["1", 0], "policy": "int4-linears"}}
        graph["2"]["inputs"]["model"] = ["3", 0]
        quantized = server.run(graph)
        sampled["2"]["inputs"]["temperature"] = 1.5000001  # the same sampling, run again on the cached loader output
        after = server.run(sampled)
    finally:
        policy.unlink()
    assert "1" in cached_nodes(quantized) and "1" in cached_nodes(after)  # the one MODEL all three were given
    assert quantized["outputs"]["2"]["text"] != before["outputs"]["2"]["text"]  # 4-bit weights: another text
    assert after["outputs"]["2"]["text"] == before["outputs"]["2"]["text"]  # the float weights, as loaded


def test_a_replaced_model_file_loads_again(server):
    folder = server.model.parent / "tiny-qwen2-copy"
    shutil.copytree(server.model, folder, dirs_exist_ok=True)
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["model"] = "streamwise/tiny-qwen2-copy"
    assert "streamwise/tiny-qwen2-copy" in server.request("/object_info/StreamwiseModelLoader")[
        "StreamwiseModelLoader"]["input"]["required"]["model"][1]["options"]
    server.run(graph)
    assert cached_nodes(server.run(graph)) == {"1", "2"}
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # a re-download: the same bytes, a new file time
    assert cached_nodes(server.run(graph)) == set()


def test_a_model_a_node_cannot_drive_is_a_message_that_names_the_node_to_use(server):
    graph = workflow("streamwise_generate_text")
    graph["1"]["inputs"]["model"] = "streamwise/tiny-vibevoice"
    entry = server.wait(server.queue(graph))
    (error,) = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert error["node_type"] == "StreamwiseGenerateText"
    assert error["exception_type"] == "streamwise.comfy_nodes.errors.NodeInputError"  # a ValueError
    assert error["exception_message"].strip() == (
        "Streamwise Generate Text cannot drive a VibeVoiceForConditionalGeneration (`vibevoice`), which generates "
        "speech; use Streamwise Generate Speech for it")
