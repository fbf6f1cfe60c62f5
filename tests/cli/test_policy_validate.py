"""policy-validate: output, exit codes, and no torch on the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from streamwise.runtime.cli.policy_validate import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from streamwise.runtime.policy.folders import SHIPPED_POLICY_DIR

from helpers import INVALID, write_policy

SHIPPED = sorted(path.stem for path in SHIPPED_POLICY_DIR.glob("*.toml"))  # `_template` included


def test_no_arguments_checks_the_shipped_policies(capsys):
    assert main([]) == EXIT_OK
    out = capsys.readouterr().out
    assert {"_template", "any-module", "decoder-llm", "transformers", "vibevoice"} <= set(SHIPPED)
    for name in SHIPPED:
        assert f"ok: policies/{name}.toml" in out
    assert out.strip().endswith(f"{len(SHIPPED)} policies valid")


def test_no_arguments_includes_the_user_policy_folder(tmp_path, monkeypatch, capsys):
    write_policy(tmp_path, "mine", '\n[compile]\nmode = "fastest"\n')
    monkeypatch.setenv("STREAMWISE_POLICY_PATH", str(tmp_path))
    assert main(["--quiet"]) == EXIT_PROBLEMS
    out = capsys.readouterr().out
    assert "mine.toml:7:8" in out and f"1 of {len(SHIPPED) + 1} policies invalid" in out


def test_a_looping_symlink_given_by_name_is_an_unreadable_file(tmp_path, capsys):
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    assert main([str(loop)]) == EXIT_PROBLEMS
    assert "error[unreadable-file]" in capsys.readouterr().out


def test_no_arguments_skips_what_the_policy_folders_ignore(tmp_path, monkeypatch, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    write_policy(outside, "elsewhere")
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "elsewhere.toml").symlink_to(outside / "elsewhere.toml")  # leads out: never loaded by name
    monkeypatch.setenv("STREAMWISE_POLICY_PATH", str(folder))
    assert main([]) == EXIT_OK
    out = capsys.readouterr().out
    assert "elsewhere" not in out and out.strip().endswith(f"{len(SHIPPED)} policies valid")


def test_problems_exit_1_and_warnings_alone_exit_0(capsys):
    assert main([str(INVALID / "bad-regex--unbalanced.toml")]) == EXIT_PROBLEMS
    assert main([str(INVALID / "unknown-backend.toml")]) == EXIT_OK
    assert "warning[unknown-backend]" in capsys.readouterr().out


def test_folders_are_searched_for_policy_files(capsys):
    assert main(["--quiet", str(INVALID)]) == EXIT_PROBLEMS
    last = capsys.readouterr().out.strip().splitlines()[-1]
    total = len(list(INVALID.glob("*.toml")))
    assert last.startswith(f"{total - 1} of {total} policies invalid")  # only unknown-backend is valid


def test_json_output_is_machine_readable(capsys):
    assert main(["--format", "json", str(INVALID / "invalid-value--compile-mode.toml")]) == EXIT_PROBLEMS
    document = json.loads(capsys.readouterr().out)
    (report,) = document["files"]
    assert report["valid"] is False
    (diagnostic,) = report["diagnostics"]
    assert (diagnostic["code"], diagnostic["line"], diagnostic["col"]) == ("invalid-value", 7, 8)
    assert diagnostic["suggestion"] == "max-autotune"
    assert document["summary"] == {"files": 1, "errors": 1, "warnings": 0}


def test_missing_path_is_a_usage_error(capsys):
    assert main(["no/such/policy.toml"]) == EXIT_USAGE
    assert "no such file or folder: no/such/policy.toml" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--format", "yaml"], ["--frobnicate"]])
def test_bad_options_are_usage_errors(argv):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == EXIT_USAGE


NAMES_FOREIGN_CLASSES = """extends = "decoder-llm"

[[stream.rule]]
id = "qualified-norms"
kind = "llama_rms_norm"
select = { class = ["transformers.models.llama.modeling_llama.LlamaRMSNorm", "torch.nn.modules.normalization.RMSNorm"] }

[[quant.rule]]
id = "qualified-linears"
format = "int8"
select = { class = "torch.nn.modules.linear.Linear", subclasses = true }

[compile]
backend = "my_backend"
blocks = { class = "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer" }
"""

FRONT_END_SCRIPT = """
import importlib, json, pkgutil, sys

baseline = set(sys.modules)
import streamwise.runtime.policy as front

submodules = {info.name for info in pkgutil.iter_modules(front.__path__)}
expected = {"folders", "source", "spans", "validate", "diagnostics", "extends", "migrations", "load", "schema_export"}
assert expected <= submodules, submodules
for name in sorted(submodules):
    importlib.import_module(f"{front.__name__}.{name}")
from streamwise.runtime import check_policy, errors_in, load_policy, render_json, render_text
from streamwise.runtime.cli.policy_validate import main
from streamwise.runtime.policy.folders import SHIPPED_POLICY_DIR, list_policies
from streamwise.runtime.policy.schema_export import render_schema

render_schema()
reports = {}
for name, path in list_policies([SHIPPED_POLICY_DIR], include_hidden=True).items():
    policy, diagnostics = check_policy(path)
    assert policy is not None and not errors_in(diagnostics) and load_policy(name) == policy, name
    reports[name] = diagnostics
named, diagnostics = check_policy(sys.argv[1])  # class names as text, torch's and transformers' among them
assert named is not None and named.stream.rule[-1].id == "qualified-norms"
assert "warning[unknown-backend]" in render_text(diagnostics)
reports["names-foreign-classes"] = diagnostics
assert json.loads(render_json(reports))["summary"] == {"files": len(reports), "errors": 0, "warnings": 1}
status = main(["-q"]) or main(["--format", "json", sys.argv[1]])

assert "torch" not in sys.modules, "torch imported"
assert "transformers" not in sys.modules, "transformers imported"
allowed = {"streamwise", "tomli", "pydantic", "re2"}  # re2: the linear-time pattern matcher
allowed |= {"pydantic_core", "annotated_types", "typing_extensions", "typing_inspection"}  # pydantic's own
foreign = {m.split(".")[0] for m in set(sys.modules) - baseline} - set(sys.stdlib_module_names) - allowed
foreign = {m for m in foreign if not m.startswith("_sysconfigdata")}  # stdlib, named per platform
assert not foreign, sorted(foreign)
sys.exit(status)
"""


def test_the_policy_front_end_imports_neither_torch_nor_what_a_policy_names(tmp_path):
    """In a fresh interpreter: every policy module and the CLI, every shipped policy checked and rendered, and a
    policy naming torch and transformers classes; only the stdlib, pydantic, tomli and streamwise get imported."""
    path = write_policy(tmp_path, "names-foreign-classes", NAMES_FOREIGN_CLASSES)
    env = {k: v for k, v in os.environ.items() if k != "STREAMWISE_POLICY_PATH"}
    command = [sys.executable, "-c", FRONT_END_SCRIPT, str(path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == EXIT_OK, result.stderr
    summary, _, document = result.stdout.partition("\n")
    assert summary == f"{len(SHIPPED)} policies valid"
    (report,) = json.loads(document)["files"]
    assert report["valid"] is True and [d["code"] for d in report["diagnostics"]] == ["unknown-backend"]


def test_model_mode_prints_the_plan_and_coverage(capsys):
    assert main(["--model", "transformers:Qwen2ForCausalLM", "decoder-llm"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("model: transformers:Qwen2ForCausalLM (built on the meta device)\nplan: policy `decoder-llm` "
                          "on transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM\n")
    assert "stream:linear" in out and "Linear x225" in out  # the full-size default config, on meta
    assert "covered                       100.00%" in out


def test_model_mode_previews_the_policy_auto_picks_and_why(capsys, monkeypatch, tmp_path):
    assert main(["--model", "transformers:qwen2", "--model-config", '{"num_hidden_layers": 2}', "auto"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("model: transformers:qwen2 (built on the meta device)\n`auto` picked `decoder-llm` by "
                          "root class `Qwen2ForCausalLM`\nplan: policy `decoder-llm` on ")
    write_policy(tmp_path, "broken", "\n[match]\nfallback = 1\n")
    monkeypatch.setenv("STREAMWISE_POLICY_PATH", str(tmp_path))
    argv = ["--format", "json", "--model", "transformers:qwen2", "--model-config", '{"num_hidden_layers": 2}', "auto"]
    assert main(argv) == EXIT_PROBLEMS  # a user policy `auto` cannot read: said, never passed over
    document = json.loads(capsys.readouterr().out)
    assert document["plan"] is None and document["chosen"] is None
    assert [d["code"] for d in document["files"][0]["diagnostics"]] == ["invalid-type", "unreadable-policy"]


def test_model_mode_with_an_inline_config_and_json(capsys):
    argv = ["--format", "json", "--model", "transformers:qwen2", "--model-config", '{"num_hidden_layers": 3}',
            "decoder-llm"]
    assert main(argv) == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    assert document["plan"]["modules"]["compile"] == {"Qwen2DecoderLayer": 3}
    assert document["plan"]["stranded"] == [] and document["model"] == "transformers:qwen2"
    assert document["files"] == [{"file": "decoder-llm", "valid": True, "diagnostics": []}]
    assert document["summary"] == {"files": 1, "errors": 0, "warnings": 0}


def test_model_mode_json_keeps_its_shape_when_the_policy_has_errors(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('schema_version = 1\n[policy]\nname = "bad"\n'
                   '[[stream.rule]]\nid = "r"\nkind = "linaer"\nselect = { class = "Linear" }\n')
    argv = ["--format", "json", "--model", "transformers:qwen2", "--model-config", '{"num_hidden_layers": 1}', str(bad)]
    assert main(argv) == EXIT_PROBLEMS
    document = json.loads(capsys.readouterr().out)
    assert document["plan"] is None and document["model"] == "transformers:qwen2"
    assert document["summary"]["errors"] == 1 and document["files"][0]["valid"] is False


def test_model_mode_with_a_python_factory(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))\n"
    )
    monkeypatch.chdir(tmp_path)  # found in the working folder, as the user's own code
    assert main(["--model", "my_models:build", "decoder-llm"]) == EXIT_PROBLEMS
    assert str(tmp_path) not in sys.path
    out = capsys.readouterr().out
    assert "error[unmatched-rule]: rule `embedding` in [stream] matches no module of `Sequential`" in out
    assert "warning[stranded-tensors]" in out
    assert '`LayerNorm` x2 (bias, weight; 32 bytes), e.g. `1.weight`: [[stream.rule]] kind = "auto"' in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "transformers:qwen22", "decoder-llm"], "did you mean `qwen2`?"),
    (["--model", "no_such_module:build", "decoder-llm"], "cannot find `no_such_module:build`"),
    (["--model", "transformers", "decoder-llm"], "is not a model spec"),
    (["--model", "transformers:qwen2", "--model-config", "{oops", "decoder-llm"], "Expecting property name"),
    (["--model", ":build", "decoder-llm"], "is not a model spec"),
    (["--model", "transformers:Conv1D", "decoder-llm"], "`Conv1D` is not a transformers model class"),
    (["--model", "transformers:qwen2", "--model-config", "[2]", "decoder-llm"], "must be a JSON object"),
    (["--model", "torch.nn:Linear", "--model-config", '{"widht": 2}', "decoder-llm"],
     "`torch.nn:Linear` has no key `widht`"),
    (["--model", "transformers:qwen2", "--model-config", '{"num_hiden_layers": 2}', "decoder-llm"],
     "the `qwen2` config has no key `num_hiden_layers`; did you mean `num_hidden_layers`?"),
    (["--model", "transformers:Qwen2ForCausalLM", "--model-config", '{"vocab_sise": 2}', "decoder-llm"],
     "did you mean `vocab_size`?"),
    (["--model", "transformers:Qwen2ForCausalLm", "decoder-llm"], "did you mean `Qwen2ForCausalLM`?"),
    (["--model", "transformers:qwen2", "--model-config", '{"num_attention_heads": 0}', "decoder-llm"],
     "ZeroDivisionError"),
    (["--model", "transformers:qwen2", "--model-config", '{"hidden_size": "x"}', "decoder-llm"],
     "cannot build `qwen2`"),
    (["--model", "torch.nn:Linear", "--model-config", '{"in_features": -1, "out_features": 2}', "missing.toml"],
     "cannot call `torch.nn:Linear`"),  # the spec is checked before the policy is looked for
])
def test_model_mode_usage_errors(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_model_mode_needs_exactly_one_policy():
    usage_errors = (
        ["--model", "transformers:qwen2"], ["--model", "transformers:qwen2", "a", "b"], ["--model-config", "{}"]
    )
    for argv in usage_errors:
        with pytest.raises(SystemExit) as raised:
            main(argv)
        assert raised.value.code == EXIT_USAGE
