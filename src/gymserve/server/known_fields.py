"""One rule for input gymserve does not apply: a query parameter or a top-level body field that no
route applies is a 400 naming it (``code: unknown_parameter``), never accepted and dropped.

This module is the one place that says which names each route takes:

- **Query parameters.** A FastAPI route's declared query parameters (``/pause``'s ``mode`` and
  ``timeout``...) are what its handler receives, so they are read from the route itself;
  ``QUERY_PARAMS`` adds the parameters of the plain Starlette routes (the model routes take none).
  ``COMPAT_IGNORED_QUERY`` lists the parameters deliberately accepted without effect, each with why
  (``docs/reference/http-api.md`` lists them too). ``UnknownQueryCheck`` (an ASGI middleware)
  refuses the rest on every route, control routes included, before the handler runs.
- **Body fields.** ``BODY_FIELDS`` holds, per model route, the top-level fields gymserve takes
  beyond the official SDK's request type for that API (vLLM's and NeMo RL's extensions, gymserve's
  own), as plain data: a feature that starts applying a new field registers it here, in one
  line. ``check_body_fields`` refuses anything else on ``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/responses``, ``/v1/messages`` and ``/v1/messages/count_tokens`` (the
  control and LoRA routes' bodies are pydantic models with ``extra="forbid"``, ``/tokenize``'s are
  checked by ``convert.tokenize_request``: the same rule).

The answer is the route's own error shape: OpenAI's error object, Anthropic's on ``/v1/messages``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any
from urllib.parse import parse_qsl

from gymserve.errors import InvalidRequestError

# Query parameters of the routes that declare none through FastAPI (Starlette routes): path -> names.
QUERY_PARAMS: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset(),
    "/v1/completions": frozenset(),
    "/v1/responses": frozenset(),
    "/v1/messages": frozenset(),
    "/v1/messages/count_tokens": frozenset(),
    "/tokenize": frozenset(),
    "/detokenize": frozenset(),
}

# Parameters accepted without effect, so that an official SDK pointed at gymserve works: (path or
# "*" for every route, name) -> why.
COMPAT_IGNORED_QUERY: dict[tuple[str, str], str] = {
    ("/v1/messages", "beta"): "the anthropic SDK's client.beta.messages adds ?beta=true; gymserve serves one "
    "Messages API, beta or not",
    ("/v1/messages/count_tokens", "beta"): "as /v1/messages",
    ("*", "api-version"): "the openai SDK's AzureOpenAI client adds ?api-version=... to every call; gymserve "
    "serves one version of each API",
}

# Top-level body fields each model route takes beyond the official SDK's request type (the openai
# SDK's CompletionCreateParams / ResponseCreateParams, the anthropic SDK's MessageCreateParams).
# Extensions every chat-shaped route shares: gymserve's training fields and NeMo RL's prefix.
_TRAINING = frozenset({"required_prefix_token_ids", "return_token_id_information"})
# vLLM's chat/completions extensions gymserve takes (vLLM's ChatCompletionRequest / CompletionRequest).
_VLLM_SAMPLING = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "stop_token_ids",
        "min_tokens",
        "ignore_eos",
        "prompt_logprobs",
        "priority",
        "request_id",
        "cache_salt",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "structural_tag",
        "vllm_xargs",
    }
)
_VLLM_CHAT = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "chat_template",
        "chat_template_kwargs",
        "documents",
        "mm_processor_kwargs",
    }
)
# SGLang's extensions a chat backend forwards to it (``return_meta_info``: the generation's meta_info,
# its weight_version included, on each choice; backends.chat_versions reads it).
_SGLANG = frozenset({"return_meta_info"})
BODY_FIELDS: dict[str, frozenset[str]] = {
    "chat": _TRAINING | _VLLM_SAMPLING | _VLLM_CHAT | _SGLANG,
    "completions": _TRAINING | _VLLM_SAMPLING | _SGLANG | frozenset({"prompt_token_ids"}),
    # Sampling params a chat server or the local engine honours, carried on Responses requests.
    "responses": _TRAINING
    | _VLLM_SAMPLING
    | frozenset({"seed", "stop", "presence_penalty", "frequency_penalty", "chat_template_kwargs"}),
    # NeMo RL's prefix (docs/concepts/messages-api.md); chat_template_kwargs is in the schema already.
    "messages": _TRAINING,
    "count_tokens": _TRAINING,
}


@lru_cache(maxsize=1)
def _sdk_fields() -> dict[str, frozenset[str]]:
    """The official SDKs' request fields per model route (read once; the TypedDicts' keys)."""
    import json
    from pathlib import Path

    from openai.types import CompletionCreateParams as LegacyParams
    from openai.types.chat import CompletionCreateParams as ChatParams
    from openai.types.responses import ResponseCreateParams

    def keys(*types: Any) -> frozenset[str]:
        out: set[str] = set()
        for t in types:
            for member in getattr(t, "__args__", None) or (t,):
                out |= set(getattr(member, "__annotations__", {}))
        return frozenset(out)

    # The anthropic SDK's MessageCreateParams / MessageCountTokensParams, as narrowed to what gymserve
    # serves in messages_schema.json (scripts/gen_messages_schema.py; importing anthropic.types is slow).
    schema = json.loads(Path(__file__).with_name("messages_schema.json").read_text(encoding="utf-8"))
    create: set[str] = set()
    for ref in schema["create"]["anyOf"]:
        create |= set(schema["components"][ref["$ref"].rsplit("/", 1)[-1]]["properties"])
    return {
        "chat": keys(ChatParams),
        "completions": keys(LegacyParams),
        "responses": keys(ResponseCreateParams),
        "messages": frozenset(create),
        "count_tokens": frozenset(schema["count_tokens"]["properties"]),
    }


def known_body_fields(api: str) -> frozenset[str]:
    """Every top-level field the ``api`` route takes: its SDK's request fields and ``BODY_FIELDS``."""
    return _sdk_fields()[api] | BODY_FIELDS[api]


def check_body_fields(body: dict[str, Any], api: str) -> None:
    """Raise ``InvalidRequestError`` (400, ``code: unknown_parameter``, ``param`` the field) for the
    first top-level field of ``body`` the ``api`` route does not take (``known_body_fields``)."""
    known = known_body_fields(api)
    for key in body:
        if key not in known:
            raise InvalidRequestError(
                f"{key} is not a field gymserve applies on this route, so it is refused rather than ignored; "
                "see the route's fields in /openapi.json and docs/reference/http-api.md",
                param=key,
                code="unknown_parameter",
            )


def unknown_query(path: str, names: Iterable[str], declared: frozenset[str] | None) -> str | None:
    """The first of ``names`` the route at ``path`` does not take (None when all are taken):
    ``declared`` are the FastAPI route's query parameters (None for a plain route, read from
    ``QUERY_PARAMS``), and ``COMPAT_IGNORED_QUERY`` is allowed everywhere it says."""
    allowed = declared if declared is not None else QUERY_PARAMS.get(path, frozenset())
    for name in names:
        if name in allowed or (path, name) in COMPAT_IGNORED_QUERY or ("*", name) in COMPAT_IGNORED_QUERY:
            continue
        return name
    return None


class UnknownQueryCheck:
    """ASGI middleware: a request whose query string names a parameter its route does not take is
    answered 400 (``unknown_query``) before the route runs; paths no route serves pass on (404)."""

    def __init__(self, app: Any, *, routes: Any):
        self.app = app
        self._routes = routes  # a callable returning the app's routes (read once, on first use)
        self._declared: dict[str, frozenset[str] | None] | None = None

    def _table(self) -> dict[str, frozenset[str] | None]:
        if self._declared is None:
            table: dict[str, frozenset[str] | None] = {}
            for route in self._routes():
                path = getattr(route, "path", None)
                dependant = getattr(route, "dependant", None)
                if path is None:
                    continue
                if dependant is not None:
                    names = frozenset(p.alias or p.name for p in _query_params(dependant))
                    table[path] = (table.get(path) or frozenset()) | names
                else:
                    table.setdefault(path, None)
            self._declared = table
        return self._declared

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("query_string"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        table = self._table()
        if path in table:
            names = [k for k, _ in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)]
            bad = unknown_query(path, names, table[path])
            if bad is not None:
                from gymserve.server.errors import error_response, is_anthropic_route

                response = error_response(
                    400,
                    f"query parameter {bad!r} is not taken by {scope.get('method', 'POST')} {path}, so it is "
                    "refused rather than ignored; see the route's parameters in /openapi.json",
                    type_="invalid_request_error",
                    param=bad,
                    code="unknown_parameter",
                    anthropic=is_anthropic_route(path),
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _query_params(dependant: Any) -> list[Any]:
    """A FastAPI dependant's query parameters, its sub-dependencies' included."""
    out = list(dependant.query_params)
    for sub in dependant.dependencies:
        out += _query_params(sub)
    return out
