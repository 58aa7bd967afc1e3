"""A simple tool-calling agent loop over the Responses API.

Each step calls the model with the initial input plus every item so far, runs each ``function_call``
in the environment, appends a ``function_call_output`` per call, and repeats until the model answers
with a message (and no function call), produces neither, or ``max_steps`` model calls were made.

Earlier output items travel back **unchanged** (the JSON dicts exactly as the server sent them,
training fields included) so gymserve can splice: turn k's prompt then starts with turn k-1's
prompt + generation, token for token. That is why responses are read as raw JSON and never
re-serialized from the SDK's pydantic objects (which may add, drop or reorder fields).

The client is the official ``openai.AsyncOpenAI``; any Responses endpoint works. Without training
fields (a cloud endpoint) the loop still runs; the turns then carry ``None`` token fields.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gymserve.protocol import get_token_info

_SDK_CREATE_PARAMS: frozenset[str] | None = None


def _sdk_create_params() -> frozenset[str]:
    """Keyword names ``AsyncResponses.create`` accepts; everything else goes in ``extra_body``."""
    global _SDK_CREATE_PARAMS
    if _SDK_CREATE_PARAMS is None:
        from openai.resources.responses import AsyncResponses

        _SDK_CREATE_PARAMS = frozenset(inspect.signature(AsyncResponses.create).parameters) - {"self"}
    return _SDK_CREATE_PARAMS


@dataclass
class Turn:
    """One model call.

    ``output``: the response's output items, unchanged. Token fields are those of the last output
    item, else of the response itself (gymserve puts them there when the output is empty), else
    ``None`` (an endpoint without training fields). ``status``: the response status
    (``completed`` / ``incomplete``). ``latency_s``: wall time of the HTTP call.
    ``weight_version`` / ``weight_version_spans``: which weights sampled the tokens, from the same
    place as the token fields (``protocol.VERSION_FIELDS``; None when the server does not say).
    """

    index: int
    response_id: str | None
    status: str | None
    output: list[dict[str, Any]]
    prompt_token_ids: list[int] | None
    generation_token_ids: list[int] | None
    generation_log_probs: list[float] | None
    usage: dict[str, Any] | None
    latency_s: float
    weight_version: Any = None
    weight_version_spans: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_types"] = [it.get("type") for it in d.pop("output")]
        return d


@dataclass
class AgentRun:
    """A finished run of the agent loop.

    ``input``: the initial input items (a string input becomes one user message item).
    ``output``: every item after the input, in order: model output items and the
    ``function_call_output`` items the agent appended.
    ``stop_reason``: ``"message"`` (the model answered), ``"max_steps"``, ``"no_action"`` (neither
    a message nor a function call, e.g. cut off mid-reasoning), ``"context_length"`` (the server said
    the context window is full), or ``"error"`` (see ``error``: ``{"type", "message", "status",
    "code"}``).
    """

    input: list[dict[str, Any]]
    output: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    final_text: str = ""
    stop_reason: str = "no_action"
    error: dict[str, Any] | None = None
    model_s: float = 0.0
    tool_s: float = 0.0


def normalize_input(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Responses ``input``: a string becomes ``[{"type": "message", "role": "user", "content": s}]``."""
    if isinstance(inp, str):
        return [{"type": "message", "role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise TypeError(f"input must be a string or a list of items, got {type(inp).__name__}")
    return list(inp)


def message_text(item: dict[str, Any]) -> str:
    """The text of a ``message`` item (``output_text`` parts joined)."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def _error_dict(exc: BaseException) -> dict[str, Any]:
    import openai

    err: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc), "status": None, "code": None}
    if isinstance(exc, openai.APIStatusError):
        # The SDK already unwrapped {"error": {...}} into exc.body and exc.code.
        err["status"] = exc.status_code
        err["code"] = exc.code
        if isinstance(exc.body, dict) and exc.body.get("message"):
            err["message"] = str(exc.body["message"])
    elif hasattr(exc, "code") and isinstance(exc.code, str):
        err["code"] = exc.code  # gymserve's own errors (e.g. from get_token_info)
    return err


async def run_agent(
    client: Any,
    env: Any,
    create_params: dict[str, Any],
    *,
    model: str | None = None,
    max_steps: int = 8,
    session_id: str | None = None,
) -> AgentRun:
    """Run the agent loop for one task; never raises for model or tool failures (see ``AgentRun.error``).

    ``client``: an ``openai.AsyncOpenAI``. ``env``: an ``gymserve.harness.envs.Environment``.
    ``create_params``: Responses create parameters (``input`` required; ``tools`` default to the
    env's tools, ``instructions`` to the env's instructions; ``model`` overrides ``model=``;
    ``stream`` is ignored). Parameters the SDK does not name travel in ``extra_body``.
    ``session_id`` goes out as ``X-Session-ID`` so a multi-replica gymserve keeps the rollout on one
    replica. Cancellation (``asyncio.CancelledError``) propagates.
    """
    params = dict(create_params)
    params.pop("stream", None)
    run = AgentRun(input=normalize_input(params.pop("input")))
    params.setdefault("tools", env.tools)
    if getattr(env, "instructions", None) and "instructions" not in params:
        params["instructions"] = env.instructions
    params["model"] = params.get("model") or model
    if not params["model"]:
        raise ValueError("no model: pass model= or put 'model' in create_params")
    known = _sdk_create_params()
    kwargs = {k: v for k, v in params.items() if k in known}
    extra_body = {k: v for k, v in params.items() if k not in known}
    if extra_body:
        kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), **extra_body}
    if session_id:
        kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), "X-Session-ID": session_id}

    for step in range(max_steps):
        t0 = time.perf_counter()
        try:
            raw = await client.responses.with_raw_response.create(input=run.input + run.output, **kwargs)
            response = json.loads(raw.text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure ends the rollout with a record of why
            run.model_s += time.perf_counter() - t0
            run.error = _error_dict(exc)
            run.stop_reason = "context_length" if run.error.get("code") == "context_length_exceeded" else "error"
            return run
        latency = time.perf_counter() - t0
        run.model_s += latency
        output = response.get("output") or []
        try:
            info = get_token_info(output[-1]) if output else None
            source = output[-1] if info is not None else response
            if info is None:
                # A generation that parsed to no item (e.g. only whitespace) has nowhere else to
                # carry its tokens: gymserve then puts them on the response itself.
                info = get_token_info(response)
        except Exception as exc:  # inconsistent token fields must not become training data
            run.error = _error_dict(exc)
            run.stop_reason = "error"
            return run
        run.turns.append(
            Turn(
                index=step,
                response_id=response.get("id"),
                status=response.get("status"),
                output=output,
                prompt_token_ids=info["prompt_token_ids"] if info else None,
                generation_token_ids=info["generation_token_ids"] if info else None,
                generation_log_probs=info["generation_log_probs"] if info else None,
                usage=response.get("usage"),
                latency_s=latency,
                weight_version=source.get("weight_version"),
                weight_version_spans=source.get("weight_version_spans"),
            )
        )
        run.output.extend(output)
        if response.get("status") == "failed" or response.get("error"):
            err = response.get("error") or {}
            run.error = {
                "type": "ResponseFailed",
                "message": err.get("message", "response failed"),
                "status": None,
                "code": err.get("code"),
            }
            run.stop_reason = "error"
            return run

        calls = [it for it in output if it.get("type") == "function_call"]
        messages = [it for it in output if it.get("type") == "message"]
        if messages:
            run.final_text = message_text(messages[-1])
        if not calls:
            run.stop_reason = "message" if messages else "no_action"
            return run
        if step == max_steps - 1:
            break  # no model call would read the tool outputs
        t1 = time.perf_counter()
        for call in calls:
            try:
                result = await env.call_tool(call.get("name", ""), call.get("arguments", ""))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken tool server ends the rollout
                run.tool_s += time.perf_counter() - t1
                run.error = _error_dict(exc)
                run.stop_reason = "error"
                return run
            run.output.append({"type": "function_call_output", "call_id": call.get("call_id"), "output": result})
        run.tool_s += time.perf_counter() - t1
    run.stop_reason = "max_steps"
    return run
