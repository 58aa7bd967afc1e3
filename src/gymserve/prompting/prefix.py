"""``required_prefix_token_ids``: the exact token IDs a chat prompt must start with.

The field is NeMo RL's (its vLLM generation server, ``NeMoRLChatCompletionRequest`` and the
matching ``/tokenize`` request; NeMo Gym agents send it). Its meaning there, followed here:

- R stands for the prompt + generation of the **last assistant message** of the request: the
  server renders the conversation, finds where that message's turn ends (its end-of-turn token)
  and replaces everything before it with R, so the prompt is ``R`` + the template's tokens from
  that end-of-turn token on. A trailing EOS in R closes the turn itself (the template's is then
  dropped), exactly as for a generation that kept its EOS (``splice.splice_token_ids``).
- Without the field, NeMo RL derives R from the last message carrying ``prompt_token_ids``
  (P + G): that is gymserve's prefix splice, which needs no R.

gymserve's rules on top, so that "the prompt starts with exactly R" always holds or the request
fails with a 400 that says why:

- R is a non-empty list of IDs inside the vocabulary (``protocol.check_token_ids``);
- the request has an assistant message (NeMo RL would treat the whole conversation as the prefix
  and double the last end-of-turn token; a whole prompt as IDs belongs in ``/v1/completions``);
- when that assistant message also carries token fields, its splice (P + G + ...) is used and must
  start with R (``required_prefix_mismatch``): the two say the same thing or the request is refused,
  rather than silently preferring one; token fields on *earlier* assistant messages are superseded
  by R, as the splice ignores fields of turns before its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gymserve.errors import InvalidRequestError
from gymserve.protocol import check_token_ids

PARAM = "required_prefix_token_ids"


def required_prefix_turn(messages: Sequence[Mapping[str, Any]], prefix: Any, vocab_size: int) -> int:
    """The index of the assistant message that ``prefix`` (R) ends with: the last one.

    Raises ``InvalidRequestError`` (param ``required_prefix_token_ids``) for an R that is not a
    non-empty list of in-vocabulary IDs, and for a conversation without an assistant message.
    """
    check_token_ids(prefix, param=PARAM, vocab_size=vocab_size)
    for k in range(len(messages) - 1, -1, -1):
        msg = messages[k]
        if isinstance(msg, Mapping) and msg.get("role") == "assistant":
            return k
    raise InvalidRequestError(
        f"{PARAM} stands for the prompt + generation of the last assistant message (NeMo RL's "
        "meaning), and messages has no assistant message; send the earlier turn as an assistant "
        "message, or send the whole prompt as token IDs to POST /v1/completions",
        param=PARAM,
    )


def prefix_mismatch(prefix: Sequence[int], ids: Sequence[int], k: int) -> InvalidRequestError:
    """The 400 for a spliced prompt (``ids``, built from the token fields of ``messages[k]``) that
    does not start with ``prefix``: where they part, and what to send."""
    at = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
    got = f"token {ids[at]}" if at < len(ids) else "the end of the prompt"
    return InvalidRequestError(
        f"{PARAM} ({len(prefix)} tokens) is not a prefix of the prompt spliced from messages[{k}]'s "
        f"prompt_token_ids + generation_token_ids: they part at position {at} ({PARAM} has token "
        f"{prefix[at]}, the prompt {got}); send the token fields and the prefix of the same model "
        f"call, or only one of them",
        param=PARAM,
        code="required_prefix_mismatch",
    )
