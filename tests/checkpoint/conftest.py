from __future__ import annotations

import pytest
import torch

from helpers import tiny_qwen2


@pytest.fixture
def qwen2_folder(tmp_path):
    """A tiny Qwen2 as `save_pretrained` writes it (one safetensors file, untied head): the model the file-change
    tests load, cut and break."""
    torch.manual_seed(0)
    tiny_qwen2(tie_word_embeddings=False).save_pretrained(tmp_path)
    return tmp_path
