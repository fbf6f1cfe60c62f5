"""6. Running a converted model: text and speech generation, host-agnostic (hosts add progress and interrupt)."""

from .processors import load_processor
from .prompts import Prompt, PromptError, prompts, takes_images
from .speech import MAX_SPEAKERS, Speech, Voice, generate_speech
from .steps import TokenSteps, interrupt_at_blocks
from .tasks import Task, task_of
from .text import SAMPLING_MODES, Sampling, generate_text, generation_config, new_tokens

__all__ = ["MAX_SPEAKERS", "SAMPLING_MODES", "Prompt", "PromptError", "Sampling", "Speech", "Task", "TokenSteps",
           "Voice", "generate_speech", "generate_text", "generation_config", "interrupt_at_blocks", "load_processor",
           "new_tokens", "prompts", "takes_images", "task_of"]
