"""The real GGUF → safetensors conversion (transformers) on a tiny GGUF, its failures, and ``gymserve
demo`` on a fresh cache beside another first run, with the embedded wheels holding that tiny GGUF."""

from __future__ import annotations

import json
import re
import threading

import pytest

from helpers.fake_store import install, make_wheels, unique_prefix


def test_tiny_gguf_converts_and_loads(tmp_path, model_cache, capfd):
    from transformers import AutoTokenizer

    from gymserve.engine.hf_models import load_causal_lm
    from gymserve.engine.model_store import model_dir_complete, resolve_model
    from helpers.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    resolved = resolve_model(str(gguf))
    assert resolved.name == "tiny" and resolved.path == model_cache / "gguf" / f"tiny-{gguf.stat().st_size}"
    assert model_dir_complete(resolved.path)
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in config
    assert "_name_or_path" not in config
    err = capfd.readouterr().err
    assert "gymserve: [1/3] reading the tokenizer from the GGUF: done in" in err
    assert "gymserve: [2/3] loading and de-quantizing the weights: 26/26 tensors" not in err  # done < total only
    assert "gymserve: [2/3] loading and de-quantizing the weights: done in" in err
    assert re.search(r"gymserve: \[3/3\] writing model.safetensors \(0.0 GB\): done in \d+ s", err)
    assert "Converting and de-quantizing" not in err and "\r" not in err  # transformers' own bars are routed
    model = load_causal_lm(resolved.path)
    tok = AutoTokenizer.from_pretrained(str(resolved.path))
    assert model.config.num_hidden_layers == 2 and tok.convert_ids_to_tokens(tok("the").input_ids) == ["t", "he"]


# Qwen2.5's tool-call hint as the embedded 1.5B model's GGUF has it: braces doubled inside a Jinja
# string (the backslashes are the template's own).
DOUBLED_HINT_TEMPLATE = (
    "{{- '<|im_start|>system\\n' }}{%- if tools %}"
    '{{- "<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call>" }}'
    "{%- endif %}{{- '<|im_end|>\\n' }}"
)


def test_a_gguf_chat_template_with_the_doubled_tool_hint_is_repaired(tmp_path, model_cache):
    """Shown ``{{"name": ...}}`` the 1.5B model wrote its calls with doubled braces, which no parser
    reads (measured: 8 of 8 weather questions); the converted copy's template shows the JSON hint."""
    from transformers import AutoTokenizer

    from gymserve.engine.model_store import resolve_model
    from helpers.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "hint.gguf", chat_template=DOUBLED_HINT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(resolve_model(str(gguf)).path))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    assert text == (
        '<|im_start|>system\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
    )
    plain = write_tiny_gguf(tmp_path / "plain.gguf")  # any other template is copied as it is
    assert AutoTokenizer.from_pretrained(str(resolve_model(str(plain)).path)).chat_template == (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )


def test_a_gguf_that_vanishes_mid_conversion(tmp_path, model_cache, monkeypatch):
    """The fresh-cache ``gymserve demo`` failure: another run deleted the GGUF while this one was
    converting it, and transformers failed with a bare ``TypeError: expected str, bytes or os.PathLike
    object, not NoneType``. The lock prevents that; should the file vanish anyway, the message says so."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from gymserve.engine.model_store import ModelStoreError, resolve_model
    from helpers.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    real_bytes = gguf.read_bytes()
    real = gguf_utils.load_gguf_checkpoint

    def read_then_delete(path, *args, **kwargs):
        result = real(path, *args, **kwargs)
        gguf.unlink(missing_ok=True)
        return result

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", read_then_delete)
    with pytest.raises(ModelStoreError) as err:
        resolve_model(str(gguf))
    assert str(err.value) == (
        f"{gguf} was deleted or moved while it was being converted; make sure nothing else removes it, then re-run"
    )
    assert [p.name for p in (model_cache / "gguf").iterdir()] == [f".tiny-{len(real_bytes)}.lock"]


def test_a_broken_gguf_names_the_file(tmp_path, model_cache):
    from gymserve.engine.model_store import ModelStoreError, resolve_model

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ModelStoreError) as err:
        resolve_model(str(bad))
    msg = str(err.value)
    assert msg.startswith(f"converting {bad} to safetensors failed: ")
    assert msg.endswith(f"Nothing was written to {model_cache / 'gguf' / 'broken-64'}; fix the cause and re-run")


# ---------------------------------------------------------------------------------------------
# gymserve demo on a fresh cache


def test_demo_on_a_fresh_cache_beside_another_first_run(tmp_path, model_cache, monkeypatch, capsys):
    """``gymserve demo`` on an empty cache while another first run (a test session, say) prepares the
    same model: before the cache was locked, whichever finished first deleted the GGUF the other was
    still converting, and the demo ended with ``TypeError: expected str, bytes or os.PathLike object,
    not NoneType``. Here the embedded wheels hold a tiny real GGUF, converted by transformers."""
    import gymserve.engine.model_store as ms
    from gymserve.harness.demo import run_demo
    from helpers.tiny_gguf import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    install(make_wheels(tmp_path / "wheels", tiny, prefix=unique_prefix("tiny")), monkeypatch)

    other: list[object] = []
    beside = threading.Thread(target=lambda: other.append(ms.embedded_model_dir()))
    beside.start()
    code = run_demo(None, "embedded", 4, engine="transformers", requests=("What's the weather in Paris?",), max_steps=1)
    beside.join(120)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert other == [model_cache / "embedded" / "Qwen2.5-Coder-0.5B-Instruct"]
    assert "serving Qwen2.5-Coder-0.5B-Instruct in process" in captured.out and "verdict: PASS" in captured.out
    assert captured.err.count("[3/4] loading and de-quantizing the weights: done in") == 1  # one of the two converted
    # The GGUF stays beside the copy: the llamacpp engine serves it as it is.
    assert (model_cache / "embedded" / "model.gguf").read_bytes() == tiny
