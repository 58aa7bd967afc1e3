"""ChatTemplate: message preparation for HF templates, rendering, kwargs, errors."""

from __future__ import annotations

import pytest

from gymserve.errors import InvalidRequestError
from gymserve.prompting import TAIL_CHARS, ChatTemplate


@pytest.fixture(scope="module")
def tpl(tokenizer):
    return ChatTemplate(tokenizer)


def test_content_none_renders_empty_never_none(tpl):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    prepared = tpl.prepare_messages(msgs)
    assert prepared[1]["content"] == ""
    text = tpl.render_text(prepared, add_generation_prompt=False)
    assert "None" not in text
    assert text.endswith("<|im_start|>assistant\n<|im_end|>\n")
    assert msgs[1]["content"] is None  # input untouched


def test_list_content_joined(tpl):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "input_text", "text": "world"}]}]
    prepared = tpl.prepare_messages(msgs)
    assert prepared[0]["content"] == "Hello\nworld"
    assert "<|im_start|>user\nHello\nworld<|im_end|>" in tpl.render_text(prepared)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_media_part_is_rejected_text_only(tpl, part):
    msgs = [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(InvalidRequestError) as e:
        tpl.prepare_messages(msgs)
    assert "text-only" in e.value.message
    assert e.value.param == "messages[1].content[1]"
    assert e.value.status_code == 400


def test_unknown_part_type_rejected(tpl):
    with pytest.raises(InvalidRequestError) as e:
        tpl.prepare_messages([{"role": "user", "content": [{"type": "hologram"}]}])
    assert e.value.param == "messages[0].content[0]"


def test_tool_call_arguments_string_becomes_object_and_renders_as_json(tpl):
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":[1,2]}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    prepared = tpl.prepare_messages(msgs)
    assert prepared[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": [1, 2]}
    assert isinstance(msgs[1]["tool_calls"][0]["function"]["arguments"], str)  # input untouched
    text = tpl.render_text(prepared)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": [1, 2]}}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<tool_response>\n18C\n</tool_response>" in text


def test_tool_call_arguments_that_are_not_json_are_kept_as_written(tpl):
    """The model's own invalid (or max_tokens-cut) arguments come back in the next turn: the turn
    still renders, with the text the model wrote, instead of failing the rollout."""
    msgs = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "f", "arguments": '{"city": "Par'}},
            ],
        },
    ]
    prepared = tpl.prepare_messages(msgs)
    assert [c["function"]["arguments"] for c in prepared[1]["tool_calls"]] == [{}, '{"city": "Par']
    # This template (Qwen2.5) renders arguments with `tojson`, so the string appears JSON-quoted.
    assert '{"name": "f", "arguments": "{\\"city\\": \\"Par"}' in tpl.render_text(prepared)


def test_empty_or_null_tool_calls_dropped(tpl):
    prepared = tpl.prepare_messages(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "a", "tool_calls": None},
            {"role": "assistant", "content": "b", "tool_calls": []},
        ]
    )
    assert "tool_calls" not in prepared[1] and "tool_calls" not in prepared[2]
    tpl.render_text(prepared)


def test_reasoning_copied_to_reasoning_content_and_training_fields_stripped(tpl):
    msgs = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "a",
            "reasoning": "think",
            "prompt_token_ids": [1],
            "generation_token_ids": [2],
            "generation_log_probs": [-0.5],
        },
    ]
    m = tpl.prepare_messages(msgs)[1]
    assert m["reasoning_content"] == "think"
    assert not {"prompt_token_ids", "generation_token_ids", "generation_log_probs"} & set(m)
    # an explicit reasoning_content wins
    m = tpl.prepare_messages([{"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "rc"}])[0]
    assert m["reasoning_content"] == "rc"


def test_developer_merging_keeps_order_and_later_developer_becomes_system(tpl):
    msgs = [
        {"role": "developer", "content": "D1"},
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "D2"},
    ]
    prepared, index = tpl.prepare_messages_indexed(msgs)
    assert [m["role"] for m in prepared] == ["system", "user", "system"]
    assert prepared[0]["content"] == "D1\n\nS1" and prepared[2]["content"] == "D2"
    assert index == [0, 0, 1, 2]
    text = tpl.render_text(prepared)
    assert text.startswith("<|im_start|>system\nD1\n\nS1<|im_end|>\n") and "D2" in text


def test_template_that_handles_developer_gets_it_unchanged(tokenizer):
    t = ChatTemplate(
        tokenizer,
        chat_template=("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{# developer aware #}"),
    )
    assert t.handles_developer
    assert (
        t.render_text(t.prepare_messages([{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]))
        == "[developer]d[user]u"
    )


@pytest.mark.parametrize(
    "bad, param",
    [
        ([], "messages"),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        (["hello"], "messages[0]"),
    ],
)
def test_bad_messages(tpl, bad, param):
    with pytest.raises(InvalidRequestError) as e:
        tpl.prepare_messages(bad)
    assert e.value.param == param


def test_render_ids_match_tokenizing_the_text_without_adding_special_tokens(tpl, tokenizer):
    msgs = tpl.prepare_messages([{"role": "user", "content": "你好, 4 + 4?"}])
    text = tpl.render_text(msgs)
    ids = tpl.render_ids(msgs)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-3:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert tpl.render_ids(msgs, add_generation_prompt=False)[-2:] == [151645, 198]


def test_chat_template_kwargs_defaults_overridden_by_request(tokenizer):
    t = ChatTemplate(
        tokenizer,
        chat_template=(
            "{% for m in messages %}{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}|{{ 'think' if enable_thinking else 'nothink' }}|{{ style }}{% endif %}"
        ),
        default_kwargs={"enable_thinking": True, "style": "s"},
    )
    msgs = [{"role": "user", "content": "q"}]
    assert t.render_text(msgs) == "q|think|s"
    assert t.render_text(msgs, kwargs={"enable_thinking": False}) == "q|nothink|s"
    assert t.merged_kwargs({"style": "x"}) == {"enable_thinking": True, "style": "x"}


def test_reserved_kwargs_rejected(tpl):
    with pytest.raises(InvalidRequestError) as e:
        tpl.render_text([{"role": "user", "content": "q"}], kwargs={"tokenize": True})
    assert e.value.param == "chat_template_kwargs"


def test_template_file_override(tokenizer, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    t = ChatTemplate(tokenizer, chat_template=str(f))
    assert t.render_text([{"role": "user", "content": "q"}]) == "<user>q"
    with pytest.raises(ValueError):
        ChatTemplate(tokenizer, chat_template=str(tmp_path / "missing.jinja"))


def test_template_raise_exception_becomes_400(tokenizer):
    t = ChatTemplate(tokenizer, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError) as e:
        t.render_text([{"role": "user", "content": "q"}])
    assert "roles must alternate" in e.value.message and e.value.status_code == 400


def test_generation_prompt_tail(tpl):
    msgs = tpl.prepare_messages([{"role": "user", "content": "x" * 200}])
    tail = tpl.generation_prompt_tail(msgs)
    assert len(tail) == TAIL_CHARS and tail.endswith("<|im_end|>\n<|im_start|>assistant\n")
