"""Shared test helpers (tests/ is on sys.path through pytest's `pythonpath`)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from streamwise.runtime.cli import example_models

TESTS = Path(__file__).resolve().parent
INVALID = TESTS / "fixtures" / "invalid"
REPO = TESTS.parent
TOKENS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def logits(model: nn.Module, inputs: torch.Tensor = TOKENS) -> torch.Tensor:
    """A causal LM's logits for `inputs`, without gradients."""
    with torch.no_grad():
        return model(inputs).logits


def write_policy(folder: Path, name: str, body: str = "", *, version: int = 1) -> Path:
    """A policy file `name.toml` in `folder` with the required header and `body` after it."""
    path = folder / f"{name}.toml"
    path.write_text(f'schema_version = {version}\n\n[policy]\nname = "{name}"\n{body}', encoding="utf-8")
    return path


def gguf_policy(folder: Path, gguf_type: str, extends: str = "decoder-llm") -> Path:
    """A policy extending `extends` whose Linear layers are GGUF residents written as `gguf_type`."""
    return write_policy(folder, gguf_type.lower(), f'extends = "{extends}"\n\n[[quant.rule]]\nid = "linears"\n'
                        f'select = {{ class = "Linear" }}\nformat = "gguf"\ngguf_type = "{gguf_type}"\n')


def make_policy(**sections):
    """A Policy from plain data, e.g. make_policy(stream={"rule": [...]})."""
    from streamwise.schemas import Policy

    return Policy.model_validate({"schema_version": 1, "policy": {"name": "test"}, **sections})


def stream_rule(rule_id: str, kind: str, **select) -> dict:
    return {"id": rule_id, "kind": kind, "select": select}


def force_streaming(model, on: bool = True) -> None:
    """Make every streamed leaf take the fetching path, as a host does for offloaded leaves."""
    from streamwise.runtime.engine import protocol

    for module in model.modules():
        if protocol.kind_of(module) is not None:
            protocol.set_fetching(module, on)


def tiny_qwen2(**overrides):
    import transformers

    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    config.update(overrides)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)).eval()


def tiny_t5():
    """An encoder-decoder: relative position buckets (no limit in its config), the decoder's output alone."""
    import transformers

    config = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config).eval()


def tiny_llava(max_position_embeddings: int = 256):
    """A vision-language model (a CLIP vision tower, a Llama decoder), used for text from a text prompt."""
    import transformers

    text = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=max_position_embeddings)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=127)
    return transformers.LlavaForConditionalGeneration(config).eval()


def tiny_tokenizer(vocabulary: int = 128):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # One word for every id of a tiny model's vocabulary (tiny_qwen2's 128), so that any generated id decodes to text.
    trainer = trainers.WordLevelTrainer(vocab_size=vocabulary, special_tokens=["[UNK]", "[PAD]", "[EOS]"])
    words = "a cat sat on the mat the quick brown fox jumps over lazy dog".split()
    filler = [f"w{i}" for i in range(vocabulary - 3 - len(set(words)))]
    tokenizer.train_from_iterator([" ".join(words), " ".join(filler)], trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
    )


def reference_text(folder: Path, prompt: str, tokens: int, system: str = "", chat: bool = True) -> str:
    """transformers' own text: `from_pretrained` (with its generation_config.json), the prompt framed by the
    tokenizer's chat template where it has one and `chat` (after a `system` turn where given), greedy."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if chat and tokenizer.chat_template:
        turns = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def tiny_acoustic_tokenizer():
    import transformers

    config = transformers.VibeVoiceAcousticTokenizerConfig(
        hidden_size=16, num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1], kernel_size=3,
        layer_scale_init_value=0.5,  # large enough that a dropped gamma would show in the output
    )
    return transformers.VibeVoiceAcousticTokenizerModel(config).eval()


def tiny_vibevoice():
    """transformers' VibeVoiceForConditionalGeneration at toy size (LM, tokenizers, diffusion head)."""
    return example_models.tiny_vibevoice()


def vibevoice_inputs():
    """Token ids with 8 audio placeholders, and 32 samples of audio that encode to 8 latents."""
    import torch

    generator = torch.Generator().manual_seed(0)
    audio = torch.randn(1, 1, 32, generator=generator)
    ids = torch.tensor([[5, 2] + [4] * 8 + [3, 6, 7]])
    return dict(input_ids=ids, input_values=audio, padding_mask=torch.ones(1, 32, dtype=torch.bool), sample=False)


# The sample of model families `auto` must stream right (tests/engine/test_generic.py, tests/comfy).
_LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


class LayerScaleNorm(nn.Module):
    """A norm nobody wrote a kind for."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(size))
        self.shift = nn.Parameter(torch.randn(size))

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) * self.scale.tanh() + self.shift


class Block(nn.Module):
    """A container with a layer-scale parameter of its own, children, and a buffer."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.norm = LayerScaleNorm(size)
        self.proj = nn.Linear(size, size)
        self.gamma = nn.Parameter(torch.full((size,), 0.5))
        self.register_buffer("offset", torch.linspace(-1, 1, size))

    def forward(self, x):
        return x + self.gamma * self.proj(self.norm(x)) + self.offset


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 32)
        self.blocks = nn.ModuleList([Block(32), Block(32)])
        self.head = nn.Linear(32, 128, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ChannelsFirstRMSNorm(nn.Module):
    """A tokenizer's RMSNorm over the channels of (batch, channels, time), as community VibeVoice writes it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels))
        self.eps = 1e-5

    def forward(self, x):
        hidden = x.transpose(1, 2).float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * hidden.type_as(x)).transpose(1, 2)


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """A LayerNorm over the channels of (batch, channels, time), in float32."""

    def forward(self, x):
        hidden = F.layer_norm(x.transpose(1, 2).float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                              self.eps)
        return hidden.type_as(x).transpose(1, 2)


def tiny_sample(name: str) -> tuple[nn.Module, dict]:
    """A tiny real model of the sample nobody wrote a policy for, and the inputs of one forward."""
    import transformers as T

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 7))
    if name == "dense":
        config = T.Qwen3Config(hidden_size=64, intermediate_size=128, head_dim=16, **_LAYERS)
        return T.Qwen3ForCausalLM(config), {"input_ids": ids}
    if name == "moe":
        config = T.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2, head_dim=16, **_LAYERS)
        return T.Qwen3MoeForCausalLM(config), {"input_ids": ids}
    if name == "state-space":
        config = T.MambaConfig(hidden_size=64, state_size=8, num_hidden_layers=2, vocab_size=128, intermediate_size=128)
        return T.MambaForCausalLM(config), {"input_ids": ids}
    if name == "gemma":
        config = T.GemmaConfig(hidden_size=64, intermediate_size=128, head_dim=16, **_LAYERS)
        return T.GemmaForCausalLM(config), {"input_ids": ids}
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)), {
            "input_ids": ids}
    if name == "encoder-decoder":
        config = T.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=128)
        return T.T5ForConditionalGeneration(config), {"input_ids": ids, "decoder_input_ids": ids}
    if name == "audio":
        config = T.WhisperConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=128,
                                 num_mel_bins=16, max_source_positions=16, max_target_positions=16,
                                 pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2)
        features = torch.randn(1, 16, 32)
        return T.WhisperForConditionalGeneration(config), {"input_features": features, "decoder_input_ids": ids}
    if name == "vision":
        config = T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                             image_size=32, patch_size=8, num_labels=3)
        return T.ViTForImageClassification(config), {"pixel_values": torch.randn(1, 3, 32, 32)}
    if name == "custom":
        return Custom(), {"ids": ids}
    raise KeyError(name)


SAMPLE = ["dense", "moe", "state-space", "gemma", "gpt2", "encoder-decoder", "audio", "vision", "custom"]


def tiny_vision_language():
    """transformers' Qwen2.5-VL at toy size (vision tower, language model, LM head), and the token ids of a forward."""
    import transformers as T

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=128, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[0])
    torch.manual_seed(0)
    model = T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(text_config=text, vision_config=vision))
    return model.eval(), {"input_ids": torch.randint(0, 128, (2, 6))}


def tiny_diffusers(name: str) -> tuple[nn.Module, dict]:
    """A tiny diffusers model from seed 0: `transformer` (Flux), `unet` (Stable Diffusion's) or `vae` (AutoencoderKL),
    and the inputs of one forward (its output's `.sample`), a batch of 2."""
    import diffusers

    torch.manual_seed(0)
    if name == "transformer":
        model = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
        inputs = dict(hidden_states=torch.randn(2, 4, 8), encoder_hidden_states=torch.randn(2, 3, 16),
                      pooled_projections=torch.randn(2, 16), timestep=torch.tensor([0.5, 0.25]),
                      img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3))
    elif name == "unet":
        model = diffusers.UNet2DConditionModel(
            block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8, cross_attention_dim=16,
            attention_head_dim=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), sample_size=8, in_channels=4, out_channels=4)
        inputs = dict(sample=torch.randn(2, 4, 8, 8), timestep=3, encoder_hidden_states=torch.randn(2, 5, 16))
    elif name == "vae":
        model = diffusers.AutoencoderKL(
            block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
        inputs = dict(sample=torch.randn(2, 3, 16, 16))
    else:
        raise KeyError(name)
    return model.eval(), inputs


DIFFUSERS_SAMPLE = ["transformer", "unet", "vae"]


def tiny_vibevoice_folder(folder: Path) -> Path:
    """The example VibeVoice folder (`streamwise example-models`): tiny_vibevoice's weights saved with its processor;
    every run makes exactly max_new_tokens frames of audible noise."""
    return example_models.tiny_vibevoice_folder(folder)


def module_from_file(path: Path):
    """A module by its path: test modules are not importable by name from each other (pytest's importlib mode)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_audio(data: bytes) -> tuple[torch.Tensor, int]:
    """An audio file's samples [channels, samples] as float32 and its sample rate, decoded by PyAV (as ComfyUI's
    LoadAudio does)."""
    import io

    import av
    import numpy as np

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() if frame.format.is_planar  # packed frames interleave their channels
                  else frame.to_ndarray().reshape(-1, len(frame.layout.channels)).T
                  for frame in container.decode(stream)]
        rate = stream.codec_context.sample_rate
    samples = np.concatenate(frames, axis=-1)
    if samples.dtype.kind == "i":
        samples = samples / float(np.iinfo(samples.dtype).max)
    return torch.from_numpy(samples.astype(np.float32)), rate


class MemoryCgroup:
    """A memory cgroup of its own (v2 `memory.max`, else v1 `memory.limit_in_bytes`, swap included where v1 counts
    it) that children join before they start (`command` or `enter`)."""

    def __init__(self, path: Path, limit_file: str) -> None:
        self.path, self._limit_file = path, limit_file

    def limit(self, nbytes: int) -> None:
        (self.path / self._limit_file).write_text(str(nbytes))
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(nbytes))

    def usage(self) -> int:
        for name in ("memory.current", "memory.usage_in_bytes"):
            if (self.path / name).exists():
                return int((self.path / name).read_text())
        raise FileNotFoundError(f"no memory usage file in {self.path}")

    def command(self, command: list[str]) -> list[str]:
        """`command`, joining the cgroup before the interpreter starts."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *command]

    def enter(self) -> None:
        """For `subprocess.Popen(preexec_fn=...)`: the child joins before it runs anything."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))


def _delegated_memory_cgroup() -> tuple[Path, str] | None:
    """A writable memory cgroup this process may create children in (v2, else v1), or None."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in own:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            parent = Path("/sys/fs/cgroup") / path.lstrip("/")
            if "memory" in (parent / "cgroup.subtree_control").read_text(errors="replace").split():
                return parent, "memory.max"
        elif "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
    return None


@contextlib.contextmanager
def memory_cgroup() -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup under this process's own, removed after; the test skips, saying why, where the
    machine delegates none."""
    import pytest

    found = _delegated_memory_cgroup()
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip("this machine delegates no writable memory cgroup (cgroup v1 or v2) to the tests")
    parent, limit_file = found
    path = parent / f"streamwise-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc.strerror}")
    try:
        yield MemoryCgroup(path, limit_file)
    finally:
        deadline = time.monotonic() + 10
        while True:  # once the processes the test started have left it (a lease keeper ends just after its holder)
            try:
                path.rmdir()
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def leases_here(folder: Path) -> bool:
    """Whether a load in `folder` maps its host tier under a read lease (`checkpoint.leased`): Linux, a local file
    system, leases on."""
    from streamwise.runtime.checkpoint.checked_file import CheckedFile
    from streamwise.runtime.checkpoint.leased import map_ranges

    path = folder / f"lease-probe-{uuid.uuid4().hex}"
    path.write_bytes(bytes(4096))
    try:
        with open(path, "rb") as handle:
            return map_ranges(CheckedFile(path, handle), [(0, 4096)]) is not None
    finally:
        path.unlink()


def cache_dir() -> Path:
    """$STREAMWISE_CACHE, or a folder of this user's own under the system temp directory."""
    if os.environ.get("STREAMWISE_CACHE"):
        cache = Path(os.environ["STREAMWISE_CACHE"]).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        return cache
    cache = Path(tempfile.gettempdir()) / f"streamwise-test-cache-{os.getuid()}"
    cache.mkdir(mode=0o700, exist_ok=True)
    if cache.stat().st_uid != os.getuid():  # a shared temp dir: never run an environment someone else planted
        raise RuntimeError(f"{cache} belongs to another user; set STREAMWISE_CACHE to a folder of your own")
    return cache
