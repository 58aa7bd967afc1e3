"""Named-call heads: the text a format writes between a call's start and its arguments object.

Formats that put the function name outside the JSON (Mistral v11+ ``get_weather[ARGS]{...}``,
DeepSeek V3 ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n{...}``) are
described by *head patterns*: a sequence of literals and variables, ``NAME`` (the function name)
and ``ID`` (a call id the model writes, skipped). A variable is 1-256 characters of
``[A-Za-z0-9_.:-]`` (names are bounded so that waiting on a partial one costs O(1) per delta); the
arguments object must follow the head directly. A format may list several heads (its versions):
the first that matches wins. Matching is incremental: a text that may still become a head waits.
"""

from __future__ import annotations

from typing import Literal

NAME = "{name}"
ID = "{id}"
HeadPattern = tuple[str, ...]
_VAR_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")
_VAR_MAX = 256

Outcome = tuple[Literal["match"], str, int] | tuple[Literal["wait"], None, int] | tuple[Literal["fail"], None, int]


def _match_one(text: str, at: int, head: HeadPattern) -> Outcome:
    i, n, name = at, len(text), ""
    for part in head:
        if part in (NAME, ID):
            j = i
            while j < n and j - i < _VAR_MAX and text[j] in _VAR_CHARS:
                j += 1
            if j == n and j - i < _VAR_MAX:
                return ("wait", None, at)  # the variable may go on
            if j == i:
                return ("fail", None, at)
            if part == NAME:
                name = text[i:j]
            i = j
        else:
            if text.startswith(part, i):
                i += len(part)
            elif part.startswith(text[i:]):
                return ("wait", None, at)
            else:
                return ("fail", None, at)
    if i == n:
        return ("wait", None, at)  # the arguments object must come next
    return ("match", name, i) if text[i] == "{" else ("fail", None, at)


def match_head(text: str, at: int, heads: tuple[HeadPattern, ...], final: bool) -> Outcome:
    """Match one of ``heads`` at ``text[at:]``: ``("match", name, args_at)`` with the arguments
    object starting at ``args_at``; ``("wait", None, at)`` while more text could still decide (only
    when not ``final``); ``("fail", None, at)`` when no head matches. Heads are tried in order, and
    an earlier head that may still match makes the scan wait even if a later one matched."""
    for head in heads:
        outcome = _match_one(text, at, head)
        if outcome[0] == "match":
            return outcome
        if outcome[0] == "wait" and not final:
            return outcome
    return ("fail", None, at)


def skip_literals(text: str, at: int, pieces: tuple[str, ...], final: bool) -> int | None:
    """Index after those of ``pieces`` (literals, in order, each optional, whitespace allowed
    before each) that ``text[at:]`` holds: ``at`` when none is there; None while more text could
    still complete one (only when not ``final``)."""
    i, n = at, len(text)
    for piece in pieces:
        j = i
        while j < n and text[j].isspace():
            j += 1
        if text.startswith(piece, j):
            i = j + len(piece)
        elif not final and piece.startswith(text[j:]):
            return None
    return i
