"""Request schemas for the OpenAPI document, generated from the openai SDK's own request types.

``CompletionCreateParams`` and ``ResponseCreateParams`` are the SDK's TypedDicts; pydantic turns
them into JSON Schema. Their ``$defs`` are moved under ``components/schemas`` (OpenAPI resolves
``$ref`` against the whole document), prefixed to avoid clashes between the two.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _schemas() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from openai.types.chat import CompletionCreateParams
    from openai.types.responses import ResponseCreateParams
    from pydantic import TypeAdapter

    components: dict[str, Any] = {}
    out = []
    # Both are Unions of TypedDicts: typing special forms, which mypy will not take as a TypeAdapter's
    # type[T], so the pair is typed Any (the adapters are TypeAdapter[Any] either way).
    params: tuple[tuple[str, Any], ...] = (("Chat", CompletionCreateParams), ("Responses", ResponseCreateParams))
    for prefix, typed in params:
        schema = TypeAdapter(typed).json_schema(ref_template=f"#/components/schemas/{prefix}{{model}}")
        for name, sub in schema.pop("$defs", {}).items():
            components[prefix + name] = sub
        out.append(schema)
    chat, responses = json.loads(json.dumps(out[0])), json.loads(json.dumps(out[1]))
    # The SDK leaves `input` optional (stored conversations); gymserve stores none, so it is required.
    responses["required"] = sorted(set(responses.get("required", [])) | {"input"})
    return chat, responses, components


def chat_request_schema() -> dict[str, Any]:
    return _schemas()[0]


def responses_request_schema() -> dict[str, Any]:
    return _schemas()[1]


def install_openapi(app) -> None:
    """Publish the SDK request schemas in ``app``'s OpenAPI document (built once, on first request)."""
    original = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        doc = original()
        chat, responses, components = _schemas()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
        error = {
            "description": "OpenAI error object",
            "content": {
                "application/json": {
                    "schema": {"type": "object", "properties": {"error": {"type": "object"}}, "required": ["error"]}
                }
            },
        }
        for path, schema, summary in (
            ("/v1/chat/completions", chat, "Create a chat completion"),
            ("/v1/responses", responses, "Create a model response"),
        ):
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
                        "400": error,
                        "401": error,
                        "413": error,
                        "429": error,
                        "502": error,
                    },
                }
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
