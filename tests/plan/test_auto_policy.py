"""`auto`: candidates ranked by root class, then model_type, state-dict key patterns, base class, then the fallback;
the strongest whose plan fits the tree (no error, nothing stranded) wins; equal fitting candidates are an error,
never a guess."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from streamwise import PolicyError
from streamwise.runtime.plan.auto import select_policy, tree_keys

from helpers import tiny_acoustic_tokenizer, tiny_qwen2, write_policy


class Unknown(torch.nn.Module):
    pass


class Holder(nn.Module):
    """A root no policy names, holding a VibeVoice acoustic tokenizer under the name VibeVoice uses."""

    def __init__(self) -> None:
        super().__init__()
        self.acoustic_tokenizer = tiny_acoustic_tokenizer()


def test_key_patterns_pick_a_policy_when_class_and_model_type_do_not():
    choice = select_policy(Holder())
    assert (choice.policy.name, choice.reason) == ("vibevoice", "`auto` picked `vibevoice` by its state-dict key "
                                                                "patterns")


def test_the_keys_are_the_trees_own_so_memory_and_files_agree():
    model = Holder()
    assert sorted(tree_keys(model)) == sorted(model.state_dict())
    # the same tree, matched against the keys a file would list, is planned alike
    assert select_policy(model, keys=model.state_dict()).policy.name == select_policy(model).policy.name


def test_every_key_pattern_must_match_not_just_one(tmp_path):
    write_policy(tmp_path, "both", '\n[match]\nstate_dict_keys = ["a.**", "b.**"]\n')
    model = nn.Module()
    assert select_policy(model, keys=["a.x"], dirs=[tmp_path]).policy.name == "any-module"
    assert select_policy(model, keys=["a.x", "b.y"], dirs=[tmp_path]).policy.name == "both"


def test_a_family_policy_beats_the_library_policy_which_beats_the_fallback():
    import transformers

    assert select_policy(tiny_qwen2()).policy.name == "decoder-llm"  # by root class
    config = transformers.CohereConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    choice = select_policy(transformers.CohereForCausalLM(config))
    assert choice.policy.name == "transformers"
    assert choice.reason.startswith("`auto` picked `transformers` by base class `PreTrainedModel`, no family policy")
    choice = select_policy(Unknown(), keys=["encoder.weight"])
    assert (choice.policy.name, choice.reason) == (
        "any-module", "`auto` picked `any-module` by fallback: no other policy recognizes it")


def test_a_candidate_whose_plan_does_not_fit_is_passed_over_with_its_reason():
    """Cohere's keys match `decoder-llm`'s pattern, which outranks the base-class match, but its norms are not
    the ones `decoder-llm` names: the library policy fits and wins, and the reason says what was passed over."""
    import transformers

    config = transformers.CohereConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = transformers.CohereForCausalLM(config)
    choice = select_policy(model)
    assert choice.policy.name == "transformers"
    assert "passed over `decoder-llm` (by its state-dict key patterns): error[unmatched-rule]" in choice.reason
    assert "rule `rms-norm`" in choice.reason
    plan, modules = choice.resolved
    assert plan.ok and not plan.coverage.stranded and len(modules) == len(plan.modules)


def test_a_candidate_that_strands_tensors_is_passed_over(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    write_policy(tmp_path, "linears-only", '\n[match]\nclasses = ["Sequential"]\n'
                 '[[stream.rule]]\nid = "linear"\nkind = "linear"\nselect = { class = "Linear" }\n')
    choice = select_policy(model, dirs=[tmp_path])
    assert choice.policy.name == "any-module"
    assert "passed over `linears-only` (by root class `Sequential`): strands 2 tensors (32 B), e.g. `1.weight`" \
        in choice.reason


@pytest.mark.parametrize("level, match", [
    ("fallback", "fallback = true"),
    ("root class", 'classes = ["Unknown"]'),
    ("keys", 'state_dict_keys = ["**"]'),
])
def test_two_fitting_candidates_of_equal_strength_are_an_error_not_a_guess(tmp_path, level, match):
    for name in ("mine", "yours"):
        write_policy(tmp_path, name, f"\n[match]\n{match}\n"
                     '[[relocate.rule]]\nid = "buffers"\nselect = { holds = "buffers-only" }\n')
    model = Unknown()
    model.register_buffer("b", torch.zeros(1))
    if level == "fallback":
        expected = "policies `any-module`, `mine`, `yours` all match `Unknown` by fallback"
    else:
        expected = "policies `mine`, `yours` all match `Unknown` by "
    with pytest.raises(PolicyError, match=expected):
        select_policy(model, dirs=[tmp_path])


def test_a_tied_candidate_that_does_not_fit_leaves_the_other_to_win(tmp_path):
    write_policy(tmp_path, "mine", '\n[match]\nclasses = ["Unknown"]\n')
    write_policy(tmp_path, "yours", '\n[match]\nclasses = ["Unknown"]\n'
                 '[[stream.rule]]\nid = "linear"\nkind = "linear"\nselect = { class = "Linear" }\n')
    choice = select_policy(Unknown(), dirs=[tmp_path])
    assert choice.policy.name == "mine"
    assert "passed over `yours` (by root class `Unknown`): error[unmatched-rule]" in choice.reason


def test_no_fitting_policy_is_an_error_that_lists_what_was_tried(tmp_path, monkeypatch):
    write_policy(tmp_path, "strict", '\n[match]\nfallback = true\n'
                 '[[stream.rule]]\nid = "linear"\nkind = "linear"\nselect = { class = "Linear" }\n')
    import streamwise.runtime.plan.auto as auto

    monkeypatch.setattr(auto, "policy_dirs", lambda dirs: [tmp_path])  # only the strict policy exists
    with pytest.raises(PolicyError, match=r"no policy fits `Unknown`: `strict` \(by fallback: no other policy "
                                          r"recognizes it\): error\[unmatched-rule\]"):
        select_policy(Unknown())


class Named(nn.Module):
    """A root with a config, the way transformers models carry `model_type`."""

    def __init__(self, model_type: str) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
        self.register_buffer("b", torch.zeros(1))


BUFFERS = '[[relocate.rule]]\nid = "buffers"\nselect = { holds = "buffers-only" }\n'


def test_the_strengths_rank_class_over_model_type_over_keys_over_base_class_over_fallback(tmp_path):
    """Each level beats the next one down: with a fitting policy at every level, the strongest wins; taken away,
    the next one does."""
    levels = {"by-class": 'classes = ["Named"]', "by-type": 'model_types = ["toy"]',
              "by-keys": 'state_dict_keys = ["b"]', "by-base": 'base_classes = ["torch.nn.modules.module.Module"]',
              "by-fallback": "fallback = true"}
    for name, match in levels.items():
        write_policy(tmp_path, name, f"\n[match]\n{match}\n{BUFFERS}")
    for strongest in list(levels)[:4]:
        assert select_policy(Named("toy"), dirs=[tmp_path]).policy.name == strongest
        (tmp_path / f"{strongest}.toml").unlink()
    with pytest.raises(PolicyError, match="policies `any-module`, `by-fallback` all match `Named` by fallback"):
        select_policy(Named("toy"), dirs=[tmp_path])  # the shipped fallback stands beside the last one


def test_model_type_is_read_from_the_models_config():
    import transformers

    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64)

    class Renamed(transformers.Qwen2ForCausalLM):  # a class no policy names, of model_type `qwen2`
        pass

    choice = select_policy(Renamed(config))
    assert (choice.policy.name, choice.reason) == ("decoder-llm", "`auto` picked `decoder-llm` by model_type `qwen2`")
    by_keys = select_policy(Renamed(config), model_type="other")  # the caller's model_type stands over the config's
    assert by_keys.reason == "`auto` picked `decoder-llm` by its state-dict key patterns"


def test_the_keys_leave_out_non_persistent_buffers():
    model = tiny_qwen2()
    keys = tree_keys(model)
    assert sorted(keys) == sorted(model.state_dict()) and not any(key.endswith("inv_freq") for key in keys)


def test_a_policy_file_that_does_not_load_fails_auto_naming_it_unless_skipped_and_then_said(tmp_path):
    broken = write_policy(tmp_path, "aaa-broken", "\n[match]\nfallback = 1\n")  # an error: first in name order
    write_policy(tmp_path, "mine", f'\n[match]\nclasses = ["Named"]\n{BUFFERS}')
    with pytest.raises(PolicyError) as raised:  # its [match] cannot be read: it may be meant for this model
        select_policy(Named("toy"), dirs=[tmp_path])
    text = str(raised.value)
    assert text.startswith("error[invalid-type]") and f"{broken}:" in text
    assert f"error[unreadable-policy]: `auto` cannot choose a policy for `Named` while 1 policy file(s) cannot be " \
           f"read: {broken}" in text
    chosen = select_policy(Named("toy"), dirs=[tmp_path], skip_unreadable=True)
    assert chosen.policy.name == "mine" and chosen.skipped == (str(broken),)
    assert chosen.reason.endswith(f"; skipped unreadable {broken}")


def test_an_unreadable_policy_is_named_alike_in_every_line_of_the_message(tmp_path, monkeypatch):
    """Inside the working folder its diagnostics name it relative to it; the refusal and the skip say the same."""
    folder = tmp_path / "user" / "policies"
    folder.mkdir(parents=True)
    write_policy(folder, "aaa-broken", "\n[match]\nfallback = 1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PolicyError) as raised:
        select_policy(Named("toy"), dirs=[folder])
    shown = "user/policies/aaa-broken.toml"
    assert f"--> {shown}:" in str(raised.value) and str(raised.value).count(shown) == 2
    assert str(tmp_path) not in str(raised.value)
    assert select_policy(Named("toy"), dirs=[folder], skip_unreadable=True).skipped == (shown,)


def test_choose_policy_selects_for_auto_and_loads_anything_else():
    import streamwise
    from streamwise.runtime.plan.auto import choose_policy, plan_for

    model = tiny_qwen2()
    assert choose_policy("auto", model).policy.name == "decoder-llm"
    named = choose_policy("transformers", model)
    assert (named.policy.name, named.reason, named.resolved) == ("transformers", "policy `transformers`", None)
    policy = streamwise.load_policy("any-module")
    assert choose_policy(policy, model).policy is policy
    assert plan_for("transformers", model)[1].ok
    with pytest.raises(PolicyError, match=r"error\[unmatched-rule\]"):  # a named policy that does not fit
        plan_for("vibevoice", model)


def test_auto_resolves_each_candidate_once(monkeypatch):
    import streamwise.runtime.plan.auto as auto
    from streamwise.runtime.plan.auto import plan_and_modules

    calls = []
    resolve = auto.resolve_with_modules
    monkeypatch.setattr(auto, "resolve_with_modules", lambda policy, model: calls.append(policy.name) or resolve(
        policy, model))
    policy, plan, modules = plan_and_modules("auto", tiny_qwen2())
    assert calls == ["decoder-llm"] and policy.name == "decoder-llm" and len(modules) == len(plan.modules)


def test_the_reason_counts_the_errors_of_a_candidate_passed_over():
    import transformers

    config = transformers.CohereConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    reason = select_policy(transformers.CohereForCausalLM(config)).reason
    assert "matches no module of `CohereForCausalLM` (and 1 more errors)" in reason  # rms-norm and rotary


def test_a_policy_by_name_is_loaded_whatever_the_name_and_auto_is_auto_however_spelled_in_memory():
    from streamwise.runtime.plan.auto import choose_policy

    model = tiny_qwen2()
    assert choose_policy("any-module", model).reason == "policy `any-module`"  # a name before "auto" in order
    spelled = "".join(["au", "to"])  # equal to "auto", not the same object
    assert choose_policy(spelled, model).reason == "`auto` picked `decoder-llm` by root class `Qwen2ForCausalLM`"


def test_key_patterns_match_a_tree_in_memory_even_when_the_first_policy_listed_matches_by_keys(tmp_path):
    """The tree's keys are read when the first policy that needs them comes up, whichever it is in name order."""
    write_policy(tmp_path, "aaa-by-keys", '\n[match]\nstate_dict_keys = ["b"]\n' + BUFFERS)
    assert select_policy(Named("toy"), dirs=[tmp_path]).reason == "`auto` picked `aaa-by-keys` by its state-dict key " \
                                                                   "patterns"


def test_a_base_class_named_without_its_module_is_shown_as_given(tmp_path):
    write_policy(tmp_path, "by-base", '\n[match]\nbase_classes = ["Module"]\n' + BUFFERS)
    assert select_policy(Named("toy"), dirs=[tmp_path]).reason == "`auto` picked `by-base` by base class `Module`, " \
                                                                   "no family policy"


def test_a_base_class_match_beats_the_fallback_and_the_fallback_is_last(tmp_path):
    write_policy(tmp_path, "by-base", '\n[match]\nbase_classes = ["torch.nn.modules.module.Module"]\n' + BUFFERS)
    write_policy(tmp_path, "by-fallback", "\n[match]\nfallback = true\n" + BUFFERS)
    assert select_policy(Named("toy"), dirs=[tmp_path]).policy.name == "by-base"


def test_a_single_error_is_named_without_a_count_of_more(tmp_path):
    write_policy(tmp_path, "one-rule", '\n[match]\nclasses = ["Named"]\n'
                 '[[stream.rule]]\nid = "linear"\nkind = "linear"\nselect = { class = "Linear" }\n')
    reason = select_policy(Named("toy"), dirs=[tmp_path]).reason
    assert reason.endswith("rule `linear` in [stream] matches no module of `Named`")


def test_a_choice_prints_without_its_plan():
    choice = select_policy(tiny_qwen2())
    assert choice.resolved is not None and "Plan" not in repr(choice) and len(repr(choice)) < 2000


def test_a_choice_cannot_be_changed_once_made():
    import dataclasses

    choice = select_policy(tiny_qwen2())
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.reason = "another"
