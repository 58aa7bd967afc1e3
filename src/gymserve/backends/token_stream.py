"""Token metadata a chat server returns (vLLM's forms), read whole or gathered from a stream.

vLLM (≥ 0.10.2, ``return_token_ids: true``) puts ``prompt_token_ids`` on the first chunk and
``token_ids`` on each choice delta's chunk; with ``logprobs: true`` and
``return_tokens_as_token_ids: true`` each chunk's ``choices[i].logprobs.content`` scores (and
names, as ``token_id:N``) the tokens of that chunk. :class:`StreamedTokens` collects them for
choice 0 — the choice the training fields describe, as on a whole completion — and hands the
chat backend a completion-shaped view of them, so one validation (``vllm_token_fields``) and one
``/tokenize`` fallback serve both paths: :func:`attach_token_info`, which puts the training fields
on the message.
"""

from __future__ import annotations

from typing import Any

from gymserve.backends.caller import UpstreamCaller
from gymserve.backends.context import RequestContext
from gymserve.backends.pool import Replica
from gymserve.errors import GymserveError, InvalidRequestError, UpstreamTokenIdsError
from gymserve.protocol import get_token_info
from gymserve.redaction import redact_url


class _ChoiceTokens:
    """One streamed choice's token metadata so far."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.saw_ids = False
        self.entries: list[Any] = []
        self.saw_logprobs = False
        self.finished = False


class StreamedTokens:
    """Collects the streamed token metadata of every choice (``n > 1`` streams interleave them).

    ``StreamedTokens(keep_logprobs, keep_token_ids)``: ``keep_logprobs`` False removes the
    ``logprobs`` that gymserve asked for on the client's behalf from the chunks it forwards;
    ``keep_token_ids`` (the client sent vLLM's ``return_token_ids`` itself) leaves vLLM's
    ``prompt_token_ids`` / ``token_ids`` in the chunks, in vLLM's places. Call :meth:`take` on each
    upstream chunk before forwarding it (it removes them otherwise),
    :meth:`finishing` to find the choices a chunk ends, and :meth:`completion` to get a
    ``ChatCompletion``-shaped dict whose ``choices[0]["message"]`` *is* that choice's delta in the
    chunk (the training fields set on it land in the chunk).
    """

    def __init__(self, keep_logprobs: bool, keep_token_ids: bool = False) -> None:
        self.keep_logprobs = keep_logprobs
        self.keep_token_ids = keep_token_ids
        self.prompt: list[int] | None = None
        self._choices: dict[int, _ChoiceTokens] = {}

    def take(self, chunk: dict[str, Any]) -> None:
        read = dict.get if self.keep_token_ids else dict.pop
        prompt = read(chunk, "prompt_token_ids", None)
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            choice_prompt = read(choice, "prompt_token_ids", None)
            ids = read(choice, "token_ids", None)
            logprobs = choice.get("logprobs")
            if not self.keep_logprobs:
                choice["logprobs"] = None
            state = self._choices.setdefault(_index(choice), _ChoiceTokens())
            prompt = prompt if prompt is not None else choice_prompt
            if isinstance(ids, list):
                state.ids += ids
                state.saw_ids = True
            content = logprobs.get("content") if isinstance(logprobs, dict) else None
            if isinstance(content, list):
                state.entries += content
                state.saw_logprobs = True
        if prompt is not None and self.prompt is None:
            self.prompt = prompt

    @staticmethod
    def finishing(chunk: dict[str, Any]) -> list[int]:
        """The indices of the choices ``chunk`` ends (those with a ``finish_reason``)."""
        return [_index(c) for c in chunk.get("choices") or [] if isinstance(c, dict) and c.get("finish_reason")]

    @property
    def finished(self) -> bool:
        """Whether every choice seen so far has ended (and at least one was seen)."""
        return bool(self._choices) and all(c.finished for c in self._choices.values())

    def completion(self, finish_chunk: dict[str, Any], index: int = 0) -> dict[str, Any]:
        state = self._choices.setdefault(index, _ChoiceTokens())
        state.finished = True
        raw = next(c for c in finish_chunk["choices"] if isinstance(c, dict) and _index(c) == index)
        choice: dict[str, Any] = {"message": raw.setdefault("delta", {})}
        if state.saw_ids:
            choice["token_ids"] = state.ids
        if state.saw_logprobs:
            choice["logprobs"] = {"content": state.entries}
        return {"prompt_token_ids": self.prompt, "choices": [choice]}


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index", 0)
    return index if isinstance(index, int) else 0


def vllm_token_fields(
    completion: dict[str, Any], choice: dict[str, Any]
) -> tuple[list | None, list | None, list | None]:
    """``(prompt_ids, generation_ids, logprobs)`` from vLLM's answer shapes (None where absent).

    Raises ``InvalidRequestError`` when ``token_ids`` and the ``token_id:N`` log-prob tokens
    disagree, or when log-prob entries lack numbers."""
    prompt = completion.get("prompt_token_ids") or choice.get("prompt_token_ids")
    gen = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    logprobs = None
    if isinstance(content, list):
        if not all(isinstance(e, dict) and isinstance(e.get("logprob"), (int, float)) for e in content):
            raise InvalidRequestError("logprobs.content has entries without a numeric logprob")
        logprobs = [float(e["logprob"]) for e in content]
        tokens = [e.get("token") for e in content]
        if all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t.split(":", 1)[1]) for t in tokens]
            if gen is None:
                gen = ids
            elif list(gen) != ids:
                raise InvalidRequestError("choices[0].token_ids and the token_id:N tokens of logprobs.content disagree")
    return prompt, gen, logprobs


async def attach_token_info(
    caller: UpstreamCaller,
    completion: dict[str, Any],
    request: dict[str, Any],
    body: dict[str, Any],
    replica: Replica,
    ctx: RequestContext,
) -> None:
    """Put the three training fields on every ``completion["choices"][i]["message"]``
    (``return_token_id_information``): taken as given when the upstream sent them (another gymserve,
    NeMo RL), else from vLLM's forms (``vllm_token_fields``), the prompt from ``/tokenize`` on the
    same replica when missing (asked once for all choices). The ``logprobs`` gymserve asked for on
    the client's behalf are removed unless the client asked. With ``required_prefix_token_ids`` in
    the request, every prompt must start with them (an upstream that ignores the field is caught).
    Raises ``UpstreamTokenIdsError`` (502) for missing or inconsistent metadata: IDs are never made up."""
    where = redact_url(caller.url(replica, "chat"))
    tokenized: list[int] | None = None
    for i, choice in enumerate(completion["choices"]):
        if not isinstance(choice, dict):
            continue
        msg = choice.setdefault("message", {})
        try:
            if get_token_info(msg) is None:
                prompt, gen, logprobs = vllm_token_fields(completion, choice)
                if gen is None or logprobs is None:
                    missing = "generation token IDs" if gen is None else "log-probs"
                    raise InvalidRequestError(
                        f"no {missing} in the answer (choice {i}); return_token_id_information needs a server "
                        "that honours return_token_ids or logprobs + return_tokens_as_token_ids (vLLM ≥ 0.10.2), "
                        "or set return_token_id_information: false"
                    )
                if prompt is None:
                    tokenized = tokenized if tokenized is not None else await _tokenize(caller, body, replica, ctx)
                    prompt = tokenized
                msg.update(prompt_token_ids=prompt, generation_token_ids=gen, generation_log_probs=logprobs)
                get_token_info(msg)
            check_required_prefix(request, msg["prompt_token_ids"], where)
        except InvalidRequestError as exc:
            raise UpstreamTokenIdsError(f"token metadata from {where} is unusable: {exc.message}", url=where) from None
        if not request.get("logprobs"):
            choice["logprobs"] = None


def check_required_prefix(request: dict[str, Any], prompt_ids: list[int], where: str) -> None:
    """Raise ``UpstreamTokenIdsError`` when ``request`` has ``required_prefix_token_ids`` and the
    prompt the upstream reports does not start with them: the upstream ignored NeMo RL's field."""
    prefix = request.get("required_prefix_token_ids")
    if prefix and prompt_ids[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prefix, prompt_ids)) if a != b), min(len(prefix), len(prompt_ids)))
        raise UpstreamTokenIdsError(
            f"{where} generated from a prompt that does not start with required_prefix_token_ids (they part "
            f"at position {at}): the server ignores the field; use an upstream that honours it (another "
            "gymserve, NeMo RL's vLLM server) or leave it out",
            url=where,
        )


async def _tokenize(caller: UpstreamCaller, body: dict[str, Any], replica: Replica, ctx: RequestContext) -> list[int]:
    """Prompt IDs of a chat ``body`` from the upstream's ``/tokenize`` (chat form), same replica."""
    tbody = {"model": body.get("model"), "messages": body.get("messages"), "add_generation_prompt": True}
    for key in ("tools", "chat_template_kwargs", "required_prefix_token_ids"):
        if body.get(key):
            tbody[key] = body[key]
    return await upstream_tokenize(caller, tbody, replica, ctx)


async def upstream_tokenize(
    caller: UpstreamCaller, body: dict[str, Any], replica: Replica, ctx: RequestContext
) -> list[int]:
    """``tokens`` of vLLM's ``POST {root}/tokenize`` (root = base URL without ``/v1``) on ``replica``
    for ``body`` (either form): the fallback when an answer carries no prompt IDs. Raises
    ``InvalidRequestError`` (made a 502 by the caller) when it fails or answers no token list."""
    root = replica.base_url.removesuffix("/v1")
    try:
        result, _ = await caller.call("tokenize", body, ctx, replica=replica, url=f"{root}/tokenize")
    except GymserveError as exc:
        raise InvalidRequestError(
            f"no prompt_token_ids in the answer and the /tokenize fallback failed: {exc.message}"
        ) from None
    tokens = result.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise InvalidRequestError(f"{redact_url(root)}/tokenize returned no token list")
    return tokens
