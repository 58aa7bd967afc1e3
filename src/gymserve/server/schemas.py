"""Request schemas for the OpenAPI document, generated from the official SDKs' own request types.

``CompletionCreateParams`` and ``ResponseCreateParams`` are the openai SDK's TypedDicts; pydantic
turns them into JSON Schema when the document is first asked for. Their ``$defs`` are moved under
``components/schemas`` (OpenAPI resolves ``$ref`` against the whole document), prefixed to avoid
clashes between them.

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
from typing import Any

MESSAGES_SCHEMA_FILE = "messages_schema.json"


@lru_cache(maxsize=1)
def _schemas() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    from openai.types.chat import CompletionCreateParams
    from openai.types.responses import ResponseCreateParams
    from pydantic import TypeAdapter

    components: dict[str, Any] = {}
    out = []
    # All are Unions of TypedDicts: typing special forms, which mypy will not take as a TypeAdapter's
    # type[T], so the tuple is typed Any (the adapters are TypeAdapter[Any] either way).
    params: tuple[tuple[str, Any], ...] = (("Chat", CompletionCreateParams), ("Responses", ResponseCreateParams))
    for prefix, typed in params:
        schema = TypeAdapter(typed).json_schema(ref_template=f"#/components/schemas/{prefix}{{model}}")
        for name, sub in schema.pop("$defs", {}).items():
            components[prefix + name] = sub
        out.append(schema)
    chat, responses = (json.loads(json.dumps(schema)) for schema in out)
    # The SDK leaves `input` optional (stored conversations); gymserve stores none, so it is required.
    responses["required"] = sorted(set(responses.get("required", [])) | {"input"})
    generated = json.loads((Path(__file__).with_name(MESSAGES_SCHEMA_FILE)).read_text(encoding="utf-8"))
    components.update(generated["components"])
    return chat, responses, generated["create"], generated["count_tokens"], components


def chat_request_schema() -> dict[str, Any]:
    return _schemas()[0]


def responses_request_schema() -> dict[str, Any]:
    return _schemas()[1]


def messages_request_schema() -> dict[str, Any]:
    return _schemas()[2]


def install_openapi(app) -> None:
    """Publish the SDK request schemas in ``app``'s OpenAPI document (built once, on first request)."""
    original = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        doc = original()
        chat, responses, messages, count_schema, components = _schemas()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
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
            ("/v1/chat/completions", chat, "Create a chat completion"),
            ("/v1/responses", responses, "Create a model response"),
            ("/v1/messages", messages, "Create a message"),
        ):
            errors = anthropic_error if path == "/v1/messages" else error
            doc["paths"][path] = {
                "post": {
                    "summary": summary,
                    "operationId": summary.lower().replace(" ", "_"),
                    "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                    "responses": {
                        "200": {
                            "description": "the completion / response (JSON, or server-sent events "
                            "when stream is true)",
                            "content": {
                                "application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}},
                            },
                        },
                        **{status: errors for status in ("400", "401", "413", "429", "502")},
                        **({"529": errors} if path == "/v1/messages" else {}),
                    },
                }
            }
        doc["paths"]["/v1/messages/count_tokens"] = {
            "post": {
                "summary": "Count tokens in a message",
                "operationId": "count_tokens_in_a_message",
                "requestBody": {"required": True, "content": {"application/json": {"schema": count_schema}}},
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
