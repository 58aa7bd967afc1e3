"""n > 1 choices, top_logprobs and required_prefix_token_ids on the local backend's chat and Responses
routes, driven by the official openai SDK (tiny model)."""

from __future__ import annotations

import openai
import pytest

from helpers.fields import assert_same_call

FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
HELLO = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(tiny_local_client):
    return tiny_local_client


def _fields(message):
    return tuple(message.model_extra[f] for f in FIELDS)


def test_n_choices_each_carry_their_training_fields(client):
    r = client.chat.completions.create(model="t", messages=HELLO, max_tokens=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    fields = [_fields(c.message) for c in r.choices]
    assert len({f[0] and tuple(f[0]) for f in fields}) == 1  # one prompt
    assert len({tuple(f[1]) for f in fields}) == 3  # seed, seed + 1, seed + 2: three samples
    assert all(len(f[1]) == len(f[2]) == 5 for f in fields)
    assert r.usage.prompt_tokens == len(fields[0][0]) and r.usage.completion_tokens == 15
    # Choice j of n is the single call with seed + j; choice 0 is the plain call.
    assert_same_call(
        _fields(client.chat.completions.create(model="t", messages=HELLO, max_tokens=5).choices[0].message), fields[0]
    )


def test_streamed_choices_equal_the_whole_ones(client):
    whole = client.chat.completions.create(model="t", messages=HELLO, max_tokens=6, n=2)
    chunks = list(
        client.chat.completions.create(
            model="t", messages=HELLO, max_tokens=6, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == (choice.message.content or "")
        [final] = [c for c in mine if c.finish_reason]
        assert_same_call(tuple(final.delta.model_extra[f] for f in FIELDS), _fields(choice.message))
    assert [c.usage for c in chunks if c.usage] == [chunks[-1].usage]
    assert chunks[-1].usage.completion_tokens == 12


def test_top_logprobs_leave_the_sampled_log_probs_unchanged(client):
    plain = client.chat.completions.create(model="t", messages=HELLO, max_tokens=5).choices[0]
    asked = client.chat.completions.create(model="t", messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=5)
    choice = asked.choices[0]
    assert _fields(choice.message) == _fields(plain.message)
    assert [c.logprob for c in choice.logprobs.content] == _fields(choice.message)[2]
    assert all(len(c.top_logprobs) == 5 for c in choice.logprobs.content)


def _turn(message) -> dict:
    return {"role": "assistant", "content": message.content}


def test_required_prefix_keeps_a_chat_rollout_contiguous_without_token_fields(client):
    """The agent sends back text only and the previous prompt + generation as
    required_prefix_token_ids (NeMo RL's field): every prompt starts with exactly them."""
    messages = list(HELLO)
    prefix = None
    for turn in range(3):
        extra = {"required_prefix_token_ids": prefix} if prefix else {}
        msg = (
            client.chat.completions.create(model="t", messages=messages, max_tokens=6, extra_body=extra)
            .choices[0]
            .message
        )
        p, g, _ = _fields(msg)
        if prefix:
            assert p[: len(prefix)] == prefix
        prefix = p + g
        messages += [_turn(msg), {"role": "user", "content": f"Turn {turn + 2}?"}]


def test_required_prefix_on_the_responses_api(client):
    first = client.responses.create(model="t", input="Say something.", max_output_tokens=6)
    item = first.output[-1].model_dump()
    prefix = item["prompt_token_ids"] + item["generation_token_ids"]
    text = "".join(part["text"] for part in item.get("content") or [] if part.get("type") == "output_text")
    second = client.responses.create(
        model="t",
        input=[
            {"role": "user", "content": "Say something."},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "More."},
        ],
        max_output_tokens=4,
        extra_body={"required_prefix_token_ids": prefix},
    )
    assert second.output[-1].model_dump()["prompt_token_ids"][: len(prefix)] == prefix


def test_required_prefix_errors_are_400s(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="t", messages=HELLO, max_tokens=2, extra_body={"required_prefix_token_ids": [1, 2]}
        )
    assert (
        exc.value.body["param"] == "required_prefix_token_ids" and "no assistant message" in exc.value.body["message"]
    )
    messages = HELLO + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="t", messages=messages, max_tokens=2, extra_body={"required_prefix_token_ids": [1, 10**9]}
        )
    assert exc.value.body["param"] == "required_prefix_token_ids[1]"


def test_continue_final_message_continues_the_assistant_text(client, tokenizer):
    messages = HELLO + [{"role": "assistant", "content": "Once upon"}]
    msg = (
        client.chat.completions.create(
            model="t", messages=messages, max_tokens=3, extra_body={"continue_final_message": True}
        )
        .choices[0]
        .message
    )
    assert tokenizer.decode(_fields(msg)[0]).endswith("<|im_start|>assistant\nOnce upon")
