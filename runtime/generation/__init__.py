"""6. Running a converted model: text and speech generation, host-agnostic (hosts add progress and interrupt)."""

from .speech import MAX_SPEAKERS, Speech, Voice, generate_speech
from .steps import TokenSteps, interrupt_at_blocks
from .tasks import Task, task_of
from .text import PromptError, PromptFit, fit_prompt, generation_config, new_tokens

__all__ = ["MAX_SPEAKERS", "PromptError", "PromptFit", "Speech", "Task", "TokenSteps", "Voice", "fit_prompt",
           "generate_speech", "generation_config", "interrupt_at_blocks", "new_tokens", "task_of"]
