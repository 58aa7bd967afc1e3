"""Public cases TE-01 (token-exact splicing), RC-05 and RC-01 (template side), with their literal values."""

from __future__ import annotations

import pytest

from gymserve.errors import SpliceError
from gymserve.prompting import ChatTemplate, build_prompt
from gymserve.prompting.splice import splice_token_ids
from helpers.spec import load_cases
from helpers.templates import QWEN3_LIKE

# TE-01 toy vocabulary: <|im_start|>=1, <|im_end|>=2 (EOS), \n=3, user=4, assistant=5, Q1=10, Q2=11,
# The=20, " answer"=21, " is"=22, " 4" merged=23, " "=24, "4"=25, "."=26, alt EOS=9.
P1 = [1, 4, 3, 10, 2, 3, 1, 5, 3]
G_A = [20, 21, 22, 24, 25, 26, 2]
G_B = [20, 21, 22]
G_C = [20, 21, 22, 24, 25, 26, 9]
FULL_A = [1, 4, 3, 10, 2, 3, 1, 5, 3, 20, 21, 22, 23, 26, 2, 3, 1, 4, 3, 11, 2, 3, 1, 5, 3]
PREFIX_A = [1, 4, 3, 10, 2, 3, 1, 5, 3, 20, 21, 22, 23, 26, 2, 3]
FULL_B = [1, 4, 3, 10, 2, 3, 1, 5, 3, 20, 21, 22, 2, 3, 1, 4, 3, 11, 2, 3, 1, 5, 3]
EXPECTED = {
    "A": [1, 4, 3, 10, 2, 3, 1, 5, 3, 20, 21, 22, 24, 25, 26, 2, 3, 1, 4, 3, 11, 2, 3, 1, 5, 3],
    "B": [1, 4, 3, 10, 2, 3, 1, 5, 3, 20, 21, 22, 2, 3, 1, 4, 3, 11, 2, 3, 1, 5, 3],
    "C": [1, 4, 3, 10, 2, 3, 1, 5, 3, 20, 21, 22, 24, 25, 26, 9, 3, 1, 4, 3, 11, 2, 3, 1, 5, 3],
}


def suffix_at_turn_end(full: list[int], turn_end_eos_index: int) -> list[int]:
    """The template's tokens from the EOS that closes the assistant turn (what find_turn_suffix yields)."""
    assert full[turn_end_eos_index] == 2
    return full[turn_end_eos_index:]


# In A's template rendering the assistant turn is PREFIX_A: it ends "... 26, 2, 3", so its EOS is
# the second-to-last token of PREFIX_A; in B it follows the three generated tokens.
SUFFIX_A = suffix_at_turn_end(FULL_A, len(PREFIX_A) - 2)
SUFFIX_B = suffix_at_turn_end(FULL_B, len(P1) + 3)


def test_te01_scenario_a_eos_generated():
    out = splice_token_ids(P1, G_A, SUFFIX_A, eos_token_ids=[2])
    assert out == EXPECTED["A"]
    assert out[: len(P1) + len(G_A)] == P1 + G_A
    assert 23 not in out  # the re-tokenized " 4" never appears
    assert out[len(P1) + len(G_A)] != 2  # exactly one EOS closes the assistant turn


def test_te01_scenario_a_with_eos_trimmed_gives_the_same_prompt():
    # gymserve returns G with the EOS trimmed; the template then supplies it.
    out = splice_token_ids(P1, G_A[:-1], SUFFIX_A, eos_token_ids=[2])
    assert out == EXPECTED["A"]


def test_te01_scenario_b_truncated_without_eos():
    out = splice_token_ids(P1, G_B, SUFFIX_B, eos_token_ids=[2])
    assert out == EXPECTED["B"]
    assert out[: len(P1) + len(G_B)] == P1 + G_B
    # The EOS is the template's, not generation: G and its log-probs are untouched.
    assert out[len(P1) + len(G_B)] == 2
    assert len(G_B) == 3


def test_te01_scenario_c_alternate_eos_keeps_the_models_eos():
    out = splice_token_ids(P1, G_C, SUFFIX_A, eos_token_ids=[2, 9])
    assert out == EXPECTED["C"]
    assert out[: len(P1) + len(G_C)] == P1 + G_C
    n = len(P1) + len(G_C)
    assert out[n - 1 : n + 1] == [9, 3]  # never [..., 9, 2, ...]


def test_te01_suffix_must_start_with_eos():
    with pytest.raises(SpliceError) as e:
        splice_token_ids(P1, G_A, SUFFIX_A[1:], eos_token_ids=[2])
    assert e.value.status_code == 400 and e.value.code == "splice_failed"


def test_te01_input_does_not_alias():
    g = list(G_A)
    out = splice_token_ids(P1, g, SUFFIX_A, eos_token_ids=[2])
    out.append(99)
    assert g == G_A and P1[-1] == 3


def test_te01_values_match_the_case_file():
    case = load_cases("token_exact_splicing")["TE-01"]
    inp, exp = case["input"], case["expected"]
    assert inp["turn1_prompt_token_ids"] == P1
    sc = inp["scenarios"]
    assert sc["A_eos_generated"]["turn1_generation_token_ids"] == G_A
    assert sc["A_eos_generated"]["turn2_template_full_ids"] == FULL_A
    assert sc["B_truncated_no_eos"]["turn1_generation_token_ids"] == G_B
    assert sc["B_truncated_no_eos"]["turn2_template_full_ids"] == FULL_B
    assert sc["C_alternate_eos"]["turn1_generation_token_ids"] == G_C
    assert sc["C_alternate_eos"]["eos_token_ids"] == [2, 9]
    assert {k: exp[k] for k in "ABC"} == EXPECTED


# ---------------------------------------------------------------- RC-05 / RC-01 (template side)


def test_rc05_developer_merged_into_the_single_leading_system_message(tokenizer):
    tpl = ChatTemplate(tokenizer)
    assert not tpl.handles_developer
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Reply in French."},
        {"role": "user", "content": "Hello"},
    ]
    prepared = tpl.prepare_messages(msgs)
    assert prepared == [
        {"role": "system", "content": "You are terse.\n\nReply in French."},
        {"role": "user", "content": "Hello"},
    ]
    text = tpl.render_text(prepared)
    assert "Reply in French." in text and "You are terse." in text
    assert text.index("You are terse.") < text.index("Reply in French.")
    assert text.count("<|im_start|>system") == 1 and text.startswith("<|im_start|>system\n")
    assert msgs[1]["role"] == "developer"  # input untouched


def test_rc05_developer_alone_becomes_system(tokenizer):
    tpl = ChatTemplate(tokenizer)
    text = tpl.render_text(
        tpl.prepare_messages(
            [{"role": "developer", "content": "Reply in French."}, {"role": "user", "content": "Hello"}]
        )
    )
    assert text.startswith("<|im_start|>system\nReply in French.<|im_end|>\n")
    assert "You are Qwen" not in text


def test_rc01_reasoning_reaches_a_qwen3_style_template_for_the_current_turn(tokenizer):
    tpl = ChatTemplate(tokenizer, chat_template=QWEN3_LIKE)
    msgs = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "I should call get_weather for Paris.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    text = tpl.render_text(tpl.prepare_messages(msgs))
    assert "<think>\nI should call get_weather for Paris.\n</think>\n\n" in text
    assert '"arguments": {"city": "Paris"}' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_rc01_splice_through_a_qwen3_style_template(tokenizer):
    tpl = ChatTemplate(tokenizer, chat_template=QWEN3_LIKE)
    p = tpl.render_ids(tpl.prepare_messages([{"role": "user", "content": "Weather in Paris?"}]))
    g = tpl.encode(
        'I should call it.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    )
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call it.",
            "reasoning": "I should call it.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
            "prompt_token_ids": p,
            "generation_token_ids": g,
            "generation_log_probs": [-0.1] * len(g),
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    res = build_prompt(tpl, msgs, eos_token_ids=(151645, 151643), vocab_size=151936)
    assert res.spliced
    assert res.token_ids[: len(p) + len(g)] == p + g
    assert res.token_ids[len(p) + len(g) :] == tpl.encode(
        "\n<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert res.text_tail.endswith("<|im_start|>assistant\n<think>\n")
