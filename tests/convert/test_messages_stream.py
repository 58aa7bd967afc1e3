"""Chat chunks → Messages streaming events (``convert.messages_stream``): every event is one of the
anthropic SDK's ``RawMessageStreamEvent`` types, the SDK's own stream helper (over a real HTTP
stream on 127.0.0.1) assembles exactly the Message the non-streamed path builds from the same
answer, and blocks are strictly sequential."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from gymserve.convert import ChunkAccumulator, chat_to_response
from gymserve.convert.chat_to_messages import response_to_message
from gymserve.convert.messages_stream import MessageStreamBuilder, context_exceeded_events
from helpers.fakes import FakeServer, sse_events

TOKENS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4, 5], "generation_log_probs": [-0.1, -0.2, -0.3]}
EVENT = TypeAdapter(RawMessageStreamEvent)


def chunk(delta=None, finish=None, **extra):
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "policy", "choices": [choice]}


def call(index, *, id=None, name=None, args=""):
    function = {"arguments": args, **({"name": name} if name else {})}
    return {"tool_calls": [{"index": index, **({"id": id, "type": "function"} if id else {}), "function": function}]}


USAGE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "policy", "choices": []}
USAGE["usage"] = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}

ANSWERS = {
    "reasoning, text and a call": [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "The user wants "}),
        chunk({"reasoning_content": "weather."}),
        chunk({"content": "Let me "}),
        chunk({"content": "check."}),
        chunk(call(0, id="call_a", name="get_weather", args='{"ci')),
        chunk(call(0, args='ty": "Paris"}')),
        chunk(TOKENS, "tool_calls"),
        USAGE,
    ],
    "think tags in the content": [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "<thi"}),
        chunk({"content": "nk>plan</think>\n\nThe answer "}),
        chunk({"content": "is 4."}),
        chunk({}, "stop"),
        USAGE,
    ],
    "text after a call": [
        chunk(call(0, id="call_a", name="f", args="{}")),
        chunk({"content": "\n\nDone calling."}),
        chunk({}, "tool_calls"),
    ],
    "two calls, arguments interleaved": [
        chunk(call(0, id="call_a", name="f", args='{"x"')),
        chunk(call(1, id="call_b", name="g", args='{"y"')),
        chunk(call(0, args=": 1}")),
        chunk(call(1, args=": 2}")),
        chunk({}, "tool_calls"),
    ],
    "arguments that are not JSON": [chunk(call(0, id="call_a", name="f", args="oops")), chunk({}, "tool_calls")],
    "cut at max_tokens": [chunk({"content": "Once upon"}), chunk({}, "length")],
    "a stop sequence": [chunk({"content": "Paris"}), chunk({}, "stop", stop_reason="END")],
    "nothing but token fields": [chunk({"role": "assistant", "content": ""}), chunk(TOKENS, "stop")],
}


def _events(chunks, stop_sequences=None):
    builder = MessageStreamBuilder("policy", stop_sequences=stop_sequences)
    events = builder.start()
    for c in chunks:
        events += builder.feed(c)
    return events + builder.finish(), builder.message


@pytest.fixture(scope="module")
def replay():
    """A fake Messages API on 127.0.0.1 that streams ``replay.events`` to every call."""
    state = {"events": []}
    with FakeServer(lambda r: sse_events(state["events"])) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)

        def final(events):
            state["events"] = events
            with client.messages.stream(
                model="policy", max_tokens=10, messages=[{"role": "user", "content": "q"}]
            ) as s:
                raw = [e for e in s if e.type in ("message_delta",)]
                return s.get_final_message(), raw

        yield final


def _blocks_are_sequential(events):
    open_index, seen = None, []
    for event in events:
        if event["type"] == "content_block_start":
            assert open_index is None, "a block started before the last one stopped"
            assert event["index"] == len(seen)
            open_index = event["index"]
            seen.append(event["index"])
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_index
            open_index = None
    assert open_index is None


@pytest.mark.parametrize("name", list(ANSWERS))
def test_the_sdk_assembles_the_non_streamed_message(name, replay):
    stops = ["END"] if name == "a stop sequence" else None
    events, message = _events(ANSWERS[name], stops)
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    for event in events:
        if event["type"] != "ping":
            EVENT.validate_python(event)
    _blocks_are_sequential(events)

    # Non-streamed, from the same answer folded into a completion (a remote chat server's path).
    accumulator = ChunkAccumulator()
    for c in ANSWERS[name]:
        accumulator.add(c)
    stop = "END" if stops else None
    whole = response_to_message(chat_to_response(accumulator.completion(), {"model": "policy"}), stop_sequence=stop)
    if name != "text after a call":  # a ChatCompletion cannot say that text came after the call
        assert message["content"] == whole["content"]
    assert (message["stop_reason"], message["stop_sequence"]) == (whole["stop_reason"], whole["stop_sequence"])

    sdk, deltas = replay(json.loads(json.dumps(events)))
    assert sdk.model_dump(exclude_none=True)["content"] == [
        {k: v for k, v in block.items() if v is not None} for block in message["content"]
    ]
    assert (sdk.stop_reason, sdk.stop_sequence) == (message["stop_reason"], message["stop_sequence"])
    assert sdk.usage.output_tokens == message["usage"]["output_tokens"]
    if "prompt_token_ids" in message:
        assert {k: deltas[-1].model_extra[k] for k in TOKENS} == TOKENS


def test_what_each_answer_becomes():
    full = _events(ANSWERS["reasoning, text and a call"])[1]["content"]
    assert [{k: v for k, v in b.items() if k != "signature"} for b in full] == [
        {"type": "thinking", "thinking": "The user wants weather."},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    think = _events(ANSWERS["think tags in the content"])[1]
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in think["content"]] == [
        ("thinking", "plan"),
        ("text", "The answer is 4."),
    ]
    after = _events(ANSWERS["text after a call"])[1]
    assert [b["type"] for b in after["content"]] == ["tool_use", "text"] and after["content"][1][
        "text"
    ] == "Done calling."
    two = _events(ANSWERS["two calls, arguments interleaved"])[1]
    assert [b["input"] for b in two["content"]] == [{"x": 1}, {"y": 2}]
    assert _events(ANSWERS["arguments that are not JSON"])[1]["content"][0]["input"] == {}
    assert _events(ANSWERS["cut at max_tokens"])[1]["stop_reason"] == "max_tokens"
    empty = _events(ANSWERS["nothing but token fields"])
    assert empty[1]["content"] == [] and not any(e["type"] == "content_block_start" for e in empty[0])


def test_the_training_fields_ride_on_message_delta():
    events, message = _events(ANSWERS["reasoning, text and a call"])
    delta = events[-2]
    assert {k: delta[k] for k in TOKENS} == TOKENS
    assert delta["usage"]["input_tokens"] == 12 and delta["usage"]["output_tokens"] == 3
    assert {k: message[k] for k in TOKENS} == TOKENS


def test_a_thinking_block_ends_with_its_signature():
    events, message = _events(ANSWERS["reasoning, text and a call"])
    signature = next(
        e for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"
    )
    assert signature["delta"]["signature"] == message["content"][0]["signature"]
    stop = events[events.index(signature) + 1]
    assert stop == {"type": "content_block_stop", "index": signature["index"]}


def test_fail_is_an_anthropic_error_event():
    builder = MessageStreamBuilder("policy")
    assert builder.fail(502, "upstream went away") == [
        {"type": "error", "error": {"type": "api_error", "message": "upstream went away"}, "request_id": None}
    ]


def test_context_exceeded_events(replay):
    events = context_exceeded_events("policy")
    sdk, _ = replay(events)
    assert sdk.content == [] and sdk.stop_reason == "model_context_window_exceeded"
