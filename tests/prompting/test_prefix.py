"""required_prefix_token_ids (NeMo RL's field) and the render options, with the real Qwen2.5 tokenizer
and template: the prompt starts with exactly the prefix, or the request is a 400 that says why."""

from __future__ import annotations

import pytest

from gymserve.errors import InvalidRequestError, SpliceError
from gymserve.prompting import ChatTemplate, RenderOptions, build_prompt

IM_END, ENDOFTEXT = 151645, 151643
EOS = (IM_END, ENDOFTEXT)
VOCAB = 151936


@pytest.fixture(scope="module")
def tpl(tokenizer):
    return ChatTemplate(tokenizer)


def build(tpl, msgs, **kw):
    return build_prompt(tpl, msgs, eos_token_ids=EOS, vocab_size=VOCAB, **kw)


def _turn1(tpl, tokenizer):
    user = [{"role": "user", "content": "Hi"}]
    prompt = build(tpl, user).token_ids
    # A generation that re-encodes differently: " hello" sampled as two tokens (" hel", "lo").
    generation = [tokenizer.convert_tokens_to_ids("Ġhel"), tokenizer.convert_tokens_to_ids("lo")]
    assert tokenizer.decode(generation) == " hello"
    assert tokenizer(" hello", add_special_tokens=False)["input_ids"] != generation
    return user, prompt, generation


def _with_fields(prompt, gen):
    """The first turn sent back as the model produced it: its text and its token fields."""
    return {
        "role": "assistant",
        "content": " hello",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.5] * len(gen),
    }


def test_prefix_replaces_the_rendering_up_to_the_last_assistant_turn(tpl, tokenizer):
    user, prompt, gen = _turn1(tpl, tokenizer)
    prefix = prompt + gen
    msgs = user + [{"role": "assistant", "content": " hello"}, {"role": "user", "content": "And 5?"}]
    res = build(tpl, msgs, required_prefix=prefix)
    assert res.spliced and res.token_ids[: len(prefix)] == prefix
    # What follows is the template's own: end of turn, the new user turn, the generation prompt.
    rest = tokenizer.decode(res.token_ids[len(prefix) :])
    assert rest == "<|im_end|>\n<|im_start|>user\nAnd 5?<|im_end|>\n<|im_start|>assistant\n"
    # Without the prefix the text is re-tokenized: " 4" becomes one token, not the model's two.
    plain = build(tpl, msgs).token_ids
    assert plain[: len(prefix)] != prefix


def test_prefix_equal_to_the_token_fields_of_the_same_turn_is_their_splice(tpl, tokenizer):
    user, prompt, gen = _turn1(tpl, tokenizer)
    turn = _with_fields(prompt, gen)
    msgs = user + [turn, {"role": "user", "content": "And 5?"}]
    assert build(tpl, msgs, required_prefix=prompt + gen).token_ids == build(tpl, msgs).token_ids


def test_prefix_that_disagrees_with_the_same_turns_token_fields_is_a_400(tpl, tokenizer):
    user, prompt, gen = _turn1(tpl, tokenizer)
    turn = _with_fields(prompt, gen)
    msgs = user + [turn, {"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequestError) as exc:
        build(tpl, msgs, required_prefix=prompt + [gen[0], 17])
    assert exc.value.code == "required_prefix_mismatch" and exc.value.param == "required_prefix_token_ids"
    assert f"part at position {len(prompt) + 1}" in exc.value.message


def test_prefix_supersedes_token_fields_of_an_earlier_turn(tpl, tokenizer):
    user, prompt, gen = _turn1(tpl, tokenizer)
    first = _with_fields(prompt, gen)
    msgs = user + [first, {"role": "user", "content": "More"}, {"role": "assistant", "content": "ok"}]
    turn2 = build(tpl, msgs[:3]).token_ids + tokenizer("ok", add_special_tokens=False)["input_ids"]
    res = build(tpl, msgs + [{"role": "user", "content": "Last"}], required_prefix=turn2)
    assert res.token_ids[: len(turn2)] == turn2
    assert tokenizer.decode(res.token_ids[len(turn2) :]).startswith("<|im_end|>\n<|im_start|>user\nLast")


def test_prefix_ending_with_an_eos_keeps_exactly_one(tpl, tokenizer):
    user, prompt, gen = _turn1(tpl, tokenizer)
    prefix = prompt + gen + [IM_END]
    msgs = user + [{"role": "assistant", "content": " hello"}, {"role": "user", "content": "x"}]
    ids = build(tpl, msgs, required_prefix=prefix).token_ids
    assert ids[: len(prefix)] == prefix and ids[len(prefix)] != IM_END


@pytest.mark.parametrize(
    "prefix, param",
    [
        ([], "required_prefix_token_ids"),
        ("1 2 3", "required_prefix_token_ids"),
        ([1, "2"], "required_prefix_token_ids[1]"),
        ([1, True], "required_prefix_token_ids[1]"),
        ([1, -4], "required_prefix_token_ids[1]"),
        ([1, VOCAB], "required_prefix_token_ids[1]"),
    ],
)
def test_malformed_prefix_is_a_400_naming_the_element(tpl, prefix, param):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    with pytest.raises(InvalidRequestError) as exc:
        build(tpl, msgs, required_prefix=prefix)
    assert exc.value.param == param


def test_prefix_without_an_assistant_message_is_a_400(tpl):
    with pytest.raises(InvalidRequestError, match="no assistant message") as exc:
        build(tpl, [{"role": "user", "content": "Hi"}], required_prefix=[1, 2, 3])
    assert "/v1/completions" in exc.value.message


def test_prefix_after_an_ambiguous_turn_is_a_splice_error(tokenizer):
    # A template that renders assistant content twice: the turn's end cannot be found.
    twice = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.role == 'assistant' %}"
        "{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tpl = ChatTemplate(tokenizer, chat_template=twice)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    with pytest.raises(SpliceError):
        build(tpl, msgs, required_prefix=[1, 2])


# ------------------------------------------------------------------------------ render options
def test_add_generation_prompt_false_ends_with_the_conversation(tpl, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    ids = build(tpl, msgs, options=RenderOptions(add_generation_prompt=False)).token_ids
    assert tokenizer.decode(ids).endswith("Hi<|im_end|>\n")


def test_continue_final_message_leaves_the_turn_open(tpl, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    opts = RenderOptions(add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(build(tpl, msgs, options=opts).token_ids).endswith("<|im_start|>assistant\nHello the")


def test_continue_final_message_after_a_spliced_turn_is_its_prompt_and_generation(tpl, tokenizer):
    user, prompt, gen = _turn1(tpl, tokenizer)
    turn = _with_fields(prompt, gen)
    opts = RenderOptions(add_generation_prompt=False, continue_final_message=True)
    assert build(tpl, user + [turn], options=opts).token_ids == prompt + gen


def test_continue_final_message_with_add_generation_prompt_is_a_400():
    with pytest.raises(InvalidRequestError) as exc:
        RenderOptions(add_generation_prompt=True, continue_final_message=True)
    assert exc.value.param == "continue_final_message"


def test_add_special_tokens_adds_what_the_tokenizer_adds(tpl, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    plain = build(tpl, msgs).token_ids
    added = build(tpl, msgs, options=RenderOptions(add_special_tokens=True)).token_ids
    expected = tokenizer(tokenizer.decode(plain), add_special_tokens=True)["input_ids"]
    assert added == expected  # Qwen adds nothing; a Llama tokenizer would add its BOS here
