"""What only the llamacpp engine has: parity with the transformers engine (the reference) on the same
weights, session KV reuse, a full KV pool (eviction, preemption), weight updates from GGUF files,
LoRA adapters, and its refusals. The tests both CPU engines share are in test_engine.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from gymserve.engine.base import SamplingParams
from gymserve.errors import ConflictError, EngineError, NotSupportedError, WeightUpdateError
from gymserve.harness.verify import load_model, teacher_forced_log_probs

pytest.importorskip("llama_cpp", reason='the llamacpp engine needs llama-cpp-python: pip install "gymserve[llamacpp]"')

from gymserve.engine.llamacpp_engine import LlamaCppEngine  # noqa: E402
from gymserve.engine.transformers_engine import TransformersEngine  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _prompts():
    return [list(range(1000, 1000 + n)) for n in (5, 17, 9, 30, 3, 12)]


def _engine(model_dir, **kw) -> LlamaCppEngine:
    kw.setdefault("max_batch_size", 4)
    return LlamaCppEngine(model_dir / "model.gguf", tokenizer_dir=model_dir, num_threads=2, **kw)


def _run(coro):
    return asyncio.run(coro)


async def _all(engine, prompts, sampling=GREEDY):
    return await asyncio.gather(*[engine.generate(p, sampling) for p in prompts])


@pytest.fixture(scope="module")
def engine(tiny_gguf_dir):
    eng = _engine(tiny_gguf_dir)
    yield eng
    _run(eng.close())


@pytest.fixture(scope="module")
def scorer(tiny_gguf_dir):
    return load_model(tiny_gguf_dir, "llamacpp")


def test_same_tokens_and_log_probs_as_the_transformers_engine(tiny_model_dir, tiny_gguf_dir):
    """The reference engine and llama.cpp on the same F32 weights: the same greedy tokens, and
    log-probs within 1e-3 (llama.cpp keeps K and V in f16; transformers in f32). With an f32 KV
    cache the two agree to float32 rounding."""
    ref = TransformersEngine(tiny_model_dir, max_batch_size=4, num_threads=2)
    f16 = _engine(tiny_gguf_dir)
    f32 = _engine(tiny_gguf_dir, engine_args={"type_k": "f32", "type_v": "f32"})
    try:
        want = _run(_all(ref, _prompts()))
        for eng, tol in ((f16, 1e-3), (f32, 1e-4)):
            got = _run(_all(eng, _prompts()))
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.log_probs, w.log_probs))
            assert worst <= tol, (eng.options.type_k, worst)
    finally:
        for eng in (ref, f16, f32):
            _run(eng.close())


def test_next_turn_prefills_only_what_the_splice_appended(engine, scorer):
    """Turn 2's prompt is turn 1's prompt + generation + new tokens: the cached KV of turn 1 is
    reused, only the rest is prefilled, and the log-probs still match teacher forcing."""
    p1 = list(range(2000, 2040))
    gen1 = _run(engine.generate(p1, GREEDY))
    p2 = p1 + gen1.token_ids + list(range(3000, 3010))
    before = dict(engine.stats)
    gen2 = _run(engine.generate(p2, GREEDY))
    reused = engine.stats["reused"] - before.get("reused", 0)
    prefilled = engine.stats["prefilled"] - before.get("prefilled", 0)
    # Turn 1's last sampled token was never fed to the model: it is prefilled with the new tokens.
    assert reused == len(p1) + len(gen1.token_ids) - 1
    assert prefilled == len(p2) - reused
    tf = teacher_forced_log_probs(scorer, p2, gen2.token_ids)
    assert max(abs(a - b) for a, b in zip(tf, gen2.log_probs)) <= 1e-4


def test_rollouts_of_one_task_prefill_their_common_prefix_once(tiny_gguf_dir, scorer):
    """Three calls at once whose prompts share 60 tokens (a task's system prompt and tools): the
    first prefills them, the others wait one step and take its cells over (seq_cp), prefilling only
    their own 5 tokens; tokens equal a pool without sharing, log-probs equal teacher forcing."""
    shared = list(range(5000, 5060))
    prompts = [shared + list(range(6000 + 10 * i, 6005 + 10 * i)) for i in range(3)]
    plain = _engine(tiny_gguf_dir, engine_args={"kv_unified": False})
    sharing = _engine(tiny_gguf_dir)
    try:
        want = _run(_all(plain, prompts))
        got = _run(_all(sharing, prompts))
        assert plain.stats["shared"] == 0 and plain.stats["prefilled"] == 3 * 65
        assert sharing.stats["shared"] == 2 * 60 and sharing.stats["prefilled"] == 65 + 2 * 5
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for p, g in zip(prompts, got):
            tf = teacher_forced_log_probs(scorer, p, g.token_ids)
            assert max(abs(a - b) for a, b in zip(tf, g.log_probs)) <= 1e-4
        # A later call starting with the same prefix prefills only its own tokens (its sequence is
        # one of the idle ones that hold the prefix).
        before = dict(sharing.stats)
        _run(sharing.generate(shared + [7000, 7001], GREEDY))
        delta = {k: sharing.stats[k] - before.get(k, 0) for k in ("shared", "reused", "prefilled")}
        assert delta["shared"] + delta["reused"] == 60 and delta["prefilled"] == 2
    finally:
        _run(plain.close())
        _run(sharing.close())


def test_teacher_forcer_shares_the_served_model_and_reuses_a_common_prefix(tiny_gguf_dir, engine, scorer):
    """``teacher_forcer`` scores on the engine's loaded model (no second load) exactly as a scorer
    that loads the file; scoring a sequence after one with a common prefix prefills only the rest
    and gives the log-probs a fresh scorer gives."""
    a = list(range(8000, 8050)) + list(range(100, 120))
    b = list(range(8000, 8050)) + list(range(200, 230))
    fresh = [load_model(tiny_gguf_dir, "llamacpp").token_log_probs(x, 50) for x in (a, b)]
    forcer = engine.teacher_forcer()
    try:
        assert forcer.model is engine.model and forcer.quantized is False
        got = [forcer.token_log_probs(x, 50) for x in (a, b)]
        assert forcer._cached == b  # b's KV: a's first 49 positions were kept, the rest prefilled
    finally:
        forcer.close()
    assert engine.model.ptr is not None  # closing the forcer leaves the served model alone
    for g, f in zip(got, fresh):
        assert len(g) == len(f) and max(abs(x - y) for x, y in zip(g, f)) <= 1e-6
    assert _run(engine.generate(a[:10], GREEDY)).token_ids  # the engine still serves


def test_full_kv_pool_evicts_and_preempts_without_changing_tokens(tiny_gguf_dir, engine):
    """A pool of 256 cells for 4 sequences of ~100 tokens: idle caches are evicted and the newest
    running sequence is preempted and recomputed, and every generation equals the unpressured one."""
    prompts = [list(range(4000 + 100 * i, 4060 + 100 * i)) for i in range(4)]
    sp = SamplingParams(max_tokens=40, temperature=0)
    want = _run(_all(engine, prompts, sp))
    small = _engine(tiny_gguf_dir, context_window=128, engine_args={"kv_cells": 256})
    try:
        got = _run(_all(small, prompts, sp))
        assert small.stats["preempted"] > 0
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.log_probs, w.log_probs))
        assert worst <= 1e-4
    finally:
        _run(small.close())


def test_pause_modes_and_versions(engine):
    async def run():
        long = SamplingParams(max_tokens=400, temperature=0)
        task = asyncio.create_task(engine.generate(_prompts()[0], long))
        await asyncio.sleep(0.2)
        await engine.pause_generation("abort")
        aborted = await asyncio.wait_for(task, 30)
        assert await engine.is_paused()
        waiting = asyncio.create_task(engine.generate(_prompts()[1], GREEDY))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # not admitted while paused
        await engine.resume_generation()
        done = await asyncio.wait_for(waiting, 60)
        await engine.update_weight_version("step-7")
        after = await engine.generate(_prompts()[2], SamplingParams(max_tokens=3, temperature=0))
        return aborted, done, after

    aborted, done, after = _run(run())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 400
    assert done.finish_reason == "length" and len(done.token_ids) == 12
    assert after.weight_version_spans == [{"version": "step-7", "start": 0, "end": 3}]
    assert engine.control_status()["weight_version"] == "step-7"


def _perturbed_gguf(tiny_model_dir, tiny_gguf_dir, out, seed=1):
    from helpers.tiny_gguf import perturbed_gguf_dir

    return perturbed_gguf_dir(tiny_model_dir, tiny_gguf_dir, out, seed)


def test_update_weights_from_a_gguf_file(tiny_model_dir, tiny_gguf_dir, tmp_path):
    new_dir = _perturbed_gguf(tiny_model_dir, tiny_gguf_dir, tmp_path)
    eng = _engine(tiny_gguf_dir)
    fresh = _engine(new_dir)
    try:
        p = _prompts()[3]
        before = _run(eng.generate(p, GREEDY))
        assert _run(eng.update_weights(path=new_dir / "model.gguf")) == 1
        reused = eng.stats["reused"]
        after = _run(eng.generate(p, GREEDY))
        assert eng.stats["reused"] == reused  # the KV cached on version 0 was dropped, not reused
        want = _run(fresh.generate(p, GREEDY))
        assert after.token_ids == want.token_ids and after.token_ids != before.token_ids
        assert after.log_probs == pytest.approx(want.log_probs, abs=1e-5)
        assert after.weight_version_spans == [{"version": 1, "start": 0, "end": 12}]
        with pytest.raises(NotSupportedError, match="state dict cannot patch"):
            _run(eng.update_weights({"model.norm.weight": np.zeros(64)}))
        with pytest.raises(WeightUpdateError, match="not a GGUF file"):
            _run(eng.update_weights(path=tiny_model_dir / "config.json"))
        assert eng.control_status()["weight_version"] == 1  # the refused updates changed nothing
    finally:
        _run(eng.close())
        _run(fresh.close())


def test_peft_lora_adapter_matches_the_transformers_merge(tiny_model_dir, tiny_gguf_dir, tmp_path):
    """A PEFT adapter served unmerged by llama.cpp gives the tokens the reference engine gives with
    it merged (log-probs within 1e-3, f16 KV); unloading restores the base outputs exactly."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(tmp_path / "adapter"))

    ref = TransformersEngine(tiny_model_dir, max_batch_size=4, num_threads=2)
    eng = _engine(tiny_gguf_dir)
    try:
        p = _prompts()[1]
        plain = _run(eng.generate(p, GREEDY))
        _run(ref.load_lora_adapter("a", str(tmp_path / "adapter")))
        assert _run(eng.load_lora_adapter("a", str(tmp_path / "adapter"))) == 1
        want = _run(ref.generate(p, GREEDY))
        got = _run(eng.generate(p, GREEDY))
        assert got.token_ids == want.token_ids and got.token_ids != plain.token_ids
        assert max(abs(a - b) for a, b in zip(got.log_probs, want.log_probs)) <= 1e-3
        assert eng.lora_adapters()[0]["name"] == "a" and eng.control_status()["lora_adapter"] == "a"
        with pytest.raises(ConflictError):
            _run(eng.load_lora_adapter("b", str(tmp_path / "adapter")))
        with pytest.raises(ConflictError, match="Unload it first"):
            _run(eng.update_weights(path=tiny_gguf_dir / "model.gguf"))
        assert _run(eng.unload_lora_adapter("a")) == 2
        again = _run(eng.generate(p, GREEDY))
        assert again.token_ids == plain.token_ids and again.log_probs == pytest.approx(plain.log_probs, abs=1e-6)
    finally:
        _run(ref.close())
        _run(eng.close())


def test_refusals_name_the_cause(tiny_gguf_dir, tmp_path):
    with pytest.raises(ValueError, match="engine_args tensor_parallel_size not known to the llamacpp engine"):
        _engine(tiny_gguf_dir, engine_args={"tensor_parallel_size": 2})
    bad = tmp_path / "model.gguf"
    bad.write_text(json.dumps({"not": "gguf"}))
    with pytest.raises(EngineError, match="is not a GGUF file"):
        LlamaCppEngine(bad)
    eng = _engine(tiny_gguf_dir, context_window=64)
    try:
        with pytest.raises(EngineError, match="context window is 64"):
            _run(eng.generate(list(range(1000, 1064)), GREEDY))
    finally:
        _run(eng.close())


def test_torch_free_tokenizer_is_the_auto_tokenizer(tiny_gguf_dir, tokenizer):
    """The llamacpp engine's tokenizer (PreTrainedTokenizerFast, no torch) gives the IDs, chat
    template, special tokens and decoding of AutoTokenizer's (the transformers engine's)."""
    fast = LlamaCppEngine.load_tokenizer(tiny_gguf_dir)
    texts = [
        "hello world",
        " leading space",
        "你好世界 The answer is 4.",
        "<|im_start|>user\nhi<|im_end|>",
        "a\tb\n\n  c",
    ]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert fast(text, add_special_tokens=False)["input_ids"] == ids
        assert fast.decode(ids) == tokenizer.decode(ids)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    kw = dict(tools=tools, add_generation_prompt=True, tokenize=False)
    assert fast.apply_chat_template(msgs, **kw) == tokenizer.apply_chat_template(msgs, **kw)
    assert (fast.eos_token_id, fast.pad_token_id, fast.all_special_ids) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.all_special_ids,
    )


def test_keep_pause_and_update_continue_the_call_on_the_new_weights(tiny_model_dir, tiny_gguf_dir, tmp_path):
    """A call frozen by a keep pause across a GGUF weight update continues on the new weights: its
    tokens carry the version that sampled them, and each token's log-prob is teacher forcing's on
    that version's weights (the KV cache was recomputed on the new weights, not reused)."""
    new_dir = _perturbed_gguf(tiny_model_dir, tiny_gguf_dir, tmp_path)
    eng = _engine(tiny_gguf_dir)
    p = _prompts()[3]

    async def run():
        stream = eng.stream(p, SamplingParams(max_tokens=40, temperature=1.0, seed=5))
        got = []
        async for delta in stream:
            got.append(delta)
            if len(got) == 10:
                await eng.pause_generation("keep")
                await eng.update_weights(path=new_dir / "model.gguf")
                await eng.resume_generation()
        return got

    try:
        deltas = _run(run())
    finally:
        _run(eng.close())
    tokens = [t for d in deltas for t in d.token_ids]
    lps = [x for d in deltas for x in d.log_probs]
    versions = [d.weight_version for d in deltas]
    k = versions.index(1)
    assert set(versions[:k]) == {0} and set(versions[k:]) == {1} and 10 <= k < len(tokens) == 40
    old = load_model(tiny_gguf_dir, "llamacpp").token_log_probs(p + tokens, len(p))
    new = load_model(new_dir, "llamacpp").token_log_probs(p + tokens, len(p))
    assert max(abs(a - b) for a, b in zip(old[:k], lps[:k])) <= 1e-4
    assert max(abs(a - b) for a, b in zip(new[k:], lps[k:])) <= 1e-4
    assert max(abs(a - b) for a, b in zip(old[k:], lps[k:])) > 1e-2  # the new weights really differ


def test_sleep_level_1_drops_the_session_cache_and_level_2_is_a_501(tiny_gguf_dir):
    """vLLM's sleep mode on llama.cpp (``engine.sleep``): level 1 and ``reset_prefix_cache`` drop
    the KV kept after calls end (the next identical call gives the same tokens, recomputed); level
    2 would need the GGUF reloaded, so it is refused naming the engine."""
    from gymserve.engine import sleep as sleep_mode

    async def go():
        eng = _engine(tiny_gguf_dir)
        try:
            first = await eng.generate(_prompts()[1], GREEDY)
            out = await sleep_mode.reset_prefix_cache(eng)
            assert out["cache_entries_dropped"] >= 1  # the finished call's session kept its KV
            assert all(not slot.cached for slot in eng._slots)
            await eng.generate(_prompts()[1], GREEDY)
            slept = await sleep_mode.sleep(eng, 1)
            assert slept["level"] == 1 and slept["cache_entries_dropped"] >= 1 and slept["bytes_released"] == 0
            assert sleep_mode.sleep_status(eng) == {"is_sleeping": True, "level": 1, "weights_released": False}
            with pytest.raises(NotSupportedError, match="level 2"):
                await sleep_mode.sleep(eng, 2)
            held = asyncio.ensure_future(eng.generate(_prompts()[1], GREEDY))
            await asyncio.sleep(0.5)
            assert not held.done()
            assert (await sleep_mode.wake_up(eng))["level"] == 0
            again = await asyncio.wait_for(held, 60)
            assert again.token_ids == first.token_ids
        finally:
            await eng.close()

    _run(go())


# ---------------------------------------------------------------- the start-up self-check (issue #24)
def test_the_engine_decodes_one_token_before_it_takes_calls(tiny_gguf_dir, monkeypatch):
    """A llama.cpp build whose kernels fail does so while the engine loads, before the server says
    it is serving: one real ``llama_decode`` of one token, which leaves the KV cache empty."""
    from gymserve.engine.llamacpp_runtime import LlamaContext

    calls: list[tuple[list[int], list[int], list[int]]] = []
    real = LlamaContext.decode

    def spy(self, tokens, positions, seq_ids, want):
        calls.append((list(tokens), list(positions), list(seq_ids)))
        return real(self, tokens, positions, seq_ids, want)

    monkeypatch.setattr(LlamaContext, "decode", spy)
    eng = _engine(tiny_gguf_dir)
    try:
        assert calls == [([eng.eos_token_ids[0]], [0], [0])]
        assert eng.ctx.seq_pos_max(0) == -1  # the check left nothing in the cache
        monkeypatch.setattr(LlamaContext, "decode", real)
        out = _run(eng.generate([1000, 1001, 1002], GREEDY))
        assert len(out.token_ids) == 12
    finally:
        _run(eng.close())


def test_a_build_that_decodes_garbage_fails_at_start_up(tiny_gguf_dir, monkeypatch):
    from gymserve.engine.llamacpp_runtime import LlamaContext

    monkeypatch.setattr(LlamaContext, "decode", lambda self, *a: np.full((1, self.vocab_size), np.nan, np.float32))
    with pytest.raises(EngineError, match="start-up self-check decoded one token .* non-finite logits"):
        _engine(tiny_gguf_dir)
