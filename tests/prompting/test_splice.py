"""Prefix splice with the real Qwen2.5 tokenizer and template: P+G kept token for token."""

from __future__ import annotations

import time
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymserve.errors import InvalidRequestError, SpliceError
from gymserve.prompting import ChatTemplate, build_prompt
from helpers.templates import QWEN3_LIKE

IM_END, ENDOFTEXT, IM_START = 151645, 151643, 151644
EOS = (IM_END, ENDOFTEXT)
VOCAB = 151936
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def tpl(tokenizer):
    return ChatTemplate(tokenizer)


def enc(tpl, text):
    return tpl.encode(text)


def assistant(content, p, g, **extra):
    return {
        "role": "assistant",
        "content": content,
        "prompt_token_ids": p,
        "generation_token_ids": g,
        "generation_log_probs": [-0.25] * len(g),
        **extra,
    }


def build(tpl, msgs, **kw):
    return build_prompt(tpl, msgs, eos_token_ids=kw.pop("eos", EOS), vocab_size=VOCAB, **kw)


def test_no_token_fields_is_the_plain_rendering(tpl):
    msgs = [{"role": "user", "content": "Hi"}]
    res = build(tpl, msgs)
    assert not res.spliced
    assert res.token_ids == tpl.render_ids(tpl.prepare_messages(msgs))
    assert res.text_tail.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("eos_mode", ["im_end", "trimmed", "endoftext"])
def test_three_turn_rollout_stays_contiguous(tpl, eos_mode):
    """(a) Each turn's prompt starts with the previous prompt + generation; with no drift it also
    equals the plain rendering, which checks the template suffix itself."""
    answers = ["Hello! How can I help?", "Paris is the capital of France.", "Goodbye."]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = build(tpl, msgs).token_ids
    gen_prompt = enc(tpl, "<|im_start|>assistant\n")
    for turn, answer in enumerate(answers):
        g = enc(tpl, answer) + {"im_end": [IM_END], "trimmed": [], "endoftext": [ENDOFTEXT]}[eos_mode]
        msgs = msgs + [assistant(answer, p, g), {"role": "user", "content": f"Question {turn + 2}"}]
        res = build(tpl, msgs)
        assert res.spliced
        assert res.token_ids[: len(p) + len(g)] == p + g
        assert res.token_ids[-len(gen_prompt) :] == gen_prompt
        n = len(p) + len(g)
        # exactly one EOS closes the spliced turn
        assert res.token_ids[n - 1 : n + 1] != [ENDOFTEXT, IM_END] and res.token_ids[n - 1 : n + 1] != [IM_END, IM_END]
        if eos_mode != "endoftext":
            plain = [
                {
                    k: v
                    for k, v in m.items()
                    if k not in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
                }
                for m in msgs
            ]
            assert res.token_ids == tpl.render_ids(tpl.prepare_messages(plain))
        assert res.text_tail.endswith(f"Question {turn + 2}<|im_end|>\n<|im_start|>assistant\n")
        p = res.token_ids


@pytest.mark.parametrize("text", ["你好世界，今天天气很好", " The answer is 4."])
def test_retokenization_drift_is_not_reintroduced(tpl, tokenizer, text):
    """(b) G sampled as per-character tokens decodes to the same text as the canonical encoding,
    so re-rendering would replace it; the splice keeps it token for token."""
    g_chars = [t for ch in text for t in enc(tpl, ch)] + [IM_END]
    canonical = enc(tpl, text) + [IM_END]
    assert g_chars != canonical
    assert tokenizer.decode(g_chars) == tokenizer.decode(canonical)
    msgs = [{"role": "user", "content": "Say it."}]
    p = build(tpl, msgs).token_ids
    msgs2 = msgs + [assistant(text, p, g_chars), {"role": "user", "content": "Again."}]
    res = build(tpl, msgs2)
    assert res.token_ids[: len(p) + len(g_chars)] == p + g_chars
    rerendered = tpl.render_ids(
        tpl.prepare_messages(msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}])
    )
    assert rerendered[: len(p) + len(g_chars)] != p + g_chars  # what the splice prevents
    # after the turn, both agree again
    assert res.token_ids[len(p) + len(g_chars) :] == rerendered[len(p) + len(canonical) :]


def test_tool_call_turn_followed_by_tool_messages(tpl):
    """(c) Qwen2.5 renders tool calls after the content; arguments come as a JSON string."""
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    p = build(tpl, msgs, tools=TOOLS).token_ids
    g = enc(
        tpl,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    ) + [IM_END]
    calls = [
        {"id": f"call_{c}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
        for c in ("Paris", "Rome")
    ]
    msgs2 = msgs + [
        assistant(None, p, g, tool_calls=calls),
        {"role": "tool", "tool_call_id": "call_Paris", "content": "18C, sunny"},
        {"role": "tool", "tool_call_id": "call_Rome", "content": "22C, cloudy"},
    ]
    res = build(tpl, msgs2, tools=TOOLS)
    n = len(p) + len(g)
    assert res.token_ids[:n] == p + g
    assert res.token_ids[n:] == enc(
        tpl,
        "\n<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n"
        "<tool_response>\n22C, cloudy\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    # the same with the EOS trimmed from G: the template supplies it
    res2 = build(tpl, msgs[:1] + [assistant(None, p, g[:-1], tool_calls=calls)] + msgs2[2:], tools=TOOLS)
    assert res2.token_ids == res.token_ids


def test_tool_call_turn_with_content_before_calls(tpl):
    msgs = [{"role": "user", "content": "Weather?"}]
    p = build(tpl, msgs, tools=TOOLS).token_ids
    g = enc(tpl, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    res = build(
        tpl,
        msgs
        + [
            assistant("Let me check.", p, g, tool_calls=[call]),
            {"role": "tool", "tool_call_id": "c1", "content": "-3C"},
        ],
        tools=TOOLS,
    )
    assert res.token_ids[: len(p) + len(g)] == p + g
    assert res.token_ids[len(p) + len(g)] == IM_END


def test_template_that_strips_reasoning_from_history(tokenizer):
    """(d) Re-rendering would drop the turn's <think> block (re-templating drift); the splice keeps it."""
    tpl = ChatTemplate(tokenizer, chat_template=QWEN3_LIKE)
    msgs = [{"role": "user", "content": "2+2?"}]
    first = build(tpl, msgs)
    assert first.text_tail.endswith("<|im_start|>assistant\n<think>\n")
    p = first.token_ids
    g = enc(tpl, "Two plus two.\n</think>\n\nIt is 4.") + [IM_END]
    msgs2 = msgs + [assistant("It is 4.", p, g, reasoning="Two plus two."), {"role": "user", "content": "3+3?"}]
    res = build(tpl, msgs2)
    n = len(p) + len(g)
    assert res.token_ids[:n] == p + g
    assert res.token_ids[n:] == enc(tpl, "\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    rerendered = tpl.render_text(
        tpl.prepare_messages(
            msgs
            + [
                {"role": "assistant", "content": "It is 4.", "reasoning": "Two plus two."},
                {"role": "user", "content": "3+3?"},
            ]
        )
    )
    assert "Two plus two." not in rerendered  # the template drops it; the splice did not
    assert res.text_tail.endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize(
    "template, fragment",
    [
        # the turn closes differently when messages follow
        (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "{% if loop.last %}<|im_end|>{% else %}<|endoftext|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "differently",
        ),
        # earlier assistant turns are not rendered at all
        (
            "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
            "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "differently",
        ),
        # the content is rendered twice
        (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}|{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "2 times",
        ),
        # no end-of-turn token at all
        (
            "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}",
            "no end-of-turn token",
        ),
    ],
)
def test_ambiguous_boundary_is_a_400_splice_error(tokenizer, template, fragment):
    """(e) Never fall back to re-tokenized text: say what was wrong."""
    tpl = ChatTemplate(tokenizer, chat_template=template)
    g = enc(tpl, "Four.")
    msgs = [{"role": "user", "content": "2+2?"}, assistant("Four.", [1, 2, 3], g), {"role": "user", "content": "?"}]
    with pytest.raises(SpliceError) as e:
        build(tpl, msgs)
    assert e.value.status_code == 400 and e.value.code == "splice_failed" and e.value.param == "messages"
    assert "messages[1]" in e.value.message and fragment in e.value.message


@pytest.mark.parametrize(
    "template",
    [
        # turns follow each other directly; a newline ends the conversation
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% if loop.last %}{{ '\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        # an end-of-text marker closes the conversation when no generation prompt follows
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<|endoftext|>{% endif %}",
    ],
)
def test_template_that_ends_the_conversation_differently_from_a_turn(tokenizer, template):
    """Only the turn's own closing must match between A and B; what follows its EOS comes from B."""
    tpl = ChatTemplate(tokenizer, chat_template=template)
    msgs = [{"role": "user", "content": "2+2?"}]
    p = build(tpl, msgs).token_ids
    g = [t for ch in "Four." for t in enc(tpl, ch)] + [IM_END]
    msgs2 = msgs + [assistant("Four.", p, g), {"role": "user", "content": "3+3?"}]
    res = build(tpl, msgs2)
    n = len(p) + len(g)
    assert res.token_ids[:n] == p + g
    plain = tpl.render_text(
        tpl.prepare_messages(msgs + [{"role": "assistant", "content": "Four."}, {"role": "user", "content": "3+3?"}])
    )
    assert res.token_ids[n:] == enc(tpl, plain.split("Four.<|im_end|>")[1])


def test_several_eos_ids_keep_the_models_own(tpl):
    """(f) G ends with <|endoftext|>: kept, and the template's <|im_end|> is not added after it."""
    msgs = [{"role": "user", "content": "Hi"}]
    p = build(tpl, msgs).token_ids
    g = enc(tpl, "Hello.") + [ENDOFTEXT]
    res = build(tpl, msgs + [assistant("Hello.", p, g), {"role": "user", "content": "Bye"}])
    n = len(p) + len(g)
    assert res.token_ids[:n] == p + g
    assert res.token_ids[n - 1 : n + 2] == [ENDOFTEXT, 198, IM_START]
    # with only <|im_end|> configured, <|endoftext|> is ordinary generation and the template closes the turn
    res1 = build(tpl, msgs + [assistant("Hello.", p, g), {"role": "user", "content": "Bye"}], eos=(IM_END,))
    assert res1.token_ids[n - 1 : n + 1] == [ENDOFTEXT, IM_END]


def test_cut_off_turn_without_eos(tpl):
    """(g) finish_reason length: G has no EOS; the template's EOS closes the turn (not generation)."""
    msgs = [{"role": "user", "content": "Count."}]
    p = build(tpl, msgs).token_ids
    g = enc(tpl, "1, 2, 3, 4")
    res = build(tpl, msgs + [assistant("1, 2, 3, 4", p, g), {"role": "user", "content": "Go on"}])
    n = len(p) + len(g)
    assert res.token_ids[:n] == p + g
    assert res.token_ids[n:] == enc(tpl, "<|im_end|>\n<|im_start|>user\nGo on<|im_end|>\n<|im_start|>assistant\n")


def test_only_the_last_token_bearing_turn_is_spliced(tpl):
    msgs = [{"role": "user", "content": "a"}]
    p1 = build(tpl, msgs).token_ids
    g1 = enc(tpl, "b") + [IM_END]
    msgs += [assistant("b", p1, g1), {"role": "user", "content": "c"}]
    p2 = build(tpl, msgs).token_ids
    g2 = [t for ch in "dd" for t in enc(tpl, ch)]
    msgs += [
        assistant("dd", p2, g2),
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "off-policy text"},
        {"role": "user", "content": "f"},
    ]
    res = build(tpl, msgs)
    assert res.token_ids[: len(p2) + len(g2)] == p2 + g2
    assert res.token_ids[len(p2) + len(g2) :] == enc(
        tpl,
        "<|im_end|>\n<|im_start|>user\ne<|im_end|>\n<|im_start|>assistant\noff-policy text<|im_end|>\n"
        "<|im_start|>user\nf<|im_end|>\n<|im_start|>assistant\n",
    )


def test_developer_merge_does_not_shift_the_spliced_turn(tpl):
    msgs = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, {"role": "user", "content": "u"}]
    p = build(tpl, msgs).token_ids
    assert tpl.tokenizer.decode(p).startswith("<|im_start|>system\nS\n\nD<|im_end|>")
    g = enc(tpl, "ok") + [IM_END]
    res = build(tpl, msgs + [assistant("ok", p, g), {"role": "user", "content": "v"}])
    assert res.token_ids[: len(p) + len(g)] == p + g


def test_token_fields_on_a_non_assistant_message(tpl):
    msgs = [
        {
            "role": "user",
            "content": "a",
            "prompt_token_ids": [1],
            "generation_token_ids": [2],
            "generation_log_probs": [0.0],
        }
    ]
    with pytest.raises(SpliceError) as e:
        build(tpl, msgs)
    assert "messages[0]" in e.value.message and "'user'" in e.value.message


@pytest.mark.parametrize("field, value", [("prompt_token_ids", [1, VOCAB]), ("generation_token_ids", [VOCAB + 7])])
def test_ids_outside_the_vocabulary(tpl, field, value):
    m = assistant("x", [1, 2], [3])
    m[field] = value
    m["generation_log_probs"] = [0.0] * len(m["generation_token_ids"])
    with pytest.raises(InvalidRequestError) as e:
        build(tpl, [{"role": "user", "content": "a"}, m, {"role": "user", "content": "b"}])
    assert e.value.param == f"messages[1].{field}" and not isinstance(e.value, SpliceError)


def test_partial_or_inconsistent_token_fields(tpl):
    m = assistant("x", [1, 2], [3])
    del m["generation_log_probs"]
    with pytest.raises(InvalidRequestError) as e:
        build(tpl, [{"role": "user", "content": "a"}, m])
    assert e.value.param == "messages[1].generation_log_probs"
    m = assistant("x", [1, 2], [3, 4])
    m["generation_log_probs"] = [0.0]
    with pytest.raises(InvalidRequestError) as e:
        build(tpl, [{"role": "user", "content": "a"}, m])
    assert e.value.param == "messages[1].generation_log_probs"


def test_turn_k_last_message_tail_has_no_sentinel(tpl):
    msgs = [{"role": "user", "content": "a"}]
    p = build(tpl, msgs).token_ids
    g = enc(tpl, "an answer that is long enough to fill the tail") + [IM_END]
    res = build(tpl, msgs + [assistant("x", p, g)])
    assert res.token_ids[: len(p) + len(g)] == p + g
    assert res.token_ids[len(p) + len(g) :] == enc(tpl, "\n<|im_start|>assistant\n")
    assert "sentinel" not in res.text_tail and res.text_tail.endswith("tail<|im_end|>\n<|im_start|>assistant\n")


def test_hundred_turns_is_fast(tpl):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "start " * 50}]
    p = build(tpl, msgs).token_ids
    for i in range(100):
        g = enc(tpl, f"answer {i} " * 30) + [IM_END]
        msgs += [assistant(f"answer {i} " * 30, p, g), {"role": "user", "content": f"next {i} " * 30}]
        if i < 99:
            p = p + g + enc(tpl, f"\n<|im_start|>user\n{f'next {i} ' * 30}<|im_end|>\n<|im_start|>assistant\n")
    t0 = time.perf_counter()
    res = build(tpl, msgs)
    elapsed = time.perf_counter() - t0
    assert res.token_ids[: len(p) + len(g)] == p + g
    assert elapsed < 1.0, elapsed


ORDINARY = st.integers(min_value=0, max_value=ENDOFTEXT - 1)  # ids below the special tokens
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<>"), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    g=st.lists(ORDINARY, max_size=30),
    end=st.sampled_from([None, IM_END, ENDOFTEXT]),
    follow=st.lists(st.tuples(st.sampled_from(["user", "tool"]), TEXT), min_size=0, max_size=4),
)
def test_property_prefix_is_always_p_plus_g(tpl, g, end, follow):
    p = tpl.encode("<|im_start|>system\nx<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    g = g + ([end] if end is not None else [])
    msgs = [{"role": "user", "content": "q"}, assistant("whatever", p, g)]
    msgs += [{"role": r, "content": t, **({"tool_call_id": "c"} if r == "tool" else {})} for r, t in follow]
    res = build(tpl, msgs)
    n = len(p) + len(g)
    assert res.token_ids[:n] == p + g
    # Independent oracle for the rest: Qwen2.5's rendering of the follow-up messages.
    expected = "" if end is not None else "<|im_end|>"
    expected += "\n"
    for i, (role, text) in enumerate(follow):
        if role == "user":
            expected += f"<|im_start|>user\n{text}<|im_end|>\n"
        else:
            if i == 0 or follow[i - 1][0] != "tool":
                expected += "<|im_start|>user"
            expected += f"\n<tool_response>\n{text}\n</tool_response>"
            if i == len(follow) - 1 or follow[i + 1][0] != "tool":
                expected += "<|im_end|>\n"
    expected += "<|im_start|>assistant\n"
    rest = tpl.tokenizer.decode(res.token_ids[n:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert rest == unicodedata.normalize("NFC", expected)
