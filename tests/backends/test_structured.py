"""``backends.local.structured``: which request fields ask for structured output and how (pure)."""

from __future__ import annotations

import pytest

from gymserve.backends.local.structured import _asked, constraint
from gymserve.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("request_body", "ask"),
    [
        ({"response_format": {"type": "text"}}, []),
        ({"response_format": {"type": "json_object"}}, [("response_format", "json", {"type": "object"})]),
        ({"guided_json_object": True}, [("guided_json_object", "json", {"type": "object"})]),
        ({"guided_json_object": False}, []),
        ({"structured_outputs": {"regex": "a+"}}, [("structured_outputs", "regex", "a+")]),
        ({"structured_outputs": {"choice": ["a"], "json": None}}, [("structured_outputs", "choice", ["a"])]),
        ({"guided_choice": ["x", "y"]}, [("guided_choice", "choice", ["x", "y"])]),
    ],
)
def test_each_form_is_read(request_body, ask):
    assert _asked(request_body) == ask


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"structured_outputs": "json"}, "structured_outputs"),
    ],
)
def test_malformed_or_unapplied_forms_are_400s_naming_the_field(request_body, param):
    with pytest.raises(InvalidRequestError) as exc:
        _asked(request_body)
    assert exc.value.param == param


def test_an_engine_without_a_token_mask_refuses_by_name():
    class NoMask:
        engine_name = "llamacpp"

    with pytest.raises(InvalidRequestError) as exc:
        constraint({"guided_json_object": True}, engine=NoMask(), tokenizer=None)
    assert exc.value.param == "guided_json_object" and "llamacpp engine applies no token mask" in exc.value.message
    assert constraint({"messages": []}, engine=NoMask(), tokenizer=None) is None
