"""The backend side of cases AZ-01, AZ-02 and CL-01 (tests/data/cases/public.jsonl).

The Azure cases use the case's own host names; requests never leave the process: the SDK client
of each backend gets an ``httpx2.MockTransport`` (through the SDK's public ``with_options``) that
answers like Azure (``fakes.azure_handler``) and records the exact URL sent.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import httpx2
import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.config import ConfigError, validate_config
from gymserve.errors import UpstreamConnectionError, UpstreamError
from helpers.fakes import ChatScript, FakeServer, Recorded, azure_handler, vllm_error

CTX = RequestContext()
KEY = "KEY_PLACEHOLDER-0123456789"


def mock_cloud(backend, handler=None, *, raise_exc: Exception | None = None) -> list[httpx2.Request]:
    """Route every replica's SDK client through a MockTransport; returns the list of sent requests."""
    sent: list[httpx2.Request] = []

    def transport(request: httpx2.Request) -> httpx2.Response:
        sent.append(request)
        if raise_exc is not None:
            raise raise_exc
        body = json.loads(request.content) if request.content else None
        rec = Recorded(
            request.method,
            request.url.path,
            dict(request.url.params),
            {k.lower(): v for k, v in request.headers.items()},
            body,
        )
        status, payload, *_ = handler(rec)
        return httpx2.Response(status, json=payload)

    for replica in backend.caller.pool.replicas:
        sdk = replica.client.sdk.with_options(http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(transport)))
        replica.client = dataclasses.replace(replica.client, sdk=sdk)
    return sent


AZ01 = {
    "type": "azure_openai",
    "endpoint": "https://RESOURCE.openai.azure.com/",
    "deployment": "DEPLOYMENT",
    "api_version": "API_VERSION",
    "api_key": KEY,
}
AZURE = azure_handler(api_key=KEY, api_version="API_VERSION", deployment="DEPLOYMENT")


async def test_az01_chat_and_responses_urls(caplog):
    caplog.set_level(logging.DEBUG)
    for api in ("chat", "responses"):
        b = build_backend(validate_config({"backend": {**AZ01, "api": api}}))
        sent = mock_cloud(b, AZURE)
        await b.chat({"model": "x", "messages": [{"role": "user", "content": "hi"}]}, CTX)
        await b.responses({"model": "x", "input": "hi"}, CTX)
        chat, resp = sent[0], sent[-1]
        # httpx lower-cases host names; compare parsed URLs (host case-insensitive, path and query exact).
        assert chat.method == "POST" and chat.url == httpx2.URL(
            "https://RESOURCE.openai.azure.com/openai/deployments/DEPLOYMENT/chat/completions?api-version=API_VERSION"
        )
        if api == "responses":
            assert resp.url == httpx2.URL("https://RESOURCE.openai.azure.com/openai/responses?api-version=API_VERSION")
            assert json.loads(resp.content)["model"] == "DEPLOYMENT"
        for r in sent:
            assert r.headers["api-key"] == KEY and "authorization" not in r.headers
            assert "//" not in r.url.path and r.url.params["api-version"] == "API_VERSION"
        assert all("/deployments/" not in str(r.url) for r in sent if r.url.path.endswith("/responses"))
        await b.close()
    assert KEY not in caplog.text


async def test_az01_separate_gateway_bases():
    b = build_backend(
        validate_config(
            {
                "backend": {
                    "type": "azure_openai",
                    "chat_base_url": "https://GATEWAY/azure",
                    "responses_base_url": "https://GATEWAY/azure/v1",
                    "api_version": "API_VERSION",
                    "api_key": KEY,
                    "deployment": "DEPLOYMENT",
                    "api": "responses",
                }
            }
        )
    )
    gateway = azure_handler(
        api_key=KEY,
        api_version="API_VERSION",
        deployment="DEPLOYMENT",
        chat_paths=("/azure/chat/completions",),
        responses_paths=("/azure/v1/responses",),
    )
    sent = mock_cloud(b, gateway)
    await b.chat({"messages": [{"role": "user", "content": "hi"}]}, CTX)
    await b.responses({"input": "hi"}, CTX)
    assert [r.url for r in sent] == [
        httpx2.URL("https://GATEWAY/azure/chat/completions?api-version=API_VERSION"),
        httpx2.URL("https://GATEWAY/azure/v1/responses?api-version=API_VERSION"),
    ]
    await b.close()


def test_az01_missing_api_version_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"backend\.api_version"):
        validate_config(
            {
                "backend": {
                    "type": "azure_openai",
                    "endpoint": "https://RESOURCE.openai.azure.com",
                    "deployment": "DEPLOYMENT",
                }
            }
        )


def test_az02_endpoint_without_scheme_rejected_at_load():
    with pytest.raises(ConfigError) as info:
        validate_config(
            {
                "backend": {
                    "type": "azure_openai",
                    "endpoint": "RESOURCE.openai.azure.com/openai",
                    "api_version": "API_VERSION",
                    "api_key": KEY,
                    "deployment": "d",
                }
            }
        )
    text = str(info.value)
    assert "http:// or https://" in text and "RESOURCE.openai.azure.com/openai" in text and KEY not in text


async def test_az02_dns_failure_names_cause_class_and_host(caplog):
    caplog.set_level(logging.DEBUG)
    b = build_backend(validate_config({"backend": {**AZ01, "api": "responses", "max_retries": 1, "retry_backoff": 0}}))
    mock_cloud(b, raise_exc=httpx2.ConnectError("[Errno -2] Name or service not known"))
    with pytest.raises(UpstreamConnectionError) as info:
        await b.responses({"input": "hi"}, CTX)
    err = info.value
    assert err.status_code == 502 and err.to_dict()["error"]["type"] == "upstream_connection_error"
    assert "ConnectError" in err.message and "resource.openai.azure.com" in err.message.lower()
    assert "Connection error." not in err.message and KEY not in err.message and KEY not in caplog.text
    await b.close()


async def test_az02_upstream_404_is_reported_as_404_not_a_connection_error():
    b = build_backend(validate_config({"backend": {**AZ01, "api_version": "WRONG", "api": "responses"}}))
    mock_cloud(b, AZURE)
    with pytest.raises(UpstreamError) as info:
        await b.responses({"input": "hi"}, CTX)
    err = info.value
    assert not isinstance(err, UpstreamConnectionError)
    assert "404" in err.message and "/openai/responses" in err.message and "api-version" in err.message
    await b.close()


CL01_OVERFLOW = (
    "This model's maximum context length is 32768 tokens. However, you requested 32818 tokens "
    "(32718 in the messages, 100 in the completion). Please reduce the length of the messages or completion."
)


@pytest.mark.parametrize("status", [400, 500])
async def test_cl01_context_overflow_ends_the_rollout_cleanly(status):
    script = ChatScript(plan=[vllm_error(CL01_OVERFLOW, status)] * 2)
    with FakeServer(script) as s:
        b = build_backend(
            validate_config(
                {"backend": {"type": "chat", "base_url": s.url + "/v1", "model": "policy", "retry_backoff": 0}}
            )
        )
        resp = await b.responses({"model": "policy", "input": "long history"}, CTX)
        assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
        assert resp["output"] == [] and resp["usage"]["output_tokens"] == 0
        chat = await b.chat({"model": "policy", "messages": [{"role": "user", "content": "x"}]}, CTX)
        choice = chat["choices"][0]
        assert choice["index"] == 0 and choice["finish_reason"] == "length"
        assert choice["message"]["content"] is None and choice["message"]["tool_calls"] is None
        assert len(s.chat_requests()) == 2  # one call each: a deterministic overflow is never retried
        await b.close()


async def test_cl01_other_400_is_propagated_as_4xx():
    with FakeServer(ChatScript(plan=[vllm_error("Invalid tool schema")])) as s:
        b = build_backend(validate_config({"backend": {"type": "chat", "base_url": s.url + "/v1"}}))
        with pytest.raises(UpstreamError) as info:
            await b.responses({"model": "policy", "input": "x"}, CTX)
        assert 400 <= info.value.status_code < 500 and "Invalid tool schema" in info.value.message
        assert len(s.chat_requests()) == 1
        await b.close()


async def test_cr04_chat_passthrough_returns_string_arguments():
    """CR-04 on /v1/chat/completions: arguments sent as an object or "" come back as JSON strings."""
    from helpers.spec import load_cases

    case = load_cases("chat_to_responses")["CR-04"]
    upstream = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "policy",
        **case["input"]["backend_chat_response"],
    }
    with FakeServer(ChatScript(plan=[(200, upstream)])) as s:
        b = build_backend(validate_config({"backend": {"type": "chat", "base_url": s.url + "/v1"}}))
        chat = await b.chat({"model": "policy", "messages": [{"role": "user", "content": "x"}]}, CTX)
        calls = chat["choices"][0]["message"]["tool_calls"]
        expected = case["expected"]["responses_output"]
        assert [c["function"]["arguments"] for c in calls] == [e["arguments"] for e in expected]
        assert json.loads(calls[0]["function"]["arguments"]) == {"location": "New York", "format": "celsius"}
        await b.close()
