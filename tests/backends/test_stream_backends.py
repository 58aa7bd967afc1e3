"""Streaming over every backend, through a real gymserve HTTP server, driven by the official openai
SDK's streaming helpers (``client.responses.stream``, ``client.chat.completions.stream``): the
accumulated result equals the non-streamed call for the same request.

- fake OpenAI and Azure clouds that stream (``fakes.py``; URL, api-version and auth checked as the
  clouds do): native Responses events passed through untouched, chat chunks turned into events;
- a real ``transformers serve`` chat server (``real_model``; greedy, a few tokens);
- the local backend with a scripted engine that emits the token IDs of a fixed text (real
  tokenizer): tool calls and reasoning parsed incrementally;
- a client that disconnects cancels the engine's generation (scripted engine, and the real
  ``TransformersEngine`` on the tiny model);
- an upstream that drops the connection mid-stream ends the stream with ``response.failed`` / an
  error the SDK raises, within the timeouts, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import httpx
import openai
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, SamplingConfig, validate_config
from gymserve.server.run import start_background_server
from helpers.fakes import AZURE_VERSION, CLOUD_KEY, FakeServer, RawServer, ScriptedEngine, response_events, response_obj
from helpers.spec import assert_valid_event

KEY, VERSION = CLOUD_KEY, AZURE_VERSION
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
WAIT = 10.0  # the longest any single wait in this file may take


def _server_config(backend: dict[str, Any]):
    return validate_config({"server": {"port": 0}, "backend": backend})


def _sdk(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=WAIT * 3)


def _strip_ids(obj: Any) -> Any:
    """``obj`` without what differs between two calls by design: ids, call ids, timestamps (and the
    ``parsed`` field the SDK's stream helper adds to output text)."""
    if isinstance(obj, list):
        return [_strip_ids(x) for x in obj]
    if isinstance(obj, dict):
        return {
            k: _strip_ids(v)
            for k, v in obj.items()
            if k not in ("id", "call_id", "created_at", "completed_at", "created", "parsed", "parsed_arguments")
        }
    return obj


def responses_both(client: openai.OpenAI, **kwargs) -> tuple[dict, list, dict]:
    """(non-streamed response, streamed events, the final response of the last event) as dicts."""
    full = client.responses.create(**kwargs).model_dump(exclude_none=False)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response.model_dump(exclude_none=False, warnings=False)
    if events[-1].type == "response.completed":
        with client.responses.stream(**kwargs) as stream:
            assert _strip_ids(stream.get_final_response().model_dump(warnings=False)) == _strip_ids(full)
    return full, events, final


def chat_both(client: openai.OpenAI, **kwargs) -> tuple[Any, Any, list]:
    """(non-streamed completion, the chat stream helper's final completion, the raw chunks)."""
    full = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError as exc:  # the helper refuses to "parse" a cut answer
            final = exc.completion
    return full, final, chunks


def assert_events_valid(events) -> None:
    for e in events:
        assert_valid_event(e.model_dump(exclude_unset=True, warnings=False) if hasattr(e, "model_dump") else e)


# ======================================================================== fake clouds
def _cloud(kind: str, openai_fake, azure_fake) -> tuple[FakeServer, dict[str, Any]]:
    if kind == "openai":
        return openai_fake, {"type": "openai", "base_url": openai_fake.url + "/v1", "api_key": KEY, "model": "gpt-test"}
    api = kind.split("-")[1]
    return azure_fake, {
        "type": "azure",
        "endpoint": azure_fake.url,
        "api_key": KEY,
        "api_version": VERSION,
        "deployment": "dep",
        "api": api,
    }


def _assert_cloud_request(kind: str, rec, route: str) -> None:
    """The streamed request reached the URL the cloud serves, with its auth and api-version."""
    assert rec.method == "POST" and rec.body["stream"] is True
    if kind == "openai":
        assert rec.path == f"/v1/{route}" and rec.query == {} and rec.headers["authorization"] == f"Bearer {KEY}"
        return
    want = "/openai/responses" if route == "responses" else "/openai/deployments/dep/chat/completions"
    assert (rec.path, rec.query, rec.headers["api-key"]) == (want, {"api-version": VERSION}, KEY)
    assert "authorization" not in rec.headers
    if route == "responses":
        assert rec.body["model"] == "dep"


@pytest.mark.parametrize("kind", ["openai", "azure-responses", "azure-chat"])
def test_cloud_responses_stream_equals_non_streamed(kind, openai_fake, azure_fake):
    fake, backend = _cloud(kind, openai_fake, azure_fake)
    with start_background_server(_server_config(backend)) as srv:
        full, events, final = responses_both(_sdk(srv), model="x", input="hi")
    _assert_cloud_request(kind, fake.requests[-1], "chat/completions" if kind == "azure-chat" else "responses")
    assert final["status"] == "completed" and _strip_ids(final) == _strip_ids(full)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full["output"][-1]["content"][0]["text"] and text.startswith("hello from")
    if kind == "azure-chat":
        # Built by gymserve from the chat chunks: the whole lifecycle, valid against the spec.
        assert_events_valid(events)
        assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens"] == 1
    else:
        # Native events passed through as the cloud sent them: same types, same sequence numbers.
        sent = response_events(response_obj(text, model="x"))
        got = [(e.type, e.sequence_number) for e in events]
        assert got == [(e["type"], e["sequence_number"]) for e in sent]
        assert events[-1].response.id == fake_last_response_id(events)


def fake_last_response_id(events) -> str:
    """Passthrough keeps the upstream's response id on every event that carries the response."""
    ids = {e.response.id for e in events if getattr(e, "response", None) is not None}
    assert len(ids) == 1
    return ids.pop()


@pytest.mark.parametrize("kind", ["openai", "azure-chat"])
def test_cloud_chat_stream_equals_non_streamed(kind, openai_fake, azure_fake):
    fake, backend = _cloud(kind, openai_fake, azure_fake)
    with start_background_server(_server_config(backend)) as srv:
        full, final, chunks = chat_both(_sdk(srv), model="x", messages=[{"role": "user", "content": "hi"}])
    rec = fake.requests[-1]
    _assert_cloud_request(kind, rec, "chat/completions")
    assert rec.body["stream_options"] == {"include_usage": True}
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert final.choices[0].message.content == full.choices[0].message.content
    assert final.choices[0].finish_reason == full.choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


# ======================================================================== transformers serve
@pytest.mark.real_model
def test_transformers_serve_streams_equal_non_streamed(transformers_serve):
    """gymserve's chat backend in front of a real chat server: the Responses stream (built from
    its chat chunks) ends with the non-streamed response; the chat stream has the same text."""
    base_url, model = transformers_serve
    cfg = _server_config(
        {
            "type": "chat",
            "base_urls": base_url,
            "model": model,
            "served_model_name": "policy",
            "timeout": 120,
            "max_retries": 0,
        }
    )
    with start_background_server(cfg) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=180)
        full, events, final = responses_both(client, model="policy", input="Say hi", max_output_tokens=8, temperature=0)
        assert_events_valid(events)
        assert final["status"] in ("completed", "incomplete") and final["output"][-1]["type"] == "message"
        assert _strip_ids(final) == _strip_ids(full)
        assert (
            "".join(e.delta for e in events if e.type == "response.output_text.delta")
            == final["output"][-1]["content"][0]["text"]
        )
        msgs = [{"role": "user", "content": "Say hi"}]
        cfull, cfinal, _ = chat_both(client, model="policy", messages=msgs, max_tokens=8, temperature=0)
        assert cfinal.choices[0].message.content == cfull.choices[0].message.content
        assert cfull.choices[0].message.content
        assert cfinal.choices[0].finish_reason == cfull.choices[0].finish_reason
        assert cfinal.usage == cfull.usage


# ======================================================================== local backend, scripted engine
TOOL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_TEXT = "<think>\nThe user greets me; I greet back.\n</think>\n\nHello there, nice to meet you!"
RESP_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in RESP_TOOLS[0].items() if k != "type"}}]


@contextlib.contextmanager
def local_server(tokenizer, engine: ScriptedEngine, **options):
    options.setdefault("tool_parser", "hermes")
    config = LocalBackendConfig(model="scripted", sampling=SamplingConfig(temperature=0.0), **options)
    cfg = validate_config({"server": {"port": 0}, "backend": config.model_dump()})
    with start_background_server(cfg, backend_factory=lambda: LocalBackend(config, engine, tokenizer)) as srv:
        yield srv


@pytest.mark.parametrize(("model_type", "parser"), [("qwen2", "hermes"), ("mistral", "mistral")])
def test_auto_tool_parser_is_inferred_from_the_engines_model_type(tokenizer, model_type, parser):
    """``tool_parser: auto`` reads ``Engine.model_type``: the same Qwen template and an uninformative
    model name give ``hermes`` (template has <tool_call>) unless the model type says Mistral."""
    engine = ScriptedEngine(tokenizer, "Hi")
    engine.model_type = model_type
    backend = LocalBackend(LocalBackendConfig(model="scripted", tool_parser="auto"), engine, tokenizer)
    assert backend.tool_parser.name == parser


def test_local_tool_call_streams_argument_deltas(tokenizer):
    engine = ScriptedEngine(tokenizer, TOOL_TEXT)
    with local_server(tokenizer, engine) as srv:
        client = _sdk(srv)
        full, events, final = responses_both(client, model="t", input="Weather in Paris?", tools=RESP_TOOLS)
        cfull, cfinal, chunks = chat_both(
            client, model="t", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=CHAT_TOOLS
        )
    assert_events_valid(events)
    types = [e.type for e in events]
    # Responses: the function call's arguments arrive as delta(s), then .done; no tag text leaks.
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas and "".join(d.delta for d in deltas) == '{"city": "Paris"}'
    assert len(done) == 1 and done[0].arguments == '{"city": "Paris"}' and done[0].name == "get_weather"
    assert types.index("response.function_call_arguments.done") > max(
        i for i, t in enumerate(types) if t == "response.function_call_arguments.delta"
    )
    assert not any("tool_call" in e.delta for e in events if e.type == "response.output_text.delta")
    assert [it["type"] for it in final["output"]] == ["function_call"]
    assert final["output"][0]["name"] == "get_weather" and final["output"][0]["arguments"] == '{"city": "Paris"}'
    assert {d.output_index for d in deltas} == {0} and final["status"] == "completed"
    assert _strip_ids(final) == _strip_ids(full)
    for f in TOKEN_FIELDS:
        assert final["output"][-1][f] == full["output"][-1][f]
    # Chat: tool_calls deltas (id and name first, then argument pieces), no content with the tags.
    tc_deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(tc_deltas) >= 2 and tc_deltas[0].id and tc_deltas[0].function.name == "get_weather"
    assert all(tc.index == 0 for tc in tc_deltas)
    assert "".join(tc.function.arguments or "" for tc in tc_deltas) == '{"city": "Paris"}'
    assert not any("tool_call" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    msg = cfinal.choices[0].message
    assert cfinal.choices[0].finish_reason == cfull.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [
        (t.function.name, t.function.arguments) for t in cfull.choices[0].message.tool_calls
    ]
    assert not msg.content and not cfull.choices[0].message.content
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason).choices[0].delta.model_extra
    for f in TOKEN_FIELDS:
        assert last[f] == cfull.choices[0].message.model_extra[f]
    assert chunks[-1].usage == cfull.usage


def test_local_tool_call_arguments_arrive_as_they_are_generated(tokenizer):
    """Each generated token of the arguments is its own delta, on both endpoints."""
    engine = ScriptedEngine(tokenizer, TOOL_TEXT)
    args = '{"city": "Paris"}'
    with local_server(tokenizer, engine) as srv:
        client = _sdk(srv)
        with client.responses.stream(model="t", input="Weather in Paris?", tools=RESP_TOOLS) as stream:
            events = list(stream)
        _, _, chunks = chat_both(
            client, model="t", messages=[{"role": "user", "content": "Weather?"}], tools=CHAT_TOOLS
        )
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) == len(tokenizer.encode(args, add_special_tokens=False)) > 1 and "".join(pieces) == args
    chat_pieces = [
        tc.function.arguments
        for c in chunks
        if c.choices
        for tc in (c.choices[0].delta.tool_calls or [])
        if tc.function.arguments
    ]
    assert chat_pieces == pieces


def test_local_tool_call_cut_by_max_tokens_streams_the_same_incomplete_call(tokenizer):
    """A generation cut inside the arguments: the call keeps what was written, the item and the
    response are incomplete, and streamed equals non-streamed."""
    engine = ScriptedEngine(tokenizer, TOOL_TEXT)
    cut = len(tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city', add_special_tokens=False))
    with local_server(tokenizer, engine) as srv:
        full, events, final = responses_both(
            _sdk(srv), model="t", input="Weather?", tools=RESP_TOOLS, max_output_tokens=cut
        )
    assert_events_valid(events)
    assert [e.type for e in events][-1] == "response.incomplete"
    assert _strip_ids(final) == _strip_ids(full)
    (item,) = final["output"]
    assert item["type"] == "function_call" and item["status"] == "incomplete"
    assert item["arguments"] == '{"city' and final["incomplete_details"] == {"reason": "max_output_tokens"}


def assert_items_match_final(events) -> None:
    """Items are added at output_index 0, 1, 2… in order, each done before the next is added
    (except function calls of one batch, which stay open together: servers may interleave their
    arguments), and every output_item.done is exactly the final response's item at its index."""
    final = events[-1].response.model_dump(exclude_none=False, warnings=False)["output"]
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert added == list(range(len(final))) and sorted(e.output_index for e in done) == added
    order = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    for index in added:
        between = order[
            order.index(("response.output_item.added", index)) + 1 : order.index(("response.output_item.done", index))
        ]
        assert all(final[i]["type"] == final[index]["type"] == "function_call" for _, i in between), order

    def plain(obj):  # without the fields the SDK's stream helper adds to the final response
        if isinstance(obj, list):
            return [plain(x) for x in obj]
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items() if k not in ("parsed", "parsed_arguments")}
        return obj

    for e in done:
        assert plain(e.item.model_dump(exclude_none=False, warnings=False)) == plain(final[e.output_index])


TOOL2 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "parser", "items"),
    [
        # text after the call: a message after the function_call, as generated
        (
            TOOL_TEXT + "\nI checked the weather.",
            "hermes",
            [("function_call", '{"city": "Paris"}'), ("message", "I checked the weather.")],
        ),
        (
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\nDone.',
            "qwen2_5_coder",
            [("function_call", '{"city": "Paris"}'), ("message", "Done.")],
        ),
        # two calls in a row
        (
            TOOL_TEXT + "\n" + TOOL2,
            "hermes",
            [("function_call", '{"city": "Paris"}'), ("function_call", '{"city": "Rome"}')],
        ),
        # text before, between and after two calls
        (
            "A first.\n" + TOOL_TEXT + "\nmiddle\n" + TOOL2 + "\nlast",
            "hermes",
            [
                ("message", "A first."),
                ("function_call", '{"city": "Paris"}'),
                ("message", "middle"),
                ("function_call", '{"city": "Rome"}'),
                ("message", "last"),
            ],
        ),
    ],
)
def test_local_text_after_tool_calls_streams_in_generation_order(tokenizer, text, parser, items):
    engine = ScriptedEngine(tokenizer, text)
    with local_server(tokenizer, engine, tool_parser=parser) as srv:
        full, events, final = responses_both(_sdk(srv), model="t", input="Weather?", tools=RESP_TOOLS)
    assert_events_valid(events)
    assert_items_match_final(events)
    got = [
        (
            it["type"],
            it.get("arguments") or it["content"][0]["text"] if it["type"] == "message" else it.get("arguments"),
        )
        for it in final["output"]
    ]
    assert got == items
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == "".join(t for k, t in items if k == "message")  # every word streamed as a delta
    assert _strip_ids(final) == _strip_ids(full)


def test_local_context_overflow_is_the_same_response_streamed_or_not(tokenizer):
    engine = ScriptedEngine(tokenizer, "Hi")
    engine.context_window = 8
    with local_server(tokenizer, engine) as srv:
        full, events, final = responses_both(_sdk(srv), model="t", input="a long question " * 10)
    assert final["status"] == "incomplete" and final["output"] == [] and final["usage"]["total_tokens"] == 0
    assert _strip_ids(final) == _strip_ids(full)


def test_local_stream_is_valid_wherever_max_output_tokens_cuts_it(tokenizer):
    """Cut at every length: the SDK accepts the stream, items match the final, and the final
    equals the non-streamed answer (tool calls cut mid-arguments, text after calls, lists)."""
    text = "Sure.\n" + TOOL_TEXT + "\nThen " + '[{"name": "get_weather", "arguments": {}}, 1]'
    engine = ScriptedEngine(tokenizer, text)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    with local_server(tokenizer, engine) as srv:
        client = _sdk(srv)
        for cut in range(1, n + 2):
            full, events, final = responses_both(
                client, model="t", input="Weather?", tools=RESP_TOOLS, max_output_tokens=cut
            )
            assert_items_match_final(events)
            assert _strip_ids(final) == _strip_ids(full), cut


def test_local_reasoning_streams_before_the_message(tokenizer):
    engine = ScriptedEngine(tokenizer, THINK_TEXT)
    with local_server(tokenizer, engine, reasoning_parser="qwen3") as srv:
        client = _sdk(srv)
        full, events, final = responses_both(client, model="t", input="Hello!")
        cfull, cfinal, chunks = chat_both(client, model="t", messages=[{"role": "user", "content": "Hello!"}])
    assert_events_valid(events)
    types = [e.type for e in events]
    reasoning = [e for e in events if e.type == "response.reasoning_text.delta"]
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert len(reasoning) > 1 and len(text) > 1  # the model opened <think> itself: it streams too
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert {e.output_index for e in reasoning} == {0} and {e.output_index for e in text} == {1}
    assert "".join(e.delta for e in reasoning) == "The user greets me; I greet back."
    assert "".join(e.delta for e in text) == "Hello there, nice to meet you!"
    assert not any("think>" in e.delta for e in reasoning + text)
    assert [it["type"] for it in final["output"]] == ["reasoning", "message"]
    assert _strip_ids(final) == _strip_ids(full)
    r_deltas = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
    assert "".join(d for d in r_deltas if d) == "The user greets me; I greet back."
    assert cfinal.choices[0].message.content == cfull.choices[0].message.content == "Hello there, nice to meet you!"
    assert not any("think>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


# ======================================================================== client disconnect
def _read_first_delta(lines) -> None:
    """Read SSE lines up to the first generated text (an output_text delta or a content chunk)."""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("type") == "response.output_text.delta" or any(
            (c.get("delta") or {}).get("content") for c in ev.get("choices") or []
        ):
            return
    raise AssertionError("stream ended before any generated text")


@pytest.mark.parametrize("route", ["responses", "chat/completions"])
def test_client_disconnect_cancels_generation(tokenizer, route):
    engine = ScriptedEngine(tokenizer, "la ", delay=0.01, repeat=True)
    with local_server(tokenizer, engine, max_batch_size=1) as srv:
        body = (
            {"model": "t", "input": "Sing", "max_output_tokens": 20000, "stream": True}
            if route == "responses"
            else {"model": "t", "messages": [{"role": "user", "content": "Sing"}], "max_tokens": 20000, "stream": True}
        )
        with httpx.Client(timeout=WAIT) as http, http.stream("POST", f"{srv.base_url}/{route}", json=body) as r:
            assert r.status_code == 200
            _read_first_delta(r.iter_lines())
        t0 = time.monotonic()
        assert engine.cancelled.wait(WAIT), "the engine stream was not closed after the client left"
        took = time.monotonic() - t0
        steps = engine.steps
        assert steps < 20000 and engine.finished == 0
        time.sleep(0.2)
        assert engine.steps == steps  # nothing generates any more
        # The engine slot (max_batch_size=1) is free again: a short request completes promptly.
        engine.repeat = False
        out = httpx.post(
            srv.base_url + "/chat/completions",
            timeout=WAIT,
            json={"model": "t", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
        )
        assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "stop"
        assert srv.backend.limiter.running == 0
    assert took < 2.0


def test_client_disconnect_stops_the_engine(local_engine):
    """Each real CPU engine on the tiny model: after the client leaves, the worker stops sampling
    for the request within a step or two, and a new request is served at once."""
    engine, model = local_engine
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "local",
                "model": str(model),
                "engine": engine,
                "max_batch_size": 1,
                "sampling": {"temperature": 0.0},
            },
        }
    )
    sampled: list[int] = []  # the request id of every token the worker sampled

    def factory():
        backend = LocalBackend.from_config(cfg.backend)
        accept = backend.engine._accept

        def counting_accept(req, logits):
            sampled.append(req.id)
            return accept(req, logits)

        backend.engine._accept = counting_accept
        return backend

    with start_background_server(cfg, backend_factory=factory) as srv:
        body = {"model": "t", "messages": [{"role": "user", "content": "Talk"}], "max_tokens": 3000, "stream": True}
        with (
            httpx.Client(timeout=WAIT * 3) as http,
            http.stream("POST", srv.base_url + "/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            _read_first_delta(r.iter_lines())
        left = sampled[0]
        deadline = time.monotonic() + WAIT
        n = -1
        while sampled.count(left) != n and time.monotonic() < deadline:  # until 1 s without its tokens
            n = sampled.count(left)
            time.sleep(1.0)
        t0 = time.monotonic()
        out = httpx.post(
            srv.base_url + "/chat/completions",
            timeout=WAIT * 3,
            json={"model": "t", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
        )
        assert out.status_code == 200 and time.monotonic() - t0 < WAIT
        first_new = next(i for i, rid in enumerate(sampled) if rid != left)
        assert left not in sampled[first_new:], "the cancelled request kept producing tokens"
        assert sampled.count(left) < 3000 and 0 < len(sampled) - first_new <= 4


# ======================================================================== upstream failing mid-stream
@pytest.fixture
def dropping():
    """An upstream that sends two events of a stream, then drops the connection."""
    s = RawServer("stream_drop")
    yield s
    s.stop()


def test_upstream_dropping_mid_stream_fails_the_response_promptly(dropping):
    cfg = _server_config(
        {"type": "chat", "base_urls": [dropping.url + "/v1"], "model": "policy", "timeout": 30, "max_retries": 0}
    )
    with start_background_server(cfg) as srv:
        client = _sdk(srv)
        t0 = time.monotonic()
        with client.responses.stream(model="policy", input="hi") as stream:
            events = list(stream)
        took = time.monotonic() - t0
        assert took < 5, f"took {took:.1f} s"
        types = [e.type for e in events]
        assert types[0] == "response.created" and types[-1] == "response.failed"
        assert "response.completed" not in types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "partial answer"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert dropping.url in failed.error.message
        assert_events_valid(events)
        # The chat route: the chunks that came, then an error the SDK raises, never a hang.
        t0 = time.monotonic()
        got = []
        with pytest.raises(openai.APIError) as info:
            for chunk in client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], stream=True
            ):
                got.append(chunk.choices[0].delta.content)
        assert time.monotonic() - t0 < 5
        assert "".join(got) == "partial answer" and dropping.url in info.value.message


def test_native_responses_upstream_dropping_mid_stream_ends_with_an_error_event(dropping):
    """A Responses-native upstream (openai backend) that drops mid-stream: the events it sent pass
    through, then one ``error`` event with the next sequence number (valid for the spec and the SDK,
    which raises it as ``APIError``), promptly."""
    from helpers.spec import spec_errors

    cfg = _server_config(
        {
            "type": "openai",
            "base_url": dropping.url + "/v1",
            "api_key": KEY,
            "model": "policy",
            "timeout": 30,
            "max_retries": 0,
        }
    )
    with start_background_server(cfg) as srv:
        t0 = time.monotonic()
        with httpx.stream(
            "POST", srv.base_url + "/responses", json={"model": "x", "input": "hi", "stream": True}, timeout=WAIT
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - t0 < 5
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
        assert [e["sequence_number"] for e in events] == [0, 1, 2]
        err = events[-1]
        assert not spec_errors(err, "ErrorStreamingEvent"), spec_errors(err, "ErrorStreamingEvent")
        assert err["code"] == err["error"]["code"] and dropping.url in err["message"]
        with pytest.raises(openai.APIError) as info, _sdk(srv).responses.stream(model="x", input="hi") as stream:
            for _ in stream:
                pass
        assert dropping.url in info.value.message
