"""Turning a Chat Completions request into one engine call for the token-exact local backend.

The rules, and why:

- Sampling params are pinned by the server config (on-policy RL needs the distribution the trainer
  assumes): a request that sends a different ``temperature``/``top_p``/``top_k``/``seed`` gets a 400
  naming the field, unless the config says ``on_mismatch: override`` (the config value silently wins).
- ``max_tokens``/``max_completion_tokens`` are clamped to what is left of the context window; a prompt
  that already fills it is a ``ContextLengthExceededError`` (400, "context length", both numbers).
- What the engine cannot honour is refused explicitly rather than silently weakened: stop strings,
  penalties and ``logit_bias``, structured output (``response_format`` json_schema/json_object),
  ``tool_choice`` ``required`` or a named function (no guided decoding).
- ``n`` choices (up to ``MAX_N``, OpenAI's limit) are ``n`` engine calls on the same prompt; with a
  seed, choice ``i`` samples with ``seed + i`` (vLLM's rule for parallel sampling), so every choice
  is reproducible on its own and no two choices repeat each other.
- vLLM's chat extras that shape the prompt are honoured: ``required_prefix_token_ids`` (NeMo RL's;
  ``prompting.prefix``), ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``
  (``prompting.RenderOptions``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gymserve.convert.request_checks import chat_tools
from gymserve.engine.base import Engine, SamplingParams
from gymserve.errors import ContextLengthExceededError, InvalidRequestError
from gymserve.prompting import RenderOptions
from gymserve.protocol import ChatRequest

MAX_N = 128
"""The most choices one request may ask for (the OpenAI API's limit for ``n``)."""

_PINNED = ("temperature", "top_p", "top_k", "seed")
_NEUTRAL = {"temperature": None, "top_p": 1.0, "top_k": None, "seed": None}


@dataclass
class LocalCall:
    """One prepared engine call: the prompt (``prompting.PromptResult``), sampling, parse options."""

    prompt: Any
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    logprobs: bool
    tokens_as_ids: bool
    include_usage: bool = False
    n: int = 1

    def sampling_for(self, choice: int) -> SamplingParams:
        """The sampling of choice ``choice`` (0-based): ``seed + choice`` when seeded (vLLM's rule)."""
        if choice == 0 or self.sampling.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=self.sampling.seed + choice)


def _number(request: ChatRequest, key: str) -> float | int | None:
    value = request.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{key} must be a number, got {type(value).__name__}", param=key)
    return value


def pinned_sampling(request: ChatRequest, cfg) -> dict[str, Any]:
    """The effective temperature/top_p/top_k/seed: the config's, checked against the request's.

    A value the request sends that differs from the config is a 400 naming the field
    (``on_mismatch: reject``, the default) or ignored (``override``). ``top_k`` of -1 or 0 and
    ``top_p`` of 1 mean "off" as in vLLM, so sending them is never a mismatch when the config is off.
    """
    eff = {k: getattr(cfg, k) for k in _PINNED}
    for key in _PINNED:
        sent = _number(request, key)
        if sent is None:
            continue
        want = eff[key]
        if key == "top_k" and (want in (None, 0, -1)) and sent in (0, -1):
            continue
        if want is None and key != "seed" and sent == _NEUTRAL[key]:
            continue
        if want is not None and float(sent) == float(want):
            continue
        if cfg.on_mismatch == "override":
            continue
        raise InvalidRequestError(
            f"{key}={sent} differs from the server's pinned {key}={want}: sampling params are fixed by the "
            f"server config so rollouts stay on-policy. Omit {key}, send {want}, or set "
            "sampling.on_mismatch: override in the server config.",
            param=key,
            code="sampling_param_pinned",
        )
    return eff


def echo_pinned_sampling(request: dict[str, Any], cfg) -> dict[str, Any]:
    """``request`` (a Responses request) with the pinned ``temperature``/``top_p`` of ``cfg`` (a
    ``SamplingConfig``) filled in where it sends none (or always, with ``on_mismatch: override``), so
    the Response echoes the values the engine ran with, as the Responses API does."""
    pinned = {"temperature": cfg.temperature, "top_p": cfg.top_p}
    forced = cfg.on_mismatch == "override"
    fill = {k: v for k, v in pinned.items() if v is not None and (forced or request.get(k) is None)}
    return {**request, **fill} if fill else request


def choice_count(request: dict[str, Any]) -> int:
    """``n``: how many choices to sample (1 when absent); an integer from 1 to ``MAX_N``, else a 400."""
    n = request.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(
            f"n={n!r} is out of range: it must be an integer from 1 to {MAX_N} (the choices to sample)", param="n"
        )
    return n


def render_options(request: dict[str, Any]) -> RenderOptions:
    """vLLM's prompt-shaping extras of a chat or ``/tokenize`` request as ``RenderOptions``; each a
    boolean (400 naming it otherwise)."""
    flags = {}
    for key in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
        value = request.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{key} must be true or false, got {type(value).__name__}", param=key)
            flags[key] = value
    if flags.get("continue_final_message") and "add_generation_prompt" not in flags:
        flags["add_generation_prompt"] = False  # continuing the last message implies no new turn
    return RenderOptions(**flags)


def check_supported(request: ChatRequest) -> None:
    stop = request.get("stop")
    if stop:
        raise InvalidRequestError(
            "stop is not supported by the token-exact local backend (a stop string can end inside a "
            "token); configure sampling.stop_token_ids instead",
            param="stop",
        )
    for key in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = request.get(key)
        if value is not None and value != (1 if key == "repetition_penalty" else 0):
            raise InvalidRequestError(
                f"{key}={value!r} is not applied by the local engine (it would change the sampling "
                "distribution the trainer assumes); omit it",
                param=key,
            )
    if request.get("logit_bias"):
        raise InvalidRequestError("logit_bias is not applied by the local engine; omit it", param="logit_bias")
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise InvalidRequestError(
            f"response_format type {fmt.get('type')!r} (structured output) is not supported by the local "
            "transformers engine; use a chat backend such as vLLM with guided decoding",
            param="response_format",
        )
    choice = request.get("tool_choice")
    if isinstance(choice, dict) or choice == "required":
        raise InvalidRequestError(
            "tool_choice that forces a tool call ('required', 'any' or a named tool) cannot be enforced by the "
            "local engine (no guided decoding); use 'auto' or 'none'",
            param="tool_choice",
        )
    if choice not in (None, "auto", "none") and not isinstance(choice, dict):
        raise InvalidRequestError(
            f"tool_choice must be 'auto', 'none', 'required' or an object, got {choice!r}", param="tool_choice"
        )


def _max_tokens(request: ChatRequest, prompt_len: int, context_window: int) -> int:
    room = context_window - prompt_len
    if room <= 0:
        raise ContextLengthExceededError(prompt_len, context_window)
    asked = None
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{key} must be a positive integer", param=key)
            asked = value
            break
    return room if asked is None else min(asked, room)


def prepare_call(
    request: ChatRequest, *, template, engine: Engine, sampling_config, stop_token_ids: tuple[int, ...]
) -> LocalCall:
    """Validate ``request`` and build the engine call; raises ``InvalidRequestError`` (400) on bad input."""
    if not isinstance(request.get("messages"), list) or not request["messages"]:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    check_supported(request)
    n = choice_count(request)
    tools = chat_tools(request.get("tools"), functions_only=True)  # the one checker of both routes
    prompt = chat_prompt(request, template=template, engine=engine)
    eff = pinned_sampling(request, sampling_config)
    top_n = request.get("top_logprobs") or 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= 20:
        raise InvalidRequestError("top_logprobs must be an integer from 0 to 20", param="top_logprobs")
    logprobs = bool(request.get("logprobs"))
    stream_options = request.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise InvalidRequestError(
            'stream_options must be an object such as {"include_usage": true}', param="stream_options"
        )
    sampling = SamplingParams(
        max_tokens=_max_tokens(request, len(prompt.token_ids), engine.context_window),
        temperature=float(eff["temperature"]) if eff["temperature"] is not None else 1.0,
        top_p=float(eff["top_p"]) if eff["top_p"] is not None else 1.0,
        top_k=eff["top_k"],
        seed=eff["seed"],
        stop_token_ids=stop_token_ids,
        top_logprobs=top_n if logprobs else 0,
    )
    return LocalCall(
        prompt=prompt,
        sampling=sampling,
        tools=tools,
        parse_tools=bool(tools) and request.get("tool_choice") != "none",
        logprobs=logprobs,
        tokens_as_ids=bool(request.get("return_tokens_as_token_ids")),
        include_usage=bool((stream_options or {}).get("include_usage")),
        n=n,
    )


def chat_prompt(request: dict[str, Any], *, template, engine: Engine):
    """The ``prompting.PromptResult`` of a chat (or chat-form ``/tokenize``) request: its messages,
    tools, ``chat_template_kwargs``, ``required_prefix_token_ids`` and render options through
    ``build_prompt``, splice included. Raises ``InvalidRequestError`` (400) naming the field."""
    from gymserve.prompting import build_prompt

    tools = chat_tools(request.get("tools"), functions_only=True)  # the one checker of both routes
    kwargs = request.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    if request.get("chat_template") is not None:
        raise InvalidRequestError(
            "chat_template in a request is not accepted (vLLM also refuses it unless "
            "--trust-request-chat-template): the template decides the token IDs the policy is trained "
            "on, so it is the server's; set backend.chat_template in the server config",
            param="chat_template",
        )
    return build_prompt(
        template,
        request["messages"],
        tools=tools,
        chat_template_kwargs=kwargs,
        eos_token_ids=engine.eos_token_ids,
        vocab_size=engine.vocab_size,
        required_prefix=request.get("required_prefix_token_ids"),
        options=render_options(request),
    )
