"""Hostile policy input: every case ends in a located diagnostic naming the limit, within counted bounds.

One case per class of issue #13 (rendering blow-up, huge integers, size limits before parsing, conflict checks
linear in the rules, names no file can have, the nodes reading only their own choices), then hypothesis mixing
them. Bounds are counted (characters rendered, diagnostics produced, bytes read), never timed; large inputs are
generated here, not stored.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamwise
from streamwise.runtime import check_policy, errors_in, render_json, render_text
from streamwise.runtime.policy import diagnostics as diagnostics_module
from streamwise.runtime.policy import load as load_module
from streamwise.runtime.policy import source as source_module
from streamwise.runtime.policy.diagnostics import (
    CODES,
    MAX_DIAGNOSTICS,
    MAX_RENDERED_CHARS,
    MAX_SNIPPET_CHARS,
    MAX_TEXT_CHARS,
    PolicyError,
)
from streamwise.runtime.policy.folders import MAX_NAME_CHARS, SHIPPED_POLICY_DIR, policy_dirs, unknown_choice
from streamwise.runtime.policy.limits import (
    MAX_EXTENDS_CHAIN,
    MAX_KEY_CHARS,
    MAX_KEY_SEGMENTS,
    MAX_LINE_CHARS,
    MAX_NUMBER_CHARS,
    MAX_RULES_PER_SECTION,
    MAX_TOKENS,
)
from streamwise.runtime.policy.source import MAX_POLICY_BYTES
from streamwise.runtime.policy.validate import _show

from comfy_harness import stand_in_comfy_api

HEADER = 'schema_version = 1\n[policy]\nname = "{name}"\n'
# The most one rendered diagnostic can take: its lines are clipped (message, notes, a snippet window).
ONE_RENDERED = 12 * MAX_TEXT_CHARS


def diagnose(tmp_path, name: str, text: str):
    path = tmp_path / f"{name}.toml"
    path.write_text(text, encoding="utf-8")
    policy, diagnostics = check_policy(path)
    assert path.read_text(encoding="utf-8") == text  # checking changes nothing
    assert (policy is None) == errors_in(diagnostics)
    assert all(d.code in CODES and d.location is not None for d in diagnostics)
    return policy, diagnostics


def only(diagnostics, code: str):
    (found,) = diagnostics
    assert found.code == code, render_text(diagnostics)
    return found


def rules(count: int, kinds=("generic", "linear"), select='{ class = "Linear" }') -> str:
    return "".join(
        f'[[stream.rule]]\nid = "r{i}"\nkind = "{kinds[i % len(kinds)]}"\nselect = {select}\n' for i in range(count)
    )


# 1. rendering ------------------------------------------------------------------------------------------------
def test_many_errors_on_one_long_line_render_within_bounds(tmp_path):
    keys = ", ".join(f"zz{i} = 1" for i in range(900))  # about 9 KB: under the line limit
    text = 'schema_version = 1\npolicy = { name = "wide", ' + keys + " }\n"
    assert len(text.split("\n")[1]) <= MAX_LINE_CHARS
    _, diagnostics = diagnose(tmp_path, "wide", text)
    assert len(diagnostics) == MAX_DIAGNOSTICS  # 900 found, 100 kept
    assert diagnostics[0].code == "unknown-key" and diagnostics[0].location.line == 2
    assert "800 more problems were found and not reported" in diagnostics[-1].notes[-1].message
    rendered = render_text(diagnostics)
    assert len(rendered) <= MAX_RENDERED_CHARS + ONE_RENDERED
    assert rendered.endswith("more diagnostics not shown")
    source_lines = [line for line in rendered.split("\n") if line.startswith("2 | ")]
    assert source_lines and all(len(line) <= MAX_SNIPPET_CHARS + 10 for line in source_lines)
    assert all(line.count("...") >= 1 for line in source_lines)  # the window says it cut the line


def test_a_one_mebibyte_line_is_one_located_diagnostic(tmp_path):
    text = 'schema_version = 1\npolicy = { name = "huge", ' + "zz = 1, " * ((MAX_POLICY_BYTES - 64) // 8) + "}\n"
    assert len(text) <= MAX_POLICY_BYTES
    found = only(diagnose(tmp_path, "huge", text)[1], "invalid-toml")
    assert (found.location.line, found.location.col) == (2, MAX_LINE_CHARS + 1)
    assert f"the limit is {MAX_LINE_CHARS}" in found.message
    assert len(render_text([found])) < 3 * MAX_SNIPPET_CHARS + len(found.message) + 100


def test_control_characters_render_as_escapes():
    found = diagnostics_module.Diagnostic("invalid-value", "a \x00 and \x1b[31m here")
    assert render_text([found]) == "error[invalid-value]: a \\x00 and \\x1b[31m here"


# 2. huge integers -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "literal"), [
    ("mode", "1" * 5000), ("mode", "0x" + "f" * 4000), ("dynamic", "-" + "9" * 4400), ("fullgraph", "0b" + "1" * 99),
])
def test_huge_integers_are_refused_before_they_are_converted(tmp_path, key, literal):
    text = HEADER.format(name="big") + f"[compile]\n{key} = {literal}\n"
    found = only(diagnose(tmp_path, "big", text)[1], "invalid-toml")
    assert (found.location.line, found.location.col) == (5, len(key) + 4)
    assert found.message == f"a number of {len(literal)} characters; the limit is {MAX_NUMBER_CHARS}"
    with pytest.raises(PolicyError, match="a number of"):  # never a bare ValueError
        streamwise.load_policy(tmp_path / "big.toml")


def test_a_huge_integer_is_shown_by_its_digit_count():
    assert _show(10**5000) == "an integer of about 5001 digits"
    assert _show(12345) == "`12345`"


# 3. size limits before the parser ---------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "line", "limit"), [
    ("a" + ".a" * 3999 + " = 1\n", 4, MAX_KEY_SEGMENTS),  # 50,000 segments would be over the line limit first
    ("[" + ".".join(["t"] * 3000) + "]\n", 4, MAX_KEY_SEGMENTS),
    ("x = { " + '"k".' * 40 + "k = 1 }\n", 4, MAX_KEY_SEGMENTS),
    ('"' + "k" * 300 + '" = 1\n', 4, MAX_KEY_CHARS),
    ("[" + "t" * 300 + "]\n", 4, MAX_KEY_CHARS),
    ("x = [\n" + "1, " * 2000 + "\n" + ("1, " * 3000 + "\n") * 20 + "]\n", 6, MAX_TOKENS),
])
def test_limits_are_checked_before_parsing(tmp_path, text, line, limit):
    found = only(diagnose(tmp_path, "limits", HEADER.format(name="limits") + text)[1], "invalid-toml")
    assert found.location.line >= line and f"the limit is {limit}" in found.message


def test_a_section_over_the_rule_limit_is_refused_at_the_first_rule_over_it(tmp_path):
    text = HEADER.format(name="many") + rules(MAX_RULES_PER_SECTION + 1, kinds=("linear",))
    found = only(diagnose(tmp_path, "many", text)[1], "invalid-value")
    assert found.location.line == 4 + 4 * MAX_RULES_PER_SECTION
    assert found.message == f"[stream] has {MAX_RULES_PER_SECTION + 1} rules; the limit is {MAX_RULES_PER_SECTION}"


def test_the_shipped_policies_are_within_every_limit():
    for path in sorted(SHIPPED_POLICY_DIR.glob("*.toml")):
        assert not errors_in(check_policy(path)[1]), path.name


def test_a_file_over_the_size_limit_is_read_no_further_than_the_limit(tmp_path, monkeypatch):
    path = tmp_path / "over.toml"
    path.write_bytes(b"#" * (3 * MAX_POLICY_BYTES))
    read = []

    class Counted:
        def __init__(self, *args, **kwargs):
            self.handle = open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def read(self, size=-1):
            data = self.handle.read(size)
            read.append(len(data))
            return data

    monkeypatch.setattr(source_module, "open", Counted, raising=False)
    only(check_policy(path)[1], "file-too-large")
    assert sum(read) == MAX_POLICY_BYTES + 1


# 4. conflicts linear in the rules ---------------------------------------------------------------------------
def test_many_rules_on_one_entry_are_one_conflict(tmp_path):
    count = MAX_RULES_PER_SECTION
    found = only(diagnose(tmp_path, "tied", HEADER.format(name="tied") + rules(count))[1], "rule-conflict")
    assert found.message == (
        "rules `r0` and `r1` both select class `Linear` but disagree on the compute kind (`generic` vs `linear`); "
        f"so do {count // 2 - 1} more rules: `r3`, `r5`, `r7`, `r9`, `r11`, and {count // 2 - 6} more"
    )
    assert found.location.line == 11 and found.notes[0].location.line == 7


def test_ties_at_many_modules_are_one_diagnostic():
    from torch import nn

    from helpers import make_policy, stream_rule

    policy = make_policy(stream={"rule": [stream_rule("any", "linear", path="*"), stream_rule("one", "generic",
                                                                                          path="?")]})
    plan = streamwise.resolve(policy, nn.Sequential(*(nn.Linear(2, 2) for _ in range(40))))
    found = only([d for d in plan.diagnostics if d.code == "rule-conflict"], "rule-conflict")
    assert "select `0` (and 9 more modules) equally specifically" in found.message


# 5. names and paths no file can have ------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "code", "says"), [
    ("x" * 256, "unknown-policy", f"policy names are at most {MAX_NAME_CHARS}"),
    ("a\x00b", "unknown-policy", "no policy named"),
    ("a\x00b.toml", "unreadable-file", "holds a NUL character"),
    ("/tmp/" + "x" * 300 + ".toml", "unreadable-file", "the path is too long"),
    ("/tmp/" + "x/" * 3000 + "p.toml", "unreadable-file", "the path is too long"),
])
def test_names_and_paths_no_file_can_have_are_diagnostics(name, code, says):
    policy, diagnostics = check_policy(name)
    assert policy is None and only(diagnostics, code) and says in diagnostics[0].message
    with pytest.raises(PolicyError):
        streamwise.load_policy(name)


def test_extends_a_name_too_long_is_located(tmp_path):
    text = HEADER.format(name="child") + 'extends = "' + "x" * 256 + '"\n'
    found = only(diagnose(tmp_path, "child", text)[1], "invalid-value")
    assert (found.location.line, found.location.col) == (4, 11)
    assert f"policy names are at most {MAX_NAME_CHARS}" in found.message


def test_the_cli_reports_a_path_too_long_without_a_traceback():
    command = [sys.executable, "-m", "streamwise.runtime.cli.policy_validate", "x" * 300 + ".toml"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error[unreadable-file]: cannot read policy file: the path is too long" in result.stdout


# 5b. extends chains are bounded and followed in linear time ---------------------------------------------------
def write_chain(folder, length: int, rules: int = 1) -> None:
    """`p0` extends `p1` ... extends `p{length - 1}`, each with `rules` rules of its own."""
    for index in range(length):
        extends = f'extends = "p{index + 1}"\n' if index + 1 < length else ""
        body = "".join(f'[[stream.rule]]\nid = "r{index}_{n}"\nselect = {{ class = "C{n}" }}\nkind = "generic"\n'
                       for n in range(rules))
        (folder / f"p{index}.toml").write_text(HEADER.format(name=f"p{index}") + extends + body, encoding="utf-8")


def counted_reads(monkeypatch) -> list:
    reads, real = [], source_module.read_source
    monkeypatch.setattr(load_module, "read_source", lambda *a: reads.append(a[0]) or real(*a))
    return reads


def test_an_extends_chain_up_to_the_limit_loads_each_file_once_and_merges_every_rule(tmp_path, monkeypatch):
    write_chain(tmp_path, MAX_EXTENDS_CHAIN, rules=3)
    reads = counted_reads(monkeypatch)
    policy, diagnostics = check_policy(tmp_path / "p0.toml")
    assert not errors_in(diagnostics) and len(reads) == MAX_EXTENDS_CHAIN
    assert [rule.id for rule in policy.stream.rule][:3] == ["r31_0", "r31_1", "r31_2"]  # the root's rules first
    assert len(policy.stream.rule) == 3 * MAX_EXTENDS_CHAIN


def test_a_chain_longer_than_the_limit_is_blamed_on_the_file_asked_for_after_reading_at_most_the_limit(
        tmp_path, monkeypatch):
    """1,000 files: refused after reading the limit's worth, with one diagnostic at the extends of the file the
    user named (every file in the chain is valid on its own), never a RecursionError."""
    write_chain(tmp_path, 1000)
    reads = counted_reads(monkeypatch)
    policy, diagnostics = check_policy(tmp_path / "p0.toml")
    found = only(diagnostics, "invalid-extends")
    assert policy is None and len(reads) == MAX_EXTENDS_CHAIN
    assert found.location.file.endswith("p0.toml") and (found.location.line, found.location.col) == (4, 11)
    assert f"holds more than {MAX_EXTENDS_CHAIN} policies" in found.message and "p0 -> p1 -> p2 -> ..." in found.message


def test_a_cycle_deep_in_a_chain_is_found_once_by_the_set_of_files_seen(tmp_path, monkeypatch):
    write_chain(tmp_path, 20)
    (tmp_path / "p19.toml").write_text(HEADER.format(name="p19") + 'extends = "p7"\n', encoding="utf-8")
    reads = counted_reads(monkeypatch)
    found = only(check_policy(tmp_path / "p0.toml")[1], "extends-cycle")
    assert len(reads) == 20 and "p7 -> p8" in found.message and found.message.endswith("p19 -> p7")


# 6. the nodes read only the policies they offer -------------------------------------------------------------
def test_a_picker_takes_only_the_names_it_offers():
    dirs = policy_dirs()
    assert unknown_choice("decoder-llm", dirs) is None and unknown_choice("auto", dirs, auto=True) is None
    for value in ("../../../../etc/passwd", "/etc/passwd", str(SHIPPED_POLICY_DIR / "decoder-llm.toml"), "auto", 3):
        refused = unknown_choice(value, dirs)
        assert refused.code == "unknown-policy" and "never a path" in refused.message


def test_the_policy_check_node_reads_no_path_it_is_handed(tmp_path, monkeypatch):
    fake = types.ModuleType("folder_paths")
    fake.get_user_directory = lambda: str(tmp_path)
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    monkeypatch.setitem(sys.modules, "comfy_api.latest", stand_in_comfy_api())
    from streamwise.comfy_nodes.policy_check import StreamwisePolicyCheck

    secret = tmp_path / "secret.toml"
    secret.write_text('schema_version = 1\n[policy]\nname = "s"\ntoken = "hunter2"\n', encoding="utf-8")
    opened = []
    monkeypatch.setattr(source_module, "open", lambda *a, **k: opened.append(a) or open(*a, **k), raising=False)
    for value in ("../../../../etc/passwd", str(secret)):
        (report,) = StreamwisePolicyCheck.execute(value).args
        assert report.startswith("error[unknown-policy]:") and "hunter2" not in report and "root:" not in report
    assert opened == []
    (report,) = StreamwisePolicyCheck.execute("decoder-llm").args
    assert report == "policy `decoder-llm` is valid"


# hypothesis: the hostile constructs mixed ------------------------------------------------------------------
PIECES = st.sampled_from([
    "a" + ".a" * 40 + " = 1\n",
    "[compile]\nmode = " + "7" * 5000 + "\n",
    "x = 0x" + "f" * 200 + "\n",
    "policy = { " + ", ".join(f"k{i} = 1" for i in range(300)) + " }\n",
    rules(30),
    '[policy]\nextends = "' + "e" * 300 + '"\n',
    '"' + "q" * 400 + '" = 2\n',
    "z = " + "[" * 40 + "]" * 40 + "\n",
    "w = " + "y" * (MAX_LINE_CHARS + 5) + "\n",
    "d = 1979-05-27T07:32:00Z\n",
    '[match]\nclasses = ["' + "C" * 3000 + '"]\n',
])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pieces=st.lists(PIECES, min_size=1, max_size=6), seed=st.sampled_from(sorted(SHIPPED_POLICY_DIR.glob("*.toml"))))
def test_mixed_hostile_constructs_stay_bounded(tmp_path_factory, pieces, seed):
    folder = tmp_path_factory.mktemp("mixed")
    text = seed.read_text(encoding="utf-8") + "\n" + "".join(pieces)
    path = folder / f"{seed.stem}.toml"
    path.write_text(text, encoding="utf-8")
    before = set(sys.modules)
    policy, diagnostics = check_policy(path)
    assert set(sys.modules) == before  # a policy is data: nothing is imported
    assert (policy is None) == errors_in(diagnostics) and len(diagnostics) <= MAX_DIAGNOSTICS
    lines = text.count("\n") + 1
    assert all(d.code in CODES and d.location is not None and 1 <= d.location.line <= lines for d in diagnostics)
    assert len(render_text(diagnostics)) <= MAX_RENDERED_CHARS + ONE_RENDERED
    assert len(render_json({path.name: diagnostics})) <= 4 * MAX_DIAGNOSTICS * MAX_TEXT_CHARS


# The limits at their edges, in the numbers docs/security-and-bounds.md documents: at the limit a text passes, one
# over it is refused at the exact place (line, column) that goes over.
def excess(text: str):
    from streamwise.runtime.policy.limits import first_excess

    return first_excess(text, text.split("\n"))


def test_a_line_of_10000_characters_passes_and_one_more_is_refused_at_its_column():
    assert excess("a = 1\n#" + "x" * 9_999) is None
    assert excess("a = 1\n#" + "x" * 10_000) == (2, 10_001, "line is 10001 characters long; the limit is 10000")


@pytest.mark.parametrize("template", ["{key} = 1", "[{key}]", "t = {{ {key} = 1 }}"])
def test_a_dotted_key_of_16_segments_passes_and_the_17th_is_refused_where_it_starts(template):
    def key(segments):
        return ".".join(f"k{i}" for i in range(segments))

    assert excess("a = 1\n" + template.format(key=key(16))) is None
    text = "a = 1\n" + template.format(key=key(17))
    assert excess(text) == (2, text.index("k16") - 5, "a dotted key of more than 16 segments; the limit is 16")


def test_segments_are_counted_per_key_not_across_keys_values_or_floats():
    sixteen = ".".join(["k"] * 16)
    assert excess(f"{sixteen} = 1.5\n{sixteen} = 2\n[{sixteen}]\n{sixteen} = 3") is None


@pytest.mark.parametrize("quoted", [False, True])
def test_a_key_of_256_characters_passes_and_257_is_refused(quoted):
    def key(size):
        return f'"{"k" * size}"' if quoted else "k" * size

    assert excess(f"{key(256)} = 1\n[{key(256)}]") is None
    assert excess(f"a = 1\n{key(257)} = 1") == (2, 1, "a key of 257 characters; the limit is 256")
    assert excess(f"a = 1\n[{key(257)}]") == (2, 2, "a key of 257 characters; the limit is 256")


def test_a_long_string_value_is_no_key_even_before_a_closing_bracket_outside_a_header():
    long = '"' + "v" * 300 + '"'
    assert excess(f"x = [{long}]") is None  # before any header
    assert excess(f"[t]\nx = [{long}]\ny = {long}\nz = {{ w = {long} }}") is None  # after one has closed


@pytest.mark.parametrize("sign", ["", "+", "-"])
def test_a_number_of_64_characters_passes_and_65_is_refused(sign):
    def number(size):
        return sign + "1" * (size - len(sign))

    assert excess(f"x = {number(64)}") is None
    assert excess(f"a = 1\nx = {number(65)}") == (2, 5, "a number of 65 characters; the limit is 64")


def test_a_long_bare_word_or_string_of_digits_is_no_number():
    assert excess("x = \"" + "1" * 100 + "\"\n" + "k" * 100 + " = 1") is None


def test_10000_keys_values_and_dots_pass_and_the_next_one_is_refused():
    def array(values):  # `x`, `=`, the values and `]`: values + 3 tokens, 2,000 a line
        lines = ["1, " * min(2_000, values - done) for done in range(0, values, 2_000)]
        return "x = [\n" + "\n".join(lines) + "\n]"

    assert excess(array(9_997)) is None
    found = excess(array(9_998))
    assert found[2] == "more than 10000 keys, values and dots; the limit is 10000" and found[:2] == (7, 1)


def test_a_section_of_500_rules_passes_and_501_do_not(tmp_path):
    assert not errors_in(diagnose(tmp_path, "many", HEADER.format(name="many") + rules(500, kinds=("linear",)))[1])
    found = only(diagnose(tmp_path, "many", HEADER.format(name="many") + rules(501, kinds=("linear",)))[1],
                 "invalid-value")
    assert found.message == "[stream] has 501 rules; the limit is 500"


def test_a_place_is_counted_from_the_first_character_a_leading_newline_too():
    assert excess("\n" + "k" * 257 + " = 1") == (2, 1, "a key of 257 characters; the limit is 256")


def test_a_comment_after_a_value_does_not_join_the_next_key_to_it():
    sixteen = ".".join(["k"] * 16)
    assert excess(f"x = 1 # a comment\n{sixteen} = 2") is None
