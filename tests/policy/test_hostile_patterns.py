r"""Patterns that make a backtracking matcher run for minutes (issue #13) match in linear time, or are refused.

Each hostile pattern is first matched in a child process under a generous timeout (a guard against hanging: the GIL
that Python's `re` holds would stop any timer in this process); the tests then assert what bounds the cost as counted
quantities (the RE2 program's size, `**` runs merged into one) and run the real thing: `resolve` and `auto`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file
from torch import nn

import streamwise
from streamwise.runtime import check_policy
from streamwise.runtime.checkpoint.readers import open_checkpoint
from streamwise.runtime.plan.auto import select_policy
from streamwise.runtime.plan.selectors import walk_modules
from streamwise.schemas import Selector
from streamwise.schemas.patterns import (
    MAX_GLOB_WILDCARDS,
    MAX_PATTERN_LENGTH,
    MAX_PROGRAM_SIZE,
    Pattern,
    PatternError,
    compile_glob,
    compile_regex,
)

from helpers import make_policy, stream_rule, write_policy

CATASTROPHIC_REGEX = r"(\w+\.?)+!"  # 1.7 s for one path under Python's `re`, doubling with each character
MANY_STARS = "**." * 40 + "*_proj"  # 40 `**`: 13.7 s on a 6-segment path
INTERLEAVED = "**.m*." * 10 + "bias"  # nothing to merge: 21 wildcard segments, ~4 s per key under `re`
KEYS = [".".join(["model"] * 20) + f".m{i}.weight" for i in range(27)]
GUARD = """
import json, sys
from streamwise.schemas.patterns import compile_glob, compile_regex, glob_matches
job = json.load(sys.stdin)
regex, stars, interleaved = compile_regex(job["regex"]), compile_glob(job["stars"]), compile_glob(job["interleaved"])
print(json.dumps({
    "regex": [p for p in job["paths"] if regex.fullmatch(p)],
    "stars": [p for p in job["paths"] if glob_matches(stars, p)],
    "interleaved": [k for k in job["keys"] if glob_matches(interleaved, k)],
}))
"""


def two_layers() -> nn.Module:
    """A 2-layer decoder's module paths (`model.layers.0.self_attn.q_proj`), without transformers."""

    def block(*names: str) -> nn.ModuleDict:
        return nn.ModuleDict({name: nn.Linear(4, 4) for name in names})

    layers = nn.ModuleList(
        nn.ModuleDict({"self_attn": block("q_proj", "k_proj", "v_proj", "o_proj"),
                       "mlp": block("gate_proj", "up_proj", "down_proj")})
        for _ in range(2)
    )
    return nn.ModuleDict({"model": nn.ModuleDict({"layers": layers})})


PATHS = [path for path, _ in walk_modules(two_layers())]
PROJECTIONS = [path for path in PATHS if path.endswith("_proj")]


@pytest.fixture(scope="module")
def guarded():
    """What the hostile patterns match, worked out in a child process that must finish within a minute."""
    job = {"regex": CATASTROPHIC_REGEX, "stars": MANY_STARS, "interleaved": INTERLEAVED, "paths": PATHS, "keys": KEYS}
    done = subprocess.run([sys.executable, "-c", GUARD], input=json.dumps(job), capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def test_a_catastrophic_regex_is_an_re2_program_of_a_dozen_instructions(guarded):
    pattern = compile_regex(CATASTROPHIC_REGEX)
    assert isinstance(pattern, Pattern) and pattern.program_size <= 16
    assert guarded["regex"] == [] and pattern.fullmatch("model.layers!")
    policy = make_policy(stream={"rule": [{**stream_rule("hostile", "linear", regex=CATASTROPHIC_REGEX),
                                           "optional": True},
                                          stream_rule("rest", "linear", **{"class": "Linear"})]})
    counts = streamwise.resolve(policy, two_layers()).summary()["rule_matches"]
    assert (counts["stream.hostile"], counts["stream.rest"]) == (0, len(PROJECTIONS))


def test_a_run_of_double_stars_compiles_to_one(guarded):
    assert compile_glob(MANY_STARS).source == compile_glob("**.*_proj").source == r"(?:\.[^.]+)*\.[^.]*_proj"
    assert compile_glob(".".join(["**"] * 40)).source == compile_glob("**").source
    assert guarded["stars"] == PROJECTIONS
    plan = streamwise.resolve(make_policy(stream={"rule": [stream_rule("stars", "linear", path=MANY_STARS)]}),
                              two_layers())
    assert plan.summary()["rule_matches"]["stream.stars"] == len(PROJECTIONS)


def test_five_thousand_double_stars_are_refused_with_the_limit(tmp_path):
    with pytest.raises(ValidationError) as refused:
        Selector(path=".".join(["**"] * 5000))
    [error] = refused.value.errors()
    assert (error["type"], error["ctx"]["offset"]) == ("bad-glob", MAX_PATTERN_LENGTH)
    assert error["msg"] == f"path glob of 14999 characters: the limit is {MAX_PATTERN_LENGTH}"
    glob = ".".join(["**"] * 400)  # a line short enough for the policy reader
    path = write_policy(tmp_path, "stars", f'\n[[stream.rule]]\nid = "all"\nkind = "linear"\n'
                                           f'select = {{ path = ["{glob}"] }}\n')
    policy, [diagnostic] = check_policy(path)
    assert policy is None and diagnostic.code == "bad-glob"
    assert (diagnostic.key_path, diagnostic.location.line) == ("stream.rule[0].select.path[0]", 9)
    assert diagnostic.message == f"path glob of {len(glob)} characters: the limit is {MAX_PATTERN_LENGTH}"


def test_wildcard_segments_are_bounded_after_merging_double_stars():
    compile_glob(".".join(["*"] * (MAX_GLOB_WILDCARDS - 1) + ["**"] * 100))  # 100 `**` merge into one: at the limit
    with pytest.raises(PatternError, match=f"more than {MAX_GLOB_WILDCARDS} segments with a wildcard") as refused:
        compile_glob(".".join(["*"] * (MAX_GLOB_WILDCARDS + 1)))
    assert refused.value.offset == 2 * MAX_GLOB_WILDCARDS


def test_hostile_state_dict_keys_pick_a_policy_through_auto_at_once(tmp_path, guarded):
    """`auto` over a real 27-key safetensors file, with a user policy whose key patterns cannot be merged."""
    pattern = compile_glob(INTERLEAVED)
    assert pattern.program_size <= 8 * len(INTERLEAVED)
    assert guarded["interleaved"] == []
    save_file({key: torch.zeros(1) for key in KEYS}, tmp_path / "model.safetensors")
    keys = open_checkpoint(tmp_path / "model.safetensors").tensors
    for name, last in (("misses", "bias"), ("hits", "weight")):
        write_policy(tmp_path, name, f'\n[match]\nstate_dict_keys = ["{INTERLEAVED[:-4]}{last}"]\n')
    choice = select_policy(nn.Module(), keys=keys, dirs=[tmp_path])
    assert (choice.policy.name, choice.reason) == ("hits", "`auto` picked `hits` by its state-dict key patterns")


@pytest.mark.parametrize(
    "regex, construct, offset",
    [
        (r"(\w+)\.\1", r"a backreference `\1`", 7),
        (r"(?P<n>\w+)\.(?P=n)", "a backreference `(?P=name)`", 12),
        (r"layers\.(?=\d)\w+", "a lookahead `(?=...)`", 8),
        (r".*(?<!mlp)\.proj", "a negative lookbehind `(?<!...)`", 2),
        (r"(?>\w+)", "an atomic group `(?>...)`", 0),
        (r"\w++", "a possessive quantifier", 3),
        (r"\d{2}+", "a possessive quantifier", 5),
        (r"(?x) a", "the `x` flag", 2),
        (r"a{,3}", "`{,3}` (RE2 reads it as text: write `{0,3}`)", 1),
        (r"proj\Z", r"`\Z`", 4),
        (r"[[:alpha:]]+", "`[:` inside a class", 1),
        (r"a{1001}", "invalid repetition size: {1001}", 1),  # what RE2 itself says, located by its fragment
    ],
)
def test_constructs_re2_lacks_are_refused_where_they_are(regex, construct, offset):
    with pytest.raises(PatternError) as refused:
        compile_regex(regex)
    assert construct in refused.value.message and refused.value.offset == offset


def test_a_refused_construct_is_a_located_diagnostic(tmp_path):
    path = write_policy(tmp_path, "backref", "\n[[stream.rule]]\nid = \"pairs\"\nkind = \"linear\"\n"
                                             "select = { regex = ['(\\w+)\\.\\1'] }\n")
    [diagnostic] = check_policy(path)[1]
    assert diagnostic.code == "bad-regex"
    assert "RE2 (the linear-time matcher) does not support a backreference" in diagnostic.message
    assert (diagnostic.location.line, diagnostic.location.col) == (9, len("select = { regex = ['(\\w+)\\.") + 1)


def test_pattern_length_and_program_size_are_bounded():
    with pytest.raises(PatternError, match=f"the limit is {MAX_PATTERN_LENGTH}"):
        compile_regex("a" * (MAX_PATTERN_LENGTH + 1))
    assert compile_regex("[^.]{1,1000}").program_size <= MAX_PROGRAM_SIZE
    with pytest.raises(PatternError, match=f"RE2 instructions: the limit is {MAX_PROGRAM_SIZE}"):
        compile_regex("[^.]{1,1000}" * 2)
