"""PEFT LoRA adapters written as llama.cpp GGUF LoRA adapters, so the llamacpp engine serves the
adapters a trainer saves (``peft.PeftModel.save_pretrained``) without llama.cpp's Python converter.

llama.cpp's adapter format (what its ``convert_lora_to_gguf.py`` writes and ``src/llama-adapter.cpp``
reads): a GGUF file with ``general.type = "adapter"``, ``adapter.type = "lora"``,
``general.architecture`` of the base model and ``adapter.lora.alpha``; for each adapted weight
``W`` (GGUF name, e.g. ``blk.0.attn_q.weight``) two tensors ``<W>.lora_a`` (PEFT's ``lora_A``,
``[r, in]``) and ``<W>.lora_b`` (``lora_B``, ``[out, r]``). llama.cpp computes
``W x + s · B (A x)`` with ``s = adapter_scale · alpha / r``, or ``s = adapter_scale`` when alpha is
0. PEFT's scale (``lora_alpha / r``, ``/ sqrt(r)`` with ``use_rslora``, per-module
``rank_pattern``/``alpha_pattern``) therefore goes into ``B`` here and alpha is written as 0, which
gives every module exactly PEFT's scale. What PEFT adapters cannot be merged exactly (DoRA, biases,
saved modules, ...) is refused as ``engine.lora`` refuses it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gymserve.errors import WeightUpdateError

# Hugging Face decoder module names → llama.cpp's (convert_hf_to_gguf.py's tensor map for the
# llama-style architectures: llama, qwen2, qwen3, mistral, ...).
_LAYER_MODULES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_MODULES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_module_name(hf_module: str) -> str:
    """The llama.cpp name of a Hugging Face module, e.g. ``model.layers.3.mlp.up_proj`` →
    ``blk.3.ffn_up``. Raises ``KeyError`` for a module llama.cpp's llama-style graphs lack."""
    if hf_module in _TOP_MODULES:
        return _TOP_MODULES[hf_module]
    parts = hf_module.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit():
        return f"blk.{parts[2]}.{_LAYER_MODULES['.'.join(parts[3:])]}"
    raise KeyError(hf_module)


def gguf_tensor_name(hf_name: str) -> str:
    """``gguf_module_name`` for a parameter: ``model.layers.0.self_attn.q_proj.bias`` → ``blk.0.attn_q.bias``."""
    module, _, kind = hf_name.rpartition(".")
    return f"{gguf_module_name(module)}.{kind}"


def write_gguf_lora(
    path: str | os.PathLike | None,
    out: str | os.PathLike,
    *,
    architecture: str,
    tensors: Mapping[str, Any] | None = None,
    config: Any = None,
) -> Path:
    """Write the PEFT adapter (directory ``path``, or ``tensors`` + ``config``: its state dict and
    ``peft.LoraConfig``) as a GGUF LoRA adapter for an ``architecture`` model at ``out``.

    Raises ``WeightUpdateError`` (400) naming the tensor or config field for what cannot be served
    exactly or has no llama.cpp name; then nothing is written.
    """
    import gguf

    from gymserve.engine.lora import PREFIX, _config_problems, _pairs, _rank_and_scale, read_adapter

    if path is not None:
        config, tensors = read_adapter(path)
    assert tensors is not None and config is not None
    source = str(path) if path is not None else "tensors"
    problems = _config_problems(config)
    pairs = _pairs(tensors, problems)
    out_tensors: list[tuple[str, np.ndarray]] = []
    for module, pair in sorted(pairs.items()):
        try:
            name = gguf_module_name(module)
        except KeyError:
            problems.append((pair["A"][0], f"module {module!r}: llama.cpp has no tensor for it"))
            continue
        a = _numpy(pair["A"][1])
        b = _numpy(pair["B"][1])
        r, scale = _rank_and_scale(config, module)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            problems.append(
                (pair["A"][0], f"module {module!r}: lora_A {a.shape} / lora_B {b.shape} do not have rank {r}")
            )
            continue
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            problems.append((pair["A"][0], f"module {module!r}: NaN or inf values"))
            continue
        out_tensors += [(f"{name}.weight.lora_a", a), (f"{name}.weight.lora_b", (b * scale).astype(np.float32))]
    if problems or not out_tensors:
        listed = "; ".join(why for _, why in problems[:10]) or f"no {PREFIX}<module>.lora_A/lora_B tensors"
        raise WeightUpdateError(
            f"LoRA adapter from {source} cannot be served by the llamacpp engine: {listed}",
            param=problems[0][0] if problems else "lora_path",
        )
    w = gguf.GGUFWriter(str(out), architecture)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # scale = adapter_scale; PEFT's scale is in B
    for name, t in out_tensors:
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def _numpy(t: Any) -> np.ndarray:
    """A float32 numpy array of a torch tensor or array-like."""
    if hasattr(t, "detach"):
        t = t.detach().float().cpu().numpy()
    return np.asarray(t, dtype=np.float32)
