"""Chat chunks → Responses streaming events: lifecycle, validity, and equality with the
non-streamed conversion of the same chunks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gymserve.convert import ChunkAccumulator, ResponseStreamBuilder, chat_to_response
from helpers.spec import assert_valid_event, assert_valid_response

TOKENS = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [7, 8], "generation_log_probs": [-0.5, -1.5]}
REQUEST = {"model": "policy", "input": "q", "stream": True}


def chunk(delta=None, finish_reason=None, **top):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "served",
        "choices": choices,
        **top,
    }


def run(chunks, request=REQUEST, validate=True, **kw):
    builder = ResponseStreamBuilder(request, **kw)
    events = builder.start()
    for c in chunks:
        events += builder.feed(c)
    events += builder.finish()
    check_invariants(events, builder, request, validate)
    return events


def check_invariants(events, builder, request, validate=True):
    if validate:
        for event in events:
            assert_valid_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] == ("response.completed" if final["status"] == "completed" else "response.incomplete")
    # The completed response IS the non-streamed conversion of the accumulated chunks.
    # When the model wrote text after a tool call, the output keeps generation order (turns).
    turns = [p.message(builder.accumulator) for p in builder._phases] if len(builder._phases) > 1 else None
    expected = chat_to_response(
        builder.accumulator.completion(),
        request,
        response_id=final["id"],
        created_at=final["created_at"],
        item_ids=[i["id"] for i in final["output"]],
        turns=turns,
    )
    expected["completed_at"] = final["completed_at"]
    assert final == expected
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == list(range(len(final["output"])))
    # Each item is done before the next one is added (the OpenAI API never interleaves items), but
    # for function calls whose arguments a server interleaves: those stay open together.
    lifecycle = [(e["type"], e["output_index"]) for e in events if e["type"].startswith("response.output_item.")]
    for index, _item in enumerate(final["output"]):
        opened = lifecycle.index(("response.output_item.added", index))
        closed = lifecycle.index(("response.output_item.done", index))
        between = {i for _, i in lifecycle[opened + 1 : closed]}
        assert all(final["output"][i]["type"] == "function_call" for i in between | {index}) or not between
    for e in done:
        assert e["item"] == final["output"][e["output_index"]]
    for index, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert mine[0]["item"]["id"] == item["id"]
        assert all(e.get("item_id", item["id"]) == item["id"] for e in mine)
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        if item["type"] == "function_call":
            assert deltas == item["arguments"]
            assert [e["type"] for e in mine][-2] == "response.function_call_arguments.done"
        elif item["content"] and "text" in item["content"][0] and len(item["content"]) == 1:
            text = item["content"][0]["text"]
            assert deltas == text
            kinds = [e["type"] for e in mine]
            assert kinds[1] == "response.content_part.added" and kinds[-2] == "response.content_part.done"
            assert mine[1]["part"]["text"] == ""
            assert mine[-3]["text"] == text and mine[-2]["part"]["text"] == text
        else:  # parts other than one text part (a refusal): each announced, then done with its value
            for k, part in enumerate(item["content"]):
                assert [
                    e["part"] for e in mine if e["type"] == "response.content_part.done" and e["content_index"] == k
                ] == [part]
    return final


def types(events):
    return [e["type"] for e in events]


def test_reasoning_then_text_stream():
    events = run(
        [
            chunk({"role": "assistant"}),
            chunk({"reasoning_content": "Let "}),
            chunk({"reasoning_content": "me"}),
            chunk({"content": "Hi"}),
            chunk({"content": "!"}, "stop"),
            chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}),
        ]
    )
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "Let me"
    assert final["usage"]["output_tokens"] == 4 and final["model"] == "served"


def test_both_reasoning_field_names_in_one_delta_count_once():
    events = run([chunk({"reasoning": "r", "reasoning_content": "r"}), chunk({"content": "a"}, "stop")])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "r"


def test_think_tags_split_across_chunks():
    pieces = ["<thi", "nk>\nab", "c\n</th", "ink>\n\nHel", "lo  ", "<", "3"]
    events = run([chunk({"content": p}) for p in pieces] + [chunk({}, "stop")])
    out = events[-1]["response"]["output"]
    assert [(i["type"], i["content"][0]["text"]) for i in out] == [("reasoning", "abc"), ("message", "Hello  <3")]
    assert "<think>" not in "".join(e.get("delta", "") for e in events)


def test_parallel_tool_calls_with_text_and_training_fields():
    chunks = [
        chunk({"role": "assistant", "content": "Checking "}),
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "call_a", "type": "function", "function": {"name": "weather", "arguments": ""}}
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk(
            {
                "tool_calls": [
                    {"index": 1, "id": "call_b", "type": "function", "function": {"name": "time", "arguments": "{}"}}
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({**TOKENS}, "tool_calls"),
    ]
    events = run(chunks)
    final = events[-1]["response"]
    out = final["output"]
    assert [i["type"] for i in out] == ["message", "function_call", "function_call"]
    assert out[0]["content"][0]["text"] == "Checking "  # trailing space kept: no tag followed
    assert [(i["call_id"], i["name"], i["arguments"]) for i in out[1:]] == [
        ("call_a", "weather", '{"city": "Paris"}'),
        ("call_b", "time", "{}"),
    ]
    assert out[2]["generation_token_ids"] == [7, 8] and "generation_token_ids" not in out[1]
    last_done = [e for e in events if e["type"] == "response.output_item.done"][-1]
    assert last_done["item"]["prompt_token_ids"] == [1, 2, 3]
    assert final["status"] == "completed"


def test_training_fields_at_chunk_top_level_and_in_pieces():
    chunks = [
        chunk({"content": "a"}, prompt_token_ids=[1, 2, 3], generation_token_ids=[7], generation_log_probs=[-0.5]),
        chunk({"content": "b", "generation_token_ids": [8], "generation_log_probs": [-1.5]}, "stop"),
    ]
    final = run(chunks)[-1]["response"]
    assert {k: final["output"][0][k] for k in TOKENS} == TOKENS


def test_length_ends_with_response_incomplete():
    events = run([chunk({"content": "The first primes are 2, 3,"}), chunk({}, "length")])
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_empty_stream_completes_with_no_items():
    events = run([chunk({"role": "assistant"}), chunk({}, "stop")])
    assert types(events) == ["response.created", "response.in_progress", "response.completed"]


def test_withheld_tag_prefix_is_sent_at_finish():
    events = run([chunk({"content": "x <"}), chunk({}, "stop")])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "x <"
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["x", " <"]


def test_item_never_announced_gets_its_whole_lifecycle_at_finish():
    events = run([chunk({"content": "<"}), chunk({}, "stop")])
    assert types(events)[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_open_responses_event_names():
    events = run([chunk({"reasoning": "r"}), chunk({"content": "a"}, "stop")], reasoning_events="reasoning")
    assert "response.reasoning.delta" in types(events) and "response.reasoning.done" in types(events)
    assert not any(t.startswith("response.reasoning_text") for t in types(events))


def test_fail():
    builder = ResponseStreamBuilder(REQUEST)
    events = builder.start() + builder.feed(chunk({"content": "Let me check"}))
    events += builder.feed(
        chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"a'}}]})
    )
    events += builder.fail("backend went away")
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "backend went away"}
    # What the client was shown is kept: the message as its done event said, the open call as far
    # as it got, marked incomplete.
    assert [
        (i["type"], i["status"], i.get("arguments") or i["content"][0]["text"])
        for i in events[-1]["response"]["output"]
    ] == [("message", "completed", "Let me check"), ("function_call", "incomplete", '{"a')]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        assert_valid_event(event)


def test_start_shell_and_fixed_ids():
    builder = ResponseStreamBuilder(REQUEST, response_id="resp_1", created_at=5, model="served")
    created, progress = builder.start()
    assert created["response"]["id"] == progress["response"]["id"] == "resp_1"
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []
    assert created["response"]["model"] == "served"
    assert_valid_response(created["response"])


def test_accumulator_builds_a_valid_chat_completion():
    from openai.types.chat import ChatCompletion

    acc = ChunkAccumulator()
    for c in [
        chunk({"content": "a", "reasoning": "r"}),
        chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
        chunk(None, usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
    ]:
        acc.add(c)
    completion = acc.completion()
    ChatCompletion.model_validate(completion)
    message = completion["choices"][0]["message"]
    assert message["content"] == "a" and message["reasoning_content"] == "r"
    assert message["tool_calls"] == [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert completion["usage"]["total_tokens"] == 3


_piece = st.sampled_from(["<think>", "</think>", "<", "think", ">", "/", "\n", " ", "a", "bc", "Hé", "<th", "ink>"])


@given(
    pieces=st.lists(_piece, max_size=25),
    reasoning=st.lists(st.sampled_from(["r", " ", "\n", "x y"]), max_size=3),
    cuts=st.lists(st.integers(0, 200), max_size=10),
    finish=st.sampled_from(["stop", "length"]),
)
@settings(max_examples=300, deadline=None)
def test_any_chunking_streams_exactly_the_final_response(pieces, reasoning, cuts, finish):
    content = "".join(pieces)
    bounds = sorted({0, len(content), *(c for c in cuts if c < len(content))})
    chunks = [chunk({"reasoning_content": r}) for r in reasoning]
    chunks += [chunk({"content": content[a:b]}) for a, b in zip(bounds, bounds[1:])]
    chunks.append(chunk({}, finish))
    run(chunks, validate=False)


_event = st.one_of(
    st.tuples(st.just("content"), st.sampled_from(["a", " b", "\n", "<think>", "x</think>", "Hé ", "  "])),
    st.tuples(st.just("reasoning_content"), st.sampled_from(["r", " s", "\n"])),
    st.tuples(st.just("refusal"), st.sampled_from(["no", " way"])),
    st.tuples(st.just("call"), st.integers(0, 2)),
    st.tuples(st.just("args"), st.sampled_from(['{"a"', ": 1}", "{}"])),
)


@given(script=st.lists(_event, max_size=20), finish=st.sampled_from(["stop", "length", "tool_calls"]))
@settings(max_examples=400, deadline=None)
def test_any_mix_of_text_reasoning_calls_and_refusal_streams_a_consistent_response(script, finish):
    """Text after tool calls, reasoning after text, refusals: the events always validate, items are
    added and done in order, and every done item is the final response's item."""
    chunks, started, current = [], set(), None
    for kind, value in script:
        if kind == "call":
            if value not in started:
                started.add(value)
                current = value
                chunks.append(
                    chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": value,
                                    "id": f"call_{value}",
                                    "type": "function",
                                    "function": {"name": f"f{value}", "arguments": ""},
                                }
                            ]
                        }
                    )
                )
        elif kind == "args":
            if current is not None:
                chunks.append(chunk({"tool_calls": [{"index": current, "function": {"arguments": value}}]}))
        else:
            chunks.append(chunk({kind: value}))
    chunks.append(chunk({}, finish))
    run(chunks)


def test_text_after_a_tool_call_is_a_new_message_after_it():
    events = run(
        [
            chunk({"content": "Let me look."}),
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ]
                }
            ),
            chunk({"content": "\nDone"}),
            chunk({"content": " now."}),
            chunk({}, "tool_calls"),
        ]
    )
    output = events[-1]["response"]["output"]
    assert [(i["type"], i.get("arguments") or i["content"][0]["text"]) for i in output] == [
        ("message", "Let me look."),
        ("function_call", "{}"),
        ("message", "Done now."),
    ]


def test_refusal_streams_as_a_refusal_part():
    events = run(
        [chunk({"content": "Hm."}), chunk({"refusal": "I can't"}), chunk({"refusal": " help."}), chunk({}, "stop")]
    )
    (item,) = events[-1]["response"]["output"]
    assert item["content"] == [
        {"type": "output_text", "text": "Hm.", "annotations": [], "logprobs": []},
        {"type": "refusal", "refusal": "I can't help."},
    ]
    assert [e["refusal"] for e in events if e["type"] == "response.refusal.done"] == ["I can't help."]


def test_accumulator_reads_choice_0_only_and_keeps_call_ids_unique():
    acc = ChunkAccumulator()
    for c in [
        {"choices": [{"index": 1, "delta": {"content": "other"}}, {"index": 0, "delta": {"content": "mine"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "call_0", "function": {"name": "f", "arguments": "{}"}},
                            {"index": 1, "id": "call_0", "function": {"name": "g", "arguments": "{}"}},
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {"index": 1, "delta": {}, "finish_reason": "length"},
                {"index": 0, "delta": {}, "finish_reason": "tool_calls"},
            ]
        },
    ]:
        acc.add(c)
    message = acc.completion()["choices"][0]["message"]
    assert message["content"] == "mine" and acc.finish_reason == "tool_calls"
    ids = [tc["id"] for tc in message["tool_calls"]]
    assert ids[0] == "call_0" and ids[1] != "call_0" and ids[1].startswith("call_")


def test_a_servers_own_prompt_token_ids_are_not_a_training_record():
    """vLLM's return_token_ids (asked for by extra_body, not by gymserve) puts prompt_token_ids at
    the top level: without generation fields it is the server's metadata, not half a record."""
    events = run([chunk({"content": "hi"}, prompt_token_ids=[1, 2]), chunk({}, "stop")])
    assert "prompt_token_ids" not in events[-1]["response"]["output"][-1]
    completion = {
        "prompt_token_ids": [1, 2],
        "choices": [
            {"index": 0, "finish_reason": "stop", "token_ids": [5], "message": {"role": "assistant", "content": "hi"}}
        ],
    }
    assert "prompt_token_ids" not in chat_to_response(completion, REQUEST)["output"][-1]
