"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` behind the real HTTP server, driven by
the official anthropic SDK (streaming helpers included): over the local backend (tiny model) and
over a chat backend whose upstream is another gymserve on the local backend. The training fields,
multi-turn token contiguity through the SDK, and Anthropic's error shapes and statuses."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig, validate_config
from gymserve.server.run import start_background_server

TRAINING = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _local(model_dir, sampling: SamplingConfig | None = None, **server):
    cfg = GymserveConfig(
        server=ServerConfig(port=0, **server),
        backend=LocalBackendConfig(
            model=str(model_dir), sampling=sampling or SamplingConfig(seed=1234), context_window=512
        ),
    )
    return start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))


def _client(srv, key: str = "unused") -> anthropic.Anthropic:
    # The anthropic SDK appends /v1/messages to its base URL itself.
    return anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = _local(tiny_model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def front(server):
    """A gymserve on the chat backend whose upstream is ``server`` (another gymserve)."""
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {"type": "chat", "base_urls": [server.base_url], "model": "tiny", "max_retries": 0},
        }
    )
    srv = start_background_server(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def _fields(obj) -> tuple[list[int], list[int], list[float]]:
    extra = obj.model_extra
    return extra["prompt_token_ids"], extra["generation_token_ids"], extra["generation_log_probs"]


def test_a_message_carries_the_training_fields(client, tokenizer):
    m = client.messages.create(
        model="tiny", max_tokens=6, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    p, g, lp = _fields(m)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert p == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert len(g) == len(lp) == 6 and m.stop_reason == "max_tokens"
    assert m.usage.input_tokens == len(p) and m.usage.output_tokens == 6
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert "".join(b.text for b in m.content if b.type == "text") == tokenizer.decode(g)
    assert isinstance(m.model_extra["weight_version"], int)


def test_streamed_and_non_streamed_messages_agree(client):
    """The pinned seed makes both calls sample the same tokens; the SDK's stream helper assembles the
    Message the non-streamed call returns, and the training fields ride on message_delta."""
    ask = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Tell me a story."}]}
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "message_delta":
                deltas.append(event)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds.count("message_delta") == 1
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert _fields(deltas[0]) == _fields(whole)


def _contiguous_turns(client, *, stream: bool) -> list[int]:
    """Three turns sent back as a harness with the SDK would: the Message as the assistant message,
    its training fields beside role and content. Returns the last prompt."""
    messages: list[dict] = [{"role": "user", "content": "Tell me something."}]
    prev = None
    for turn in range(3):
        ask = {"model": "tiny", "max_tokens": 8, "messages": messages}
        if stream:
            with client.messages.stream(**ask) as s:
                delta = [e for e in s if e.type == "message_delta"][-1]
                reply = s.get_final_message()
            fields = {k: delta.model_extra[k] for k in TRAINING}
        else:
            reply = client.messages.create(**ask)
            fields = {k: reply.model_extra[k] for k in TRAINING}
        p, g = fields["prompt_token_ids"], fields["generation_token_ids"]
        if prev is not None:
            assert p[: len(prev[0]) + len(prev[1])] == prev[0] + prev[1], f"turn {turn} is not contiguous"
        prev = (p, g)
        messages += [{**reply.to_param(), **fields}, {"role": "user", "content": f"And turn {turn + 2}?"}]
    return prev[0]


@pytest.mark.parametrize("stream", [False, True])
def test_three_turns_stay_token_contiguous(client, stream):
    assert len(_contiguous_turns(client, stream=stream)) > 60


def test_three_turns_stay_token_contiguous_through_a_chat_backend(front):
    """Messages → chat on the front gymserve; the upstream gymserve splices the chat history."""
    assert len(_contiguous_turns(_client(front), stream=False)) > 60


def test_tool_use_round_trip_keeps_the_splice(client, tokenizer):
    """A tool_use the harness sends back with its fields and a tool_result: the next prompt extends
    the previous prompt + generation, then renders the tool result."""
    first = client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Weather?"}])
    p, g, lp = _fields(first)
    call = {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [*first.to_param()["content"], call],
            "prompt_token_ids": p,
            "generation_token_ids": g,
            "generation_log_probs": lp,
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"}]},
    ]
    second = client.messages.create(model="tiny", max_tokens=2, messages=messages)
    p2 = _fields(second)[0]
    assert p2[: len(p) + len(g)] == p + g
    assert "18 C" in tokenizer.decode(p2[len(p) + len(g) :])


def test_count_tokens_is_the_prompt_generation_sees(client):
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "system": "Be brief."}
    counted = client.messages.count_tokens(**ask)
    made = client.messages.create(max_tokens=1, **ask)
    assert counted.input_tokens == len(_fields(made)[0]) == made.usage.input_tokens
    # A prompt that fills the window is still counted (the engine would refuse to generate).
    long = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "word " * 600}])
    assert long.input_tokens > 512


def test_count_tokens_on_a_chat_backend_is_501_in_anthropic_shape(front):
    with pytest.raises(anthropic.APIStatusError) as exc:
        _client(front).messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hello"}])
    assert exc.value.status_code == 501
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "api_error"
    assert "local backend" in exc.value.body["error"]["message"]


def test_context_overflow_ends_the_rollout_cleanly(client):
    m = client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "word " * 600}])
    assert m.stop_reason == "model_context_window_exceeded" and m.content == [] and m.usage.output_tokens == 0
    with client.messages.stream(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": "word " * 600}]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "model_context_window_exceeded" and final.content == []


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "ask, extra, words",
    [
        (
            {
                "max_tokens": 4,
                "tool_choice": {"type": "any"},
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            },
            None,
            "cannot be enforced",
        ),
        ({"max_tokens": 0}, None, "out of range"),
        ({"max_tokens": 4}, {"n": 2}, "send n requests"),
    ],
)
def test_refusals_are_anthropic_400s(client, ask, extra, words):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="tiny", messages=[{"role": "user", "content": "x"}], extra_body=extra, **ask)
    body = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert words in body["error"]["message"]


def test_a_pinned_server_refuses_a_messages_temperature(tiny_model_dir):
    """Sampling is per request unless the server pins it (``--pin-sampling``); a pinned server refuses a
    request's own temperature with Anthropic's 400 rather than sampling from a policy it did not ask for."""
    srv = _local(tiny_model_dir, sampling=SamplingConfig(seed=1234, temperature=1.0, pin="reject"))
    try:
        with pytest.raises(anthropic.BadRequestError) as exc:
            _client(srv).messages.create(
                # temperature is a Messages field this SDK release no longer names: extra_body.
                model="tiny",
                max_tokens=4,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"temperature": 0.3},
            )
    finally:
        srv.stop()
    body = exc.value.body
    assert body["error"]["type"] == "invalid_request_error" and "pinned" in body["error"]["message"], body


def _error(root: str, path: str, body: dict) -> str:
    r = httpx.post(root + path, json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    return r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_errors_after_the_conversion_name_the_messages_fields(server, path):
    """The engine, template and splice check the chat request Messages became, where a system prompt
    is one more message and consecutive user messages are one: their errors still name the message
    the caller sent (messages[1], not the chat request's messages[2]) and its fields."""
    bad = {
        "role": "assistant",
        "content": "ok",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [10**9],
        "generation_log_probs": [-0.1],
    }
    root = server.base_url.removesuffix("/v1")
    user = {"role": "user", "content": "a"}
    asked = {"max_tokens": 3} if path == "/v1/messages" else {}
    with_system = _error(root, path, {**asked, "system": "S", "messages": [user, bad, user]})
    assert with_system.startswith("messages[1].generation_token_ids holds token id 1000000000"), with_system
    merged = _error(root, path, {**asked, "messages": [user, user, bad, user]})
    assert merged.startswith("messages[2].generation_token_ids holds token id 1000000000"), merged
    if path == "/v1/messages":  # stop strings are applied now (engine.ending), so a Message comes back
        r = httpx.post(root + path, json={"model": "t", "max_tokens": 3, "messages": [user], "stop_sequences": ["x"]})
        assert r.status_code == 200, r.text


def test_a_user_message_without_content_blocks_is_refused_by_name(server):
    """An empty content list would vanish from the conversation; refused naming it, as Anthropic does."""
    root = server.base_url.removesuffix("/v1")
    message = _error(root, "/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": []}]})
    assert message.startswith("messages[0].content is an empty list"), message


def test_required_prefix_token_ids_binds_a_messages_call_too(client):
    """NeMo RL's required prefix is honoured on /v1/messages as on chat and Responses: a prefix the
    spliced prompt does not start with is a 400, never silently ignored; the right one is kept."""
    first = client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    p, g, lp = _fields(first)
    history = [
        {"role": "user", "content": "Hi"},
        {**first.to_param(), "prompt_token_ids": p, "generation_token_ids": g, "generation_log_probs": lp},
        {"role": "user", "content": "Again"},
    ]
    second = client.messages.create(
        model="tiny", max_tokens=2, messages=history, extra_body={"required_prefix_token_ids": p + g}
    )
    assert _fields(second)[0][: len(p) + len(g)] == p + g
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(
            model="tiny", max_tokens=2, messages=history, extra_body={"required_prefix_token_ids": [p[0] + 1]}
        )
    assert "required_prefix_token_ids" in exc.value.body["error"]["message"]


def test_raw_http_errors_are_in_anthropic_shape(server):
    root = server.base_url.removesuffix("/v1")
    for content, status, kind in (
        (b"{oops", 400, "invalid_request_error"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}', 400, "invalid_request_error"),
        (b"[1, 2]", 400, "invalid_request_error"),
        (
            b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            400,
            "invalid_request_error",
        ),
    ):
        r = httpx.post(root + "/v1/messages", content=content, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    r = httpx.get(root + "/v1/messages", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    # Other routes keep the OpenAI shape.
    r = httpx.post(root + "/v1/chat/completions", content=b"{oops", timeout=30)
    assert r.status_code == 400 and "type" not in r.json() and r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_too_large_is_request_too_large(tiny_model_dir):
    srv = _local(tiny_model_dir, max_body_bytes=2048)
    try:
        with pytest.raises(anthropic.APIStatusError) as exc:
            _client(srv).messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x" * 4000}])
        assert exc.value.status_code == 413 and exc.value.body["error"]["type"] == "request_too_large"
    finally:
        srv.stop()


def test_the_server_key_is_taken_as_x_api_key(tiny_model_dir):
    """Anthropic's header (``x-api-key``) and the Bearer form recent anthropic SDKs send both work;
    a wrong key is Anthropic's 401."""
    srv = _local(tiny_model_dir, api_key="s3cret-key")
    root = srv.base_url.removesuffix("/v1")
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    try:
        for headers, status in (
            ({"x-api-key": "s3cret-key", "anthropic-version": "2023-06-01"}, 200),
            ({"x-api-key": "wrong"}, 401),
            ({}, 401),
        ):
            r = httpx.post(root + "/v1/messages", json=body, headers=headers, timeout=60)
            assert r.status_code == status, r.text
            if status == 401:
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
                assert "x-api-key" in r.json()["error"]["message"]
        with pytest.raises(anthropic.AuthenticationError):
            _client(srv, key="wrong").messages.create(**body)
        assert _client(srv, key="s3cret-key").messages.create(**body).usage.output_tokens == 1
    finally:
        srv.stop()


def test_a_stream_broken_upstream_raises_in_the_sdk(tiny_model_dir):
    """A chat upstream that drops the connection mid-stream: the 200 stream ends with Anthropic's
    error event, which the SDK raises."""
    from helpers.fakes import RawServer

    raw = RawServer("stream_drop")
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {"type": "chat", "base_urls": [raw.url + "/v1"], "model": "p", "max_retries": 0},
        }
    )
    srv = start_background_server(cfg)
    try:
        with pytest.raises(anthropic.APIStatusError) as exc:
            with _client(srv).messages.stream(
                model="p", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            ) as s:
                s.get_final_message()
        assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "api_error"
    finally:
        srv.stop()
        raw.stop()


def test_openapi_documents_the_messages_routes(server):
    doc = httpx.get(server.base_url.removesuffix("/v1") + "/openapi.json", timeout=60).json()
    create = doc["paths"]["/v1/messages"]["post"]
    schema = create["requestBody"]["content"]["application/json"]["schema"]
    branch = doc["components"]["schemas"][schema["anyOf"][0]["$ref"].rsplit("/", 1)[1]]
    assert {"max_tokens", "messages", "model"} <= set(branch["required"])
    assert {"temperature", "top_k", "tools", "tool_choice", "stop_sequences", "system"} <= set(branch["properties"])
    assert "529" in create["responses"]
    assert "/v1/messages/count_tokens" in doc["paths"]


def test_the_messages_schema_is_generated_from_the_installed_sdk():
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        import gen_messages_schema
    finally:
        sys.path.pop(0)
    assert gen_messages_schema.OUT.read_text(encoding="utf-8") == gen_messages_schema.build(), (
        "src/gymserve/server/messages_schema.json is out of date: run python scripts/gen_messages_schema.py"
    )
