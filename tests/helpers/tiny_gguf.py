"""A tiny real GGUF file (qwen2 architecture, byte-level BPE vocabulary, random F32 weights) for
tests of the GGUF → safetensors conversion: transformers loads it like the embedded model's GGUF,
in about a second instead of minutes. Written with the ``gguf`` package's ``GGUFWriter``; the keys
and tensor names are llama.cpp's for qwen2 (the ones transformers' GGUF loader maps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_tokens() -> list[str]:
    # GPT-2's byte → printable-character table, which byte-level BPE vocabularies are written in.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(path: Path, seed: int = 0, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write the tiny model to ``path`` (a ``.gguf`` file of about 0.2 MB) and return ``path``."""
    import gguf

    tokens = _byte_tokens() + ["Ġt", "he"] + list(SPECIAL)
    merges = ["Ġ t", "h e"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2 test model")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - len(SPECIAL)) + [3] * len(SPECIAL))
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    t("token_embd.weight", vocab, HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", HIDDEN)
        t(p + "attn_q.weight", HIDDEN, HIDDEN)
        t(p + "attn_q.bias", HIDDEN)
        t(p + "attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        t(p + "attn_k.bias", KV_HEADS * head_dim)
        t(p + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        t(p + "attn_v.bias", KV_HEADS * head_dim)
        t(p + "attn_output.weight", HIDDEN, HIDDEN)
        t(p + "ffn_norm.weight", HIDDEN)
        t(p + "ffn_gate.weight", FFN, HIDDEN)
        t(p + "ffn_up.weight", FFN, HIDDEN)
        t(p + "ffn_down.weight", HIDDEN, FFN)
    t("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
