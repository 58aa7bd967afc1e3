"""Upstream failures become errors that name the URL, the cause and the fix, and never a key."""

from __future__ import annotations

import httpx2
import openai
import pytest

from gymserve.backends.upstream_errors import is_context_length_message, is_retryable, translate_error
from gymserve.errors import ContextLengthExceededError, OverloadedError, UpstreamConnectionError, UpstreamError
from gymserve.redaction import redact, redact_url
from helpers.fakes import free_port

KEY = "sk-proj-VERYSECRET0123456789"


def status_error(status: int, body, url="http://127.0.0.1:8000/v1/chat/completions", headers=None):
    request = httpx2.Request("POST", url)
    response = httpx2.Response(status, json=body, request=request, headers=headers)
    cls = {
        400: openai.BadRequestError,
        401: openai.AuthenticationError,
        404: openai.NotFoundError,
        429: openai.RateLimitError,
    }.get(status, openai.InternalServerError if status >= 500 else openai.APIStatusError)
    return cls(f"Error code: {status}", response=response, body=body)


async def connection_error(url: str) -> Exception:
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=5)
    try:
        await client.post(url + "/chat/completions", body={}, cast_to=object)
    except Exception as exc:
        return exc
    raise AssertionError("expected a connection failure")


async def test_connection_refused_names_host_port_and_class():
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    err = translate_error(await connection_error(url), url=url + "/chat/completions", secrets=(KEY,))
    assert isinstance(err, UpstreamConnectionError) and err.status_code == 502
    assert (
        "ConnectError" in err.message and f"127.0.0.1:{port}" in err.message and "is the server running" in err.message
    )
    assert "Connection error." not in err.message and KEY not in err.message
    assert is_retryable(err)


async def test_a_server_closing_mid_answer_is_not_called_a_url_problem():
    from helpers.fakes import RawServer

    s = RawServer("truncated")
    try:
        url = s.url + "/v1"
        err = translate_error(await connection_error(url), url=url + "/chat/completions")
    finally:
        s.stop()
    assert isinstance(err, UpstreamConnectionError) and "RemoteProtocolError" in err.message
    assert "must start with http://" not in err.message and "check the base URL, that the server is up" in err.message


async def test_dns_failure_names_host():
    url = "https://resource.openai.azure.invalid/openai"
    err = translate_error(await connection_error(url), url=url + "/responses", backend="azure")
    assert isinstance(err, UpstreamConnectionError)
    assert "ConnectError" in err.message and "resource.openai.azure.invalid" in err.message and "DNS" in err.message


def test_404_is_reported_as_404_with_path_and_hint():
    url = "http://127.0.0.1:8000/chat/completions"
    err = translate_error(status_error(404, {"detail": "Not Found"}, url=url), url=url)
    assert err.code == "upstream_not_found" and "404" in err.message and "/chat/completions" in err.message
    assert "/v1" in err.message and "connection" not in err.message.lower()


def test_azure_404_explains_api_version_and_the_two_bases():
    url = "https://r.openai.azure.com/openai/deployments/d/responses?api-version=2025-01-01"
    err = translate_error(
        status_error(404, {"error": {"code": "404", "message": "Resource not found"}}, url=url),
        url=url,
        kind="responses",
        backend="azure",
        api_version="2025-01-01",
    )
    assert "404" in err.message and "Resource not found" in err.message
    assert "deployment-scoped" in err.message and "/openai/responses" in err.message and "api-version" in err.message


def test_chat_server_asked_for_responses():
    url = "http://127.0.0.1:8000/v1/responses"
    err = translate_error(
        status_error(404, {"detail": "Not Found"}, url=url), url=url, kind="responses", backend="openai"
    )
    assert "backend type 'chat'" in err.message


@pytest.mark.parametrize(
    "message",
    [
        "This model's maximum context length is 32768 tokens. However, you requested 32818 tokens (32718 in the "
        "messages, 100 in the completion). Please reduce the length of the messages or completion.",
        "'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum context length is 4096 tokens",
        "the request exceeds the available context size, try increasing it",
        "Requested token count exceeds the model's maximum context length of 8192 tokens.",
    ],
)
def test_context_length_400_detected(message):
    err = translate_error(status_error(400, {"object": "error", "message": message, "code": 400}), url="http://h/v1/x")
    assert isinstance(err, ContextLengthExceededError) and err.status_code == 400 and not is_retryable(err)


def test_context_length_in_a_plain_500_is_not_retried():
    err = translate_error(
        status_error(500, {"message": "ValueError: prompt exceeds maximum context length"}), url="http://h/v1"
    )
    assert isinstance(err, ContextLengthExceededError) and not is_retryable(err)


def test_other_400_passes_through_with_upstream_message():
    err = translate_error(
        status_error(400, {"object": "error", "message": "Invalid tool schema", "code": 400}), url="http://h"
    )
    assert not isinstance(err, ContextLengthExceededError)
    assert err.status_code == 400 and err.message == "Invalid tool schema" and not is_retryable(err)
    assert not is_context_length_message("max_tokens must be at least 1")


def test_429_and_5xx_are_retryable_and_401_hides_the_key():
    err = translate_error(
        status_error(429, {"error": {"message": "slow down"}}, headers={"retry-after": "2"}), url="http://h"
    )
    assert isinstance(err, OverloadedError) and err.retry_after == 2.0 and is_retryable(err)
    err = translate_error(status_error(503, {"error": {"message": "busy"}}), url="http://h")
    assert isinstance(err, UpstreamError) and err.status_code == 502 and "503" in err.message and is_retryable(err)
    err = translate_error(
        status_error(401, {"error": {"message": f"Incorrect API key provided: {KEY}"}}), url="http://h", secrets=(KEY,)
    )
    assert "401" in err.message and KEY not in err.message and not is_retryable(err)
    err = translate_error(
        status_error(401, {"error": {"message": "Incorrect API key provided: sk-abcdefghijklmnop"}}), url="http://h"
    )
    assert "sk-abcdefghijklmnop" not in err.message


def test_redaction_helpers():
    assert (
        redact_url(f"https://user:{KEY}@h.example/v1?api-version=1&api_key={KEY}")
        == "https://h.example/v1?api-version=1&api_key=***"
    )
    assert redact(f"key {KEY} and Bearer abcdefghijklmnop", (KEY,)) == "key *** and Bea***"
