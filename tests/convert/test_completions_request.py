"""The checks of POST /v1/completions requests (pure): the four prompt forms, the API's ranges, and
what is refused with the field to use instead."""

from __future__ import annotations

import pytest

from gymserve.convert.completions_request import MAX_CHOICES, check_completions_request, prompts
from gymserve.errors import InvalidRequestError


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("Once upon", ["Once upon"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_the_four_prompt_forms(prompt, expected):
    assert prompts(check_completions_request({"prompt": prompt})) == expected


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({}, "prompt", "prompt is required"),
        ({"prompt": []}, "prompt", "got an empty array"),
        ({"prompt": ["a", [1]]}, "prompt", "mixes them"),
        ({"prompt": [[1], []]}, "prompt[1]", "non-empty list of token IDs"),
        ({"prompt": [[1], ["x"]]}, "prompt[1]", "non-empty list of token IDs"),
        ({"prompt": 5}, "prompt", "got a number"),
        ({"prompt": "a", "suffix": "b"}, "suffix", "insert mode"),
        ({"prompt": "a", "best_of": 3}, "best_of", "rank them yourself"),
        ({"prompt": "a", "logprobs": 21}, "logprobs", "out of range"),
        ({"prompt": "a", "logprobs": True}, "logprobs", "must be an integer"),
        ({"prompt": "a", "n": 129}, "n", "out of range"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", "out of range"),
        ({"prompt": "a", "echo": "yes"}, "echo", "true or false"),
        ({"prompt": "a", "stop": [1]}, "stop", "list of strings"),
        ({"prompt": "a", "stream_options": True}, "stream_options", "include_usage"),
        ({"prompt": "a", "messages": []}, "messages", "/v1/chat/completions"),
        ({"prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens", "use max_tokens"),
        ({"prompt": "a", "top_logprobs": 3}, "top_logprobs", "use logprobs"),
        ({"prompt": "a", "tools": []}, "tools", "no tools"),
        ({"prompt": [1], "required_prefix_token_ids": [1]}, "required_prefix_token_ids", "whole prompt"),
        ({"prompt": ["a"] * 9, "n": 128}, "prompt", f"at most {MAX_CHOICES}"),
    ],
)
def test_bad_requests_name_the_field(body, param, words):
    with pytest.raises(InvalidRequestError) as exc:
        check_completions_request(body)
    assert exc.value.param == param and words in exc.value.message


def test_nulls_are_absent_and_best_of_equal_to_n_is_fine():
    out = check_completions_request({"prompt": "a", "suffix": None, "best_of": 2, "n": 2, "model": None})
    assert "suffix" not in out and "model" not in out
