"""Model loads in one process never overlap (``gymserve.engine.hf_models``): transformers patches
process-wide state for the length of ``from_pretrained``, and overlapping loads leave a patch behind."""

from __future__ import annotations

import threading
import time

import torch


def test_loads_from_many_threads_leave_torch_as_they_found_it(tiny_model_dir):
    """Six threads load the tiny model at once, as server start-ups and teacher forcing do. Before
    the lock, an overlap left transformers' no-op ``tie_weights`` installed: every model loaded after
    it had an untied, uninitialised ``lm_head`` (garbage logits, NaN probabilities)."""
    from transformers import PreTrainedModel

    from gymserve.engine.hf_models import load_causal_lm

    before = (PreTrainedModel.tie_weights, torch.linspace, torch.get_default_dtype())
    models: list = []
    errors: list = []

    def load():
        try:
            models.append(load_causal_lm(tiny_model_dir))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(models) == 6
    assert (PreTrainedModel.tie_weights, torch.linspace, torch.get_default_dtype()) == before
    ids = torch.tensor([[151644, 872, 198, 9707]])
    with torch.inference_mode():
        ref = models[0](ids).logits
        assert torch.isfinite(ref).all()
        for m in models:
            assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()  # tied
            assert torch.equal(m(ids).logits, ref)


def test_loads_take_turns(monkeypatch, tmp_path):
    """Two loads started together run one after the other, never interleaved."""
    import transformers

    from gymserve.engine.hf_models import load_causal_lm

    spans: list[tuple[float, float]] = []

    def slow_load(path, **kwargs):
        start = time.monotonic()
        time.sleep(0.2)
        spans.append((start, time.monotonic()))
        return path

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", slow_load)
    threads = [threading.Thread(target=load_causal_lm, args=(tmp_path,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    spans.sort()
    assert len(spans) == 3
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
