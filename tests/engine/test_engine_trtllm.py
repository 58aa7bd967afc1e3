"""The TensorRT-LLM engine adapter against a test double of ``tensorrt_llm`` (no GPU, no install).

The double follows TensorRT-LLM's real names and signatures (read from its source):
``tensorrt_llm.SamplingParams`` (a keyword-only dataclass with the same field names and defaults),
``tensorrt_llm.LLM`` (``generate_async(inputs, sampling_params=None, ..., streaming=False)``,
``shutdown``), ``tensorrt_llm.llmapi.KvCacheConfig``, and the ``RequestOutput`` that
``generate_async`` returns (``GenerationResult``: awaitable, async-iterable when streaming,
``abort()``, ``finished``, ``outputs[0]`` a ``CompletionOutput`` with ``token_ids``, ``logprobs`` as
floats or ``{token_id: Logprob(logprob, rank)}``, ``finish_reason`` ``stop``/``length``/``cancelled``,
``stop_reason``). Like the real ``_handle_sequence``, a stop-token finish cuts the stop token from
``token_ids`` (not from the log-probs) unless ``include_stop_str_in_output`` is set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from gymserve.engine.base import SamplingParams
from gymserve.errors import EngineError

EOS = 151645
EOS2 = 151643


class Script:
    """The tokens the double's "model" samples (then ``EOS``)."""

    tokens: list[int] = []


def fake_step(prompt: list[int], generated: list[int]) -> tuple[int, list[tuple[int, float]]]:
    """Next token and the raw distribution's top entries, best first (as in test_engine_vllm)."""
    step = len(generated)
    tok = Script.tokens[step] if step < len(Script.tokens) else EOS
    lp = -0.1 * (step + 1)
    dist = [(tok, lp), (500 + step, lp - 1.0), (600 + step, lp - 2.0), (700 + step, lp - 3.0)]
    if step % 3 == 2:
        dist = [(900 + step, lp + 0.05)] + dist
    return tok, dist


def write_model_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "vocab_size": 151936,
                "max_position_embeddings": 32768,
                "eos_token_id": EOS,
            }
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, EOS2]}))
    return path


# ---- the TensorRT-LLM double --------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class TSamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        self.logprobs = self.logprobs and int(self.logprobs)


@dataclass(slots=True, kw_only=True)
class TSamplingParamsWithMode(TSamplingParams):  # releases with a logprobs_mode
    logprobs_mode: str = "processed_logprobs"


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] | None = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: Any = field(default_factory=list)
    prompt_logprobs: Any = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: Any = None
    _last_token_ids_len: int = 0
    _last_logprobs_len: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self):
        return self.logprobs[self._last_logprobs_len :]


class FakeResult:
    """``tensorrt_llm.llmapi.llm.RequestOutput`` (a ``GenerationResult``)."""

    def __init__(self, llm: FakeLLM, prompt_ids: list[int], params: TSamplingParams, streaming: bool):
        self.llm, self.prompt_token_ids, self.sampling_params, self._streaming = llm, prompt_ids, params, streaming
        self.request_id = len(llm.results)
        self.outputs = [CompletionOutput(0)]
        self._done = False
        self._aborted = False
        self._generated: list[int] = []

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _step(self) -> None:
        p, out = self.sampling_params, self.outputs[0]
        out._last_token_ids_len, out._last_logprobs_len = len(out.token_ids), len(out.logprobs)
        if self._aborted:
            out.finish_reason, self._done = "cancelled", True
            return
        tok, dist = fake_step(self.prompt_token_ids, self._generated)
        self._generated.append(tok)
        reason = None
        if not p.ignore_eos and tok == p.end_id:
            reason = "END_ID"
        elif tok in (p.stop_token_ids or ()):
            reason = "STOP_WORDS"
        elif len(self._generated) >= p.max_tokens:
            reason = "LENGTH"
        drop = reason == "END_ID" and self.llm.drop_end_id
        if not drop:
            out.token_ids.append(tok)
            if p.logprobs:
                if self.llm.float_logprobs:
                    out.logprobs.append(dict(dist)[tok])
                else:
                    top = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(dist[: p.logprobs])}
                    rank = next(r + 1 for r, (t, _) in enumerate(dist) if t == tok)
                    top.setdefault(tok, Logprob(dict(dist)[tok], rank))
                    out.logprobs.append(top)
        if reason:
            self._done = True
            if reason == "STOP_WORDS":
                out.finish_reason, out.stop_reason = "stop", tok
                if not p.include_stop_str_in_output:
                    out.token_ids = out.token_ids[:-1]  # the real one leaves the log-prob in place
            else:
                out.finish_reason = "stop" if reason == "END_ID" else "length"

    async def aresult(self):
        while not self._done:
            await asyncio.sleep(self.llm.step_delay)
            self._step()
        return self

    def __await__(self):
        return self.aresult().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        await asyncio.sleep(self.llm.step_delay)
        self._step()
        return self


class FakeLLM:
    """``tensorrt_llm.LLM`` as far as gymserve uses it."""

    instances: list[FakeLLM] = []
    float_logprobs = False
    drop_end_id = False

    def __init__(self, model: str, tokenizer: Any = None, **kwargs: Any):
        self.model, self.kwargs = model, kwargs
        self.args = types.SimpleNamespace(max_seq_len=kwargs.get("max_seq_len"))
        self.results: list[FakeResult] = []
        self.step_delay = 0.0
        self.shut_down = False
        FakeLLM.instances.append(self)

    def generate_async(
        self,
        inputs,
        sampling_params=None,
        lora_request=None,
        prompt_adapter_request=None,
        streaming: bool = False,
        kv_cache_retention_config=None,
        disaggregated_params=None,
    ):
        assert isinstance(inputs, dict) and list(inputs) == ["prompt_token_ids"]
        res = FakeResult(self, list(inputs["prompt_token_ids"]), sampling_params or TSamplingParams(), streaming)
        self.results.append(res)
        return res

    def shutdown(self) -> None:
        self.shut_down = True


@dataclass
class KvCacheConfig:
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool = True


def install_fake_trtllm(monkeypatch, *, sampling_cls=TSamplingParams) -> None:
    mod = types.ModuleType("tensorrt_llm")
    mod.LLM, mod.SamplingParams = FakeLLM, sampling_cls
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig, llmapi.LLM, llmapi.SamplingParams = KvCacheConfig, FakeLLM, sampling_cls
    mod.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", mod)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)


@pytest.fixture
def model_dir(tmp_path):
    return write_model_dir(tmp_path / "Qwen2.5-Coder-0.5B-Instruct")


@pytest.fixture
def fake_trtllm(monkeypatch):
    install_fake_trtllm(monkeypatch)
    monkeypatch.setattr(Script, "tokens", [11, 12, 13, 14, 15])
    monkeypatch.setattr(FakeLLM, "instances", [])
    monkeypatch.setattr(FakeLLM, "float_logprobs", False)
    monkeypatch.setattr(FakeLLM, "drop_end_id", False)
    return FakeLLM


@pytest.fixture
def engine(fake_trtllm, model_dir):
    from gymserve.engine.trtllm_engine import TRTLLMEngine

    eng = TRTLLMEngine(model_dir, model_name="policy")
    yield eng
    asyncio.run(eng.close())


def _sp(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 16)
    kw.setdefault("stop_token_ids", (EOS, EOS2))
    return SamplingParams(**kw)


def _script(values):
    Script.tokens = list(values)


# ---- construction -------------------------------------------------------------------------------


def test_missing_tensorrt_llm_says_what_to_install(monkeypatch, model_dir):
    from gymserve.config import LocalBackendConfig
    from gymserve.engine import create_engine
    from gymserve.engine.model_store import ResolvedModel

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(ImportError, match=r"pip install tensorrt_llm"):
        create_engine(LocalBackendConfig(engine="trtllm"), ResolvedModel("m", model_dir))


def test_engine_args_map_onto_llm(fake_trtllm, model_dir):
    from gymserve.config import LocalBackendConfig
    from gymserve.engine import create_engine
    from gymserve.engine.model_store import ResolvedModel

    cfg = LocalBackendConfig(
        engine="trtllm",
        engine_args={
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.7,
            "max_model_len": 8192,
            "dtype": "bfloat16",
        },
    )
    eng = create_engine(cfg, ResolvedModel("policy", model_dir))
    llm = fake_trtllm.instances[-1]
    assert llm.model == str(model_dir)
    assert llm.kwargs["tensor_parallel_size"] == 2 and llm.kwargs["dtype"] == "bfloat16"
    assert llm.kwargs["max_seq_len"] == 8192 and "max_model_len" not in llm.kwargs
    assert llm.kwargs["kv_cache_config"].free_gpu_memory_fraction == 0.7
    assert eng.context_window == 8192 and eng.eos_token_ids == (EOS, EOS2) and eng.end_id == EOS
    assert eng.model_type == "qwen2"  # config.json's, for tool-call parser inference


def test_context_window_becomes_max_seq_len(fake_trtllm, model_dir):
    from gymserve.engine.trtllm_engine import TRTLLMEngine

    eng = TRTLLMEngine(model_dir, context_window=2048)
    assert fake_trtllm.instances[-1].kwargs["max_seq_len"] == 2048 and eng.context_window == 2048


def test_unknown_llm_argument_is_a_value_error(monkeypatch, model_dir):
    from gymserve.engine.trtllm_engine import TRTLLMEngine

    install_fake_trtllm(monkeypatch)

    class StrictLLM(FakeLLM):
        def __init__(self, model, tokenizer=None, tensor_parallel_size=1, max_seq_len=None):
            super().__init__(model, tokenizer, tensor_parallel_size=tensor_parallel_size, max_seq_len=max_seq_len)

    sys.modules["tensorrt_llm"].LLM = StrictLLM
    with pytest.raises(ValueError, match="tensorrt_llm.LLM"):
        TRTLLMEngine(model_dir, engine_args={"tensor_paralel_size": 2})


# ---- sampling params ----------------------------------------------------------------------------


def test_sampling_mapping_defaults(engine):
    p = engine.sampling_params(_sp(max_tokens=9))
    assert isinstance(p, TSamplingParams)
    assert (p.n, p.max_tokens, p.top_k, p.top_p, p.temperature) == (1, 9, 0, 1.0, 1.0)
    assert p.end_id == EOS and p.stop_token_ids == [EOS, EOS2]
    assert p.include_stop_str_in_output is True and p.ignore_eos is False
    assert p.logprobs == 1 and p.detokenize is False and p.skip_special_tokens is False
    assert p.stop is None and not p.use_beam_search


@pytest.mark.parametrize("top_k, want", [(None, 0), (0, 0), (-1, 0), (40, 40)])
def test_sampling_mapping_top_k(engine, top_k, want):
    assert engine.sampling_params(_sp(top_k=top_k)).top_k == want


def test_sampling_mapping_greedy_and_pinned(engine):
    g = engine.sampling_params(_sp(temperature=0, top_p=0.5, top_k=7))
    assert (g.top_k, g.top_p, g.temperature) == (1, 1.0, None)  # argmax in every TensorRT-LLM version
    p = engine.sampling_params(_sp(temperature=0.6, top_p=0.9, top_k=20, seed=99, top_logprobs=4))
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.logprobs) == (0.6, 0.9, 20, 99, 4)


def test_unseeded_requests_get_distinct_seeds(engine):
    seeds = {engine.sampling_params(_sp()).seed for _ in range(20)}
    assert None not in seeds and len(seeds) == 20


def test_logprobs_mode_is_raw_where_available(monkeypatch, model_dir, caplog):
    from gymserve.engine.trtllm_engine import TRTLLMEngine

    install_fake_trtllm(monkeypatch, sampling_cls=TSamplingParamsWithMode)
    assert TRTLLMEngine(model_dir).sampling_params(_sp()).logprobs_mode == "raw_logprobs"
    install_fake_trtllm(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="gymserve.engine.trtllm_engine"):
        eng = TRTLLMEngine(model_dir)
    assert not eng.raw_logprobs and "processed distribution" in caplog.text


def test_fake_sampling_params_mirror_trtllm_field_names():
    from gymserve.engine.trtllm_engine import trtllm_sampling_kwargs

    names = {f.name for f in dataclasses.fields(TSamplingParams)}
    assert set(trtllm_sampling_kwargs(_sp(), end_id=EOS, seed=1)) <= names
    assert set(trtllm_sampling_kwargs(_sp(temperature=0), end_id=EOS)) <= names


# ---- outputs ------------------------------------------------------------------------------------


def test_eos_kept_with_log_prob_dict_form(engine):
    gen = asyncio.run(engine.generate([1, 2, 3], _sp(top_logprobs=2)))
    assert gen.token_ids == [11, 12, 13, 14, 15, EOS] and gen.finish_reason == "stop"
    assert gen.log_probs == pytest.approx([-0.1 * (i + 1) for i in range(6)])
    assert gen.top_logprobs[0] == [(11, pytest.approx(-0.1)), (500, pytest.approx(-1.1))]
    assert gen.top_logprobs[2][0][0] == 902  # the sampled token ranked second there
    res = FakeLLM.instances[-1].results[-1]
    assert res.prompt_token_ids == [1, 2, 3] and not res._streaming


def test_float_log_probs_form(engine, monkeypatch):
    monkeypatch.setattr(FakeLLM, "float_logprobs", True)
    gen = asyncio.run(engine.generate([1], _sp()))
    assert gen.token_ids[-1] == EOS and len(gen.log_probs) == len(gen.token_ids) == 6
    assert gen.log_probs == pytest.approx([-0.1 * (i + 1) for i in range(6)])


def test_stop_token_kept_with_its_log_prob(engine):
    gen = asyncio.run(engine.generate([1], _sp(stop_token_ids=(EOS, EOS2, 13))))
    assert gen.token_ids == [11, 12, 13] and gen.finish_reason == "stop"
    assert len(gen.log_probs) == 3


def test_without_include_stop_the_real_engine_would_misalign():
    """Why include_stop_str_in_output=True: without it the stop token leaves token_ids but not log-probs."""
    llm = FakeLLM("m")
    _script([11, 12, 13])
    res = llm.generate_async({"prompt_token_ids": [1]}, TSamplingParams(end_id=EOS, stop_token_ids=[13], logprobs=1))
    asyncio.run(res.aresult())
    assert res.outputs[0].token_ids == [11, 12] and len(res.outputs[0].logprobs) == 3


def test_dropped_end_id_is_put_back(engine, monkeypatch):
    monkeypatch.setattr(FakeLLM, "drop_end_id", True)
    gen = asyncio.run(engine.generate([1], _sp()))
    assert gen.token_ids == [11, 12, 13, 14, 15, EOS] and gen.finish_reason == "stop"
    assert math.isnan(gen.log_probs[-1]) and len(gen.log_probs) == 6


def test_length_finish(engine):
    gen = asyncio.run(engine.generate([1], _sp(max_tokens=3)))
    assert gen.token_ids == [11, 12, 13] and gen.finish_reason == "length"


def test_cancelled_by_engine_is_an_engine_error(engine):
    async def run():
        stream = engine.stream([1], _sp())
        await stream.__anext__()
        FakeLLM.instances[-1].results[-1]._aborted = True
        return [d async for d in stream]

    with pytest.raises(EngineError, match="cancelled"):
        asyncio.run(run())


# ---- streaming and cancellation -----------------------------------------------------------------


def test_stream_deltas_add_up_to_generate(engine):
    async def run():
        deltas = [d async for d in engine.stream([1], _sp(top_logprobs=1))]
        return deltas, await engine.generate([1], _sp(top_logprobs=1))

    deltas, whole = asyncio.run(run())
    assert [d.token_ids for d in deltas] == [[t] for t in whole.token_ids]
    assert [d.finish_reason for d in deltas][-1] == "stop"
    assert sum((d.log_probs for d in deltas), []) == whole.log_probs
    assert sum((d.top_logprobs for d in deltas), []) == whole.top_logprobs
    assert FakeLLM.instances[-1].results[0]._streaming


def test_closing_the_stream_aborts(engine):
    _script(range(100, 200))

    async def run():
        stream = engine.stream([1], _sp(max_tokens=100))
        got = []
        async for d in stream:
            got += d.token_ids
            if len(got) == 3:
                break
        await stream.aclose()
        return got

    assert asyncio.run(run()) == [100, 101, 102]
    res = FakeLLM.instances[-1].results[-1]
    assert res.aborted() and not res.finished


def test_closed_engine_refuses_and_shuts_down(engine):
    asyncio.run(engine.close())
    assert FakeLLM.instances[-1].shut_down
    with pytest.raises(EngineError, match="shut down"):
        asyncio.run(engine.generate([1], _sp()))


def test_local_backend_chat_over_trtllm(fake_trtllm, model_dir, tokenizer):
    from gymserve.backends.base import RequestContext
    from gymserve.backends.local import LocalBackend
    from gymserve.config import LocalBackendConfig, SamplingConfig
    from gymserve.engine.trtllm_engine import TRTLLMEngine

    cfg = LocalBackendConfig(engine="trtllm", sampling=SamplingConfig(temperature=1.0, seed=3))
    backend = LocalBackend(
        cfg, TRTLLMEngine(model_dir, model_name="Qwen2.5-Coder-0.5B-Instruct", context_window=4096), tokenizer
    )
    answer = tokenizer.encode("Bonjour!", add_special_tokens=False)
    _script(answer)
    out = asyncio.run(backend.chat({"messages": [{"role": "user", "content": "hi"}]}, RequestContext()))
    msg = out["choices"][0]["message"]
    assert msg["content"] == "Bonjour!" and out["choices"][0]["finish_reason"] == "stop"
    assert msg["generation_token_ids"] == answer and len(msg["generation_log_probs"]) == len(answer)
    res = FakeLLM.instances[-1].results[-1]
    assert res.prompt_token_ids == msg["prompt_token_ids"]
    assert res.sampling_params.seed == 3 and res.sampling_params.max_tokens == 4096 - len(msg["prompt_token_ids"])


def test_top_logprobs_leave_the_sampled_tokens_and_log_probs_unchanged(engine):
    """The adapter reads the sampled token's own entry whatever the alternatives asked for."""
    from helpers.engine_contract import assert_top_logprobs_leave_sampling_unchanged

    assert_top_logprobs_leave_sampling_unchanged(engine, [1, 2, 3], max_tokens=4, top_n=2)
