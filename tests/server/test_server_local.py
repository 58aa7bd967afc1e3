"""The local backend behind the real HTTP server, driven by the official openai SDK (tiny model), on
each in-process CPU engine (``local_engine``: transformers, llamacpp)."""

from __future__ import annotations

import httpx
import openai
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
from gymserve.server.run import start_background_server

TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _server(model_dir, **local):
    cfg = GymserveConfig(server=ServerConfig(port=0), backend=LocalBackendConfig(model=str(model_dir), **local))
    return start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))


@pytest.fixture(scope="module")
def server(local_engine):
    engine, model = local_engine
    srv = _server(model, engine=engine, sampling=SamplingConfig(temperature=1.0, seed=1234), context_window=512)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _fields(message) -> tuple[list[int], list[int], list[float]]:
    extra = message.model_extra
    return extra["prompt_token_ids"], extra["generation_token_ids"], extra["generation_log_probs"]


def test_chat_returns_training_fields_and_usage(client, tokenizer):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6)
    p, g, lp = _fields(r.choices[0].message)
    expected_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    assert p == tokenizer(expected_prompt, add_special_tokens=False)["input_ids"]
    assert len(g) == len(lp) == 6
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 6


def test_three_turns_stay_token_contiguous(client, tokenizer):
    """Each turn's prompt extends the previous prompt + generation exactly (sampled drift on the
    real model: test_real_model.py)."""
    messages = [{"role": "user", "content": "Tell me something."}]
    prev = None
    for turn in range(3):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        msg = r.choices[0].message
        p, g, lp = _fields(msg)
        if prev is not None:
            assert p[: len(prev[0]) + len(prev[1])] == prev[0] + prev[1]
        prev = (p, g)
        # Sent back as NeMo Gym does: content plus the three token fields on the assistant message.
        messages += [
            {
                "role": "assistant",
                "content": msg.content,
                "prompt_token_ids": p,
                "generation_token_ids": g,
                "generation_log_probs": lp,
            },
            {"role": "user", "content": f"And turn {turn + 2}?"},
        ]
    assert len(prev[0]) > 60


def test_requests_choose_their_own_sampling_by_default(client):
    """As vllm serve: a server not told to pin applies each request's temperature/top_k/min_p/seed
    (the config's values are the defaults). Observable: top_k 1, min_p 1 and temperature 0 all
    sample the most likely token, whatever the server's temperature (1.0 here); a request seed
    replays a generation."""
    msgs = [{"role": "user", "content": "Tell me a story."}]

    def gen(route: str = "chat", **sampling) -> list[int]:
        if route == "completions":
            done = client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, **sampling)
            return done.choices[0].model_extra["generation_token_ids"]
        done = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, **sampling)
        return _fields(done.choices[0].message)[1]

    greedy = gen(temperature=0)
    assert gen(extra_body={"top_k": 1}) == greedy
    assert gen(extra_body={"min_p": 1.0}, temperature=1.5) == greedy
    assert gen(seed=77) == gen(seed=77) != gen(seed=78)
    assert gen("completions", temperature=0) == gen("completions", extra_body={"min_p": 1.0})
    with pytest.raises(openai.BadRequestError) as exc:
        gen(extra_body={"min_p": 1.5})
    assert exc.value.body["param"] == "min_p" and "out of range" in exc.value.body["message"]


def test_a_pinned_server_rejects_other_sampling(tiny_model_dir):
    """``sampling.pin: reject`` (``--pin-sampling``): another temperature/top_k/min_p/seed is a 400
    naming it; the server's own values (or "off" values for its off filters), as NeMo Gym sends
    them, are fine. ``pin: override`` samples with the server's values whatever is sent."""
    pinned = SamplingConfig(temperature=1.0, seed=1234, pin="reject")
    srv = _server(tiny_model_dir, sampling=pinned, context_window=512)
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "x"}]
        for field, value in (("temperature", 0.3), ("top_k", 5), ("min_p", 0.1), ("seed", 9)):
            with pytest.raises(openai.BadRequestError) as exc:
                c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body={field: value})
            err = exc.value.body
            assert (
                err["param"] == field and err["code"] == "sampling_param_pinned" and "--pin-sampling" in err["message"]
            )
        same = {"temperature": 1.0, "top_p": 1.0, "seed": 1234, "extra_body": {"top_k": -1, "min_p": 0}}
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **same)
    finally:
        srv.stop()
    srv = _server(tiny_model_dir, sampling=SamplingConfig(temperature=0, pin="override"))
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "x"}]
        runs = [c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=1.9) for _ in "ab"]
        assert _fields(runs[0].choices[0].message)[1] == _fields(runs[1].choices[0].message)[1]  # greedy both
    finally:
        srv.stop()


def test_context_length_error_names_both_numbers(client):
    long = "word " * 600
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], max_tokens=2)
    msg = exc.value.body["message"]
    assert "context length" in msg and "512" in msg
    assert exc.value.body["code"] == "context_length_exceeded"


def test_max_tokens_clamped_to_context_window(client, tokenizer):
    text = "word " * 480
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=400)
    p, g, _ = _fields(r.choices[0].message)
    assert len(p) + r.usage.completion_tokens == 512
    assert r.choices[0].finish_reason == "length"


def test_standard_logprobs_with_token_ids(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    _, g, lp = _fields(r.choices[0].message)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in g]
    assert [c.logprob for c in content] == pytest.approx(lp)
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_vllm_token_fields_in_vllm_places(client):
    """``return_token_ids`` (vLLM ≥ 0.10.2): top-level ``prompt_token_ids`` and ``choices[].token_ids``
    on chat, ``choices[].prompt_token_ids`` + ``token_ids`` on completions, equal to gymserve's own
    fields; without it, neither appears."""
    msgs = [{"role": "user", "content": "x"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=3, n=2, extra_body={"return_token_ids": True}
    ).model_dump()
    for choice in r["choices"]:
        assert choice["token_ids"] == choice["message"]["generation_token_ids"]
        assert r["prompt_token_ids"] == choice["message"]["prompt_token_ids"]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    c = client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"return_token_ids": True})
    extra = c.choices[0].model_extra
    assert extra["token_ids"] == extra["generation_token_ids"] and extra["prompt_token_ids"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=3, extra_body={"return_token_ids": "yes"}
        )
    assert exc.value.body["param"] == "return_token_ids"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, None),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
            },
            None,
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 129}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 5}, "frequency_penalty"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"12": 3}}, "logit_bias"),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": "y",
                        "prompt_token_ids": [1, 2],
                        "generation_token_ids": [999999999],
                        "generation_log_probs": [-1.0],
                    },
                ],
            },
            None,
        ),
        (
            # json_object/json_schema are applied where the engine can mask tokens (llguidance on
            # transformers): a type no API defines is bad input on every engine
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
    ],
)
def test_bad_input_is_400_with_error_object(server, body, param):
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


def test_malformed_json_and_unknown_route(server):
    r = httpx.post(
        server.base_url + "/chat/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.base_url.removesuffix("/v1") + "/chat/completions", json={}, timeout=10)
    assert r.status_code == 404 and "/v1" in r.json()["error"]["message"]
    # Every route is listed, read from the app (the old hand-written list had five).
    for route in ("POST /v1/completions", "POST /tokenize", "POST /v1/messages/count_tokens", "GET /v1/models"):
        assert route in r.json()["error"]["message"]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [server.backend.engine.model_name]
    # vLLM's max_model_len: the context window the renderers library checks prompts against.
    assert [m.model_extra["max_model_len"] for m in client.models.list().data] == [512]
    h = httpx.get(server.base_url.removesuffix("/v1") + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["tool_call_parser"] == "qwen2_5_coder"


def test_non_canonical_generation_survives_splice(client, tokenizer):
    """Retokenization drift: a generation whose IDs are not what its text re-encodes to (as a model
    sampling " 4" as " " + "4" produces) is kept token for token in the next prompt."""
    text = "The answer is 4. 你好世界"
    canonical = tokenizer(text, add_special_tokens=False)["input_ids"]
    sampled = [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert sampled != canonical and tokenizer.decode(sampled) == text
    first = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Q1"}], max_tokens=1)
    p = first.choices[0].message.model_extra["prompt_token_ids"]
    messages = [
        {"role": "user", "content": "Q1"},
        {
            "role": "assistant",
            "content": text,
            "prompt_token_ids": p,
            "generation_token_ids": sampled,
            "generation_log_probs": [-1.0] * len(sampled),
        },
        {"role": "user", "content": "Q2"},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    p2 = r.choices[0].message.model_extra["prompt_token_ids"]
    assert p2[: len(p) + len(sampled)] == p + sampled
    # Then exactly one end-of-turn, and the template's rendering of the rest.
    rest = tokenizer.decode(p2[len(p) + len(sampled) :])
    assert rest == "<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"


def test_responses_context_overflow_ends_the_rollout_cleanly(client):
    """CL-01 over the local backend's Responses endpoint: an empty, incomplete Response (as over
    every other backend), while /v1/chat/completions keeps its "context length" 400."""
    r = client.responses.create(model="tiny", input="word " * 600, max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output == [] and r.usage.output_tokens == 0


def test_streamed_responses_context_overflow_ends_the_rollout_cleanly(client):
    """CL-01 streamed: the same empty, incomplete Response as the non-streamed call, as events."""
    with client.responses.stream(model="tiny", input="word " * 600, max_output_tokens=4) as stream:
        events = list(stream)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.incomplete"]
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens" and final.output == []


# ------------------------------------------------------------------------------ GET /, request checks
def test_status_at_the_root(server):
    root = server.base_url.removesuffix("/v1")
    r = httpx.get(root + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    status = r.json()
    from gymserve import __version__

    assert {k: status[k] for k in ("name", "version", "backend", "model")} == {
        "name": "gymserve",
        "version": __version__,
        "backend": "local",
        "model": server.backend.engine.model_name,
    }
    assert status["links"]["health"] == "/health" and status["links"]["models"] == "/v1/models"
    assert status["links"]["docs"] == "/docs"
    for link in status["links"].values():  # every link leads somewhere (POST routes answer GET with 405)
        assert httpx.get(root + link, timeout=10).status_code in (200, 405), link


def _refused_fields():
    from helpers.apis import CHAT_ON_RESPONSES, RESPONSES_ON_CHAT

    return [("responses", f, v, h) for f, v, h in CHAT_ON_RESPONSES] + [
        ("chat", f, v, h) for f, v, h in RESPONSES_ON_CHAT
    ]


@pytest.mark.parametrize(("route", "field", "value", "hint"), _refused_fields(), ids=lambda x: str(x)[:20])
def test_the_other_apis_fields_are_400_naming_the_right_field(client, route, field, value, hint):
    """Through the official SDK, as a user porting code between the two APIs sends them."""
    with pytest.raises(openai.BadRequestError) as exc:
        if route == "responses":
            client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body={field: value})
        else:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={field: value}
            )
    err = exc.value.body
    assert exc.value.status_code == 400 and err["param"] == field and err["code"] == "unsupported_parameter"
    assert (
        hint in err["message"]
        and f"/v1/{'responses' if route == 'responses' else 'chat/completions'}" in err["message"]
    )


def test_max_tokens_on_responses_is_refused_not_ignored(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny", input="hi", extra_body={"max_tokens": 4})
    assert exc.value.body["message"] == (
        "max_tokens is a Chat Completions field, not a Responses API one: on POST /v1/responses, use max_output_tokens"
    )


def test_model_null_is_a_missing_model_on_both_routes(server):
    """25 of NeMo Gym's shipped task rows send "model": null."""
    r = httpx.post(
        server.base_url + "/responses",
        timeout=60,
        json={"model": None, "input": "hi", "max_output_tokens": 2, "temperature": None, "tools": None},
    )
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response" and r.json()["usage"]["output_tokens"] == 2
    r = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        json={"model": None, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": None},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_a_string_parameters_tool_is_refused_alike_on_both_routes(client):
    """It used to be pasted into the prompt on chat while /v1/responses refused it."""
    with pytest.raises(openai.BadRequestError) as responses_exc:
        client.responses.create(
            model="tiny",
            input="weather?",
            max_output_tokens=2,
            tools=[{"type": "function", "name": "get_weather", "parameters": "city: string"}],
        )
    with pytest.raises(openai.BadRequestError) as chat_exc:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "weather?"}],
            max_tokens=2,
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": "city: string"}}],
        )
    responses_err, chat_err = responses_exc.value.body, chat_exc.value.body
    assert responses_err["param"] == "tools[0].parameters" and chat_err["param"] == "tools[0].function.parameters"
    assert responses_err["message"].startswith("tools[0].parameters must be a JSON Schema object, got a string")
    assert chat_err["message"] == responses_err["message"].replace("tools[0].", "tools[0].function.")


@pytest.mark.parametrize(
    "item",
    [
        {"role": "system", "content": "Say hello."},
        {"role": "developer", "content": [{"type": "input_text", "text": "Say hello."}]},
    ],
)
def test_a_system_prompt_alone_is_answered(client, tokenizer, item):
    r = client.responses.create(model="tiny", input=[item], max_output_tokens=3)
    assert r.status == "incomplete" and r.usage.output_tokens == 3
    prompt = r.output[-1].model_extra["prompt_token_ids"]
    want = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(prompt) == want
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Say hello."}], max_tokens=3
    )
    assert chat.choices[0].message.model_extra["prompt_token_ids"] == prompt


# ------------------------------------------------------------------ errors in the caller's vocabulary


def test_a_bad_responses_request_is_named_with_responses_fields(server):
    """The local engine checks the converted chat request; its errors name the input items."""
    item = {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": "{}",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [10**9],
        "generation_log_probs": [-1.0],
    }
    body = {"model": "m", "input": [{"role": "user", "content": "x"}, item]}
    for stream in (False, True):
        r = httpx.post(server.base_url + "/responses", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "input[1].generation_token_ids", err
        assert err["message"].startswith("input[1].generation_token_ids holds token id 1000000000"), err
        assert "messages" not in err["message"]


def test_out_of_range_numbers_say_out_of_range(server):
    r = httpx.post(
        server.base_url + "/responses",
        content=b'{"model": "m", "input": "hi", "max_output_tokens": 1e30}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert "out of range" in r.json()["error"]["message"]


def test_a_tool_message_without_tool_call_id_is_refused_on_chat_as_on_responses(server):
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "18 C"}]}
    r = httpx.post(server.base_url + "/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_call_id", r.text
    responses = {
        "model": "m",
        "input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "18 C"}],
    }
    r = httpx.post(server.base_url + "/responses", json=responses, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].call_id", r.text
