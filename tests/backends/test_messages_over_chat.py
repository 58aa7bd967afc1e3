"""One Messages-over-chat path (``backends.messages_over_chat``): the same generation gives the same
Message through the local backend, the ray backend (its real routing class over an in-process
replica) and a chat backend whose upstream answers the local backend's own chat completion (a real
HTTP fake on 127.0.0.1); streamed (local, chat), the events fold into the same Message; an overflow ends the
rollout cleanly; a stream that breaks after its first event ends with Anthropic's error event."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.backends.chat_wire import completion_to_chunks
from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, SamplingConfig, validate_config
from gymserve.convert.messages_to_chat import messages_to_chat
from gymserve.errors import InvalidRequestError
from helpers.fakes import RawServer, ScriptedEngine, sse
from helpers.inprocess_ray import ray_over
from helpers.messages import assemble

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
REQUEST = {
    "model": "policy",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": [WEATHER],
}
CONFIG = LocalBackendConfig(
    model="scripted", tool_parser="hermes", reasoning_parser="qwen3", sampling=SamplingConfig(temperature=0.5)
)


def _same(obj: Any) -> Any:
    """``obj`` without what differs between two calls by design: ids."""
    if isinstance(obj, list):
        return [_same(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _same(v) for k, v in obj.items() if k != "id"}
    return obj


def _chat_backend(start_server, answer: tuple[int, dict[str, Any]], url: str | None = None):
    """A chat backend whose upstream answers ``answer`` to every call, its chunks when asked to
    stream (or whose upstream is at ``url``)."""

    def handle(r):
        if answer[0] == 200 and r.body.get("stream"):
            return sse(completion_to_chunks(copy.deepcopy(answer[1])))
        return answer[0], copy.deepcopy(answer[1])

    if url is None:
        url = start_server(handle).url
    config = {"type": "chat", "base_urls": [url + "/v1"], "model": "policy", "max_retries": 0, "timeout": 10}
    return build_backend(validate_config({"backend": config}))


async def _streamed(backend, request) -> list[dict[str, Any]]:
    return [event async for event in backend.messages_stream({**request, "stream": True}, RequestContext())]


@pytest.mark.parametrize(
    "text, stop",
    [
        ("<think>The user wants the weather.</think>Checking.\n" + CALL, "tool_use"),
        ("Hello! How can I help?", "end_turn"),
        ("<think>Cut off mid-thought, this reasoning never", "max_tokens"),
    ],
)
async def test_local_ray_and_chat_paths_give_the_same_message(tokenizer, servers, text, stop):
    request = {**REQUEST, "max_tokens": 8} if "Cut off" in text else REQUEST
    engine = ScriptedEngine(tokenizer, text)
    engine.weight_version = "step-3"  # named on every path: the chat one passes the upstream's through
    local = LocalBackend(CONFIG, engine, tokenizer)
    ray = await ray_over(local, CONFIG)
    ctx = RequestContext(session_id="s")
    by_local = await local.messages(request, ctx)
    assert by_local["stop_reason"] == stop
    assert _same(await ray.messages(request, ctx)) == _same(by_local)
    completion = await local.chat(messages_to_chat(request, local.convert_options()), ctx)
    chat = _chat_backend(servers, (200, completion))
    assert _same(await chat.messages(request, ctx)) == _same(by_local)
    # Streamed, the events fold into the same Message (Ray streams the replica's own chunks, which
    # an in-process actor cannot: a Ray streaming generator needs a cluster).
    for backend in (local, chat):
        assert _same(assemble(await _streamed(backend, request))) == _same(by_local), backend.name
    await chat.close()
    await ray.close()


async def test_a_tool_call_message_has_the_blocks_and_training_fields(tokenizer):
    local = LocalBackend(CONFIG, ScriptedEngine(tokenizer, "<think>Plan.</think>Checking.\n" + CALL), tokenizer)
    message = await local.messages(REQUEST, RequestContext())
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["thinking"] == "Plan." and message["content"][1]["text"] == "Checking."
    tool = message["content"][2]
    assert (tool["name"], tool["input"]) == ("get_weather", {"city": "Paris"}) and tool["id"].startswith("call_")
    # Every sampled token, the <|im_end|> that ended the turn included (a training token, as in vLLM).
    generated = tokenizer.encode("<think>Plan.</think>Checking.\n" + CALL + "<|im_end|>", add_special_tokens=False)
    assert message["generation_token_ids"] == generated and len(message["generation_log_probs"]) == len(generated)
    assert message["usage"]["output_tokens"] == len(generated)
    assert message["usage"]["input_tokens"] == len(message["prompt_token_ids"])


async def test_context_overflow_is_the_same_empty_message_on_every_path(tokenizer, servers):
    engine = ScriptedEngine(tokenizer, "Hi")
    engine.context_window = 8
    local = LocalBackend(CONFIG, engine, tokenizer)
    ray = await ray_over(local, CONFIG)
    chat = _chat_backend(
        servers, (400, {"object": "error", "message": "This model's maximum context length is 8 tokens", "code": 400})
    )
    request = {**REQUEST, "messages": [{"role": "user", "content": "a long question " * 10}]}
    answers = [await backend.messages(request, RequestContext()) for backend in (local, ray, chat)]
    assert answers[0]["content"] == [] and answers[0]["stop_reason"] == "model_context_window_exceeded"
    assert _same(answers[1]) == _same(answers[0]) == _same(answers[2])
    streamed = assemble(await _streamed(local, request))
    assert streamed["content"] == [] and streamed["stop_reason"] == "model_context_window_exceeded"
    await chat.close()
    await ray.close()


async def test_a_rejected_request_fails_before_the_first_event(tokenizer):
    pinned = CONFIG.model_copy(update={"sampling": SamplingConfig(temperature=0.5, pin="reject")})
    local = LocalBackend(pinned, ScriptedEngine(tokenizer, "Hi"), tokenizer)
    events = aiter(local.messages_stream({**REQUEST, "stream": True, "temperature": 0.9}, RequestContext()))
    with pytest.raises(InvalidRequestError) as exc:
        await anext(events)
    assert exc.value.param == "temperature" and "pinned" in exc.value.message


async def test_a_stream_that_breaks_ends_with_an_error_event(servers):
    raw = RawServer("stream_drop")
    try:
        chat = _chat_backend(servers, (200, {}), url=raw.url)
        events = await _streamed(chat, REQUEST)
        assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
        assert raw.url.split("//")[1] in events[-1]["error"]["message"]  # names where it failed
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        assert text == "partial answer"
        await chat.close()
    finally:
        raw.stop()


async def test_clouds_answer_messages_through_their_chat_api(openai_fake, azure_fake):
    """OpenAI and Azure (``api: chat``) serve /v1/messages through their Chat Completions API, as
    clouds take it: no training fields in the history, ``max_completion_tokens``."""
    from helpers.fakes import AZURE_VERSION, CLOUD_KEY

    tokens = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]}
    request = {
        "model": "ignored",
        "max_tokens": 16,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", **tokens},
            {"role": "user", "content": "Again?"},
        ],
    }
    openai_backend = {"type": "openai", "base_url": openai_fake.url + "/v1", "api_key": CLOUD_KEY, "model": "gpt-test"}
    azure = {"type": "azure", "endpoint": azure_fake.url, "api_key": CLOUD_KEY, "api_version": AZURE_VERSION}
    for config, fake, text in (
        (openai_backend, openai_fake, "hello from openai"),
        ({**azure, "deployment": "dep"}, azure_fake, "hello from azure chat"),
    ):
        backend = build_backend(validate_config({"backend": {**config, "max_retries": 0}}))
        try:
            message = await backend.messages(request, RequestContext())
        finally:
            await backend.close()
        assert message["content"] == [{"type": "text", "text": text}] and message["stop_reason"] == "end_turn"
        sent = [r for r in fake.requests if r.path.endswith("/chat/completions")][-1].body
        assert sent["max_completion_tokens"] == 16 and "max_tokens" not in sent
        assert sent["messages"][1] == {"role": "assistant", "content": "Hello."}  # training fields stripped
