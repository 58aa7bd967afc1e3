"""Token metadata of an upstream ``/v1/completions`` answer (vLLM's forms), whole or streamed.

vLLM (≥ 0.10.2, ``return_token_ids: true``) puts ``prompt_token_ids`` and ``token_ids`` on each
completion choice (streamed: the prompt on a choice's first chunk, the generated IDs piece by
piece); with ``logprobs: k`` and ``return_tokens_as_token_ids: true`` the legacy log-probs object
``{"tokens": ["token_id:N", ...], "token_logprobs": [...]}`` scores each token. With ``echo`` the
log-probs start with the prompt's tokens (the first has no log-prob), which are dropped here. The
training fields (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``) go on
each choice, as the local engine puts them (an upstream that sends them itself, another gymserve,
has them taken as given). A prompt the answer does not carry comes from the
request (token IDs) or from the upstream's ``/tokenize`` (text, prompt form).
"""

from __future__ import annotations

from typing import Any

from gymserve.backends.caller import UpstreamCaller
from gymserve.backends.context import RequestContext
from gymserve.backends.pool import Replica
from gymserve.backends.token_stream import upstream_tokenize
from gymserve.convert.completions_request import prompts
from gymserve.errors import InvalidRequestError, UpstreamTokenIdsError
from gymserve.protocol import get_token_info


def _ids_of_tokens(tokens: Any) -> list[int] | None:
    if isinstance(tokens, list) and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    return None


class CompletionTokens:
    """Token metadata of every choice of one completions call, gathered and attached.

    ``CompletionTokens(request, model)``: the client's request (its ``logprobs``, ``echo``, ``n``
    and prompts) and the upstream's model name (for its ``/tokenize``). :meth:`take` each streamed chunk (it removes vLLM's ``token_ids`` /
    ``prompt_token_ids`` and, unless the client asked, the log-probs gymserve asked for);
    :meth:`attach` puts the training fields on a finished choice (whole answers: every choice).
    """

    def __init__(self, request: dict[str, Any], model: str | None) -> None:
        self.request = request
        self.model = model
        self.prompts = prompts(request)
        self.n = request.get("n", 1)
        self._ids: dict[int, list[int]] = {}
        self._prompt: dict[int, list[int]] = {}
        self._tokens: dict[int, list[Any]] = {}
        self._logprobs: dict[int, list[Any]] = {}
        self._finished: set[int] = set()
        self._tokenized: dict[int, list[int]] = {}

    @property
    def finished(self) -> bool:
        """Whether every choice seen has ended (and one was seen)."""
        return bool(self._tokens or self._ids) and set(self._tokens) | set(self._ids) <= self._finished

    def take(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """Collect one streamed chunk's metadata; returns its choices that end here."""
        ending = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0) if isinstance(choice.get("index", 0), int) else 0
            self._gather(index, choice)
            if choice.get("finish_reason"):
                ending.append(choice)
        return ending

    def _gather(self, index: int, choice: dict[str, Any]) -> None:
        # vLLM's token fields leave the chunk unless the client asked for them (return_token_ids);
        # a gymserve upstream's training fields stay together.
        keep = bool(self.request.get("return_token_ids")) or "generation_token_ids" in choice
        prompt = choice.get("prompt_token_ids") if keep else choice.pop("prompt_token_ids", None)
        if isinstance(prompt, list):
            self._prompt[index] = prompt
        ids = choice.get("token_ids") if self.request.get("return_token_ids") else choice.pop("token_ids", None)
        if isinstance(ids, list):
            self._ids.setdefault(index, []).extend(ids)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self._tokens.setdefault(index, []).extend(logprobs.get("tokens") or [])
            self._logprobs.setdefault(index, []).extend(logprobs.get("token_logprobs") or [])
        else:
            self._tokens.setdefault(index, [])
        if self.request.get("logprobs") is None:
            choice["logprobs"] = None

    async def attach(
        self, choice: dict[str, Any], caller: UpstreamCaller, replica: Replica, ctx: RequestContext, where: str
    ) -> None:
        """Put the training fields on ``choice`` (its metadata already gathered). Raises
        ``UpstreamTokenIdsError`` (502) when they are missing or inconsistent: never made up."""
        index = choice.get("index", 0) if isinstance(choice.get("index", 0), int) else 0
        self._finished.add(index)
        try:
            if get_token_info(choice) is not None:  # another gymserve (or NeMo RL) sent them itself
                return
            prompt = self._prompt.get(index)
            if prompt is None:
                prompt = await self._prompt_ids(index, caller, replica, ctx)
            logprobs = list(self._logprobs.get(index, []))
            tokens = list(self._tokens.get(index, []))
            if self.request.get("echo"):  # the prompt's tokens come first, the first without a log-prob
                logprobs, tokens = logprobs[len(prompt) :], tokens[len(prompt) :]
            gen = self._ids.get(index)
            from_tokens = _ids_of_tokens(tokens)
            if gen is None:
                gen = from_tokens
            elif from_tokens is not None and from_tokens != gen:
                raise InvalidRequestError(f"choice {index}: token_ids and the token_id:N log-prob tokens disagree")
            if gen is None or (gen and not logprobs):
                raise InvalidRequestError(
                    f"choice {index} has no {'generation token IDs' if gen is None else 'log-probs'}; "
                    "return_token_id_information needs a server that honours return_token_ids, or logprobs + "
                    "return_tokens_as_token_ids (vLLM), or set return_token_id_information: false"
                )
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs):
                raise InvalidRequestError(f"choice {index}: token_logprobs holds entries that are not numbers")
            fields = {
                "prompt_token_ids": prompt,
                "generation_token_ids": gen,
                "generation_log_probs": [float(x) for x in logprobs],
            }
            get_token_info(fields)
        except InvalidRequestError as exc:
            raise UpstreamTokenIdsError(f"token metadata from {where} is unusable: {exc.message}", url=where) from None
        choice.update(fields)

    async def _prompt_ids(self, index: int, caller: UpstreamCaller, replica: Replica, ctx: RequestContext) -> list[int]:
        number = index // self.n
        if number >= len(self.prompts):
            raise InvalidRequestError(f"choice {index} answers no prompt of the request")
        prompt = self.prompts[number]
        if isinstance(prompt, list):
            return prompt
        if number not in self._tokenized:
            body = {"model": self.model, "prompt": prompt}
            body["add_special_tokens"] = self.request.get("add_special_tokens", True)
            self._tokenized[number] = await upstream_tokenize(caller, body, replica, ctx)
        return self._tokenized[number]
