"""Wire shapes shared by every layer.

Requests and responses travel as plain JSON dicts shaped like the openai SDK's own types
(``openai.types.chat.CompletionCreateParams``, ``openai.types.chat.ChatCompletion``,
``openai.types.responses.ResponseCreateParams``, ``openai.types.responses.Response``); the SDK's
pydantic models validate them in tests. Dicts keep the request path cheap: gymserve sits on the hot
path of every rollout and re-validating 100 KB histories per call would dominate its cost.

gymserve adds only the training fields, the names NeMo RL's generation servers use:

- ``prompt_token_ids``: ``list[int]``, the exact prompt the policy saw;
- ``generation_token_ids``: ``list[int]``, the tokens it sampled, including the EOS/stop token
  that ended the turn (``finish_reason`` ``stop``; vLLM's ``token_ids`` include it too); a
  generation cut by ``length`` or ``abort`` has none;
- ``generation_log_probs``: ``list[float]``, one log-probability (natural log) per generated token.

They ride on the chat assistant message (``choices[0].message``), on the last Responses output
item of a model call and on the Anthropic ``Message`` itself (beside ``content``; streamed, on the
``message_delta`` event), and come back on input items/messages of the next turn for the prefix
splice.

Beside them, a backend that knows its weights (local, Ray) says which weights generated the call
(``VERSION_FIELDS``, named as SGLang names its ``weight_version``), and the chat gateway says what
its servers said or what it forwarded to them (``backends.chat_versions``):

- ``weight_version``: ``int | str``, the weight version that sampled the first generated token;
  ``null`` from the chat gateway when it cannot name it (unknown, or a weight change was forwarded
  while the call ran);
- ``weight_version_spans``: only when the generation spans a weight update,
  ``[{"version": v, "start": i, "end": j}, ...]`` over ``generation_token_ids`` (token ``k`` for
  ``i <= k < j`` came from version ``v``), in order and covering every token.

They are informational: nothing reads them back from the next turn's input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

TRAINING_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
VERSION_FIELDS = ("weight_version", "weight_version_spans")
_INT = frozenset({int})  # exactly int: bool is a subclass of int but never a token ID
_NUMBER = frozenset({int, float})

ChatRequest = dict[str, Any]
"""A Chat Completions create request (``openai.types.chat.CompletionCreateParams`` shape) plus
engine extras such as ``chat_template_kwargs``."""
ChatCompletionDict = dict[str, Any]
"""A ``ChatCompletion`` as JSON (``openai.types.chat.ChatCompletion`` shape) plus training fields."""
ResponsesRequest = dict[str, Any]
"""A Responses create request (``openai.types.responses.ResponseCreateParams`` shape)."""
ResponseDict = dict[str, Any]
"""A ``Response`` as JSON (``openai.types.responses.Response`` shape) plus training fields on items."""
MessagesRequest = dict[str, Any]
"""An Anthropic Messages create request (``anthropic.types.MessageCreateParams`` shape)."""
MessageDict = dict[str, Any]
"""An Anthropic ``Message`` as JSON (``anthropic.types.Message`` shape) plus the training fields."""


class TokenInfo(TypedDict):
    """The three training fields of one model call; lists of equal length for the generation."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]


def get_token_info(obj: Mapping[str, Any], *, deep: bool = True) -> TokenInfo | None:
    """The training fields of a message or item: all three, or None when none is present.

    Raises ``InvalidRequestError`` when only some are present, when they are not lists of the right
    element type, or when the generation IDs and log-probs differ in length: partial or inconsistent
    token metadata must never be trusted (it would silently corrupt training data).

    ``deep=False`` checks presence, list types and lengths but not every element: each turn of a
    rollout carries its whole prompt, so checking every element of every turn costs O(turns²);
    the turn that is actually spliced is always checked deeply.
    """
    from gymserve.errors import InvalidRequestError

    if "prompt_token_ids" not in obj and "generation_token_ids" not in obj and "generation_log_probs" not in obj:
        return None
    present = [f for f in TRAINING_FIELDS if obj.get(f) is not None]
    if not present:
        return None
    if len(present) != len(TRAINING_FIELDS):
        missing = [f for f in TRAINING_FIELDS if f not in present]
        raise InvalidRequestError(
            f"token fields must come together: got {', '.join(present)} without {', '.join(missing)}",
            param=missing[0],
        )
    p, g, lp = (obj[f] for f in TRAINING_FIELDS)
    if not deep:
        for name, value in (("prompt_token_ids", p), ("generation_token_ids", g), ("generation_log_probs", lp)):
            if not isinstance(value, list):
                raise InvalidRequestError(f"{name} must be a list", param=name)
        if len(lp) != len(g):
            raise InvalidRequestError(
                f"generation_log_probs has {len(lp)} entries but generation_token_ids has {len(g)}; "
                "they must be equal (one log-prob per generated token)",
                param="generation_log_probs",
            )
        return TokenInfo(prompt_token_ids=p, generation_token_ids=g, generation_log_probs=lp)
    for name, value in (("prompt_token_ids", p), ("generation_token_ids", g)):
        # set(map(type, ...)) iterates in C: this check runs on every spliced turn's whole prompt.
        if not isinstance(value, list) or (value and (not set(map(type, value)) <= _INT or min(value) < 0)):
            raise InvalidRequestError(f"{name} must be a list of non-negative integers", param=name)
    if not isinstance(lp, list) or not set(map(type, lp)) <= _NUMBER:
        raise InvalidRequestError("generation_log_probs must be a list of numbers", param="generation_log_probs")
    if len(lp) != len(g):
        raise InvalidRequestError(
            f"generation_log_probs has {len(lp)} entries but generation_token_ids has {len(g)}; "
            "they must be equal (one log-prob per generated token)",
            param="generation_log_probs",
        )
    if int in set(map(type, lp)):
        lp = [float(x) for x in lp]
    return TokenInfo(prompt_token_ids=p, generation_token_ids=g, generation_log_probs=lp)


def check_token_ids(value: Any, *, param: str, vocab_size: int | None = None, allow_empty: bool = False) -> list[int]:
    """``value`` checked as a list of token IDs: JSON integers (not booleans) in ``[0, vocab_size)``.

    Used for every list of IDs a client sends outside the training fields: ``required_prefix_token_ids``,
    a ``/v1/completions`` prompt given as IDs, ``/detokenize``'s ``tokens``. Raises
    ``InvalidRequestError`` (param ``param``, or ``param[i]`` for one bad element) for a value that is
    not a list, an element that is not a non-negative integer, an ID outside the vocabulary
    (``vocab_size`` None: not checked), or an empty list unless ``allow_empty``.
    """
    from gymserve.errors import InvalidRequestError

    if not isinstance(value, list):
        raise InvalidRequestError(f"{param} must be a list of token IDs (integers)", param=param)
    if not value:
        if allow_empty:
            return value
        raise InvalidRequestError(f"{param} is empty; give at least one token ID", param=param)
    if not set(map(type, value)) <= _INT or min(value) < 0:
        i = next(i for i, t in enumerate(value) if type(t) is not int or t < 0)
        raise InvalidRequestError(
            f"{param}[{i}] must be a non-negative integer token ID, got {value[i]!r}", param=f"{param}[{i}]"
        )
    if vocab_size is not None and max(value) >= vocab_size:
        i = next(i for i, t in enumerate(value) if t >= vocab_size)
        raise InvalidRequestError(
            f"{param}[{i}] is token ID {value[i]}, outside the model's vocabulary [0, {vocab_size})",
            param=f"{param}[{i}]",
        )
    return value
