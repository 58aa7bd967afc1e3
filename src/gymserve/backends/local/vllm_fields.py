"""vLLM's request extras on the local backend, as data: each one applied, or refused with a 400 naming it.

vLLM's ``ChatCompletionRequest`` and ``CompletionRequest`` (``vllm/entrypoints/openai/chat_completion/
protocol.py``, ``completion/protocol.py``) take many fields beyond the OpenAI API's. The local engines
apply those ``APPLIED`` lists (where: the module that does); every field of ``REFUSED`` is a 400
(code ``unsupported_parameter``, ``param`` the field) unless the request sends a value that asks for
nothing (vLLM's default, or the behaviour the local backend has anyway: ``off``). ``check_extras``
applies the table; ``tests/backends/test_vllm_fields.py`` checks the table against vLLM's field list
(``tests/data/vllm_request_fields.json``) and each entry's effect or refusal over HTTP.

Fields of the OpenAI API itself (``user``, ``parallel_tool_calls``, ...) are the generic request
checks' (``convert.request_checks``), not this table's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gymserve.errors import InvalidRequestError

APPLIED: dict[str, str] = {
    "top_k": "backends.local.request.sampling_params (engine.sampling)",
    "min_p": "backends.local.request.sampling_params (engine.sampling)",
    "stop_token_ids": "backends.local.request.ending_params (engine.ending)",
    "include_stop_str_in_output": "backends.local.request.ending_params (engine.ending.cut_at_stop)",
    "ignore_eos": "backends.local.request.ending_params (engine.ending)",
    "min_tokens": "backends.local.request.ending_params (engine.ending)",
    "prompt_logprobs": "backends.local.request.chat_prompt_logprobs / completions (engine prefill)",
    "add_generation_prompt": "backends.local.request.render_options (prompting)",
    "continue_final_message": "backends.local.request.render_options (prompting)",
    "add_special_tokens": "backends.local.request.render_options (prompting)",
    "chat_template_kwargs": "backends.local.request.chat_prompt (prompting)",
    "return_tokens_as_token_ids": "backends.local.output (logprobs token spelling)",
    "return_token_ids": "backends.local.output (prompt_token_ids, choices[].token_ids)",
    "request_id": "the answer's id: chatcmpl-{request_id} / cmpl-{request_id}, as vLLM names it",
    "echo": "completions: the prompt's text before the generation (chat: refused unless false)",
    "skip_special_tokens": "false: the text keeps special tokens, as the local backend's text does (true refused)",
    "response_format": "backends.local.structured (json_schema, json_object: a token mask per step)",
    "structured_outputs": "backends.local.structured (json, json_object, regex, choice)",
    "guided_json": "backends.local.structured",
    "guided_regex": "backends.local.structured",
    "guided_choice": "backends.local.structured",
    "guided_json_object": "backends.local.structured",
}
"""vLLM extras the local backend applies, and where."""


@dataclass(frozen=True)
class Refused:
    """A vLLM extra the local engines do not apply: ``off`` holds the values that ask for nothing
    (accepted), ``why`` says why anything else is a 400."""

    off: tuple[Any, ...]
    why: str


_NO_PENALTY = "the local engines apply no penalties (they would change the distribution the trainer assumes)"
_GUIDED = (
    "this form of structured output is not applied by the local backend (it applies JSON schemas, "
    "regular expressions and choices: structured_outputs json/regex/choice, guided_json/regex/choice)"
)
_NOT_LOCAL = "not applied by the local engines"

REFUSED: dict[str, Refused] = {
    "use_beam_search": Refused((False,), "beam search is not implemented by the local engines"),
    "length_penalty": Refused((1, 1.0), "length_penalty only applies to beam search, which the local engines lack"),
    "repetition_penalty": Refused((1, 1.0), _NO_PENALTY),
    "watermarking": Refused((False,), "watermarking is " + _NOT_LOCAL),
    "truncate_prompt_tokens": Refused((), "prompt truncation is " + _NOT_LOCAL + "; shorten the prompt yourself"),
    "truncation_side": Refused((), "prompt truncation is " + _NOT_LOCAL),
    "logprob_token_ids": Refused((), "log-probs of chosen token IDs are " + _NOT_LOCAL + "; use top_logprobs"),
    "allowed_token_ids": Refused((), "an allowed-token mask is " + _NOT_LOCAL),
    "bad_words": Refused(([],), "bad-word masks are " + _NOT_LOCAL),
    "spaces_between_special_tokens": Refused((True,), "the text is decoded with the tokenizer's own spacing"),
    "documents": Refused((), "RAG documents are not passed to the chat template by the local backend"),
    "chat_template": Refused(
        (),
        "the template decides the token IDs the policy is trained on, so it is the server's "
        "(backend.chat_template); vLLM too refuses it unless --trust-request-chat-template",
    ),
    "media_io_kwargs": Refused((), "the local engines serve text-only models"),
    "mm_processor_kwargs": Refused((), "the local engines serve text-only models"),
    "prompt_embeds": Refused((), "the local engines take token IDs, not embeddings"),
    "guided_grammar": Refused((), _GUIDED),
    "structural_tag": Refused((), _GUIDED),
    "guided_decoding_backend": Refused((), _GUIDED),
    "guided_whitespace_pattern": Refused((), _GUIDED),
    "logits_processors": Refused((), "custom logits processors are " + _NOT_LOCAL),
    "priority": Refused((0,), "the local engines schedule first come, first served (no priority scheduling)"),
    "return_token_offsets": Refused((False,), "token offsets are for vLLM's render routes"),
    "return_prompt_text": Refused((False,), "use POST /tokenize, or return_token_ids for the prompt's token IDs"),
    "routed_experts_prompt_start": Refused((0,), "routed-expert data is " + _NOT_LOCAL),
    "cache_salt": Refused((), "the local engines do not salt their prefix cache"),
    "kv_transfer_params": Refused((), "disaggregated serving (KV transfer) is " + _NOT_LOCAL),
    "ec_transfer_params": Refused((), "encoder-cache transfer is " + _NOT_LOCAL),
    "vllm_xargs": Refused((), "vLLM extension arguments are " + _NOT_LOCAL),
    "repetition_detection": Refused((), "repetition detection is " + _NOT_LOCAL),
    "stream_interval": Refused((1,), "each engine step's tokens are streamed as they come"),
    "thinking_token_budget": Refused((-1,), "a thinking-token budget is " + _NOT_LOCAL),
    "include_reasoning": Refused((True,), "the answer always carries the reasoning the model wrote"),
}
"""vLLM extras the local engines refuse (unless off); see ``Refused``."""

CHAT_ONLY_REFUSED: dict[str, Refused] = {
    "echo": Refused((False,), "echo on chat (prepending the last message) is " + _NOT_LOCAL),
}
"""Refused on ``/v1/chat/completions`` only (applied on ``/v1/completions``)."""


def check_extras(request: dict[str, Any], *, chat: bool) -> None:
    """400 (``unsupported_parameter``, ``param`` the field) for the first field of ``REFUSED`` (and,
    with ``chat``, ``CHAT_ONLY_REFUSED``) that ``request`` sends with a value other than off (null
    counts as off), and for ``skip_special_tokens: true``."""
    table = {**REFUSED, **(CHAT_ONLY_REFUSED if chat else {})}
    for key, rule in table.items():
        value = request.get(key)
        if value is None or _is_off(value, rule.off):
            continue
        raise InvalidRequestError(
            f"{key}={_short(value)} is not applied by the local backend: {rule.why}; leave {key} out",
            param=key,
            code="unsupported_parameter",
        )
    if request.get("skip_special_tokens") is True:
        raise InvalidRequestError(
            "skip_special_tokens=true is not applied by the local backend: its text keeps special tokens "
            "other than the stop token (the token IDs are exact either way); send false or leave it out",
            param="skip_special_tokens",
            code="unsupported_parameter",
        )


def answer_id(request: dict[str, Any], prefix: str) -> str:
    """The answer's ``id``: ``{prefix}-{request_id}`` when the request names one (vLLM's rule, e.g.
    ``chatcmpl-abc``), else a fresh one; a ``request_id`` that is not a non-empty string is a 400."""
    from gymserve.wire.ids import new_id

    rid = request.get("request_id")
    if rid is None:
        return new_id(prefix)
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
    return f"{prefix}-{rid}"


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    return any(type(value) is type(o) and value == o for o in off) or (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and any(isinstance(o, (int, float)) and not isinstance(o, bool) and value == o for o in off)
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
