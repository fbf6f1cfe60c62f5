"""Definitions made once in `schemas/` and used by the runtime: the policy schema and its users cannot drift apart."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from streamwise.runtime.policy.folders import SHIPPED_POLICY_DIR, find_policy
from streamwise.schemas import Policy, QuantRule
from streamwise.schemas.patterns import is_policy_name
from streamwise.schemas.policy import RuleSection
from streamwise.schemas.vocabulary import is_power_of_4


def quant_rule(group_size):
    return {"id": "q", "select": {"class": "Linear"}, "format": "convrot_int8", "group_size": group_size}


def test_group_sizes_are_the_powers_of_4_from_4():
    assert [n for n in range(-4, 5000) if is_power_of_4(n)] == [4, 16, 64, 256, 1024, 4096]


@pytest.mark.parametrize("size", [1, 2, 8, 32, 48, 64, 256])
def test_the_schema_and_convrot_agree_on_group_sizes(size):
    from streamwise.runtime.quant.convrot import check_group_size

    try:
        check_group_size(size, 4096)
        convrot_accepts = True
    except ValueError:
        convrot_accepts = False
    try:
        QuantRule.model_validate(quant_rule(size))
        schema_accepts = True
    except ValidationError:
        schema_accepts = False
    assert schema_accepts == convrot_accepts == is_power_of_4(size)


@pytest.mark.parametrize("name", ["../vibevoice", "..", "a..b", "a/b", "x\\y", "", "-lead", ".hidden", "a b"])
def test_a_name_the_schema_refuses_is_never_found_as_a_file(name):
    assert not is_policy_name(name)
    assert find_policy(name, [SHIPPED_POLICY_DIR]) is None


@pytest.mark.parametrize("name", ["vibevoice", "decoder-llm", "_template", "v1.2", "a_b-c"])
def test_policy_names_the_schema_accepts(name):
    assert is_policy_name(name)


def test_rule_sections_are_the_rule_section_fields_in_order():
    fields = [
        name for name, field in Policy.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, RuleSection)
    ]
    assert list(Policy.RULE_SECTIONS) == fields == ["stream", "relocate", "quant"]
