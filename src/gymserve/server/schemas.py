"""Request schemas for the OpenAPI document, generated from the official SDKs' own request types.

``CompletionCreateParams`` (chat and legacy completions) and ``ResponseCreateParams`` are the
openai SDK's TypedDicts; pydantic turns them into JSON Schema when the document is first asked for.
Their ``$defs`` are moved under ``components/schemas`` (OpenAPI resolves ``$ref`` against the whole
document), prefixed to avoid clashes. ``/tokenize`` and ``/detokenize`` have no SDK type: their
schemas are vLLM's request models (``TokenizeCompletionRequest`` | ``TokenizeChatRequest``,
``DetokenizeRequest``) written here as pydantic models with the same fields.

The Messages schemas (``POST /v1/messages`` and ``/v1/messages/count_tokens``) come from the
anthropic SDK's ``MessageCreateParams`` and ``MessageCountTokensParams`` the same way, but ahead of
time: ``scripts/gen_messages_schema.py`` writes them to ``messages_schema.json`` beside this module
(a test checks it is current), because importing ``anthropic.types`` takes seconds — longer than a
client waits for ``/openapi.json``. See that script for how they are narrowed to what gymserve
serves.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


class _Tokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = Field(None, description="also return the tokenizer's token strings")


class TokenizePromptRequest(_Tokenize):
    """vLLM's ``TokenizeCompletionRequest``: a prompt tokenized as ``/v1/completions`` tokenizes it
    (``add_special_tokens`` default true)."""

    prompt: str


class TokenizeChatRequest(_Tokenize):
    """vLLM's ``TokenizeChatRequest``: messages rendered through the chat template as generation
    would see them (``add_special_tokens`` default false), plus NeMo RL's ``required_prefix_token_ids``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool | None = Field(None, description="default true")
    continue_final_message: bool | None = Field(None, description="default false; not with add_generation_prompt")
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    required_prefix_token_ids: list[Annotated[int, Field(ge=0)]] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's ``DetokenizeRequest``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


MESSAGES_SCHEMA_FILE = "messages_schema.json"


@lru_cache(maxsize=1)
def _schemas() -> dict[str, Any]:
    """``{"chat", "responses", "completions", "tokenize", "detokenize", "messages", "count_tokens",
    "components"}``."""
    from openai.types import CompletionCreateParams as LegacyCompletionCreateParams
    from openai.types.chat import CompletionCreateParams
    from openai.types.responses import ResponseCreateParams
    from pydantic import TypeAdapter

    components: dict[str, Any] = {}
    out: dict[str, Any] = {}
    # Unions of TypedDicts are typing special forms, which mypy will not take as a TypeAdapter's
    # type[T], so the table is typed Any (the adapters are TypeAdapter[Any] either way).
    params: tuple[tuple[str, str, Any], ...] = (
        ("chat", "Chat", CompletionCreateParams),
        ("responses", "Responses", ResponseCreateParams),
        ("completions", "Completions", LegacyCompletionCreateParams),
        ("tokenize", "Tokenize", TokenizePromptRequest | TokenizeChatRequest),
        ("detokenize", "Detokenize", DetokenizeRequest),
    )
    for key, prefix, typed in params:
        schema = TypeAdapter(typed).json_schema(ref_template=f"#/components/schemas/{prefix}{{model}}")
        for name, sub in schema.pop("$defs", {}).items():
            components[prefix + name] = sub
        out[key] = json.loads(json.dumps(schema))
    # The SDK leaves `input` optional (stored conversations); gymserve stores none, so it is required.
    out["responses"]["required"] = sorted(set(out["responses"].get("required", [])) | {"input"})
    generated = json.loads((Path(__file__).with_name(MESSAGES_SCHEMA_FILE)).read_text(encoding="utf-8"))
    components.update(generated["components"])
    out["messages"], out["count_tokens"] = generated["create"], generated["count_tokens"]
    out["components"] = components
    return out


def chat_request_schema() -> dict[str, Any]:
    return _schemas()["chat"]


def responses_request_schema() -> dict[str, Any]:
    return _schemas()["responses"]


def messages_request_schema() -> dict[str, Any]:
    return _schemas()["messages"]


def install_openapi(app) -> None:
    """Publish the SDK request schemas in ``app``'s OpenAPI document (built once, on first request)."""
    original = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        doc = original()
        schemas = _schemas()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas["components"])
        error = {
            "description": "OpenAI error object",
            "content": {
                "application/json": {
                    "schema": {"type": "object", "properties": {"error": {"type": "object"}}, "required": ["error"]}
                }
            },
        }
        anthropic_error = {
            "description": "Anthropic error object",
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "properties": {"type": {"const": "error"}, "error": {"type": "object"}},
                        "required": ["type", "error"],
                    }
                }
            },
        }
        for path, schema, summary in (
            ("/v1/chat/completions", schemas["chat"], "Create a chat completion"),
            ("/v1/responses", schemas["responses"], "Create a model response"),
            ("/v1/completions", schemas["completions"], "Create a completion"),
            ("/tokenize", schemas["tokenize"], "Tokenize a prompt or chat messages"),
            ("/detokenize", schemas["detokenize"], "Detokenize token IDs"),
            ("/v1/messages", schemas["messages"], "Create a message"),
        ):
            errors = anthropic_error if path == "/v1/messages" else error
            doc["paths"][path] = {
                "post": {
                    "summary": summary,
                    "operationId": summary.lower().replace(" ", "_"),
                    "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                    "responses": {
                        "200": {
                            "description": "the answer (JSON, or server-sent events when a model call "
                            "sets stream: true)",
                            "content": {
                                "application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}},
                            },
                        },
                        **{status: errors for status in ("400", "401", "413", "429", "501", "502")},
                        **({"529": errors} if path == "/v1/messages" else {}),
                    },
                }
            }
        doc["paths"]["/v1/messages/count_tokens"] = {
            "post": {
                "summary": "Count tokens in a message",
                "operationId": "count_tokens_in_a_message",
                "requestBody": {"required": True, "content": {"application/json": {"schema": schemas["count_tokens"]}}},
                "responses": {
                    "200": {
                        "description": '{"input_tokens": N}: the prompt as generation would see it',
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "400": anthropic_error,
                    "501": anthropic_error,
                },
            }
        }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
