"""The row keys' one declaration (tasks/schema.py) and what is read off it."""

from __future__ import annotations

import typing
from pathlib import Path

import msgspec
import orjson
import pytest

from dispatcher.client.gym_plan import DISPATCHER_KEYS, agent_result
from dispatcher.serve.lines import GroupLine
from dispatcher.tasks import keys, schema
from dispatcher.tasks.materialize import RESERVED_INPUT_KEYS

CONTRACTS = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"


def test_the_docs_key_table_is_the_declaration() -> None:
    text = CONTRACTS.read_text()
    table = "\n".join("  " + line for line in schema.docs_table().splitlines())
    assert table in text, "docs/contracts.md §4's key table differs from:\n" + table


def test_every_declared_key_is_documented_once() -> None:
    text = CONTRACTS.read_text()
    for key in schema.KEYS:
        assert text.count(f"| `{key.name}` | {schema._type_name(key.type)} |") == 1, key.name


def test_the_derived_sets_follow_the_declarations() -> None:
    assert RESERVED_INPUT_KEYS == schema.RESERVED_INPUT_KEYS
    assert {k.name for k in schema.KEYS if k.source is schema.Source.DISPATCHER} - {
        "task_index",
        "rows",
        "failures",
        "filtered",
        "agent",
        "tokens",
        "surplus",
    } == keys.RESERVED_RESULT_KEYS
    assert DISPATCHER_KEYS == schema.STRIPPED_KEYS
    assert keys.FAILURE_TERMINAL in keys.RESERVED_SUCCESS_KEYS
    assert keys.FAILURE_TERMINAL not in keys.RESERVED_RESULT_KEYS
    # The agent's keys are never the dispatcher's.
    assert not {schema.REWARD, schema.MASK_SAMPLE, keys.NO_PERSIST} & keys.RESERVED_RESULT_KEYS


def test_failure_keys_type_exactly_the_declared_flat_failure_keys() -> None:
    assert set(typing.get_type_hints(keys.FailureKeys)) == keys.FAILURE_KEYS


def test_group_line_fields_are_the_declared_group_keys() -> None:
    declared = {k.name for k in schema.KEYS if k.where == schema.Where.GROUP}
    assert set(GroupLine.__struct_fields__) == declared


def test_the_dispatchers_keys_are_reserved_the_new_gym_keys_included() -> None:
    for name in (schema.ENVIRONMENT_SERVER, schema.RESULT_TYPE, keys.SEQ, keys.RUN_ID):
        assert name in keys.RESERVED_RESULT_KEYS
        assert name in DISPATCHER_KEYS
    row = {"reward": 1.0, schema.ENVIRONMENT_SERVER: "env", schema.RESULT_TYPE: "legacy_agent"}
    assert agent_result(row) == {"reward": 1.0}


def test_a_declared_key_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        schema.declare(keys.TASK_INDEX, int, schema.Where.ROW, "again")


def test_facts_decoder_decodes_only_the_named_keys_as_declared() -> None:
    decoder = schema.facts_decoder((keys.TASK_INDEX, keys.AGENT_REF, schema.REWARD))
    line = orjson.dumps(
        {"response": {"output": ["x" * 1000]}, "_ng_task_index": 3, "agent_ref": {"name": "a"}}
    )
    assert decoder.decode(line) == {"_ng_task_index": 3, "agent_ref": {"name": "a"}}
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(b'{"_ng_task_index": "3"}')
