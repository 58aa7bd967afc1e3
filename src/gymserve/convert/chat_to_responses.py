"""Chat completion → Response (pure, no I/O), plus the shared item and envelope builders."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gymserve.errors import UpstreamError
from gymserve.protocol import (
    TRAINING_FIELDS,
    VERSION_FIELDS,
    ChatCompletionDict,
    ResponseDict,
    ResponsesRequest,
    get_token_info,
)
from gymserve.wire.ids import new_id
from gymserve.wire.reasoning import field_reasoning
from gymserve.wire.think import split_think


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # some servers answer with text parts
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def message_segments(message: dict[str, Any], *, final: bool = True) -> list[tuple[str, str]]:
    """Ordered reasoning/text segments of a chat assistant message: reasoning field first
    (``wire.reasoning``), then the content split on ``<think>`` blocks (``wire.think.split_think``)."""
    segments = []
    reasoning = field_reasoning(message)
    if reasoning is not None and reasoning.strip():
        segments.append(("reasoning", reasoning))
    return segments + split_think(_content_text(message.get("content")), final=final)


def normalize_arguments(arguments: Any) -> str:
    """Function-call arguments as the JSON string OpenAI clients ``json.loads`` (case CR-04):
    strings kept as they are, objects dumped, ``""``/None → ``"{}"``."""
    if arguments is None or arguments == "":
        return "{}"
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


# -- items -----------------------------------------------------------------------------------


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    """A reasoning output item; ``text=None`` gives the empty shell announced when streaming starts."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message output item; ``text=None`` gives the empty in-progress shell."""
    content = [] if text is None else [output_text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# -- envelope --------------------------------------------------------------------------------


def _echo_tools(tools: Any) -> list[Any]:
    out = []
    for tool in tools or []:
        if isinstance(tool, dict) and tool.get("type") == "function":
            # The Open Responses spec requires these keys on every function tool, null allowed.
            tool = {
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
        out.append(tool)
    return out


def _echo_text(text: Any) -> dict[str, Any]:
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        return {"format": {"type": "text"}}
    fmt = text["format"]
    if fmt.get("type") == "json_schema":
        fmt = {**fmt, "description": fmt.get("description"), "strict": bool(fmt.get("strict") or False)}
    return {**text, "format": fmt}


def _number(value: Any, default: float) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def response_envelope(
    request: ResponsesRequest,
    *,
    model: str | None,
    status: str,
    output: list[dict[str, Any]] | None = None,
    incomplete_details: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    response_id: str | None = None,
    created_at: float | None = None,
) -> ResponseDict:
    """The Response object around ``output``, echoing the request's parameters as the OpenAI
    Responses API does, with every key the Open Responses ``ResponseResource`` schema requires."""
    created = int(created_at if created_at is not None else time.time())
    reasoning = request.get("reasoning")
    metadata = request.get("metadata")
    return {
        "id": response_id or new_id("resp"),
        "object": "response",
        "created_at": created,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "incomplete_details": incomplete_details,
        "error": error,
        "model": model or request.get("model") or "",
        "previous_response_id": None,
        "instructions": request.get("instructions"),
        "output": output or [],
        "tools": _echo_tools(request.get("tools")),
        "tool_choice": request.get("tool_choice") or "auto",
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "text": _echo_text(request.get("text")),
        "reasoning": (
            {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}
            if isinstance(reasoning, dict)
            else None
        ),
        "temperature": _number(request.get("temperature"), 1.0),
        "top_p": _number(request.get("top_p"), 1.0),
        "presence_penalty": _number(request.get("presence_penalty"), 0.0),
        "frequency_penalty": _number(request.get("frequency_penalty"), 0.0),
        "top_logprobs": request.get("top_logprobs") if isinstance(request.get("top_logprobs"), int) else 0,
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "truncation": "disabled",  # never truncated here: an overflow is reported, not hidden
        "store": False,  # gymserve keeps no responses
        "background": False,
        "service_tier": "default",
        "metadata": metadata if isinstance(metadata, dict) else {},
        "safety_identifier": request.get("safety_identifier"),
        "prompt_cache_key": request.get("prompt_cache_key"),
        "user": request.get("user"),
        "usage": usage,
    }


def convert_usage(usage: Any) -> dict[str, Any] | None:
    """Chat usage → Responses usage (cached, cache-write and reasoning token counts default to 0)."""
    if not isinstance(usage, dict):
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    prompt_details = usage.get("prompt_tokens_details") or {}
    cached = prompt_details.get("cached_tokens") or 0
    # openai >= 3 requires cache_write_tokens; chat servers do not report it, so 0.
    cache_write = prompt_details.get("cache_write_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": int(cache_write)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def finish_status(finish_reason: Any) -> tuple[str, dict[str, Any] | None]:
    """``(status, incomplete_details)`` for a chat ``finish_reason`` (case CR-02)."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    if finish_reason == "abort":  # vLLM's, and gymserve's for POST /pause?mode=abort (training-control.md)
        return "incomplete", {"reason": "abort"}
    return "completed", None


# -- conversion ------------------------------------------------------------------------------


def _first_choice(completion: Any) -> dict[str, Any]:
    choices = completion.get("choices") if isinstance(completion, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamError("the backend returned a chat completion without choices")
    return choices[0]


def _token_info(completion: dict[str, Any], choice: dict[str, Any], message: dict[str, Any]):
    for source in (message, choice, completion):
        present = [f for f in TRAINING_FIELDS if source.get(f) is not None]
        if present and (source is message or present != ["prompt_token_ids"]):
            # A bare prompt_token_ids beside the message is a server's own metadata (vLLM's
            # return_token_ids without gymserve asking), not a training record.
            return get_token_info(source)
    return None


def chat_to_response(
    completion: ChatCompletionDict,
    request: ResponsesRequest,
    *,
    response_id: str | None = None,
    created_at: float | None = None,
    item_ids: Sequence[str] | None = None,
    turns: Sequence[dict[str, Any]] | None = None,
) -> ResponseDict:
    """Translate a ``ChatCompletion`` dict into a ``Response`` dict for ``request``.

    Output items, in order: one reasoning item per reasoning source (``reasoning_content`` or
    ``reasoning`` field, then each ``<think>`` block of the content), a message item for the
    remaining text (none when empty), then one ``function_call`` item per tool call (``call_id`` =
    the tool call id; ``arguments`` always a JSON string). ``finish_reason`` ``length`` /
    ``content_filter`` give status ``incomplete`` with ``incomplete_details`` and mark the last
    message/function_call item incomplete (only the end of a generation is cut off). Training
    fields and the weight version (``protocol.VERSION_FIELDS``, even null, and even without training
    fields) go on the last output item; a call with token fields but no visible output gets one
    empty message item to carry them.

    ``item_ids`` fixes the ids of the output items in order (the streaming builder passes the ids
    it already announced); missing ones are generated. ``turns``: pieces of the assistant message
    in generation order (``content``, reasoning, ``refusal``, ``tool_calls`` each), whose items are
    concatenated instead of the message's own — the streaming builder passes them when the model
    wrote text after a tool call, so the output follows what was streamed; everything else (finish
    reason, training fields, usage) still comes from ``completion``. Raises ``UpstreamError`` when
    the completion has no choices and ``InvalidRequestError`` for inconsistent training fields.
    """
    choice = _first_choice(completion)
    raw_message = choice.get("message")
    message: dict[str, Any] = raw_message if isinstance(raw_message, dict) else {}
    status, details = finish_status(choice.get("finish_reason"))
    given: Iterator[str] = iter(item_ids or ())

    def next_id(prefix: str) -> str:
        return next(given, None) or new_id(prefix)

    output: list[dict[str, Any]] = []
    for turn in turns if turns is not None else [message]:
        output += message_items(turn, next_id)
    if status == "incomplete" and output and output[-1]["type"] in ("message", "function_call"):
        output[-1]["status"] = "incomplete"

    tokens = _token_info(completion, choice, message)
    if tokens is not None:
        if not output:
            # A model call that produced no visible text (only EOS, or whitespace) is still a turn
            # the policy took: an empty message item carries its token fields so the agent passes
            # it back and the next prompt stays token-contiguous.
            output.append(message_item(next_id("msg"), "", "incomplete" if status == "incomplete" else "completed"))
        # On the last item, which the next turn's input carries back unchanged.
        output[-1].update(tokens)
    if output:  # the weight version, also without token fields (null: a gateway that cannot name it)
        output[-1].update({f: message[f] for f in VERSION_FIELDS if f in message})
    response = response_envelope(
        request,
        model=completion.get("model"),
        status=status,
        output=output,
        incomplete_details=details,
        usage=convert_usage(completion.get("usage")),
        response_id=response_id,
        created_at=created_at,
    )
    return response


def message_items(message: dict[str, Any], next_id: Callable[[str], str]) -> list[dict[str, Any]]:
    """The output items of one chat assistant message: reasoning items, the message item (with any
    refusal as a second part), then function_call items; ``next_id(prefix)`` names each."""
    output: list[dict[str, Any]] = []
    for kind, text in message_segments(message):
        if kind == "reasoning":
            output.append(reasoning_item(next_id("rs"), text))
        else:
            output.append(message_item(next_id("msg"), text, "completed"))
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        if not output or output[-1]["type"] != "message":
            output.append(message_item(next_id("msg"), None, "completed"))
        output[-1]["content"].append({"type": "refusal", "refusal": refusal})
    for tc in message.get("tool_calls") or []:
        if not isinstance(tc, dict):
            raise UpstreamError("the backend returned a tool call that is not an object")
        raw_function = tc.get("function")
        function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
        output.append(
            function_call_item(
                next_id("fc"),
                tc.get("id") or new_id("call"),
                function.get("name") or "",
                normalize_arguments(function.get("arguments")),
                "completed",
            )
        )
    return output


def context_exceeded_response(request: ResponsesRequest) -> ResponseDict:
    """The Response for an upstream context-length overflow (case CL-01): status ``incomplete``,
    ``incomplete_details.reason`` ``max_output_tokens``, empty output, zero usage — so a rollout
    that outgrew the context window ends cleanly instead of crashing or retrying forever."""
    return chat_to_response(_empty_completion(request.get("model") or "", "length"), request)


def context_exceeded_chat_completion(request: dict[str, Any], model: str) -> ChatCompletionDict:
    """The ChatCompletion for an upstream context-length overflow (case CL-01): one choice with
    ``finish_reason`` ``length`` and an assistant message with no content and no tool calls.
    ``request`` (the chat request) names the model when ``model`` is empty."""
    return _empty_completion(model or request.get("model") or "", "length")


def aborted_chat_completion(model: str) -> ChatCompletionDict:
    """The ChatCompletion of a call that a pause with mode ``abort`` ended before anything came
    back (the chat backend's gateway): ``finish_reason`` ``abort`` (vLLM's value for an aborted
    request), no content, zero usage."""
    return _empty_completion(model, "abort")


def _empty_completion(model: str, finish_reason: str) -> ChatCompletionDict:
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "logprobs": None,
                "message": {"role": "assistant", "content": None, "tool_calls": None},
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
