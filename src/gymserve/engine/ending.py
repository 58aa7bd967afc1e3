"""When a generation ends: the one rule every engine and the local backend apply (vLLM's rule).

Token rules (engines, per sampled token; ``Ending``):

- the stop set is the model's EOS IDs plus ``SamplingParams.stop_token_ids`` (the server's and the
  request's); with ``ignore_eos`` the EOS IDs leave it (generation runs on past them, vLLM's
  ``ignore_eos``), the request's stop tokens stay;
- while fewer than ``min_tokens`` tokens were sampled, every ID of the stop set is masked out of
  the sampling distribution (vLLM's ``MinTokensLogitsProcessor`` sets their logits to -inf), so the
  generation cannot end early; the reported log-prob stays the raw model's (``engine.sampling``);
- a sampled ID in the stop set ends the generation with ``stop``; the token stays in the output with
  its log-prob (a training token). Else ``max_tokens`` tokens end it with ``length``.

Stop strings (``SamplingParams.stop``, text; the local backend, which has the tokenizer;
``StopStrings``): the generation ends after the token whose text completes a stop string, checked
from the ``min_tokens``-th token on (vLLM's ``StopChecker`` skips the check before that). The token
IDs stay whole, that token included, with their log-probs; the text is cut where the string starts
(vLLM's default; with ``include_stop_str_in_output`` where it ends) and ``stop_reason`` is the string. A stream
holds back the last ``len(longest stop) - 1`` characters until it knows they do not begin a stop
string, as vLLM's streaming does.

``stop_reason`` (vLLM's field on a choice): the stop string, or the request's or server's stop token
ID that ended the generation; ``None`` for EOS, length or abort (vLLM's meaning).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gymserve.engine.base import FinishReason, SamplingParams


@dataclass(frozen=True)
class Ending:
    """The token rule of one call: built once per request by ``Ending.of``."""

    stop_ids: frozenset[int]
    min_tokens: int
    max_tokens: int

    @classmethod
    def of(cls, eos_token_ids: Iterable[int], sampling: SamplingParams) -> Ending:
        """The rule for ``sampling`` on a model whose turn-ending IDs are ``eos_token_ids``."""
        eos = frozenset() if sampling.ignore_eos else frozenset(int(t) for t in eos_token_ids)
        return cls(eos | frozenset(int(t) for t in sampling.stop_token_ids), sampling.min_tokens, sampling.max_tokens)

    def suppressed(self, generated: int) -> list[int]:
        """The IDs to mask before sampling token number ``generated + 1`` (``min_tokens``): the
        stop set while fewer than ``min_tokens`` tokens were sampled, else none."""
        return sorted(self.stop_ids) if generated < self.min_tokens else []

    def finish(self, token: int, generated: int) -> FinishReason | None:
        """``stop`` when ``token`` (the ``generated``-th sampled token, counted from 1) is in the stop
        set, ``length`` when it is the ``max_tokens``-th, else ``None`` (goes on)."""
        if token in self.stop_ids:
            return "stop"
        if generated >= self.max_tokens:
            return "length"
        return None


def stop_reason(token_ids: Sequence[int], finish: str, sampling: SamplingParams, eos_token_ids: Iterable[int]):
    """vLLM's ``stop_reason`` of a generation that ended by a token: the stop token ID (one of
    ``sampling.stop_token_ids`` that is not an EOS) when it ended with ``stop`` on it, else None."""
    if finish != "stop" or not token_ids:
        return None
    last = token_ids[-1]
    eos = set() if sampling.ignore_eos else set(eos_token_ids)
    return last if last in sampling.stop_token_ids and last not in eos else None


def cut_at_stop(text: str, stops: Sequence[str], *, include: bool = False) -> tuple[str, str | None]:
    """``text`` up to the first stop string in it (``include``: up to its end, vLLM's
    ``include_stop_str_in_output``) and that string; ``(text, None)`` when none is in it."""
    first: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (first is None or at < first[0]):
            first = (at, stop)
    if first is None:
        return text, None
    return text[: first[0] + (len(first[1]) if include else 0)], first[1]


def cut_at_hit(text: str, hit: str, *, include: bool = False) -> str:
    """The text of a generation that a stop string ``hit`` ended: cut at its last occurrence, the one
    the last token completed (``include``: after it)."""
    at = text.rfind(hit)
    return text if at < 0 else text[: at + (len(hit) if include else 0)]


class StopStrings:
    """The stop-string watch of one streamed generation: feed each piece of final text as it is
    decoded; ``feed`` returns the text that may be shown now (a stop string's start held back) and
    sets ``hit`` to the string once one is complete. ``armed`` false (before ``min_tokens``) shows the
    text at once and never stops on it."""

    def __init__(self, stops: Sequence[str], *, include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # every piece fed
        self.shown = 0  # characters of ``text`` returned
        self.checked = 0  # a stop string may start at this character or later
        self.hit: str | None = None

    def feed(self, piece: str, *, armed: bool = True) -> str:
        """The part of ``text + piece`` that can be shown now (see class docstring)."""
        if self.hit is not None:
            return ""
        self.text += piece
        if not armed:
            self.checked = len(self.text)
            return self._show(len(self.text))
        cut, hit = cut_at_stop(self.text[self.checked :], self.stops, include=self.include)
        if hit is not None:
            self.hit = hit
            return self._show(self.checked + len(cut))
        self.checked = max(self.checked, len(self.text) - self.hold)
        return self._show(len(self.text) - self.hold)

    def flush(self) -> str:
        """The text held back, at the end of a generation that hit no stop string."""
        return "" if self.hit is not None else self._show(len(self.text))

    def _show(self, upto: int) -> str:
        upto = max(upto, self.shown)
        out, self.shown = self.text[self.shown : upto], upto
        return out
