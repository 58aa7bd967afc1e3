"""Anthropic's tool pairing rules on ``/v1/messages`` (issue #26, symptom 5): a ``tool_use`` not
answered in the next user turn, a ``tool_result`` without its ``tool_use``, or a ``tool_result``
after other content is a 400 ``invalid_request_error`` in Anthropic's error shape naming the block,
on every backend, before anything is sent upstream."""

from __future__ import annotations

import httpx
import pytest

from gymserve.convert.tool_pairing import check_tool_pairing
from gymserve.errors import InvalidRequestError
from helpers.fakes import CLOUD_KEY, ChatScript, FakeServer, anthropic_handler
from helpers.servers import gateway

CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
CALL2 = {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}


def result(call_id: str, text: str = "sunny") -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": text}


def convo(*turns: dict) -> list[dict]:
    return [{"role": "user", "content": "weather?"}, *turns]


def asst(*blocks: dict) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, *blocks]}


def user(content) -> dict:
    return {"role": "user", "content": content}


BROKEN = [
    # A tool_use answered by a user turn without its tool_result.
    (convo(asst(CALL), user("and tomorrow?")), "messages[1].content[1]", "toolu_1"),
    (convo(asst(CALL, CALL2), user([result("toolu_1")])), "messages[1].content[2]", "toolu_2"),
    # A tool_result whose tool_use_id matches no call of the assistant turn before it.
    (convo(asst(CALL), user([result("toolu_1"), result("toolu_9")])), "messages[2].content[1].tool_use_id", "toolu_9"),
    (convo(user([result("toolu_1")])), "messages[1].content[0].tool_use_id", "toolu_1"),
    # A tool_result after other content in its turn.
    (
        convo(asst(CALL), user([{"type": "text", "text": "here:"}, result("toolu_1")])),
        "messages[2].content[1]",
        "first",
    ),
    # Answered two turns later, not in the next one.
    (
        convo(asst(CALL), user("wait"), asst(), user([result("toolu_1")])),
        "messages[1].content[1]",
        "toolu_1",
    ),
]


@pytest.mark.parametrize(("messages", "param", "words"), BROKEN)
def test_broken_pairings_are_refused_naming_the_block(messages, param, words):
    with pytest.raises(InvalidRequestError) as info:
        check_tool_pairing(messages)
    assert (
        info.value.param == param
        and words in info.value.message
        and param.split(".tool_use_id")[0] in (info.value.message)
    )


@pytest.mark.parametrize(
    "messages",
    [
        convo(asst(CALL), user([result("toolu_1"), {"type": "text", "text": "and tomorrow?"}])),
        convo(asst(CALL, CALL2), user([result("toolu_2"), result("toolu_1")])),
        convo(asst(CALL), user([result("toolu_1")]), user("also this")),  # consecutive user messages: one turn
        convo(asst(CALL)),  # the last turn: nothing answers it yet
        convo(asst(), user("thanks")),
    ],
)
def test_valid_pairings_pass(messages):
    check_tool_pairing(messages)


def _chat_upstream():
    return FakeServer(ChatScript(name="up"))


def _anthropic_upstream():
    return FakeServer(anthropic_handler(CLOUD_KEY, model="claude-test"))


@pytest.mark.parametrize("kind", ["chat", "anthropic"])
@pytest.mark.parametrize("route", ["/messages", "/messages/count_tokens"])
def test_every_backend_answers_anthropics_400_before_calling_upstream(kind, route):
    upstream = _chat_upstream() if kind == "chat" else _anthropic_upstream()
    with upstream as s:
        backend = (
            {"type": "chat", "base_urls": [s.url + "/v1"], "model": "policy", "health_check_interval": 0}
            if kind == "chat"
            else {"type": "anthropic", "base_url": s.url, "api_key": CLOUD_KEY, "model": "claude-test"}
        )
        with gateway(backend) as srv:
            before = len([r for r in s.requests if r.method == "POST"])
            messages = convo(asst(CALL), user("and tomorrow?"))
            body = {"model": "claude-test", "messages": messages}
            if route == "/messages":
                body["max_tokens"] = 16
            r = httpx.post(srv.base_url + route, json=body, timeout=10)
            assert r.status_code == 400, r.text
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            assert "messages[1].content[1]" in r.json()["error"]["message"]
            assert len([r for r in s.requests if r.method == "POST"]) == before
            # The same conversation with its tool_result goes through.
            fixed = convo(asst(CALL), user([result("toolu_1")]))
            ok = httpx.post(srv.base_url + route, json={**body, "messages": fixed}, timeout=10)
            assert ok.status_code in (200, 501), ok.text  # count_tokens over chat may be unsupported
