"""Tokens in, tokens out on the local backend: vLLM's ``POST /inference/v1/generate`` and SGLang's
``POST /generate``, for RL clients that render prompts themselves.

Both take prompt token IDs and a ``sampling_params`` object, run one engine call per choice with the
rules of the chat route (``request.sampling_params``: the request's sampling unless the server is
pinned; ``engine.ending``: EOS, stop tokens and strings, ``min_tokens``, ``ignore_eos``; the
context-window clamp) and answer the sampled token IDs, the stop token included, with their
log-probs. Each field is applied or refused with a 400 naming it (``sampling_params.<key>`` for a
sampling field); the tables below are the data.

vLLM (``vllm/entrypoints/serve/disagg/protocol.py`` ``GenerateRequest``/``GenerateResponse``,
``serving.py`` ``ServingTokens``): ``{"token_ids", "sampling_params", "model", "request_id"}`` →
``{"id", "request_id", "created", "model", "choices": [{"index", "token_ids", "finish_reason",
"logprobs": {"content": [{"token": "token_id:N", "logprob", "bytes": null, "top_logprobs"}]}}],
"usage", "prompt_logprobs"}``. ``sampling_params.logprobs: k`` (vLLM's: the sampled token plus the
``k`` most likely) asks for log-probs; each position's ``top_logprobs`` lists the sampled token first,
then the most likely others, ``max(k, 1)`` in all, as vLLM's ``_create_tokens_logprobs`` does.
``max_tokens`` defaults to what the context window leaves (vLLM's server-side default).

SGLang (``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput``; the answer of
``tokenizer_manager``): ``{"input_ids" | "text", "sampling_params", "return_logprob",
"top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "rid"}`` → ``{"text",
"output_ids", "meta_info": {"id", "finish_reason": {"type": "stop", "matched": id | str} |
{"type": "length", "length": n} | {"type": "abort"}, "prompt_tokens", "completion_tokens",
"cached_tokens", "weight_version", "output_token_logprobs": [[logprob, id, text | None], ...],
"output_top_logprobs", "input_token_logprobs"}}``. ``max_new_tokens`` defaults to 128 (SGLang's);
the text drops the matched stop string or token unless ``no_stop_trim``.

Streaming is not served on these routes yet (``stream: true`` is a 400). Backends without an engine
answer 501 (``Backend._not_served``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gymserve.backends.context import RequestContext
from gymserve.backends.local.choices import run_all
from gymserve.backends.local.completion_output import vllm_prompt_logprobs
from gymserve.backends.local.output import text_ids
from gymserve.backends.local.request import check_min_tokens, ending_params, engine_sampling
from gymserve.backends.local.stream import generate
from gymserve.engine.base import Generation, SamplingParams, check_prompt_logprobs
from gymserve.engine.ending import Ending, cut_at_hit
from gymserve.errors import ContextLengthExceededError, InvalidRequestError
from gymserve.protocol import check_token_ids

MAX_N = 128
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's ``max_new_tokens`` when a request sends none (``SamplingParams`` in ``sampling_params.py``)."""

# sampling_params keys of vLLM's SamplingParams, each applied or refused.
VLLM_SAMPLING_APPLIED = frozenset(
    {
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
        "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "prompt_logprobs",
    }
)  # fmt: skip
VLLM_SAMPLING_NO_TEXT = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize"})
"""Text options: this route answers no text, so any boolean asks for nothing here."""
VLLM_SAMPLING_OFF: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "flat_logprobs": (True, False),  # vLLM's storage of log-probs in the engine: the answer is the same
    "output_kind": (None,),
}
VLLM_EXTRA_ARGS_KNOWN = frozenset({"prl_compact_logprobs"})
"""``extra_args`` keys with a documented plain-JSON fallback (the renderers client's compact log-probs:
"servers without the extension can still return native JSON"), so answering plain JSON applies them."""

SGLANG_SAMPLING_APPLIED = frozenset(
    {
        "n", "temperature", "top_p", "top_k", "min_p", "sampling_seed", "max_new_tokens", "min_new_tokens",
        "stop", "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens",
        "spaces_between_special_tokens",
    }
)  # fmt: skip
SGLANG_SAMPLING_OFF: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
}
SGLANG_TOP_FIELDS = frozenset(
    {
        "input_ids", "text", "sampling_params", "return_logprob", "top_logprobs_num", "logprob_start_len",
        "return_text_in_logprobs", "rid", "stream", "model",
    }
)  # fmt: skip
VLLM_TOP_FIELDS = frozenset({"token_ids", "sampling_params", "model", "stream", "stream_options", "request_id"})
TOP_OFF: dict[str, tuple[Any, ...]] = {"priority": (0,), "return_routed_experts": (False,)}


def _refuse(param: str, value: Any, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param}={value!r} is not applied by the local backend: {why}", param=param, code="unsupported_parameter"
    )


def _check_keys(body: dict[str, Any], known: frozenset[str], off: dict[str, tuple[Any, ...]], where: str) -> None:
    for key, value in body.items():
        if key in known or value is None:
            continue
        if key in off:
            if any(type(value) is type(o) and value == o for o in off[key]) or (
                type(value) in (int, float) and any(type(o) in (int, float) and value == o for o in off[key])
            ):
                continue
            raise _refuse(f"{where}{key}", value, "only its neutral value is accepted here")
        raise _refuse(f"{where}{key}", value, "this field is not applied on this route")


def _int(body: dict[str, Any], key: str, param: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"from {low}" + (f" to {high}" if high is not None else "")
        raise InvalidRequestError(f"{param} must be an integer {span}, got {value!r}", param=param)
    return value


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{key} must be an object", param=key)
    return value


class LocalTokensIn:
    """``Backend.generate_tokens`` (vLLM) and ``Backend.sglang_generate`` for ``LocalBackend`` (a
    mixin over its engine, tokenizer, limiter and sampling config)."""

    engine: Any
    tokenizer: Any
    limiter: Any
    config: Any
    stop_token_ids: tuple[int, ...]

    if TYPE_CHECKING:  # LocalBackend's

        def check_model(self, requested: Any) -> None: ...
        def served_model_name(self) -> str: ...

    # ---- shared ----------------------------------------------------------------------------------

    def _prompt(self, ids: Any, param: str) -> list[int]:
        prompt = check_token_ids(ids, param=param, vocab_size=self.engine.vocab_size)
        if len(prompt) >= self.engine.context_window:
            raise ContextLengthExceededError(len(prompt), self.engine.context_window)
        return prompt

    def _sampling(
        self, request: dict[str, Any], prompt_len: int, max_tokens: int | None, renames: dict[str, str], **call: Any
    ) -> SamplingParams:
        """``request`` (chat-route names) as the engine's params, by the chat route's rules; a 400
        names the field as this body spells it (``sampling_params.<renames[name] or name>``)."""
        room = self.engine.context_window - prompt_len
        try:
            sampling = engine_sampling(
                request,
                self.config.sampling,
                max_tokens=room if max_tokens is None else min(max_tokens, room),
                **call,
                **ending_params(request, stop_token_ids=self.stop_token_ids, vocab_size=self.engine.vocab_size),
            )
            check_min_tokens(sampling)
        except InvalidRequestError as exc:
            if exc.param in _CHAT_NAMES:
                exc.param = "sampling_params." + renames.get(exc.param, exc.param)
            raise
        return sampling

    async def _run(self, prompt: list[int], sampling: SamplingParams, n: int) -> list[Generation]:
        async def one(i: int) -> Generation:
            seeded = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + i)
            async with self.limiter.slot():
                return await generate(self.engine, prompt, seeded, self.tokenizer)

        return await run_all([one(i) for i in range(n)])

    def _text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    # ---- vLLM --------------------------------------------------------------------------------------

    async def generate_tokens(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``GenerateResponse`` for a ``POST /inference/v1/generate`` body (module docstring).
        Raises ``InvalidRequestError`` (400) naming the field, ``ContextLengthExceededError``, and
        ``NotSupportedError`` (501) for ``prompt_logprobs`` on an engine that cannot score prompts."""
        if not isinstance(request, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        _check_keys(request, VLLM_TOP_FIELDS, TOP_OFF, "")
        self.check_model(request.get("model"))
        if request.get("stream"):
            raise _refuse("stream", True, "this route answers whole generations only; send stream false")
        if "token_ids" not in request:
            raise InvalidRequestError("token_ids is required: the prompt's token IDs", param="token_ids")
        prompt = self._prompt(request["token_ids"], "token_ids")
        sp = _object(request, "sampling_params")
        _check_keys(
            sp, VLLM_SAMPLING_APPLIED | VLLM_SAMPLING_NO_TEXT | {"extra_args"}, VLLM_SAMPLING_OFF, "sampling_params."
        )
        for key in VLLM_SAMPLING_NO_TEXT:
            if sp.get(key) is not None and not isinstance(sp[key], bool):
                raise InvalidRequestError(
                    f"sampling_params.{key} must be true or false", param=f"sampling_params.{key}"
                )
        extra = sp.get("extra_args")
        if extra is not None:
            if not isinstance(extra, dict):
                raise InvalidRequestError(
                    "sampling_params.extra_args must be an object", param="sampling_params.extra_args"
                )
            for key in extra:
                if key not in VLLM_EXTRA_ARGS_KNOWN:
                    raise _refuse(
                        f"sampling_params.extra_args.{key}",
                        extra[key],
                        "an extension argument this server does not know",
                    )
        rid = request.get("request_id")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        answer_id = f"generate-tokens-{rid or uuid.uuid4().hex}"  # vLLM's ServingTokens names it so
        n = _int(sp, "n", "sampling_params.n", low=1, high=MAX_N) or 1
        top = _int(sp, "logprobs", "sampling_params.logprobs", low=0, high=20)
        prompt_top = _int(sp, "prompt_logprobs", "sampling_params.prompt_logprobs", low=0, high=20)
        if prompt_top is not None:
            check_prompt_logprobs(self.engine)
        max_tokens = _int(sp, "max_tokens", "sampling_params.max_tokens", low=1)
        sampling = self._sampling(
            _named(sp), len(prompt), max_tokens, {}, top_logprobs=top or 0, prompt_logprobs=prompt_top
        )
        gens = await self._run(prompt, sampling, n)
        choices = [
            {
                "index": i,
                "token_ids": gen.token_ids,
                "finish_reason": gen.finish_reason,
                "logprobs": self._vllm_logprobs(gen, top) if top is not None else None,
            }
            for i, gen in enumerate(gens)
        ]
        completion = sum(len(g.token_ids) for g in gens)
        answer: dict[str, Any] = {
            "id": answer_id,
            "request_id": answer_id,
            "object": "generate",
            "created": int(time.time()),
            "model": self.served_model_name(),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
            },
            "prompt_logprobs": None,
        }
        scores = gens[0].prompt_logprobs
        if prompt_top is not None and scores is not None:
            answer["prompt_logprobs"] = vllm_prompt_logprobs(prompt, scores, self.tokenizer)
        return answer

    @staticmethod
    def _vllm_logprobs(gen: Generation, k: int) -> dict[str, Any]:
        content = []
        for i, (tid, lp) in enumerate(zip(gen.token_ids, gen.log_probs)):
            head = {tid: lp}
            for alt, alp in gen.top_logprobs[i] if i < len(gen.top_logprobs) else []:
                head.setdefault(alt, alp)
            top = [
                {"token": f"token_id:{t}", "logprob": max(v, -9999.0), "bytes": None}
                for t, v in list(head.items())[: max(k, 1)]
            ]
            content.append(
                {"token": f"token_id:{tid}", "logprob": max(lp, -9999.0), "bytes": None, "top_logprobs": top}
            )
        return {"content": content}

    # ---- SGLang ------------------------------------------------------------------------------------

    async def sglang_generate(
        self, request: dict[str, Any], ctx: RequestContext
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's ``/generate`` answer for one prompt (a list of ``n`` answers when
        ``sampling_params.n > 1``, as SGLang answers parallel samples); module docstring for the
        shapes. Raises ``InvalidRequestError`` (400) naming the field and
        ``ContextLengthExceededError``."""
        if not isinstance(request, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        _check_keys(request, SGLANG_TOP_FIELDS, TOP_OFF, "")
        self.check_model(request.get("model"))
        if request.get("stream"):
            raise _refuse("stream", True, "this route answers whole generations only; send stream false")
        if request.get("input_ids") is not None:
            prompt = self._prompt(request["input_ids"], "input_ids")
        elif isinstance(request.get("text"), str) and request["text"]:
            prompt = self._prompt(list(self.tokenizer(request["text"])["input_ids"]), "text")
        else:
            raise InvalidRequestError("input_ids (the prompt's token IDs) or text is required", param="input_ids")
        sp = _object(request, "sampling_params")
        _check_keys(sp, SGLANG_SAMPLING_APPLIED, SGLANG_SAMPLING_OFF, "sampling_params.")
        n = _int(sp, "n", "sampling_params.n", low=1, high=MAX_N) or 1
        want_lp = request.get("return_logprob") is True
        top = _int(request, "top_logprobs_num", "top_logprobs_num", low=0, high=20) or 0
        start = request.get("logprob_start_len")
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < -1):
            raise InvalidRequestError("logprob_start_len must be an integer from -1", param="logprob_start_len")
        score_prompt = want_lp and start is not None and start >= 0
        if score_prompt:
            check_prompt_logprobs(self.engine)
        max_new = _int(sp, "max_new_tokens", "sampling_params.max_new_tokens", low=0)
        if max_new == 0:
            raise _refuse(
                "sampling_params.max_new_tokens", 0, "scoring without generating is not served; ask for at least 1"
            )
        keep_stop = sp.get("no_stop_trim") is True
        renames = {
            "seed": "sampling_seed",
            "min_tokens": "min_new_tokens",
            "include_stop_str_in_output": "no_stop_trim",
        }
        sampling = self._sampling(
            _named(sp, renames),
            len(prompt),
            SGLANG_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
            renames,
            top_logprobs=top if want_lp else 0,
            prompt_logprobs=0 if score_prompt else None,
        )
        gens = await self._run(prompt, sampling, n)
        rid = request.get("rid")
        stop_set = Ending.of(self.engine.eos_token_ids, sampling).stop_ids
        answers = [
            self._sglang_answer(
                gen, prompt, sampling, stop_set, rid=rid if isinstance(rid, str) else None, keep_stop=keep_stop,
                want_lp=want_lp, top=top, start=start if score_prompt else None,
                text_in_logprobs=request.get("return_text_in_logprobs") is True,
                skip_special=sp.get("skip_special_tokens", True) is not False,
            )
            for gen in gens
        ]  # fmt: skip
        return answers[0] if n == 1 else answers

    def _sglang_answer(
        self,
        gen: Generation,
        prompt: list[int],
        sampling: SamplingParams,
        stop_set: frozenset[int],
        *,
        rid: str | None,
        keep_stop: bool,
        want_lp: bool,
        top: int,
        start: int | None,
        text_in_logprobs: bool,
        skip_special: bool,
    ) -> dict[str, Any]:
        shown = gen.token_ids if keep_stop else text_ids(gen, stop_set)
        text = self.tokenizer.decode(shown, skip_special_tokens=skip_special)
        if isinstance(gen.stop_reason, str):
            text = cut_at_hit(text, gen.stop_reason, include=keep_stop)
        if gen.finish_reason == "length":
            finish: dict[str, Any] = {"type": "length", "length": sampling.max_tokens}
        elif gen.finish_reason == "abort":
            finish = {"type": "abort", "message": "aborted by pause_generation"}
        else:
            matched = gen.stop_reason if gen.stop_reason is not None else (gen.token_ids[-1] if gen.token_ids else None)
            finish = {"type": "stop", "matched": matched}
        version = gen.weight_version_spans[-1]["version"] if gen.weight_version_spans else self.engine.weight_version
        meta: dict[str, Any] = {
            "id": rid or uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(gen.token_ids),
            "cached_tokens": 0,
            "weight_version": str(version),
        }

        def label(tid: int) -> str | None:
            return self._text(tid) if text_in_logprobs else None

        if want_lp:
            meta["output_token_logprobs"] = [[lp, t, label(t)] for t, lp in zip(gen.token_ids, gen.log_probs)]
            if top:
                meta["output_top_logprobs"] = [
                    [[alp, a, label(a)] for a, alp in (gen.top_logprobs[i] if i < len(gen.top_logprobs) else [])]
                    for i in range(len(gen.token_ids))
                ]
            if start is not None and gen.prompt_logprobs is not None:
                scores = gen.prompt_logprobs
                meta["input_token_logprobs"] = [
                    [scores.log_probs[i], prompt[i], label(prompt[i])] for i in range(start, len(prompt))
                ]
        return {"text": text, "output_ids": gen.token_ids, "meta_info": meta}


_CHAT_NAMES = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos", "stop",
               "stop_token_ids", "include_stop_str_in_output")  # fmt: skip


def _named(sp: dict[str, Any], renames: dict[str, str] | None = None) -> dict[str, Any]:
    """The sampling fields of ``sp`` under the chat route's names (``renames``: chat name → this
    body's name), so the chat route's checks and rules apply to them."""
    renames = renames or {}
    out = {name: sp.get(renames.get(name, name)) for name in _CHAT_NAMES}
    return {k: v for k, v in out.items() if v is not None}
