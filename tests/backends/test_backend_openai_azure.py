"""The openai and azure backends against fake clouds that check method, path, api-version,
auth header and body the way the real services do; and ``gymserve check`` over them."""

from __future__ import annotations

import io
import logging

import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.check import main_check, run_check
from gymserve.config import validate_config
from gymserve.errors import UpstreamError
from helpers.fakes import AZURE_VERSION, CLOUD_KEY, FakeServer, azure_handler

KEY, VERSION = CLOUD_KEY, AZURE_VERSION
MSG = [{"role": "user", "content": "hi"}]
CTX = RequestContext()


def backend(**options):
    return build_backend(validate_config({"backend": {"retry_backoff": 0.01, **options}}))


async def test_openai_chat_and_native_responses(openai_fake):
    b = backend(type="openai", base_url=openai_fake.url + "/v1/", api_key=KEY, model="gpt-test")
    out = await b.chat({"model": "x", "messages": MSG, "max_completion_tokens": 4}, CTX)
    assert out["choices"][0]["message"]["content"] == "hello from openai"
    history = [
        {"type": "message", "role": "user", "content": "hi"},
        {
            "type": "message",
            "role": "assistant",
            "content": "yo",
            "prompt_token_ids": [1],
            "generation_token_ids": [2],
            "generation_log_probs": [-1.0],
        },
    ]
    resp = await b.responses({"model": "x", "input": history, "stream": False}, CTX)
    rec = openai_fake.requests[-1]
    assert rec.method == "POST" and rec.path == "/v1/responses" and rec.headers["authorization"] == f"Bearer {KEY}"
    assert rec.body["model"] == "gpt-test" and "stream" not in rec.body
    assert "prompt_token_ids" not in rec.body["input"][1]  # clouds reject the training fields
    assert resp["output"][0]["content"][0]["text"] == "hello from responses"
    await b.close()


async def test_openai_native_streaming_and_context_overflow(openai_fake):
    b = backend(type="openai", base_url=openai_fake.url + "/v1", api_key=KEY, model="gpt-test", served_model_name="pub")
    events = [e async for e in b.responses_stream({"input": "hi", "stream": True}, CTX)]
    assert openai_fake.requests[-1].body["stream"] is True
    types = [e["type"] for e in events]
    assert (
        types[0] == "response.created" and types[-1] == "response.completed" and "response.output_text.delta" in types
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["model"] == "pub"
    resp = await b.responses({"input": "overflow"}, CTX)
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"] == []
    events = [e async for e in b.responses_stream({"input": "overflow"}, CTX)]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    await b.close()


async def test_openai_wrong_key_and_wrong_path(openai_fake, caplog):
    caplog.set_level(logging.DEBUG)
    b = backend(type="openai", base_url=openai_fake.url + "/v1", api_key="sk-wrong-key-0123456789", model="gpt-test")
    with pytest.raises(UpstreamError, match="401") as info:
        await b.chat({"messages": MSG}, CTX)
    assert "sk-wrong-key-0123456789" not in info.value.message
    b = backend(type="openai", base_url=openai_fake.url, api_key=KEY, model="gpt-test")  # missing /v1
    with pytest.raises(UpstreamError) as info:
        await b.responses({"input": "hi"}, CTX)
    assert "404" in info.value.message and f"{openai_fake.url}/responses" in info.value.message
    assert KEY not in caplog.text and "sk-wrong-key-0123456789" not in caplog.text
    await b.close()


AZ = {"type": "azure", "api_key": KEY, "api_version": VERSION, "deployment": "dep"}


async def test_azure_chat_is_deployment_scoped_with_api_version_and_api_key(azure_fake):
    b = backend(**AZ, endpoint=azure_fake.url + "/")
    out = await b.chat({"model": "anything", "messages": MSG}, CTX)
    rec = azure_fake.requests[-1]
    assert (rec.method, rec.path, rec.query) == (
        "POST",
        "/openai/deployments/dep/chat/completions",
        {"api-version": VERSION},
    )
    assert rec.headers["api-key"] == KEY and "authorization" not in rec.headers
    assert out["choices"][0]["message"]["content"] == "hello from azure chat"
    # api: chat serves Responses through the converter, on the same deployment URL.
    resp = await b.responses({"model": "anything", "input": "hi"}, CTX)
    assert azure_fake.requests[-1].path == "/openai/deployments/dep/chat/completions"
    assert resp["output"][-1]["content"][0]["text"] == "hello from azure chat"
    await b.close()


@pytest.mark.parametrize(
    "endpoint_tail, version, path",
    [
        ("/", VERSION, "/openai/responses"),
        ("/openai/deployments/dep", VERSION, "/openai/responses"),  # a chat-style endpoint still gets the right URL
        ("/openai/v1", VERSION, "/openai/v1/responses"),
    ],
)
async def test_azure_responses_api_is_never_deployment_scoped(endpoint_tail, version, path):
    with FakeServer(azure_handler(api_key=KEY, api_version=version, deployment="dep")) as fake:
        b = backend(**{**AZ, "api_version": version}, endpoint=fake.url + endpoint_tail, api="responses")
        resp = await b.responses({"model": "x", "input": "hi"}, CTX)
        rec = fake.requests[-1]
        assert (rec.path, rec.query, rec.body["model"]) == (path, {"api-version": version}, "dep")
        assert "/deployments/" not in rec.path and "//" not in rec.path
        assert resp["output"][0]["content"][0]["text"] == "hello from azure responses"
        await b.close()


async def test_azure_api_version_from_default_query():
    with FakeServer(azure_handler(api_key=KEY, api_version="2024-10-21", deployment="gpt-5-nano")) as fake:
        cfg = validate_config(
            {
                "backend": {
                    "type": "azure_openai_model",
                    "openai_base_url": fake.url,
                    "openai_api_key": KEY,
                    "openai_model": "gpt-5-nano",
                    "default_query": {"api-version": "2024-10-21"},
                }
            }
        )
        b = build_backend(cfg)
        await b.chat({"messages": MSG}, CTX)
        rec = fake.requests[-1]
        assert rec.path == "/openai/deployments/gpt-5-nano/chat/completions" and rec.query == {
            "api-version": "2024-10-21"
        }
        await b.close()


async def test_azure_gateway_bases():
    handler = azure_handler(
        api_key=KEY,
        api_version=VERSION,
        deployment="dep",
        chat_paths=("/azure/chat/completions",),
        responses_paths=("/azure/v1/responses",),
    )
    with FakeServer(handler) as gw:
        for api in ("chat", "responses"):
            b = backend(
                type="azure",
                api_key=KEY,
                api_version=VERSION,
                deployment="dep",
                api=api,
                chat_base_url=gw.url + "/azure/",
                responses_base_url=gw.url + "/azure/v1",
            )
            await b.chat({"messages": MSG}, CTX)
            assert (gw.requests[-1].path, gw.requests[-1].query) == (
                "/azure/chat/completions",
                {"api-version": VERSION},
            )
            resp = await b.responses({"input": "hi"}, CTX)
            want = "/azure/v1/responses" if api == "responses" else "/azure/chat/completions"
            assert gw.requests[-1].path == want and resp["status"] == "completed"
            await b.close()


async def test_azure_wrong_version_404_is_explained(azure_fake, caplog):
    caplog.set_level(logging.DEBUG)
    b = backend(**{**AZ, "api_version": "2023-01-01"}, endpoint=azure_fake.url, api="responses")
    with pytest.raises(UpstreamError) as info:
        await b.responses({"input": "hi"}, CTX)
    msg = info.value.message
    assert "404" in msg and "Resource not found" in msg and "/openai/responses?api-version=2023-01-01" in msg
    assert "api-version sent: 2023-01-01" in msg and "deployment-scoped" in msg
    assert "connection" not in msg.lower() and KEY not in msg and KEY not in caplog.text
    # A gateway "responses" base that is really the deployment-scoped chat base: the hint says so.
    b = backend(**AZ, responses_base_url=azure_fake.url + "/openai/deployments/dep", api="responses")
    with pytest.raises(UpstreamError, match="This Responses URL is deployment-scoped"):
        await b.responses({"input": "hi"}, CTX)
    await b.close()


async def test_check_reports_what_works(azure_fake):
    cfg = validate_config({"backend": {**AZ, "endpoint": azure_fake.url, "api": "responses"}})
    report = await run_check(cfg)
    assert [(r.name, r.ok) for r in report.results] == [
        ("models", True),
        ("chat", True),
        ("responses", True),
        ("messages", True),  # converted to chat
    ]
    assert report.ok and KEY not in report.format()


def test_main_check_exit_codes(openai_fake, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"backend: {{type: openai, base_url: '{openai_fake.url}', api_key: '{KEY}', model: gpt-test}}\n")
    out = io.StringIO()
    assert main_check(str(path), out=out) == 1  # the base URL lacks /v1
    text = out.getvalue()
    assert "FAIL" in text and "404" in text and "/v1" in text and KEY not in text
    path.write_text("backend: {type: azure, endpoint: 'https://r.openai.azure.com', deployment: d}\n")
    out = io.StringIO()
    assert main_check(str(path), out=out) == 2 and "backend.api_version" in out.getvalue()
    cfg = validate_config(
        {"backend": {"type": "openai", "base_url": openai_fake.url + "/v1", "api_key": KEY, "model": "gpt-test"}}
    )
    out = io.StringIO()
    assert main_check(cfg, out=out) == 0 and "all probes passed" in out.getvalue()
