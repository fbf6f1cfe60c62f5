"""Config -> tree: building a model skeleton (parameters on `meta`) from a folder's config, a spec or a builder a
node pack registers, in the dtype asked for, without touching the process's defaults."""

from .model_spec import ModelSpecError, build_model
from .skeleton import build_skeleton, register_builder, skeleton

__all__ = ["ModelSpecError", "build_model", "build_skeleton", "register_builder", "skeleton"]
