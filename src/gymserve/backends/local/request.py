"""Turning a Chat Completions request into one engine call for the token-exact local backend.

The rules, and why:

- Sampling params (``temperature``/``top_p``/``top_k``/``min_p``/``seed``) are the request's where it
  sends them and the server config's where not, as ``vllm serve`` applies a request's own sampling;
  a server told to pin (``sampling.pin: reject``, what on-policy training wants: every rollout from
  the distribution the trainer assumes) answers a request sending another value with a 400 naming
  the field, or (``pin: override``) uses its own values. ``sampling_params`` holds the rule.
- ``max_tokens``/``max_completion_tokens`` are clamped to what is left of the context window; a prompt
  that already fills it is a ``ContextLengthExceededError`` (400, "context length", both numbers).
- vLLM's ending fields are applied (``ending_params``; the rule is ``engine.ending``'s): ``min_tokens``,
  ``ignore_eos``, per-request ``stop_token_ids`` (added to the server's) and ``stop`` strings, which
  end the generation after the token that completes the string, token IDs whole.
  ``prompt_logprobs`` (vLLM's chat extra) scores the rendered prompt on engines that can (501 else).
- Structured output (``response_format`` json_schema/json_object, vLLM's ``structured_outputs`` and
  ``guided_json``/``guided_regex``/``guided_choice``) is a token mask per step (``structured``) on
  engines that apply one (transformers); a 400 naming the field elsewhere.
- What the engine cannot honour is refused explicitly rather than silently weakened: penalties and
  ``logit_bias``, ``tool_choice`` ``required`` or a named function, and the other vLLM extras
  listed in ``vllm_fields.REFUSED``.
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

from gymserve.backends.local import structured
from gymserve.backends.local.vllm_fields import check_extras
from gymserve.convert.request_checks import chat_tools
from gymserve.engine.base import Engine, SamplingParams, check_prompt_logprobs
from gymserve.errors import ContextLengthExceededError, InvalidRequestError
from gymserve.prompting import RenderOptions
from gymserve.protocol import ChatRequest

MAX_N = 128
"""The most choices one request may ask for (the OpenAI API's limit for ``n``)."""

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")
"""The request fields the local engines sample with (vLLM's names), each applied or refused."""
_OFF = {"top_p": 1.0, "min_p": 0.0}  # values that switch a filter off (top_k: None, 0 and -1)


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
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and choices[].token_ids in vLLM's places

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


def _checked(key: str, value: float | int) -> float | int:
    """A request's sampling value within what the engines take (vLLM's ranges): a 400 otherwise."""
    if key == "top_k" and (value != int(value) or value < -1):
        raise InvalidRequestError(
            f"top_k={value} is out of range: it must be an integer, -1 or 0 (off) or a positive count", param=key
        )
    if key == "top_p" and not 0 < value <= 1:
        raise InvalidRequestError(f"top_p={value} is out of range: it must be above 0 and at most 1", param=key)
    if key == "min_p" and not 0 <= value <= 1:
        raise InvalidRequestError(f"min_p={value} is out of range: it must be from 0 to 1", param=key)
    if key == "temperature" and value < 0:
        raise InvalidRequestError(f"temperature={value} is out of range: it must be 0 (greedy) or more", param=key)
    return int(value) if key in ("top_k", "seed") else value


def _same(key: str, sent: float | int, want: float | int | None) -> bool:
    """Whether a request's value asks for what the server samples with (an "off" value matches off)."""
    if key == "top_k":
        return (want in (None, 0, -1) and sent in (0, -1)) or (want is not None and sent == want)
    if want is None:
        return False
    return float(sent) == float(want) or (key in _OFF and float(sent) == _OFF[key] == float(want))


def sampling_params(request: dict[str, Any], cfg) -> dict[str, Any]:
    """The effective ``temperature``/``top_p``/``top_k``/``min_p``/``seed`` of a chat or completions
    request under ``cfg`` (a ``SamplingConfig``).

    ``cfg.pin`` ``off`` (the default, vLLM's behaviour): each value the request sends is used (a 400
    naming it when out of range), the config's otherwise. ``reject``: the config's, and a request value
    that differs is a 400 (code ``sampling_param_pinned``); sending the config's value, or an "off"
    value when the config's filter is off (``top_k`` -1/0, ``top_p`` 1, ``min_p`` 0), is fine, as
    NeMo Gym sends ``temperature: 1.0``. ``override``: the config's, whatever the request sends.
    """
    eff = {k: getattr(cfg, k) for k in SAMPLING_FIELDS}
    for key in SAMPLING_FIELDS:
        raw = _number(request, key)
        if raw is None:
            continue
        sent = _checked(key, raw)
        if cfg.pin == "off":
            eff[key] = sent
        elif cfg.pin == "reject" and not _same(key, sent, eff[key]):
            raise InvalidRequestError(
                f"{key}={sent} differs from the server's pinned {key}={eff[key]}: this server fixes its "
                f"sampling params so rollouts stay on-policy. Omit {key}, send {eff[key]}, or start the "
                "server without --pin-sampling (sampling.pin: off) to let requests choose.",
                param=key,
                code="sampling_param_pinned",
            )
    return eff


def engine_sampling(request: dict[str, Any], cfg, **call: Any) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``request`` under ``cfg``: ``sampling_params``'s values
    and ``call``'s (``max_tokens``, ``stop_token_ids``, ``top_logprobs``, ``prompt_logprobs``)."""
    eff = sampling_params(request, cfg)
    return SamplingParams(
        temperature=float(eff["temperature"]),
        top_p=float(eff["top_p"]),
        top_k=eff["top_k"],
        min_p=float(eff["min_p"]),
        seed=eff["seed"],
        **call,
    )


def echo_sampling(request: dict[str, Any], cfg) -> dict[str, Any]:
    """``request`` (a Responses request) with the ``temperature``/``top_p`` of ``cfg`` (a
    ``SamplingConfig``) filled in where it sends none (or always, with ``pin: override``), so the
    Response echoes the values the engine ran with, as the Responses API does (``sampling_params``
    applies the request's own otherwise)."""
    pinned = {"temperature": cfg.temperature, "top_p": cfg.top_p}
    forced = cfg.pin == "override"
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


def ending_params(request: dict[str, Any], *, stop_token_ids: tuple[int, ...], vocab_size: int) -> dict[str, Any]:
    """vLLM's ending fields of a chat or completions request as ``SamplingParams`` keywords
    (``engine.ending`` applies them): ``min_tokens`` (an integer from 0), ``ignore_eos`` (boolean),
    ``stop_token_ids`` (IDs in the vocabulary; added to the server's ``stop_token_ids``), ``stop``
    (a string or a list of strings; empty strings dropped), ``include_stop_str_in_output`` (boolean).
    Each malformed one is a 400 naming it."""
    out: dict[str, Any] = {"stop_token_ids": stop_token_ids}
    value = request.get("min_tokens")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequestError(f"min_tokens must be an integer from 0, got {value!r}", param="min_tokens")
        out["min_tokens"] = value
    out["ignore_eos"] = _flag(request, "ignore_eos")
    ids = request.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of token IDs from 0 to {vocab_size - 1}", param="stop_token_ids"
            )
        out["stop_token_ids"] = tuple(dict.fromkeys([*stop_token_ids, *ids]))
    stop = request.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        out["stop"] = tuple(s for s in stops if s)
    out["include_stop_str_in_output"] = _flag(request, "include_stop_str_in_output")
    return out


def check_min_tokens(sampling: SamplingParams) -> None:
    """vLLM's rule: ``min_tokens`` may not exceed ``max_tokens`` (after the context-window clamp)."""
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError(
            f"min_tokens={sampling.min_tokens} is more than max_tokens={sampling.max_tokens} (the tokens this "
            "request may generate, within the context window)",
            param="min_tokens",
        )


def check_supported(request: ChatRequest) -> None:
    """400 naming each field the local engines do not apply (the module docstring's list)."""
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
    request: ChatRequest,
    *,
    template,
    engine: Engine,
    sampling_config,
    stop_token_ids: tuple[int, ...],
    tokenizer: Any = None,
) -> LocalCall:
    """Validate ``request`` and build the engine call; raises ``InvalidRequestError`` (400) on bad input."""
    if not isinstance(request.get("messages"), list) or not request["messages"]:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    check_supported(request)
    check_extras(request, chat=True)
    n = choice_count(request)
    tools = chat_tools(request.get("tools"), functions_only=True)  # the one checker of both routes
    prompt = chat_prompt(request, template=template, engine=engine)
    top_n = request.get("top_logprobs") or 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= 20:
        raise InvalidRequestError("top_logprobs must be an integer from 0 to 20", param="top_logprobs")
    logprobs = bool(request.get("logprobs"))
    stream_options = request.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise InvalidRequestError(
            'stream_options must be an object such as {"include_usage": true}', param="stream_options"
        )
    sampling = engine_sampling(
        request,
        sampling_config,
        max_tokens=_max_tokens(request, len(prompt.token_ids), engine.context_window),
        top_logprobs=top_n if logprobs else 0,
        prompt_logprobs=chat_prompt_logprobs(request, engine),
        constraint=structured.constraint(request, engine=engine, tokenizer=tokenizer),
        **ending_params(request, stop_token_ids=stop_token_ids, vocab_size=engine.vocab_size),
    )
    check_min_tokens(sampling)
    return LocalCall(
        prompt=prompt,
        sampling=sampling,
        tools=tools,
        parse_tools=bool(tools) and request.get("tool_choice") != "none",
        logprobs=logprobs,
        tokens_as_ids=_flag(request, "return_tokens_as_token_ids"),
        include_usage=bool((stream_options or {}).get("include_usage")),
        n=n,
        return_token_ids=_flag(request, "return_token_ids"),
    )


def chat_prompt_logprobs(request: dict[str, Any], engine: Engine) -> int | None:
    """vLLM's ``prompt_logprobs`` on a chat request: ``None`` (absent) or the alternatives per prompt
    position, an integer from 0 to 20 (400 naming it otherwise; a negative one too, which vLLM
    reads as the whole vocabulary; with ``stream`` too, as vLLM refuses it); a 501 on an engine that
    does not score prompts."""
    value = request.get("prompt_logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20:
        raise InvalidRequestError(
            f"prompt_logprobs must be an integer from 0 to 20, got {value!r}", param="prompt_logprobs"
        )
    if request.get("stream"):
        raise InvalidRequestError(
            "prompt_logprobs are not available with stream: true (vLLM's rule); send the request unstreamed",
            param="prompt_logprobs",
        )
    check_prompt_logprobs(engine)
    return value


def _flag(request: dict[str, Any], key: str) -> bool:
    """A boolean request field (absent or null: false); anything else is a 400 naming it."""
    value = request.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{key} must be true or false, got {type(value).__name__}", param=key)
    return value


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
