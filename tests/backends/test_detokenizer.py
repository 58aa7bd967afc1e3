"""The local stream's incremental detokenizer: pieces concatenate to ``decode(ids)`` however the
tokens arrive, multi-byte characters split across tokens included."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymserve.backends.local.stream import IncrementalDetokenizer

TEXTS = [
    "plain ascii words, then code: def f(x):\n    return x",
    "日本語のテキストと絵文字 🎉👍🏽 and flags 🇫🇷",
    '<tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call>',
    "<think>\nhm\n</think>\n\nok",
    "  leading spaces and trailing  ",
    "\ufffd literal replacement char",
]


def pieces(tokenizer, ids, sizes, final_tail=True):
    detok = IncrementalDetokenizer(tokenizer)
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(detok.push(ids[i : i + size]))
        i += size
    out.append(detok.push(ids[i:], final=True))
    return out


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(st.sampled_from(TEXTS), st.lists(st.integers(1, 4), max_size=80), st.lists(st.integers(0, 151642), max_size=6))
def test_pieces_concatenate_to_the_full_decode(tokenizer, text, sizes, noise):
    ids = tokenizer.encode(text, add_special_tokens=False) + noise  # noise: arbitrary ids, partial bytes too
    got = pieces(tokenizer, ids, sizes)
    assert "".join(got) == tokenizer.decode(ids, skip_special_tokens=False)
    if not noise and "\ufffd" not in text:
        assert not any("\ufffd" in p for p in got)  # a character split over tokens waits for its end


def test_an_emoji_split_over_byte_tokens_arrives_whole(tokenizer):
    ids = tokenizer.encode("a🎉b", add_special_tokens=False)
    got = [p for p in pieces(tokenizer, ids, [1] * len(ids)) if p]
    assert "".join(got) == "a🎉b" and "🎉" in "".join(got[1:2]) + "".join(got[1:])
    assert not any("\ufffd" in p for p in got)
