"""Control tokens only where the chat template puts them: message text is tokenized as plain text.

A chat template writes control tokens (ChatML's ``<|im_start|>``, Llama 3's
``<|start_header_id|>``, Mistral's ``[INST]``, DeepSeek's ``<｜User｜>``, harmony's ``<|start|>``)
around the messages. Tokenizing the rendered prompt the usual way (``tokenizer(text)``) also turns
the *text* of a message that spells one of them into that token: a tool output holding
``<|im_end|>\\n<|im_start|>assistant`` forges a turn the model never took, in the prompt and in the
training data. What counts as a control token is every token the tokenizer adds on top of its
model vocabulary (``added_tokens_decoder``), whether it is flagged ``special`` or not: DeepSeek's
turn markers and Qwen's ``<tool_call>`` are added tokens with ``special: false``, and matched as
whole tokens all the same.

How the plain-text rule is applied, exactly and cheaply:

1. :meth:`MessageText.escape` replaces, in every string of the messages and tools before
   rendering, each control-token spelling with a placeholder (a private-use code point pair that no
   template writes and no tokenizer treats as a control token). In assistant messages only the
   tokens flagged ``special`` are replaced (:meth:`MessageText.escape_message`): the model's own
   markup (``<think>``, ``<tool_call>``) is what templates parse there.
2. The template renders as usual; its own control tokens are real text, the escaped ones are
   placeholders.
3. :meth:`MessageText.encode` tokenizes the rendering with the tokenizer as it is. A run of text
   tokens (between two control tokens) that holds a placeholder is tokenized again, on its own, with
   the placeholders restored, through the tokenizer's normalizer, pre-tokenizer and model but *not*
   its added-token matching (what ``split_special_tokens`` does for special tokens, extended to
   every added token). Runs without placeholders keep their tokens, so a prompt whose messages
   spell no control token is tokenized exactly as before.

A re-tokenized run is tokenized as a text of its own: for byte-level BPE tokenizers (Qwen, Llama 3,
DeepSeek V3, gpt-oss, Mistral's Tekken) that is what the tokenizer gives for that run inside the
whole prompt too. ``LocalBackendConfig.split_special_tokens: false`` turns all of this off (the
old behaviour: message text spelling a control token becomes that token).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MARK = "\U000f0000"
"""Starts every placeholder (Unicode private-use plane 15); ``MARK + MARK`` stands for a MARK the
message itself holds, so escaping is reversible for every text."""
_BASE = 0xF0001  # MARK + chr(_BASE + i): control token i


class MessageText:
    """The control tokens of one tokenizer, and the plain-text rule over them (module docstring).

    ``tokenizer``: a Hugging Face tokenizer. Its added tokens are the control tokens. A slow
    (Python) tokenizer has no offsets and no ``tokenizers`` copy to split with: nothing is escaped
    for it (the behaviour of ``split_special_tokens: false``); ``AutoTokenizer`` loads fast ones.
    Raises ``ValueError`` when the tokenizer has more added tokens than placeholders exist (over
    65,000).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        fast = getattr(tokenizer, "backend_tokenizer", None) is not None
        decoder = (getattr(tokenizer, "added_tokens_decoder", None) or {}) if fast else {}
        self.added_ids = frozenset(decoder)
        # Longest first, so a token that contains another is matched whole.
        self.tokens = sorted({t.content for t in decoder.values() if getattr(t, "content", "")}, key=len, reverse=True)
        if len(self.tokens) > 0xFFFFD - _BASE:
            raise ValueError(
                f"the tokenizer has {len(self.tokens)} added tokens; at most {0xFFFFD - _BASE} are supported"
            )
        self._index = {tok: i for i, tok in enumerate(self.tokens)}
        self._find = re.compile("|".join([re.escape(MARK), *map(re.escape, self.tokens)]))
        special = [t for t in self.tokens if any(a.content == t and a.special for a in decoder.values())]
        self._find_special = re.compile("|".join([re.escape(MARK), *map(re.escape, special)]))
        # The characters control tokens start with (`<`, `[`): most message text holds none of
        # them, and one character class is far cheaper to search than the alternation.
        self._starts = re.compile("[" + "".join(sorted({re.escape(t[0]) for t in [MARK, *self.tokens]})) + "]")

    # ---- escaping ----------------------------------------------------------------------------

    def escape_text(self, text: str, special_only: bool = False) -> str:
        """``text`` with every control-token spelling (and MARK itself) replaced by its placeholder;
        ``special_only``: only the tokens the tokenizer flags ``special``."""
        find = self._find_special if special_only else self._find
        if not self.tokens or not self._starts.search(text) or not find.search(text):
            return text
        return find.sub(self._placeholder, text)

    def _placeholder(self, match: re.Match[str]) -> str:
        found = match.group()
        return MARK + (MARK if found == MARK else chr(_BASE + self._index[found]))

    def escape(self, value: Any, special_only: bool = False) -> Any:
        """A copy of ``value`` (messages, tools: JSON-like data) with :meth:`escape_text` applied to
        every string value; keys and non-strings are kept, and so is the input."""
        if not self.tokens:
            return value
        if isinstance(value, str):
            return self.escape_text(value, special_only)
        if isinstance(value, Mapping):
            return {k: self.escape(v, special_only) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v, special_only) for v in value]
        return value

    def escape_message(self, message: Mapping[str, Any]) -> Any:
        """A chat message escaped: every added token in the text of user, system, developer and
        tool messages; in an assistant message (the model's own text) only the tokens flagged
        ``special``, because its markup tokens (Qwen's ``<think>``, ``<tool_call>``: added,
        not special) are what chat templates look for in it (Qwen3's and DeepSeek-R1's split a
        history answer on ``</think>``)."""
        return self.escape(message, special_only=message.get("role") == "assistant")

    def unescape(self, text: str) -> str:
        """Rendered text with the placeholders turned back into the spellings they stand for (what
        the prompt *reads* as; its tokens come from :meth:`encode`)."""
        if MARK not in text:
            return text
        return re.sub(re.escape(MARK) + "(.)", self._spelling, text, flags=re.S)

    def _spelling(self, match: re.Match[str]) -> str:
        ch = match.group(1)
        if ch == MARK:
            return MARK
        i = ord(ch) - _BASE
        return self.tokens[i] if 0 <= i < len(self.tokens) else match.group()

    # ---- tokenizing --------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token IDs of rendered text, no special tokens added (the template wrote them): control
        tokens the template wrote are their IDs; a placeholder is tokenized as the plain text it
        stands for, together with the text around it up to the nearest control tokens."""
        tok = self.tokenizer
        if MARK not in text:
            return list(tok(text, add_special_tokens=False)["input_ids"])
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        out: list[int] = []
        i, n = 0, len(ids)
        while i < n:
            if ids[i] in self.added_ids:
                out.append(ids[i])
                i += 1
                continue
            j = i
            while j < n and ids[j] not in self.added_ids:
                j += 1
            start = min(s for s, _ in offsets[i:j])
            end = max(e for _, e in offsets[i:j])
            run = text[start:end]
            out.extend(self._plain_ids(self.unescape(run)) if MARK in run else ids[i:j])
            i = j
        return out

    def _plain_ids(self, text: str) -> list[int]:
        """``text`` tokenized with no added token recognised: the tokenizer's own pipeline
        (normalizer, pre-tokenizer, model) without its added-token matching, which is what
        ``tokenizers`` runs for text between added tokens."""
        backend = self.tokenizer.backend_tokenizer
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]
