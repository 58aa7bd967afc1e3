"""One Responses-over-chat path: the same generation gives the same Response through the local
backend, the ray backend (its real routing class over an in-process replica: ``EngineReplica`` on
the same local backend, no Ray cluster) and a chat backend whose upstream answers with the local
backend's own chat completion (a real HTTP fake on 127.0.0.1).

Sampling params are pinned (temperature 0.5, top_p 0.9) and the request sends none: local and ray
must both echo the pinned values, as a Response echoes what ran.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, SamplingConfig, validate_config
from gymserve.convert import responses_to_chat
from gymserve.ray_cluster.backend import RayBackend
from helpers.fakes import ScriptedEngine
from helpers.inprocess_ray import ray_over
from helpers.spec import assert_valid_response

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
REQUEST = {"model": "policy", "input": "Weather in Paris?", "tools": TOOLS, "max_output_tokens": 64}
CONFIG = LocalBackendConfig(
    model="scripted",
    tool_parser="hermes",
    reasoning_parser="qwen3",
    sampling=SamplingConfig(temperature=0.5, top_p=0.9),
)


def _same(obj: Any) -> Any:
    """``obj`` without what differs between two calls by design: ids and timestamps."""
    if isinstance(obj, list):
        return [_same(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _same(v) for k, v in obj.items() if k not in ("id", "call_id", "created_at", "completed_at")}
    return obj


async def _ray_over(local: LocalBackend) -> RayBackend:
    return await ray_over(local, CONFIG)


def _chat_backend(start_server, answer: tuple[int, dict[str, Any]]):
    """A chat backend whose upstream (a fake chat server on 127.0.0.1) answers ``answer`` to every call."""
    server = start_server(lambda r: (answer[0], copy.deepcopy(answer[1])))
    return build_backend(
        validate_config({"backend": {"type": "chat", "base_urls": [server.url + "/v1"], "model": "policy"}})
    )


@pytest.mark.parametrize(
    "text",
    [
        "<think>The user wants the weather.</think>Checking.\n" + CALL,
        "Hello! How can I help?",
        "<think>Cut off mid-thought, this reasoning never",  # length-terminated (max_output_tokens below)
    ],
)
async def test_local_ray_and_chat_paths_give_the_same_response(tokenizer, servers, text):
    request = {**REQUEST, "max_output_tokens": 8} if "Cut off" in text else REQUEST
    engine = ScriptedEngine(tokenizer, text)
    engine.weight_version = "step-3"  # named on every path: the chat one passes the upstream's through
    local = LocalBackend(CONFIG, engine, tokenizer)
    ray = await _ray_over(local)
    ctx = RequestContext(session_id="s")
    by_local = await local.responses(request, ctx)
    by_ray = await ray.responses(request, ctx)
    assert (by_local["temperature"], by_local["top_p"]) == (0.5, 0.9)  # the pinned values, echoed
    assert _same(by_ray) == _same(by_local)
    # A chat server that answers what the local backend answers to the chat request this Responses
    # request becomes; asked with the values that ran.
    ran = {**request, "temperature": 0.5, "top_p": 0.9}
    completion = await local.chat(responses_to_chat(ran, local.convert_options()), ctx)
    chat = _chat_backend(servers, (200, completion))
    by_chat = await chat.responses(ran, ctx)
    assert _same(by_chat) == _same(by_local)
    assert_valid_response(by_local)
    await chat.close()
    await ray.close()


async def test_text_after_a_tool_call_keeps_its_place_through_ray(tokenizer):
    """The order a ChatCompletion cannot express survives the replica hop (chunks cross, not a completion)."""
    local = LocalBackend(CONFIG, ScriptedEngine(tokenizer, CALL + "\nI asked for the weather."), tokenizer)
    ray = await _ray_over(local)
    by_local = await local.responses(REQUEST, RequestContext())
    by_ray = await ray.responses(REQUEST, RequestContext())
    assert [item["type"] for item in by_local["output"]] == ["function_call", "message"]
    assert _same(by_ray) == _same(by_local)
    await ray.close()


async def test_context_overflow_is_the_same_empty_response_on_every_path(tokenizer, servers):
    engine = ScriptedEngine(tokenizer, "Hi")
    engine.context_window = 8
    local = LocalBackend(CONFIG, engine, tokenizer)
    ray = await _ray_over(local)
    chat = _chat_backend(
        servers, (400, {"object": "error", "message": "This model's maximum context length is 8 tokens", "code": 400})
    )
    request = {**REQUEST, "input": "a long question " * 10, "temperature": 0.5, "top_p": 0.9}
    answers = [await backend.responses(request, RequestContext()) for backend in (local, ray, chat)]
    assert answers[0]["status"] == "incomplete" and answers[0]["output"] == []
    assert answers[0]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert _same(answers[1]) == _same(answers[0]) == _same(answers[2])
    await chat.close()
    await ray.close()
