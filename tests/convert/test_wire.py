"""The wire vocabulary has one owner each: reasoning field names, id formats, think tags."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from gymserve.config import LocalBackendConfig
from gymserve.convert.options import ReasoningMode
from gymserve.wire import think
from gymserve.wire.ids import new_id
from gymserve.wire.reasoning import REASONING_FIELDS, field_reasoning, mirror_reasoning

SRC = Path(__file__).resolve().parents[2] / "src" / "gymserve"


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        ("chatcmpl", r"chatcmpl-[0-9a-f]{32}"),
        ("call", r"call_[0-9a-f]{24}"),
        ("resp", r"resp_[0-9a-f]{32}"),
        ("msg", r"msg_[0-9a-f]{32}"),
        ("rs", r"rs_[0-9a-f]{32}"),
        ("fc", r"fc_[0-9a-f]{32}"),
    ],
)
def test_ids_have_the_openai_formats(kind, pattern):
    first, second = new_id(kind), new_id(kind)
    assert re.fullmatch(pattern, first) and re.fullmatch(pattern, second) and first != second


def test_unknown_id_kind_is_refused():
    with pytest.raises(KeyError):
        new_id("chatcmpl_")


def test_reasoning_fields_read_one_and_mirror_both():
    assert REASONING_FIELDS == ("reasoning_content", "reasoning")
    assert field_reasoning({"reasoning": "r", "reasoning_content": ""}) == "r"
    assert field_reasoning({"reasoning_content": "a", "reasoning": "b"}) == "a"
    assert field_reasoning({"content": "x"}) is None
    message = {"reasoning": "why"}
    mirror_reasoning(message)
    assert message == {"reasoning": "why", "reasoning_content": "why"}


def test_config_and_converter_name_the_same_fields():
    assert get_args(LocalBackendConfig.model_fields["reasoning_field"].annotation) == REASONING_FIELDS
    assert set(REASONING_FIELDS) <= set(get_args(ReasoningMode))


@pytest.mark.parametrize(
    ("text", "reasoning", "rest"),
    [
        ("<think>\n r \n</think>\n\nanswer", "r", "answer"),
        ("  <think>why</think>ok", "why", "ok"),
        ("<think></think>\n\nA", None, "A"),
    ],
)
def test_both_splits_agree_on_a_leading_block(text, reasoning, rest):
    """The two rules differ only where they must (later blocks, pre-filled spans); a block the
    model opened at the start is split the same by both, tags and whitespace alike."""
    assert think.split_span(text, "<|im_start|>assistant\n", "stop") == (reasoning, rest, False)
    assert think.split_think(text) == [*([("reasoning", reasoning)] if reasoning else []), ("text", rest)]


def test_think_block_is_split_back_into_its_reasoning():
    written = think.think_block("step one") + "done"
    assert think.split_think(written) == [("reasoning", "step one"), ("text", "done")]
    assert think.split_span(written, "", "stop") == ("step one", "done", False)


def test_no_module_outside_wire_spells_the_think_tags_or_mints_ids():
    bad = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "wire":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in (think.OPEN, think.CLOSE):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value}")
            if (
                isinstance(node, ast.JoinedStr)
                and node.values
                and isinstance(node.values[0], ast.Constant)
                and str(node.values[0].value).startswith(("call_", "chatcmpl", "resp_", "msg_", "rs_", "fc_"))
            ):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} mints an id")
    assert not bad, bad
