"""load_policy: names and paths, the policy folders, `extends`, migrations, and policy-as-data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import streamwise
from streamwise.runtime import check_policy, load_policy
from streamwise.runtime.policy import migrations
from streamwise.runtime.policy.diagnostics import CODES
from streamwise.runtime.policy.folders import SHIPPED_POLICY_DIR, find_policy, list_policies, policy_dirs
from streamwise.runtime.registry import Registry

from helpers import REPO, write_policy

PARENT_BODY = """
[stream]
exclude = { path = "lm_head" }

[[stream.rule]]
id = "linear"
kind = "linear"
select = { class = "Linear" }

[[stream.rule]]
id = "norms"
kind = "rms_norm"
select = { class = "RMSNorm" }

[match]
classes = ["ParentModel"]

[compile]
mode = "max-autotune"
verbose = false
"""


def ids(section):
    return [rule.id for rule in section.rule]


def test_top_level_api_is_small_and_deliberate():
    assert set(streamwise.__all__) == {
        "Error", "Policy", "PolicyError", "load_policy", "resolve", "apply", "apply_policy", "revert", "offload",
        "dispatch", "model_patcher", "load", "skeleton", "load_pretrained", "lazy_compile", "compile_stats",
        "draft_policy", "register_builder",
    }
    assert dir(streamwise) == sorted({*streamwise.__all__, "runtime", "schemas"})  # listed before first use, and
    # nothing of how the package imports itself (`annotations`, `os`, `sys`, `importlib`), nor `errors` itself
    assert callable(streamwise.draft_policy)
    assert isinstance(streamwise.load_policy("decoder-llm"), streamwise.Policy)
    assert callable(streamwise.resolve) and callable(streamwise.model_patcher)
    with pytest.raises(AttributeError):
        streamwise.no_such_thing  # noqa: B018 (the attribute access is what must raise)


def test_shipped_policy_by_name_and_by_path_are_the_same():
    by_name = load_policy("vibevoice")
    by_path = load_policy(SHIPPED_POLICY_DIR / "vibevoice.toml")
    assert by_name == by_path
    assert by_name.source.endswith("vibevoice.toml")


def test_vibevoice_inherits_the_decoder_rules_but_not_its_match():
    policy = load_policy("vibevoice")
    assert ids(policy.stream)[:3] == ["linear", "embedding", "rms-norm"]  # parent's first, in order
    assert "conv-transpose1d" in ids(policy.stream)
    assert ids(policy.relocate)[0] == "rotary"
    assert "VibeVoiceForConditionalGeneration" in policy.match.classes
    assert "Qwen2ForCausalLM" not in policy.match.classes
    assert policy.compile.blocks.class_ == ("Qwen2DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer")


def test_merge_rules_replace_by_id_append_new_and_overlay_compile(tmp_path):
    write_policy(tmp_path, "parent", PARENT_BODY)
    child = write_policy(tmp_path, "child", """extends = "parent"

[[stream.rule]]
id = "norms"
kind = "llama_rms_norm"
select = { class = "LlamaRMSNorm" }

[[stream.rule]]
id = "embedding"
kind = "embedding"
select = { class = "Embedding" }

[compile]
verbose = true
""")
    policy = load_policy(child)
    assert ids(policy.stream) == ["linear", "norms", "embedding"]
    assert policy.stream.rule[1].kind == "llama_rms_norm"
    assert policy.stream.exclude.path == ("lm_head",)  # kept: the child gave none
    assert policy.compile.mode == "max-autotune" and policy.compile.verbose is True
    assert policy.match.classes == ()  # never inherited
    assert policy.policy.extends == "parent"


def test_child_exclude_replaces_the_parents(tmp_path):
    write_policy(tmp_path, "parent", PARENT_BODY)
    child = write_policy(tmp_path, "child", 'extends = "parent"\n\n[stream]\nexclude = { class = "Embedding" }\n')
    policy = load_policy(child)
    assert policy.stream.exclude.class_ == ("Embedding",) and policy.stream.exclude.path == ()


def test_extends_prefers_a_sibling_over_a_shipped_policy(tmp_path):
    write_policy(tmp_path, "decoder-llm", PARENT_BODY)
    child = write_policy(tmp_path, "child", 'extends = "decoder-llm"\n')
    assert ids(load_policy(child).stream) == ["linear", "norms"]


def test_user_folder_shadows_the_shipped_policy(tmp_path, monkeypatch):
    write_policy(tmp_path, "decoder-llm", PARENT_BODY)
    monkeypatch.setenv("STREAMWISE_POLICY_PATH", str(tmp_path))
    assert ids(load_policy("decoder-llm").stream) == ["linear", "norms"]
    assert policy_dirs()[0] == tmp_path and policy_dirs()[-1] == SHIPPED_POLICY_DIR
    assert list_policies(policy_dirs())["decoder-llm"] == tmp_path / "decoder-llm.toml"


def test_hidden_policies_are_valid_but_not_listed():
    assert "_template" not in list_policies([SHIPPED_POLICY_DIR])
    assert "_template" in list_policies([SHIPPED_POLICY_DIR], include_hidden=True)
    assert load_policy("_template").name == "_template"


@pytest.mark.parametrize("name", ["../vibevoice", "..", "a/b", "/etc/passwd", "vibevoice.toml", "x\\y", ""])
def test_names_never_leave_the_policy_folders(name):
    assert find_policy(name, [SHIPPED_POLICY_DIR]) is None


def test_symlinks_cannot_escape_a_policy_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    write_policy(outside, "secret")
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "secret.toml").symlink_to(outside / "secret.toml")
    assert find_policy("secret", [folder]) is None
    assert "secret" not in list_policies([folder])


def test_unknown_name_suggests_the_closest_policy():
    with pytest.raises(streamwise.PolicyError) as raised:
        load_policy("vibevoise")
    (diagnostic,) = raised.value.diagnostics
    assert diagnostic.code == "unknown-policy" and diagnostic.suggestion == "vibevoice"
    assert "did you mean `vibevoice`?" in str(raised.value)


def test_policy_error_carries_located_diagnostics(tmp_path):
    path = write_policy(tmp_path, "broken", '\n[compile]\nmode = "fast"\nfullgraph = "no"\n')
    with pytest.raises(streamwise.PolicyError) as raised:
        load_policy(path)
    found = {(d.code, d.location.line) for d in raised.value.diagnostics}
    assert found == {("invalid-value", 7), ("invalid-type", 8)}
    assert f"{path}:7:8" in str(raised.value)


def test_newer_schema_version_is_refused(tmp_path):
    path = write_policy(tmp_path, "future", version=2)
    _, diagnostics = check_policy(path)
    assert [d.code for d in diagnostics] == ["unsupported-version"]
    assert "supports up to 1" in diagnostics[0].message


def test_migration_hook_upgrades_older_documents_with_located_deprecations(tmp_path, monkeypatch):
    monkeypatch.setattr(migrations, "_MIGRATIONS", Registry("migration"))

    @migrations.migration(0)
    def rename_title(document):
        document["policy"]["name"] = document["policy"].pop("title")
        return document, [migrations.KeyMove(("policy", "title"), ("policy", "name"))]

    assert migrations.oldest_readable_version() == 0
    path = tmp_path / "old.toml"
    path.write_text('schema_version = 0\n\n[policy]\ntitle = "old"\n', encoding="utf-8")
    policy, diagnostics = check_policy(path)
    assert policy is not None and policy.name == "old" and policy.schema_version == 1
    (warning,) = diagnostics
    assert (warning.code, warning.severity) == ("deprecated-key", "warning")
    assert warning.message == "'policy.title' -> 'policy.name'"
    assert (warning.location.line, warning.location.col) == (4, 1)
    with pytest.raises(ValueError, match="already registered; register yours under another name"):
        migrations.migration(0)(rename_title)


def test_every_code_is_documented_in_the_policy_format_docs():
    readme = (REPO / "docs" / "policy-format.md").read_text(encoding="utf-8")  # the format's reference
    assert [code for code in CODES if f"`{code}`" not in readme] == []


def test_loading_a_policy_imports_nothing_it_names(tmp_path):
    """A policy is data: class names are compared as text, never imported."""
    canary = tmp_path / "sw_canary.py"
    fired = tmp_path / "fired"
    canary.write_text(f"open({str(fired)!r}, 'w').close()\nclass Thing: pass\n", encoding="utf-8")
    path = write_policy(tmp_path, "canary", """
[[stream.rule]]
id = "thing"
kind = "linear"
select = { class = ["sw_canary.Thing", "os.system"], regex = ['__import__\\(.*\\)'] }
""")
    script = (
        "import sys; sys.path.insert(0, sys.argv[2]); import streamwise; "
        "streamwise.load_policy(sys.argv[1]); "
        "assert 'torch' not in sys.modules, 'torch imported'; assert 'sw_canary' not in sys.modules"
    )
    env = {k: v for k, v in os.environ.items() if k != "STREAMWISE_POLICY_PATH"}
    subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path)], check=True, env=env)
    assert not fired.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX devices and FIFOs")
def test_devices_pipes_and_symlink_loops_are_unreadable_files(tmp_path):
    os.mkfifo(tmp_path / "pipe.toml")  # opening one would wait for a writer forever
    (tmp_path / "loop.toml").symlink_to(tmp_path / "loop.toml")
    for path in ("/dev/zero", tmp_path / "pipe.toml", tmp_path / "loop.toml"):
        policy, diagnostics = check_policy(path)
        assert policy is None and [d.code for d in diagnostics] == ["unreadable-file"], path
    assert list_policies([tmp_path]) == {}  # a loop, a FIFO: listing still works, and offers neither


def test_an_encoding_error_after_a_bom_gives_the_files_own_offset(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbfschema_version = 1 # caf\xe9\n")
    _, diagnostics = check_policy(path)
    assert "at offset 27 is not" in diagnostics[0].message


def test_every_error_a_stage_defines_is_a_streamwise_error():
    """One `except streamwise.Error` catches whatever Streamwise raises on purpose (each keeps its builtin too)."""
    import importlib
    import inspect
    import pkgutil

    found = {}
    for package in (streamwise.runtime, streamwise.schemas):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            found.update({f"{info.name}.{name}": cls for name, cls in vars(module).items()
                          if inspect.isclass(cls) and issubclass(cls, Exception) and not name.startswith("_")
                          and cls.__module__ == info.name})
    assert len(found) >= 15, sorted(found)
    assert [name for name, cls in found.items() if not issubclass(cls, streamwise.Error)] == []
