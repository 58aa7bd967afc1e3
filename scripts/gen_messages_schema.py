"""Generate ``src/gymserve/server/messages_schema.json``: the request schemas of ``POST /v1/messages``
and ``POST /v1/messages/count_tokens`` in gymserve's OpenAPI document.

    python scripts/gen_messages_schema.py          # rewrite the file from the installed anthropic SDK
    python scripts/gen_messages_schema.py --check  # exit 1 when the committed file is out of date

The schemas are the anthropic SDK's ``MessageCreateParams`` and ``MessageCountTokensParams`` as
pydantic writes them (``$defs`` under ``components/schemas``, prefixed ``Messages``), narrowed to the
request gymserve serves rather than all of Anthropic's: content blocks are the ones
``convert.messages_to_chat`` converts (text, thinking, redacted_thinking, tool_use, tool_result with
text), tools are client tools (no server tools, no ``container``), ``max_tokens`` is at least 1, and
they gain the sampling fields the API takes that recent SDK releases no longer name
(``temperature``, ``top_p``, ``top_k``: Anthropic's ``anthropic-version: 2023-06-01`` reference,
vLLM's Messages endpoint) and gymserve's ``chat_template_kwargs`` extension. Without the server-tool
unions the schema is a fifth of the SDK's, which also keeps schema fuzzing affordable. Generated
ahead of time because importing ``anthropic.types`` takes seconds (``server.schemas``);
``tests/server/test_server_messages.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "gymserve" / "server" / "messages_schema.json"

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


def _sorted_enums(node: Any) -> Any:
    """``node`` with every ``enum`` list sorted: pydantic writes some from sets, whose order changes
    with the process's string hash seed."""
    if isinstance(node, dict):
        out = {k: _sorted_enums(v) for k, v in node.items()}
        if isinstance(out.get("enum"), list) and all(isinstance(v, str) for v in out["enum"]):
            out["enum"] = sorted(out["enum"])
        return out
    if isinstance(node, list):
        return [_sorted_enums(v) for v in node]
    return node


def build() -> str:
    """The file's text, from the installed anthropic SDK."""
    from anthropic.types import MessageCountTokensParams, MessageCreateParams
    from pydantic import TypeAdapter

    components: dict[str, Any] = {}
    out = []
    params: tuple[Any, ...] = (MessageCreateParams, MessageCountTokensParams)  # Unions of TypedDicts
    for typed in params:
        schema = TypeAdapter(typed).json_schema(ref_template=_REF + "Messages{model}")
        for name, sub in schema.pop("$defs", {}).items():
            components["Messages" + name] = sub  # the count request's $defs are the create request's
        out.append(schema)
    create, count = out
    for name in _MESSAGES_ROOTS:
        components[name]["properties"].update(_MESSAGES_EXTRAS)
        components[name]["properties"]["max_tokens"]["minimum"] = 1  # 0 (cache pre-warming) is refused here
    count.setdefault("properties", {})["chat_template_kwargs"] = _MESSAGES_EXTRAS["chat_template_kwargs"]
    _as_served([create, count], components)
    doc = {"create": create, "count_tokens": count, "components": dict(sorted(components.items()))}
    return json.dumps(_sorted_enums(doc), indent=1) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is out of date")
    args = parser.parse_args()
    text = build()
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/gen_messages_schema.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
