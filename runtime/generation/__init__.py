"""6. Running a converted model: text and speech generation, host-agnostic (hosts add progress and interrupt)."""

from .speech import MAX_SPEAKERS, Speech, Voice, generate_speech
from .steps import TokenSteps
from .tasks import Task, task_of
from .text import generation_config

__all__ = ["MAX_SPEAKERS", "Speech", "Task", "TokenSteps", "Voice", "generate_speech", "generation_config", "task_of"]
