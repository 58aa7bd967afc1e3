"""The checks of POST /tokenize and /detokenize requests in vLLM's shapes (pure)."""

from __future__ import annotations

import pytest

from gymserve.convert.tokenize_request import check_detokenize_request, check_tokenize_request
from gymserve.errors import InvalidRequestError


def test_both_forms_pass():
    assert check_tokenize_request({"prompt": "hi", "add_special_tokens": False, "model": None}) == {
        "prompt": "hi",
        "add_special_tokens": False,
    }
    body = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True, "return_token_strs": True}
    assert check_tokenize_request(body) == body
    assert check_detokenize_request({"tokens": [1, 2]}) == {"tokens": [1, 2]}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({}, "prompt", "neither"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "x"}]}, "messages", "both"),
        ({"prompt": ["a"]}, "prompt", "must be a string"),
        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "other form"),
        ({"prompt": "a", "add_generation_promt": True}, "add_generation_promt", "not a field"),
        ({"messages": []}, "messages", "non-empty"),
        (
            {"messages": [{"role": "user", "content": "x"}], "return_token_strs": 1},
            "return_token_strs",
            "true or false",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []},
            "chat_template_kwargs",
            "object",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
            "required",
        ),
        ({"prompt": "a", "model": 3}, "model", "string"),
    ],
)
def test_bad_tokenize_requests_name_the_field(body, param, words):
    with pytest.raises(InvalidRequestError) as exc:
        check_tokenize_request(body)
    assert exc.value.param == param and words in exc.value.message


@pytest.mark.parametrize("body, param", [({}, "tokens"), ({"tokens": "1 2"}, "tokens"), ({"tokens": [1], "x": 1}, "x")])
def test_bad_detokenize_requests_name_the_field(body, param):
    with pytest.raises(InvalidRequestError) as exc:
        check_detokenize_request(body)
    assert exc.value.param == param
