"""The row keys' one declaration (tasks/schema.py) and what is read off it."""

from __future__ import annotations

import ast
import re
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


def test_facts_decoder_shapes_narrow_a_declared_key_and_name_an_agents_own() -> None:
    class Ref(typing.TypedDict, total=False):
        name: str

    decoder = schema.facts_decoder(
        (keys.AGENT_REF, "response"), shapes={keys.AGENT_REF: Ref, "response": typing.Any}
    )
    line = b'{"agent_ref": {"name": "a", "big": ["\xff"]}, "response": 1, "other": 2}'
    assert decoder.decode(line) == {"agent_ref": {"name": "a"}, "response": 1}
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(b'{"agent_ref": "a"}')


# Where a key's name is written as a literal on purpose: a TypedDict's keys must be
# literals (``FailureKeys`` is checked against the declarations), and the prefix of
# every dispatcher key is no key.
_LITERALS_ALLOWED = {
    "dispatcher/delivery/answers.py",  # builds a ``FailureKeys``
    "dispatcher/rows/wire.py",  # OWN_PREFIX
    "dispatcher/tasks/keys.py",  # FailureKeys, and the materialized line's tail pattern
    "dispatcher/tasks/schema.py",  # the declarations
}


_KEY_LITERAL = re.compile(r'^_?ng_[a-z_]+$|"_?ng_[a-z_]+"')


def _key_literals(path: Path) -> list[str]:
    """The string and bytes constants of a module that are a key's name (``_ng_``,
    ``ng_``) or hold one quoted as JSON does; prose that mentions a key (a message, a
    flag's help) is no key."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in docstrings:
            continue
        value = node.value
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if isinstance(text, str) and _KEY_LITERAL.search(text):
            found.append(f"{path.name}:{node.lineno}: {text!r}")
    return found


def test_no_module_spells_a_declared_key_but_the_schema() -> None:
    root = CONTRACTS.parents[1]
    stray = [
        literal
        for path in sorted((root / "dispatcher").rglob("*.py"))
        if str(path.relative_to(root)) not in _LITERALS_ALLOWED
        for literal in _key_literals(path)
    ]
    assert not stray, "name these keys through tasks/schema.py:\n" + "\n".join(stray)


def test_the_gym_drop_in_s_own_keys_are_declared() -> None:
    drained = schema.key(schema.DISPATCH_DRAINED)
    assert drained.where == schema.Where.DROP_IN
    assert schema.DISPATCH_DRAINED in keys.RESERVED_RESULT_KEYS
    assert schema.DISPATCH_DRAINED in DISPATCHER_KEYS
    assert schema.FAILURE_STAGE not in keys.FAILURE_KEYS
    assert schema.FAILURE_STAGE not in keys.RESERVED_RESULT_KEYS


def test_adding_a_key_is_one_declaration() -> None:
    registry = {k.name: k for k in schema.KEYS}
    probe = schema.declare(
        "_ng_probe",
        int,
        schema.ROWS,
        "a key added by this test",
        input_ok=False,
        registry=registry,
    )
    assert probe not in {k.name for k in schema.KEYS}  # the module's own are untouched
    derived = schema.derive(registry.values())
    assert probe in derived.reserved_result
    assert probe in derived.reserved_success
    assert probe in derived.reserved_input
    assert probe in derived.stripped
    assert derived.reserved_result - {probe} == keys.RESERVED_RESULT_KEYS
    decoder = schema.facts_decoder((keys.TASK_INDEX, probe), registry.values())
    line = orjson.dumps({"response": {"output": ["x"]}, "_ng_task_index": 1, "_ng_probe": 7})
    assert decoder.decode(line) == {"_ng_task_index": 1, "_ng_probe": 7}
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(b'{"_ng_probe": "7"}')
    table = schema.docs_table(registry.values())
    assert (
        "| `_ng_probe` | integer | row, failure row | dispatcher | refused | stripped "
        "| a key added by this test |"
    ) in table.splitlines()
    assert table.replace(table.splitlines()[-1] + "\n", "") == schema.docs_table()
