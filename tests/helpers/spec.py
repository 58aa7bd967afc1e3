"""Validate Responses objects and streaming events against the openai SDK types and the Open
Responses OpenAPI spec (``tests/data/spec/openresponses-openapi.json``), and read the public cases
(``tests/data/cases/public.jsonl``). Both files live in the repository (see ``tests/data/README.md``).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
CASES_PATH = DATA_DIR / "cases" / "public.jsonl"
SPEC_PATH = DATA_DIR / "spec" / "openresponses-openapi.json"


def load_cases(*categories: str) -> dict[str, dict[str, Any]]:
    """Public cases by id, from ``tests/data/cases/public.jsonl``, limited to ``categories`` (all if none)."""
    cases = {}
    with open(CASES_PATH) as f:
        for line in f:
            if line.strip():
                case = json.loads(line)
                if not categories or case.get("category") in categories:
                    cases[case["id"]] = case
    return cases


@functools.cache
def _components() -> dict[str, Any]:
    spec = json.loads(SPEC_PATH.read_text())
    components = copy.deepcopy(spec["components"])
    # Spec bug (2026-04-24 copy): JsonSchemaResponseFormat.schema is typed {"type": "null"}, which
    # would reject every real schema the API echoes back; a JSON schema is an object.
    components["schemas"]["JsonSchemaResponseFormat"]["properties"]["schema"] = {"type": "object"}
    return components


@functools.cache
def _validator(schema_name: str) -> jsonschema.protocols.Validator:
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": _components()}
    return jsonschema.Draft202012Validator(schema)


def spec_errors(obj: dict[str, Any], schema_name: str) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(schema_name).iter_errors(obj)]


def assert_valid_response(response: dict[str, Any]) -> None:
    """Valid as ``openai.types.responses.Response`` and as the spec's ``ResponseResource``."""
    Response.model_validate(response)
    errors = spec_errors(response, "ResponseResource")
    assert not errors, errors


def assert_valid_chat_completion(completion: dict[str, Any]) -> None:
    ChatCompletion.model_validate(completion)


_EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedStreamingEvent",
    "response.in_progress": "ResponseInProgressStreamingEvent",
    "response.completed": "ResponseCompletedStreamingEvent",
    "response.failed": "ResponseFailedStreamingEvent",
    "response.incomplete": "ResponseIncompleteStreamingEvent",
    "response.output_item.added": "ResponseOutputItemAddedStreamingEvent",
    "response.output_item.done": "ResponseOutputItemDoneStreamingEvent",
    "response.content_part.added": "ResponseContentPartAddedStreamingEvent",
    "response.content_part.done": "ResponseContentPartDoneStreamingEvent",
    "response.output_text.delta": "ResponseOutputTextDeltaStreamingEvent",
    "response.output_text.done": "ResponseOutputTextDoneStreamingEvent",
    "response.reasoning.delta": "ResponseReasoningDeltaStreamingEvent",
    "response.reasoning.done": "ResponseReasoningDoneStreamingEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaStreamingEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneStreamingEvent",
    "response.refusal.delta": "ResponseRefusalDeltaStreamingEvent",
    "response.refusal.done": "ResponseRefusalDoneStreamingEvent",
}

_sdk_event = TypeAdapter(ResponseStreamEvent)


def assert_valid_event(event: dict[str, Any]) -> None:
    """Valid as an SDK ``ResponseStreamEvent`` (where the SDK knows the type) and against the spec.

    The OpenAI API / SDK name reasoning deltas ``response.reasoning_text.*``; the Open Responses
    spec names the same-shaped events ``response.reasoning.*``: each is checked against the other's
    schema under its own name.
    """
    kind = event["type"]
    if not kind.startswith("response.reasoning."):
        _sdk_event.validate_python(event)
    spec_kind = kind.replace("response.reasoning_text.", "response.reasoning.")
    assert spec_kind in _EVENT_SCHEMAS, f"no spec schema for event {kind}"
    errors = spec_errors({**event, "type": spec_kind}, _EVENT_SCHEMAS[spec_kind])
    assert not errors, (kind, errors)
    if "response" in event:
        assert_valid_response(event["response"])


def assert_subset(expected: Any, actual: Any, path: str = "") -> None:
    """Every key the case names has the case's value (lists: same length, element-wise)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        for key, value in expected.items():
            assert key in actual, f"{path}.{key} missing"
            assert_subset(value, actual[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (path, actual)
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_subset(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, (path, actual, expected)
