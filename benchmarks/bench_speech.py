"""Speech per frame: Streamwise's Generate Speech path against transformers' own VibeVoice generation, same process.

The tiny VibeVoice that `streamwise example-models` writes (random weights, 10 diffusion steps a frame), on the CPU:
- `transformers`: the folder loaded with `VibeVoiceForConditionalGeneration.from_pretrained` and its processor,
  `model.generate(...)` as transformers' documentation calls it;
- `streamwise resident`: `load_pretrained(folder, "auto")` and `offload(budget=None)` (every streamed leaf resident,
  the fast path), then `generation.generate_speech`, what the node runs;
- `streamwise streamed`: the same at `budget=0`, every leaf fetching per forward.
Each makes the same number of frames from the same seed (the tiny folder masks end of speech). The two Streamwise
paths must give identical audio; beside transformers' the last bit may differ, since `from_pretrained` leaves the
weights where the file's memory map puts them (unaligned) and a one-row product on the CPU rounds by alignment:
the largest difference is printed. Rounds run one generation of each in turn (order rotating) and keep the CPU time
per frame; the figures are medians over rounds, and the ratios medians of per-round ratios. `--profile` prints the
top functions of one resident generation (cProfile, by cumulative time), to see where a frame goes. Run:

    python benchmarks/bench_speech.py [--rounds 7] [--frames 16] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch
from report import recorded  # this folder's: results/<name>-<date>.md

from streamwise import load_pretrained, offload
from streamwise.runtime.cli.example_models import tiny_vibevoice_folder
from streamwise.runtime.generation import generate_speech
from streamwise.runtime.generation.speech import conversation, load_processor, parse_script

SCRIPT = "Speaker 0: Hello, and welcome to the show.\nSpeaker 1: Thanks, it's great to be here."
STEPS, CFG, SEED = 10, 1.3, 0


def transformers_own(folder):
    """What transformers' VibeVoice documentation does: the model and processor from the folder, then generate."""
    import transformers

    model = transformers.VibeVoiceForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    processor = load_processor(folder)
    messages = conversation(parse_script(SCRIPT), [], processor.feature_extractor.sampling_rate)
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    config = transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)

    def run(frames: int):
        config.update(max_new_tokens=frames, guidance_scale=CFG)
        torch.manual_seed(SEED)
        with torch.no_grad():
            return model.generate(**inputs, generation_config=config, num_diffusion_steps=STEPS)[0]

    return run


def streamwise_path(folder, budget):
    model, _, _ = load_pretrained(folder, "auto", progress=False)
    offload(model, "vibevoice", device="cpu", budget=budget)

    def run(frames: int):
        return generate_speech(model, folder, SCRIPT, seed=SEED, steps=STEPS, cfg=CFG, max_new_tokens=frames).waveform

    return run


def cpu_seconds(run, frames: int) -> float:
    started = time.thread_time()
    run(frames)
    return time.thread_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: the 2-core VM's second core is the noise
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_vibevoice_folder(f"{tmp}/tiny-vibevoice")
        runs = {"transformers": transformers_own(folder), "streamwise resident": streamwise_path(folder, None),
                "streamwise streamed": streamwise_path(folder, 0)}
        audio = {name: run(args.frames) for name, run in runs.items()}
        assert torch.equal(audio["streamwise resident"], audio["streamwise streamed"]), "streaming changed the audio"
        reference = audio["transformers"].reshape(-1)
        differences = {name: (waveform.reshape(-1) - reference).abs().max().item() for name, waveform in audio.items()}
        per_frame = {name: [] for name in runs}
        names = list(runs)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                per_frame[name].append(cpu_seconds(runs[name], args.frames) / args.frames)
        print(f"tiny VibeVoice, {args.frames} frames of {STEPS} diffusion steps, one thread, {args.rounds} rounds")
        own = per_frame["transformers"]
        for name, times in per_frame.items():
            ratio = statistics.median(t / o for t, o in zip(times, own, strict=True))
            print(f"  {name:<22} {statistics.median(times) * 1e3:8.2f} ms/frame   {ratio:5.3f}x transformers   "
                  f"audio max |diff| {differences[name]:.2g}")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(runs["streamwise resident"], args.frames)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    with recorded("speech"):
        main()
