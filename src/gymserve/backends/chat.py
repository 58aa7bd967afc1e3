"""The chat backend: any OpenAI-compatible Chat Completions server, one or more replicas.

Serves vLLM, SGLang, TensorRT-LLM, llama.cpp, ``transformers serve`` or another gymserve. Responses
requests go through ``gymserve.convert``. Calls use the official ``openai`` SDK client
(``AsyncOpenAI``: auth header, ``default_query``, ``default_headers``, timeouts) with its own retries
off: retries happen here, once, so a connection failure can move to another replica and a
context-window overflow is never retried.

Upstream behaviour followed:

- reasoning arrives as ``message.reasoning_content`` (DeepSeek, vLLM < 0.10) or ``message.reasoning``
  (vLLM ≥ 0.10; gpt-oss always sends it); whichever comes is mirrored into the other name, so
  clients keyed on either keep working.
- token IDs (``return_token_id_information: true``), in vLLM's forms: ``return_token_ids: true``
  (top-level ``prompt_token_ids`` and ``choices[0].token_ids``, vLLM ≥ 0.10.2), ``logprobs: true``
  with ``return_tokens_as_token_ids: true`` (``logprobs.content[].token == "token_id:N"``), and
  ``POST {root}/tokenize`` as the fallback for the prompt. Message-level ``prompt_token_ids``,
  ``generation_token_ids``, ``generation_log_probs`` (another gymserve, NeMo RL) are taken as given.
  The three are put on ``choices[0].message``. Partial or inconsistent metadata raises
  ``UpstreamError`` (502); IDs are never fabricated.
- servers that return raw text (no tool-call/reasoning parser) are parsed here with the same
  parser registry as the local engine (``tool_parser``, ``reasoning_parser`` options).
- an upstream context-window overflow becomes an empty, length-terminated reply on the chat
  endpoint and the empty ``incomplete`` Response on the Responses one (case CL-01).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.chat_wire import (
    checked_chunk,
    completion_to_chunks,
    mirror_reasoning,
    normalize_tool_call_arguments,
)
from gymserve.backends.pool import Limiter, Replica, ReplicaPool, backoff_delay
from gymserve.backends.raw_text import ParsedChunkStream, apply_parsers
from gymserve.backends.token_stream import StreamedTokens, vllm_token_fields
from gymserve.backends.upstream_errors import is_retryable, translate_error
from gymserve.errors import (
    ContextLengthExceededError,
    GymserveError,
    InvalidRequestError,
    UpstreamBadResponseError,
    UpstreamError,
    UpstreamRateLimitedError,
    UpstreamTokenIdsError,
    UpstreamUnreachableError,
)
from gymserve.protocol import ChatCompletionDict, ChatRequest, get_token_info

if TYPE_CHECKING:
    from gymserve.backends.responses_over_chat import ChatAnswer
from gymserve.redaction import redact_url

log = logging.getLogger("gymserve.backends")

_PLACEHOLDER_KEY = "EMPTY"  # what vLLM's docs use; never let the SDK pick up OPENAI_API_KEY for a self-hosted server


def secret_value(secret: Any) -> str | None:
    return secret.get_secret_value() if secret is not None else None


class ChatBackend(Backend):
    """A remote Chat Completions server (``ChatBackendConfig``); base class of the OpenAI and
    Azure backends, which change URLs, clients and the Responses route.

    ``max_queue`` bounds the requests waiting for one of ``num_concurrent_requests`` slots
    (``OverloadedError`` beyond). Errors: everything upstream becomes a ``GymserveError`` from
    ``upstream_errors.translate_error``.
    """

    name = "chat"
    # Non-streamed chat calls go through gymserve.backends.http (aiohttp) rather than the SDK: see
    # that module for the measured reason. Cloud backends keep the SDK, which encodes their rules.
    lean_http = True

    def __init__(self, config: Any, *, max_queue: int = 1024):
        self.config = config
        self._secret_values = tuple(s for s in (secret_value(getattr(config, f, None)) for f in ("api_key", "azure_ad_token")) if s)
        replicas = [Replica(url, self._make_client(url)) for url in self._replica_bases()]
        self._json_clients = {url: self._make_json_client() for url in self._replica_bases()} if self.lean_http else {}
        self.pool = ReplicaPool(replicas, probe=self._probe, interval=getattr(config, "health_check_interval", 0))
        # Built inside the serving loop (server.run), this probes every replica now, so /health
        # is true from start-up; built outside a loop, the first request or /health starts it.
        self.pool.start()
        self.limiter = Limiter(config.num_concurrent_requests, max_queue, name=f"{self.name} backend")
        self._tool_parser = self._reasoning_parser = None
        if getattr(config, "tool_parser", None):
            from gymserve.parsers import tool_call_parser_for

            self._tool_parser = tool_call_parser_for(config.tool_parser, model_name=config.model)[0]
        if getattr(config, "reasoning_parser", None):
            from gymserve.parsers import get_reasoning_parser

            self._reasoning_parser = get_reasoning_parser(config.reasoning_parser)

    @classmethod
    def from_config(cls, config: Any, *, max_queue: int = 1024) -> ChatBackend:
        return cls(config, max_queue=max_queue)

    @property
    def secrets(self) -> tuple[str, ...]:
        return self._secret_values

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "target": self._target(), "model": self.config.model,
                "tool_call_parser": getattr(self._tool_parser, "name", None),
                "reasoning_parser": getattr(self._reasoning_parser, "name", None)}

    # ------------------------------------------------------------------ per-backend hooks
    def _replica_bases(self) -> list[str]:
        return list(self.config.base_urls)

    def _target(self) -> str:
        return ", ".join(redact_url(u) for u in self.config.base_urls)

    def _make_client(self, base_url: str) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=base_url, api_key=secret_value(self.config.api_key) or _PLACEHOLDER_KEY,
                           default_query=self.config.default_query or None,
                           default_headers=self.config.default_headers or None,
                           timeout=self.config.timeout, max_retries=0)

    def _make_json_client(self):
        from gymserve.backends.http import JSONClient

        key = secret_value(self.config.api_key) or _PLACEHOLDER_KEY
        return JSONClient(headers={"Authorization": f"Bearer {key}", **(self.config.default_headers or {})},
                          params=self.config.default_query, limit=self.config.num_concurrent_requests,
                          timeout=self.config.timeout)

    def _url(self, replica: Replica, kind: str) -> str:
        path = {"chat": "/chat/completions", "responses": "/responses", "models": "/models"}[kind]
        return replica.base_url + path

    def _upstream_model(self, request: dict[str, Any]) -> str | None:
        return self.config.model or request.get("model")

    @property
    def api_version(self) -> str | None:
        return getattr(self.config, "api_version", None)

    def convert_options(self):
        from gymserve.convert import ConvertOptions

        cfg = self.config
        return ConvertOptions(reasoning_mode=cfg.reasoning_mode, developer_role=cfg.developer_role or "system",
                              max_tokens_field=cfg.max_tokens_field or "max_tokens")

    # ------------------------------------------------------------------ the one call path
    @property
    def _probe_timeout(self) -> float:
        return min(5.0, self.config.timeout)

    async def _probe(self, replica: Replica) -> None:
        """``GET {base}/models``: the one route every OpenAI-compatible server answers under the same
        base URL, key and proxy as the model calls (``/health`` sits at a server-specific place
        outside the base URL, or nowhere, and checks no key). Raises the translated error."""
        url = self._url(replica, "models")
        try:
            async with asyncio.timeout(self._probe_timeout):
                await replica.client.get(url, cast_to=object, options={"timeout": self._probe_timeout})
        except Exception as exc:
            raise translate_error(exc, url=url, kind="models", backend=self.name, secrets=self._secrets,
                                  api_version=self.api_version, timeout=self._probe_timeout) from None

    def _translate(self, exc: BaseException, url: str, kind: str) -> GymserveError:
        return translate_error(exc, url=url, kind=kind, backend=self.name, secrets=self._secret_values,
                               api_version=self.api_version, timeout=self.config.timeout)

    async def _call(self, kind: str, body: dict[str, Any] | None, ctx: RequestContext, *, stream: bool = False,
                    replica: Replica | None = None, url: str | None = None) -> tuple[Any, Replica]:
        """POST ``body`` (GET when None) to the ``kind`` URL of a replica; retries connection
        errors, 5xx and 429 with backoff (on another replica when the first is unreachable).
        Returns ``(parsed JSON or SDK stream, replica)``; raises a translated ``GymserveError``."""
        from openai import AsyncStream

        attempt = 0
        # At start-up, choose among replicas known to answer (bounded: a hanging one costs one probe timeout).
        await self.pool.first_probe(self._probe_timeout)
        while True:
            rep = replica or self.pool.pick(ctx.session_id)
            target = url or self._url(rep, kind)
            ctx.extra["replica"] = replica_label(rep.base_url)
            rep.in_flight += 1
            try:
                # httpx's timeout bounds each read, not the whole answer: an upstream that trickles
                # a byte at a time would never time out. The deadline bounds the whole call (for
                # streams: until the headers arrive; each chunk is then bounded by the read timeout).
                async with asyncio.timeout(self.config.timeout):
                    if body is None:
                        result = await rep.client.get(target, cast_to=object)
                    elif stream:
                        result = await rep.client.post(target, body=body, cast_to=object, stream=True,
                                                       stream_cls=AsyncStream[object])
                    elif rep.base_url in self._json_clients:
                        result = await self._json_clients[rep.base_url].post(target, body)
                    else:
                        result = await rep.client.post(target, body=body, cast_to=object)
            except Exception as exc:
                err = self._translate(exc, target, kind)
                if isinstance(err, UpstreamUnreachableError):
                    self.pool.mark_down(rep, err.message)
                if attempt >= self.config.max_retries or not is_retryable(err):
                    raise err from None
                asked = err.upstream_retry_after if isinstance(err, UpstreamRateLimitedError) else None
                delay = backoff_delay(attempt, self.config.retry_backoff, asked)
                attempt += 1
                log.warning("retry %d/%d of %s in %.2f s: %s", attempt, self.config.max_retries,
                            redact_url(target), delay, err.message)
                await asyncio.sleep(delay)
                continue
            finally:
                rep.in_flight -= 1
            self.pool.mark_up(rep)
            if not stream and not isinstance(result, dict):
                raise UpstreamBadResponseError(
                    f"{redact_url(target)} answered with something that is not a JSON object "
                    f"({str(result)[:120]!r}); is the base URL an OpenAI-compatible API?", url=redact_url(target))
            return result, rep

    # ------------------------------------------------------------------ chat
    @property
    def _wants_token_ids(self) -> bool:
        return bool(getattr(self.config, "return_token_id_information", False))

    def _chat_body(self, request: ChatRequest) -> dict[str, Any]:
        cfg = self.config
        body = {**copy.deepcopy(cfg.extra_body), **request}
        body.pop("stream", None)
        body.pop("stream_options", None)
        if cfg.chat_template_kwargs or request.get("chat_template_kwargs"):
            body["chat_template_kwargs"] = {**cfg.chat_template_kwargs, **(request.get("chat_template_kwargs") or {})}
        model = self._upstream_model(request)
        if model:
            body["model"] = model
        if getattr(cfg, "return_token_id_information", False):
            body.update(return_token_ids=True, logprobs=True, return_tokens_as_token_ids=True)
            body.setdefault("top_logprobs", 0)
        return body

    async def _chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """The upstream completion, post-processed; raises ``ContextLengthExceededError`` on overflow."""
        body = self._chat_body(request)
        async with self.limiter.slot():
            completion, replica = await self._call("chat", body, ctx)
            choices = completion.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise UpstreamError(f"{redact_url(self._url(replica, 'chat'))} returned a chat completion without choices")
            if getattr(self.config, "return_token_id_information", False):
                await self._attach_token_info(completion, request, body, replica, ctx)
        for choice in choices:
            if isinstance(choice.get("message"), dict):
                mirror_reasoning(choice["message"])
                apply_parsers(choice, request.get("tools"), self._tool_parser, self._reasoning_parser)
                normalize_tool_call_arguments(choice["message"])
        if self.config.served_model_name:
            completion["model"] = self.config.served_model_name
        return completion

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """POST ``{base}/chat/completions``; an upstream context overflow gives an empty
        ``finish_reason: length`` completion (``context_exceeded_chat_completion``)."""
        try:
            return await self._chat(request, ctx)
        except ContextLengthExceededError as exc:
            from gymserve.convert import context_exceeded_chat_completion

            log.info("context window exceeded upstream; answering with an empty length-terminated reply: %s", exc.message)
            return context_exceeded_chat_completion(request, self.config.served_model_name or request.get("model") or "")

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Upstream chunks passed through (reasoning field mirrored), their raw text parsed as it
        arrives when ``tool_parser`` / ``reasoning_parser`` are set (``raw_text``). With
        ``return_token_id_information`` the token metadata vLLM streams (``prompt_token_ids`` on
        the first chunk, ``token_ids`` and ``logprobs`` on each) is collected and the training
        fields ride on the finish chunk's delta, as on the local engine's stream; an overflow gives
        the chunks of the empty length-terminated completion."""
        tokens = StreamedTokens(bool(request.get("logprobs"))) if self._wants_token_ids else None
        parsed = None
        if self._tool_parser or self._reasoning_parser:
            parsed = ParsedChunkStream(request.get("tools"), self._tool_parser, self._reasoning_parser)
        plain_body = self._chat_body(request)  # also what /tokenize renders, if the prompt IDs are missing
        body = {**plain_body, "stream": True}
        if request.get("stream_options"):
            body["stream_options"] = request["stream_options"]
        async with self.limiter.slot():
            try:
                stream, replica = await self._call("chat", body, ctx, stream=True)
            except ContextLengthExceededError:
                from gymserve.convert import context_exceeded_chat_completion

                for chunk in completion_to_chunks(context_exceeded_chat_completion(request, request.get("model") or "")):
                    yield chunk
                return
            got_chunk = False
            try:
                call_index: dict[tuple[int, str], int] = {}  # (choice, call id) -> index, for servers that omit it
                async for chunk in stream:
                    got_chunk = True
                    chunk = checked_chunk(chunk, redact_url(self._url(replica, "chat")), call_index)
                    if self.config.served_model_name:
                        chunk["model"] = self.config.served_model_name
                    if tokens is not None:
                        tokens.take(chunk)
                    for piece in parsed.process(chunk) if parsed is not None else [chunk]:
                        if tokens is not None and tokens.is_finish(piece):
                            await self._attach_token_info(tokens.completion(piece), request, plain_body, replica, ctx)
                        yield piece
                if not got_chunk:
                    where = redact_url(self._url(replica, "chat"))
                    raise UpstreamBadResponseError(
                        f"{where} answered a streaming request without any events (not server-sent events, or an "
                        "empty stream); does the server support stream=true?", url=where)
                if tokens is not None and not tokens.finished:
                    where = redact_url(self._url(replica, "chat"))
                    raise UpstreamTokenIdsError(
                        f"{where} ended the stream without a finish_reason, so the token IDs of the generation are "
                        "incomplete; is the server cutting streams short?", url=where)
            except Exception as exc:
                raise self._translate(exc, self._url(replica, "chat"), "chat") from None
            finally:
                with contextlib.suppress(Exception):
                    await stream.close()

    # ------------------------------------------------------------------ responses, models, health
    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The upstream's completion for the Responses path, which answers an overflow itself
        (``ContextLengthExceededError`` propagates)."""
        from gymserve.backends.responses_over_chat import ChatAnswer

        return ChatAnswer.of_completion(await self._chat(request, ctx))

    async def upstream_models(self, ctx: RequestContext | None = None) -> list[str]:
        """IDs from ``GET {base}/models`` of one replica (raises the translated error)."""
        result, _ = await self._call("models", None, ctx or RequestContext())
        return [m.get("id") for m in result.get("data") or [] if isinstance(m, dict) and m.get("id")]

    async def models(self) -> list[str]:
        name = self.config.served_model_name or self.config.model
        return [name] if name else await self.upstream_models()

    async def health(self) -> dict[str, Any]:
        """The pool's status (``ReplicaPool.status``: ok / degraded / down, per replica its URL,
        health, last probe time and last error) once the first probe round is in; URLs without
        credentials. ``probe`` names what is asked of each replica."""
        await self.pool.first_probe(self._probe_timeout)
        status = self.pool.status()
        for row in status["replicas"]:
            row["base_url"] = replica_label(row["base_url"])
        probe = "GET {base_url}/models" if self.pool.probing else None
        return {**status, "backend": self.name, "probe": probe}

    async def close(self) -> None:
        await self.pool.close()
        for replica in self.pool.replicas:
            with contextlib.suppress(Exception):
                await replica.client.close()
        for client in self._json_clients.values():
            with contextlib.suppress(Exception):
                await client.close()

    # ------------------------------------------------------------------ post-processing
    async def _attach_token_info(self, completion: dict[str, Any], request: ChatRequest, body: dict[str, Any],
                                 replica: Replica, ctx: RequestContext) -> None:
        where = redact_url(self._url(replica, "chat"))
        choice = completion["choices"][0]
        msg = choice.setdefault("message", {})
        try:
            if get_token_info(msg) is not None:
                return
            prompt, gen, logprobs = vllm_token_fields(completion, choice)
            if gen is None or logprobs is None:
                missing = "generation token IDs" if gen is None else "log-probs"
                raise InvalidRequestError(
                    f"no {missing} in the answer; return_token_id_information needs a server that honours "
                    "return_token_ids or logprobs + return_tokens_as_token_ids (vLLM ≥ 0.10.2), or set "
                    "return_token_id_information: false")
            if prompt is None:
                prompt = await self._tokenize(body, replica, ctx)
            msg.update(prompt_token_ids=prompt, generation_token_ids=gen, generation_log_probs=logprobs)
            get_token_info(msg)
        except InvalidRequestError as exc:
            raise UpstreamTokenIdsError(f"token metadata from {where} is unusable: {exc.message}", url=where) from None
        if not request.get("logprobs"):
            choice["logprobs"] = None

    async def _tokenize(self, body: dict[str, Any], replica: Replica, ctx: RequestContext) -> list[int]:
        """Prompt IDs from vLLM's ``POST {root}/tokenize`` (root = base URL without ``/v1``), same replica."""
        root = replica.base_url.removesuffix("/v1")
        tbody = {"model": body.get("model"), "messages": body.get("messages"), "add_generation_prompt": True}
        for key in ("tools", "chat_template_kwargs"):
            if body.get(key):
                tbody[key] = body[key]
        try:
            result, _ = await self._call("tokenize", tbody, ctx, replica=replica, url=f"{root}/tokenize")
        except GymserveError as exc:
            raise InvalidRequestError(f"no prompt_token_ids in the answer and the /tokenize fallback failed: {exc.message}") from None
        tokens = result.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise InvalidRequestError(f"{root}/tokenize returned no token list")
        return tokens


@functools.lru_cache(maxsize=1024)
def replica_label(base_url: str) -> str:
    """A replica's name in metrics and capture: its base URL without credentials (``redact_url``)."""
    return redact_url(base_url)

