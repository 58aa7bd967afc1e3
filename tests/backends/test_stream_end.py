"""``StreamEnd``: the terminal event each streamed API ends with (issue #26)."""

from __future__ import annotations

import pytest

from gymserve.backends.stream_end import StreamEnd


def _chunk(index: int, finish: str | None) -> dict:
    return {"choices": [{"index": index, "delta": {"content": "x"}, "finish_reason": finish}]}


def _ended(kind: str, events: list[dict]) -> StreamEnd:
    end = StreamEnd(kind)
    for event in events:
        end.see(event)
    return end


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_chat_and_completions_need_a_finish_reason_for_every_choice(kind):
    assert _ended(kind, [_chunk(0, None), _chunk(0, "stop")]).complete
    assert _ended(kind, [_chunk(0, None), _chunk(0, "stop"), {"choices": [], "usage": {}}]).complete
    cut = _ended(kind, [_chunk(0, None), _chunk(1, None), _chunk(0, "stop")])  # n=2, choice 1 cut
    assert not cut.complete and cut.expected == "a finish_reason for choice 1"
    assert not _ended(kind, [_chunk(0, None)]).complete
    assert not _ended(kind, [{"choices": [], "usage": {}}]).complete  # no choice at all


@pytest.mark.parametrize(
    ("kind", "terminal"),
    [
        ("responses", "response.completed"),
        ("responses", "response.incomplete"),
        ("responses", "response.failed"),
        ("responses", "error"),
        ("messages", "message_stop"),
        ("messages", "error"),
    ],
)
def test_event_streams_need_their_terminal_event(kind, terminal):
    start = {"type": "response.created"} if kind == "responses" else {"type": "message_start"}
    assert _ended(kind, [start, {"type": terminal}]).complete
    cut = _ended(kind, [start])
    assert not cut.complete and ("response.completed" in cut.expected or cut.expected == "message_stop")


def test_kinds_that_are_not_streamed_count_as_complete():
    assert _ended("tokenize", []).complete
