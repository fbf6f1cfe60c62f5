"""Moved: building a skeleton is `runtime.build` (`register_builder`, `build_skeleton`, `skeleton`). This module
re-exports them for one release, so `streamwise.runtime.checkpoint.skeleton` imports keep working; the
import-direction test lists it as an exemption."""

from ..build.skeleton import build_skeleton, built_skeleton, config_folder, register_builder, skeleton

__all__ = ["build_skeleton", "built_skeleton", "config_folder", "register_builder", "skeleton"]
