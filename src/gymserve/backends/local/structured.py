"""Structured output on the local backend: a grammar (JSON schema, regex, choice) as a token mask per
step, through llguidance (guidance-ai's grammar engine, which vLLM and SGLang use too).

The request fields, vLLM's and OpenAI's, each applied or refused with a 400 naming it:

- ``response_format``: ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, or
  ``{"type": "json_object"}`` (any JSON object); ``{"type": "text"}`` asks for nothing.
- vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": "..."}``, ``{"choice": [...]}``
  or ``{"json_object": true}``; its ``grammar`` and ``structural_tag`` are refused.
- The ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_json_object`` of earlier vLLM
  releases, which clients written for them still send.

At most one of them. The grammar masks what the sampler may pick; the reported log-probs stay the
raw model's (``engine.sampling``), so a trainer scores the constrained tokens against the policy's
own distribution, as vLLM's ``raw_logprobs`` do. When the grammar is complete only the EOS is
allowed, so the generation ends with it (a training token, as ever). Engines that apply a mask say
``supports_structured_output`` (the transformers engine); the others, and a server without
llguidance installed (``pip install "gymserve[structured]"``), answer a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gymserve.errors import InvalidRequestError

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_json_object")
"""The request fields that ask for structured output (module docstring)."""

_TOKENIZERS: dict[int, tuple[Any, Any]] = {}  # id(HF tokenizer) → (it, its llguidance tokenizer)


def _asked(request: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """``(field, kind, spec)`` for each structured-output ask in ``request``: kind ``json`` (a
    schema), ``regex`` or ``choice``."""
    asks: list[tuple[str, str, Any]] = []
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        if fmt.get("type") == "json_object":
            asks.append(("response_format", "json", {"type": "object"}))
        elif fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequestError(
                    "response_format json_schema needs json_schema.schema (a JSON schema object)",
                    param="response_format",
                )
            asks.append(("response_format", "json", schema))
        else:
            raise _refused("response_format", f"type {fmt.get('type')!r} is not a format the local backend applies")
    so = request.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
        set_keys = [k for k, v in so.items() if v not in (None, False)]
        for key in set_keys:
            if key == "json":
                asks.append(("structured_outputs", "json", so[key]))
            elif key == "json_object":
                asks.append(("structured_outputs", "json", {"type": "object"}))
            elif key in ("regex", "choice"):
                asks.append(("structured_outputs", key, so[key]))
            else:
                raise _refused(f"structured_outputs.{key}", "only json, json_object, regex and choice are applied")
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if request.get(field) is not None:
            asks.append((field, kind, request[field]))
    if request.get("guided_json_object") is True:
        asks.append(("guided_json_object", "json", {"type": "object"}))
    if len(asks) > 1:
        raise InvalidRequestError(
            f"{asks[1][0]}: ask for one kind of structured output per request (also {asks[0][0]})", param=asks[1][0]
        )
    return asks


def _refused(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param} is not applied by the local backend: {why}", param=param, code="unsupported_parameter"
    )


def constraint(request: dict[str, Any], *, engine: Any, tokenizer: Any) -> Any:
    """The ``SamplingParams.constraint`` factory ``request`` asks for, or None. Raises
    ``InvalidRequestError`` (400, naming the field) for a malformed spec, a grammar llguidance
    cannot build, an engine without a token mask, or a server without llguidance."""
    asks = _asked(request)
    if not asks:
        return None
    field, kind, spec = asks[0]
    if not getattr(engine, "supports_structured_output", False):
        name = getattr(engine, "engine_name", None) or type(engine).__name__
        raise _refused(field, f"the {name} engine applies no token mask; serve with the transformers engine")
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise _refused(field, 'this server lacks llguidance: pip install "gymserve[structured]"') from None
    grammar = _grammar(llguidance, field, kind, spec)
    lltok = _lltokenizer(llguidance, tokenizer, engine.vocab_size)
    probe = llguidance.LLMatcher(lltok, grammar)
    if probe.is_error():
        raise InvalidRequestError(f"{field}: the grammar cannot be built: {probe.get_error()}", param=field)

    def make() -> Grammar:
        return Grammar(llguidance.LLMatcher(lltok, grammar), lltok.vocab_size)

    return make


def _grammar(llguidance: Any, field: str, kind: str, spec: Any) -> str:
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise InvalidRequestError(f"{field} must be a JSON schema (an object)", param=field) from None
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"{field} must be a JSON schema (an object)", param=field)
        # Compact JSON (no free whitespace): a model cannot run on in blank space.
        spec = {**spec, "x-guidance": {"whitespace_flexible": False, **(spec.get("x-guidance") or {})}}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec)
        except Exception as exc:  # noqa: BLE001 - the library's words, as a 400
            raise InvalidRequestError(f"{field}: not a JSON schema llguidance accepts: {exc}", param=field) from exc
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
            raise InvalidRequestError(f"{field} must be a non-empty list of strings", param=field)
        spec = "|".join(f"(?:{re.escape(c)})" for c in spec)
    if not isinstance(spec, str) or not spec:
        raise InvalidRequestError(f"{field} must be a regular expression (a string)", param=field)
    return llguidance.LLMatcher.grammar_from_regex(spec)


def _lltokenizer(llguidance: Any, tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the HF ``tokenizer`` (built once per tokenizer: seconds for a 150k vocabulary)."""
    held = _TOKENIZERS.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
        _TOKENIZERS[id(tokenizer)] = held
    return held[1]


class Grammar:
    """One call's ``engine.base.TokenConstraint`` over an llguidance matcher."""

    def __init__(self, matcher: Any, vocab_size: int):
        import llguidance.torch

        self.matcher = matcher
        self._lt = llguidance.torch
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: Any) -> Any:
        self._lt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        masked = logits.clone()
        self._lt.apply_token_bitmask_inplace(masked, self.bitmask)
        return masked

    def accept(self, token: int) -> None:
        self.matcher.consume_token(int(token))
