"""gymserve's harmony chat template for gpt-oss: the prompt the harmony guide prescribes."""

from __future__ import annotations

import pytest

from gymserve.prompting import ChatTemplate
from gymserve.prompting.harmony_template import HARMONY_TEMPLATE
from helpers import synthetic_tokenizer as syn

SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_flight",
        "description": "Finds a flight by number.",
        "parameters": {
            "type": "object",
            "properties": {
                "number": {"type": "string", "description": "Flight number, e.g. LH 400"},
                "day": {"type": "integer"},
                "cabin": {"type": "string", "enum": ["economy", "business"], "default": "economy"},
                "legs": {"type": "array", "items": {"type": "string"}},
                "filters": {"type": "object", "properties": {"direct": {"type": "boolean"}}},
                "note": {"type": ["string", "null"]},
            },
            "required": ["number"],
        },
    },
}


@pytest.fixture(scope="module")
def tpl():
    return ChatTemplate(syn.synthetic_tokenizer(syn.HARMONY, HARMONY_TEMPLATE, eos_token="<|return|>"))


def render(tpl, messages, tools=None, kwargs=None, gen=True) -> str:
    return tpl.render_text(tpl.prepare_messages(messages), tools, kwargs, add_generation_prompt=gen)


def test_system_and_developer_messages_with_tools(tpl):
    text = render(
        tpl,
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "LH 400 tomorrow?"}],
        [TOOL, {"type": "function", "function": {"name": "now"}}],
        {"reasoning_effort": "high", "current_date": "2026-01-02"},
    )
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2026-01-02\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n"
        "// Finds a flight by number.\n"
        "type lookup_flight = (_: {\n"
        "// Flight number, e.g. LH 400\n"
        "number: string,\n"
        "day?: number,\n"
        'cabin?: "economy" | "business", // default: economy\n'
        "legs?: string[],\n"
        "filters?: {\ndirect?: boolean,\n},\n"
        "note?: string | null,\n"
        "}) => any;\n\n"
        "type now = () => any;\n\n"
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>LH 400 tomorrow?<|end|><|start|>assistant"
    )


def call_turn(call_id: str, reasoning: str) -> list[dict]:
    return [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": reasoning,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "lookup_flight", "arguments": '{"number": "LH 400"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"status": "on time"}'},
    ]


def test_reasoning_kept_between_tool_calls_dropped_after_a_final_answer(tpl):
    first = [{"role": "user", "content": "Status?"}, *call_turn("c1", "Look it up.")]
    ongoing = render(tpl, first)
    assert ongoing == (
        SYSTEM + "<|end|><|start|>user<|message|>Status?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        "<|start|>assistant to=functions.lookup_flight<|channel|>commentary <|constrain|>json<|message|>"
        '{"number":"LH 400"}<|call|>'
        '<|start|>functions.lookup_flight to=assistant<|channel|>commentary<|message|>{"status": "on time"}<|end|>'
        "<|start|>assistant"
    )
    answered = [
        *first,
        {"role": "assistant", "content": "On time.", "reasoning_content": "Tool says on time."},
        {"role": "user", "content": "And tomorrow?"},
        *call_turn("c2", "Check again."),
    ]
    text = render(tpl, answered)
    # Before the last final answer: the analysis is gone, the calls and the answer stay.
    assert "Look it up." not in text and "Tool says on time." not in text
    assert "<|start|>assistant<|channel|>final<|message|>On time.<|end|>" in text
    # After it: the analysis of the ongoing tool-call turn is kept.
    assert "<|start|>assistant<|channel|>analysis<|message|>Check again.<|end|>" in text


def test_a_final_answer_as_the_last_message_keeps_its_analysis_for_training(tpl):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple."},
    ]
    assert render(tpl, messages, gen=False).endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Simple.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|end|>"
    )
    assert "Simple." not in render(tpl, [*messages, {"role": "user", "content": "3+3?"}])


def test_preamble_later_developer_message_and_tool_names_by_call_id(tpl):
    messages = [
        {"role": "user", "content": "Two flights."},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "first", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "second", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "developer", "content": "Be exact."},
    ]
    text = render(tpl, messages)
    assert "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>" in text
    assert (
        "<|start|>functions.second to=assistant<|channel|>commentary<|message|>2<|end|>"
        "<|start|>functions.first to=assistant<|channel|>commentary<|message|>1<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe exact.<|end|><|start|>assistant"
    ) in text
