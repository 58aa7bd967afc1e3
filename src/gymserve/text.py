"""Text helpers shared by the parsers and the converter (which must not depend on each other)."""

from __future__ import annotations


def partial_tag_len(text: str, tag: str, start: int = 0) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``tag``: what a
    stream holds back because it may still become the tag (``"<tool"`` → ``"<tool_call>"``).
    Costs O(len(tag)²) whatever the length of ``text`` (nothing is copied)."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
