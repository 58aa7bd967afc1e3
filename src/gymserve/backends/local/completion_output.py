"""What one choice of a ``/v1/completions`` call sends back: ``Completion`` chunks and choices.

The legacy Completions API's shapes (OpenAI's ``Completion`` / ``CompletionChoice``, as vLLM serves
them), with gymserve's training fields on each choice:

- ``text``: the generated text (after the prompt's text with ``echo``), without the text of the
  EOS/stop token that ended it (``output.text_ids``); that token stays in the training fields and
  the log-probs, as on the chat routes and in vLLM's ``token_ids``;
- ``finish_reason``: ``stop``, ``length``, or ``abort`` (a call ended by ``POST /pause?mode=abort``,
  vLLM's value);
- ``logprobs`` (when the request sends ``logprobs: k``): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per generated token; ``top_logprobs[i]`` maps the
  ``k`` most likely tokens *and the sampled one* to their log-probs, so it has up to ``k + 1``
  entries (the OpenAI API reference says so of its own answers; vLLM does the same). Tokens are
  their text, or ``token_id:N`` with vLLM's ``return_tokens_as_token_ids``. ``text_offset[i]`` is
  where token i's text starts in ``text``. With ``echo`` the prompt's tokens come first, scored by
  the engine (``engine.base.PromptLogprobs``): the first one's ``token_logprobs`` and
  ``top_logprobs`` entries are ``null`` (nothing precedes it), as in vLLM's
  ``_create_completion_logprobs`` and OpenAI's legacy answers;
- ``prompt_logprobs`` (when the call computed them: vLLM's ``prompt_logprobs`` field, or echo with
  logprobs): vLLM's ``CompletionResponseChoice.prompt_logprobs``, one entry per prompt token, ``null``
  first, then ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the prompt token and the
  ``k`` most likely ones;
- ``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs`` and the weight version
  (``control.version_fields``) on the choice itself (a completion choice has no message).

With vLLM's ``return_token_ids`` each choice also carries ``token_ids`` (the generation, as vLLM's
``CompletionResponseChoice``; its ``prompt_token_ids`` is gymserve's field already). Streamed, the
chunks carry text as it becomes final (``stream.IncrementalDetokenizer``); the finish chunk of each
choice carries its finish reason, training fields and log-probs; with ``return_token_ids``, as in
vLLM's ``completion_stream_generator``, the choice's first chunk carries ``prompt_token_ids`` and
each engine step's tokens ride as ``token_ids`` on the chunk that step produced
(``output.with_token_ids``).
"""

from __future__ import annotations

from typing import Any

from gymserve.backends.local.control import version_fields
from gymserve.backends.local.output import text_ids, with_token_ids
from gymserve.engine.base import Generation, PromptLogprobs
from gymserve.engine.ending import cut_at_hit
from gymserve.errors import EngineError


class CompletionOutput:
    """The chunks of one completion choice: generation of ``prompt_ids`` (text ``prompt_text``).

    ``head``: the fields every chunk shares (``id``, ``object``, ``created``, ``model``). ``index``:
    the choice's index in the answer. ``logprobs``: the request's ``logprobs`` (None: no log-probs
    object). ``prompt_logprobs``: the alternatives per prompt position the engine was asked for (None:
    no prompt scores). ``echo``: the prompt's text (and, with ``logprobs``, its tokens' log-probs)
    comes first. ``tokens_as_ids``: tokens as ``token_id:N``.
    Use as ``stream.stream_chunks`` uses a chat ``CallOutput`` (:meth:`role`, :meth:`text`,
    :meth:`text_ids`, :meth:`end`), or :meth:`choice` for the whole choice at once.
    """

    def __init__(
        self,
        *,
        prompt_ids: list[int],
        prompt_text: str,
        index: int,
        head: dict[str, Any],
        tokenizer: Any,
        stop_token_ids: tuple[int, ...] | frozenset[int],
        logprobs: int | None,
        echo: bool,
        prompt_logprobs: int | None = None,
        tokens_as_ids: bool,
        return_token_ids: bool = False,
        engine: Any = None,
        include_stop: bool = False,
    ):
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.index = index
        self.head = head
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.echo = echo
        self.tokens_as_ids = tokens_as_ids
        self.return_token_ids = return_token_ids
        self.engine = engine
        self.include_stop = include_stop  # include_stop_str_in_output: the text keeps the stop string
        self.sampled = 0  # tokens the engine sampled (usage), known at end()
        self.ids_sent = 0  # generation tokens already sent as token_ids (return_token_ids)

    # ---- chunks (streaming) ---------------------------------------------------------------------

    def _chunk(self, text: str, **choice: Any) -> dict[str, Any]:
        body = {"index": self.index, "text": text, "logprobs": None, "finish_reason": None, **choice}
        return {**self.head, "choices": [body]}

    def role(self) -> dict[str, Any]:
        """The first chunk: the prompt's text with ``echo``, else empty text (and the choice's
        ``prompt_token_ids`` with ``return_token_ids``, as vLLM's first chunk of a choice)."""
        extra = {"prompt_token_ids": self.prompt_ids} if self.return_token_ids else {}
        return self._chunk(self.prompt_text if self.echo else "", **extra)

    def text(self, text: str) -> list[dict[str, Any]]:
        """The chunk for the next piece of final generated text (none for empty text)."""
        return [self._chunk(text)] if text else []

    def step(self, ids: list[int], text: str) -> list[dict[str, Any]]:
        """The chunks of one engine step (``ids``, their final ``text``), with the step's
        ``token_ids`` when asked for (module docstring)."""
        chunks = self.text(text)
        if self.return_token_ids:
            self.ids_sent += len(ids)
            chunks = with_token_ids(chunks, ids, lambda: self._chunk(""))
        return chunks

    def text_ids(self, gen: Generation) -> list[int]:
        """The tokens of ``gen`` whose text is shown (``output.text_ids``)."""
        return text_ids(gen, self.stop_token_ids)

    def end(self, gen: Generation, tail_text: str, *, include_usage: bool) -> list[dict[str, Any]]:
        """The last chunks of the choice: ``tail_text`` (final text not yet sent), then the finish
        chunk with the training fields and log-probs, then (``include_usage``) this choice's usage."""
        self.sampled = len(gen.token_ids)
        out = self.text(tail_text)
        last = {"token_ids": gen.token_ids[self.ids_sent :]} if self.return_token_ids else {}
        out.append(self._chunk("", **self._final(gen), **last))
        if include_usage:
            prompt, completion = len(self.prompt_ids), len(gen.token_ids)
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            out.append({**self.head, "choices": [], "usage": usage})
        return out

    # ---- the whole choice ------------------------------------------------------------------------

    def choice(self, gen: Generation) -> dict[str, Any]:
        """The ``CompletionChoice`` dict of a finished generation (what the stream's chunks add up to)."""
        self.sampled = len(gen.token_ids)
        text = self.tokenizer.decode(self.text_ids(gen), skip_special_tokens=False)
        if isinstance(gen.stop_reason, str):
            text = cut_at_hit(text, gen.stop_reason, include=self.include_stop)
        choice = {"index": self.index, "text": (self.prompt_text if self.echo else "") + text, **self._final(gen)}
        if self.return_token_ids:
            choice["token_ids"] = gen.token_ids
        return choice

    # ---- rules -----------------------------------------------------------------------------------

    def _final(self, gen: Generation) -> dict[str, Any]:
        finish = "abort" if gen.finish_reason == "abort" else "length" if gen.finish_reason == "length" else "stop"
        scores = self._prompt_scores(gen)
        return {
            "finish_reason": finish,
            "stop_reason": gen.stop_reason,
            "logprobs": self._logprobs(gen, scores) if self.logprobs is not None else None,
            **({"prompt_logprobs": self._vllm_prompt_logprobs(scores)} if scores is not None else {}),
            "prompt_token_ids": self.prompt_ids,
            "generation_token_ids": gen.token_ids,
            "generation_log_probs": gen.log_probs,
            **version_fields(gen, self.engine),
        }

    def _token(self, tid: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _prompt_scores(self, gen: Generation) -> PromptLogprobs | None:
        """The prompt's scores when asked for; an ``EngineError`` when the engine left them out
        (an engine must not claim ``supports_prompt_logprobs`` and skip them)."""
        if self.prompt_logprobs is None:
            return None
        if gen.prompt_logprobs is None or len(gen.prompt_logprobs.log_probs) != len(self.prompt_ids):
            raise EngineError("the engine returned no log-probs for the prompt's tokens although they were asked for")
        return gen.prompt_logprobs

    def _vllm_prompt_logprobs(self, scores: PromptLogprobs) -> list[dict[str, dict[str, Any]] | None]:
        return vllm_prompt_logprobs(self.prompt_ids, scores, self.tokenizer)

    def _text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _logprobs(self, gen: Generation, scores: PromptLogprobs | None) -> dict[str, Any]:
        tokens: list[str] = []
        offsets: list[int] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []

        def add(tid: int, lp: float | None, alternatives: list[tuple[int, float]], offset: int) -> int:
            token = self._token(tid)
            top = None
            if lp is not None:
                top = {self._token(a): alp for a, alp in alternatives[: self.logprobs]}
                top.setdefault(token, lp)  # the scored token is always listed (up to k + 1 entries)
            tokens.append(token)
            offsets.append(offset)
            lps.append(lp)
            tops.append(top)
            return offset + len(self._text(tid))

        offset = 0
        if self.echo and scores is not None:
            for i, tid in enumerate(self.prompt_ids):
                offset = add(tid, scores.log_probs[i], scores.top_logprobs[i], offset)
        offset = len(self.prompt_text) if self.echo else 0
        for i, (tid, lp) in enumerate(zip(gen.token_ids, gen.log_probs)):
            offset = add(tid, lp, gen.top_logprobs[i] if i < len(gen.top_logprobs) else [], offset)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(
    prompt_ids: list[int], scores: PromptLogprobs, tokenizer: Any
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` (completions' ``choices[i]``, chat's top level): per prompt token
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` with the alternatives asked for, the first
    ``null``."""

    def text(tid: int) -> str:
        return tokenizer.decode([tid], skip_special_tokens=False)

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for i in range(1, len(prompt_ids)):
        tid, lp = prompt_ids[i], scores.log_probs[i]
        entry = {str(tid): {"logprob": lp, "rank": scores.ranks[i], "decoded_token": text(tid)}}
        for rank, (alt, alp) in enumerate(scores.top_logprobs[i], start=1):
            entry.setdefault(str(alt), {"logprob": alp, "rank": rank, "decoded_token": text(alt)})
        out.append(entry)
    return out
