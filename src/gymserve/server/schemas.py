"""Request schemas for the OpenAPI document, generated from the official SDKs' own request types.

``CompletionCreateParams`` and ``ResponseCreateParams`` are the openai SDK's TypedDicts,
``MessageCreateParams`` the anthropic SDK's; pydantic turns them into JSON Schema. Their ``$defs``
are moved under ``components/schemas`` (OpenAPI resolves ``$ref`` against the whole document),
prefixed to avoid clashes between them.

The Messages schema is the request gymserve serves, not all of Anthropic's: content blocks are the
ones it converts (text, thinking, redacted_thinking, tool_use, tool_result with text), tools are
client tools (no server tools, no ``container``: ``convert.messages_to_chat`` refuses the rest), and
it gains the sampling fields the API takes that this SDK release leaves out (``temperature``,
``top_p``, ``top_k``: Anthropic's ``anthropic-version: 2023-06-01`` reference, vLLM's Messages
endpoint) and gymserve's ``chat_template_kwargs`` extension. Without the server-tool unions the
schema is a fraction of the SDK's, which also keeps schema fuzzing affordable.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

_MESSAGES_EXTRAS = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 1, "title": "Temperature"},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "title": "Top P"},
    "top_k": {"type": "integer", "minimum": 0, "title": "Top K"},
    "chat_template_kwargs": {"type": "object", "title": "Chat Template Kwargs"},
}
# What messages_to_chat converts: anthropic.types names (params, and the response blocks the SDK
# lets a harness pass back as they came).
_SERVED_BLOCKS = frozenset(
    {
        "TextBlockParam",
        "ThinkingBlockParam",
        "RedactedThinkingBlockParam",
        "ToolUseBlockParam",
        "ToolResultBlockParam",
        "TextBlock",
        "ThinkingBlock",
        "RedactedThinkingBlock",
        "ToolUseBlock",
    }
)
_REF = "#/components/schemas/"


def _keep(union: Any, allowed: frozenset[str], prefix: str = "Messages") -> None:
    """Drop from an ``anyOf`` of ``$ref``s (in place) the refs whose type is not in ``allowed``."""
    if isinstance(union, dict) and isinstance(union.get("anyOf"), list):
        union["anyOf"] = [
            r for r in union["anyOf"] if r.get("$ref", "").removeprefix(_REF + prefix) in allowed or "$ref" not in r
        ]


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].removeprefix(_REF)} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _as_served(roots: list[dict[str, Any]], components: dict[str, Any]) -> None:
    """Narrow the Messages components to the request gymserve serves (module docstring), in place,
    and drop the components nothing refers to any more."""
    for role in ("UserMessageParam", "AssistantMessageParam"):
        content = components["Messages" + role]["properties"]["content"]
        for option in content.get("anyOf", []):
            _keep(option.get("items"), _SERVED_BLOCKS)
    for option in components["MessagesToolResultBlockParam"]["properties"]["content"].get("anyOf", []):
        _keep(option.get("items"), frozenset({"TextBlockParam"}))
    for schema in (*roots, *(components[n] for n in _MESSAGES_ROOTS)):
        properties = schema.get("properties", {})
        properties.pop("container", None)
        if "tools" in properties:
            _keep(properties["tools"].get("items"), frozenset({"ToolParam"}))
    reachable: set[str] = set()
    todo = _refs(roots)
    while todo:
        name = todo.pop()
        if name not in reachable and name in components:
            reachable.add(name)
            todo |= _refs(components[name])
    for name in [n for n in components if n.startswith("Messages") and n not in reachable]:
        del components[name]


_MESSAGES_ROOTS = ("MessagesMessageCreateParamsNonStreaming", "MessagesMessageCreateParamsStreaming")


@lru_cache(maxsize=1)
def _schemas() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    from anthropic.types import MessageCountTokensParams, MessageCreateParams
    from openai.types.chat import CompletionCreateParams
    from openai.types.responses import ResponseCreateParams
    from pydantic import TypeAdapter

    components: dict[str, Any] = {}
    out = []
    # All are Unions of TypedDicts: typing special forms, which mypy will not take as a TypeAdapter's
    # type[T], so the tuple is typed Any (the adapters are TypeAdapter[Any] either way).
    params: tuple[tuple[str, Any], ...] = (
        ("Chat", CompletionCreateParams),
        ("Responses", ResponseCreateParams),
        ("Messages", MessageCreateParams),
        ("Messages", MessageCountTokensParams),  # its $defs are the create request's, under the same names
    )
    for prefix, typed in params:
        schema = TypeAdapter(typed).json_schema(ref_template=f"#/components/schemas/{prefix}{{model}}")
        for name, sub in schema.pop("$defs", {}).items():
            components[prefix + name] = sub
        out.append(schema)
    chat, responses, messages, count = (json.loads(json.dumps(schema)) for schema in out)
    # The SDK leaves `input` optional (stored conversations); gymserve stores none, so it is required.
    responses["required"] = sorted(set(responses.get("required", [])) | {"input"})
    for name in _MESSAGES_ROOTS:
        components[name]["properties"].update(_MESSAGES_EXTRAS)
        components[name]["properties"]["max_tokens"]["minimum"] = 1  # 0 (cache pre-warming) is refused here
    count.setdefault("properties", {})["chat_template_kwargs"] = _MESSAGES_EXTRAS["chat_template_kwargs"]
    _as_served([messages, count], components)
    return chat, responses, messages, count, components


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
