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


# llama.cpp's qwen2 tensor names for a Hugging Face Qwen2 state dict (convert_hf_to_gguf.py's mapping).
_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# GGUF token types (gguf.TokenType): normal, control (special added tokens), user-defined, unused.
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def gguf_tensor_name(hf_name: str) -> str:
    """The llama.cpp (GGUF) name of a Hugging Face Qwen2 parameter, e.g.
    ``model.layers.0.self_attn.q_proj.weight`` → ``blk.0.attn_q.weight``."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{_HF_TO_GGUF['.'.join(parts[3:])]}"
    raise KeyError(hf_name)


def write_gguf_of_hf_model(model_dir: Path, path: Path, *, q8_0: bool = False) -> Path:
    """Write the Hugging Face Qwen2 model in ``model_dir`` (config.json, model.safetensors,
    tokenizer.json) as an F32 GGUF at ``path`` that llama.cpp loads: the same weights (so an engine on
    it can be compared with the transformers engine on ``model_dir``) and the same vocabulary, with
    ``[PAD<id>]`` entries up to the config's ``vocab_size`` as convert_hf_to_gguf.py writes them.
    ``q8_0``: the matrices as Q8_0 blocks instead (file type MOSTLY_Q8_0, as
    ``convert_hf_to_gguf.py --outtype q8_0`` writes them): a quantized model."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab_size = int(cfg["vocab_size"])
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [_UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, _NORMAL
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = _CONTROL if added["special"] else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(model_dir.name)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg["num_key_value_heads"]))
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(int(cfg.get("bos_token_id") or 151643))
    w.add_eos_token_id(int(cfg.get("eos_token_id") or 151645))
    w.add_add_bos_token(False)
    state = load_file(str(model_dir / "model.safetensors"))
    for name, value in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        value = np.ascontiguousarray(value, dtype=np.float32)
        if q8_0 and value.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_tensor_name(name), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def perturbed_gguf_dir(tiny_model_dir: Path, tiny_gguf_dir: Path, out: Path, seed: int = 1) -> Path:
    """The tiny model with noise (σ 0.05) on every weight, as a GGUF directory under ``out`` beside
    ``tiny_gguf_dir``'s tokenizer files: another policy version for weight-update tests."""
    import shutil

    from safetensors.numpy import load_file, save_file

    hf = out / "hf"
    shutil.copytree(tiny_model_dir, hf)
    rng = np.random.default_rng(seed)
    state = load_file(str(hf / "model.safetensors"))
    save_file(
        {k: v + rng.standard_normal(v.shape).astype(v.dtype) * 0.05 for k, v in state.items()},
        str(hf / "model.safetensors"),
    )
    gguf_dir = out / "gguf"
    gguf_dir.mkdir()
    write_gguf_of_hf_model(hf, gguf_dir / "model.gguf")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_gguf_dir / name, gguf_dir / name)
    return gguf_dir
