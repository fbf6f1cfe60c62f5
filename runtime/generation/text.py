"""Text generation settings: a causal LM's own generation defaults with the caller's flags."""

from __future__ import annotations

import copy

# transformers' own defaults for the sampling-only flags: values its validator never calls "not valid" when greedy.
GREEDY_FLAGS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}


def generation_config(model, max_new_tokens: int, do_sample: bool, pad_token_id, **sampling):
    """The model's own generation defaults with these flags. Sampling flags apply only when sampling; a greedy run
    sets them neutral, so neither the caller's flags nor the checkpoint's generation_config.json log a warning."""
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad_token_id,
                  **(sampling if do_sample else GREEDY_FLAGS))
    return config
