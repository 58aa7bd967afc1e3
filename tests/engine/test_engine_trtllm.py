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

For the control plane it follows ``LLM._collective_rpc(method, args=(), kwargs=None,
non_block=False, unique_reply_rank=None)`` driving ``tensorrt_llm.llmapi.rlhf_utils.WorkerExtension
.update_weights(ipc_handles)`` (``{device_uuid: [(name, (rebuild_fn, args)), ...]}``, rebuilt with
``rebuild_fn(*args)``; ``None`` finalizes the reload), ``tensorrt_llm._torch.utils.get_device_uuid``
and ``tensorrt_llm.executor.request.LoRARequest(lora_name, lora_int_id, lora_path)``.
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
        self.args = types.SimpleNamespace(
            max_seq_len=kwargs.get("max_seq_len"),
            model=model,
            tensor_parallel_size=kwargs.get("tensor_parallel_size", 1),
            ray_worker_extension_cls=kwargs.get("ray_worker_extension_cls"),
        )
        self.results: list[FakeResult] = []
        self.step_delay = 0.0
        self.shut_down = False
        self.rpc_calls: list = []
        self.pending: dict = {}
        self.reloaded: dict = {}
        self.lora_requests: list = []
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
        self.lora_requests.append(lora_request)
        res = FakeResult(self, list(inputs["prompt_token_ids"]), sampling_params or TSamplingParams(), streaming)
        self.results.append(res)
        return res

    def shutdown(self) -> None:
        self.shut_down = True

    def _collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ):
        """WorkerExtension.update_weights on each (fake) GPU worker of the tensor-parallel group."""
        assert (
            method == "update_weights"
            and self.kwargs.get("ray_worker_extension_cls") == "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
        )
        (handles,) = args
        self.rpc_calls.append(None if handles is None else sorted(handles))
        if handles is None:
            self.reloaded = dict(self.pending)
            self.pending = {}
            return [None] * int(self.kwargs.get("tensor_parallel_size", 1))
        for device in range(int(self.kwargs.get("tensor_parallel_size", 1))):
            uuid = get_device_uuid(device)
            if uuid not in handles:
                raise ValueError(f"Device UUID {uuid} not found in ipc_handles")
            for name, (func, fargs) in handles[uuid]:
                self.pending[name] = func(*fargs).clone()
        return [None] * int(self.kwargs.get("tensor_parallel_size", 1))


def get_device_uuid(device_idx: int) -> str:
    return f"GPU-fake-{device_idx:04d}"


@dataclass
class LoRARequest:
    """tensorrt_llm.executor.request.LoRARequest's leading fields."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"


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
    torch_utils = types.ModuleType("tensorrt_llm._torch.utils")
    torch_utils.get_device_uuid = get_device_uuid
    monkeypatch.setitem(sys.modules, "tensorrt_llm._torch", types.ModuleType("tensorrt_llm._torch"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm._torch.utils", torch_utils)
    request = types.ModuleType("tensorrt_llm.executor.request")
    request.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "tensorrt_llm.executor", types.ModuleType("tensorrt_llm.executor"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.executor.request", request)


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


def test_a_dropped_end_id_is_not_made_up(engine, monkeypatch, caplog):
    """A build that leaves the EOS out: its log-prob is unknown, so the generation ends without it
    (never with an invented log-prob) and the log says so once."""
    monkeypatch.setattr(FakeLLM, "drop_end_id", True)
    with caplog.at_level("WARNING", logger="gymserve.engine.trtllm_engine"):
        gen = asyncio.run(engine.generate([1], _sp()))
        asyncio.run(engine.generate([1], _sp()))
    assert gen.token_ids == [11, 12, 13, 14, 15] and gen.finish_reason == "stop"
    assert len(gen.log_probs) == 5 and not any(math.isnan(x) for x in gen.log_probs)
    assert sum("left the EOS" in r.message for r in caplog.records) == 1


def test_length_finish(engine):
    gen = asyncio.run(engine.generate([1], _sp(max_tokens=3)))
    assert gen.token_ids == [11, 12, 13] and gen.finish_reason == "length"


def test_cancelled_request_is_an_aborted_answer_keeping_its_tokens(engine):
    async def run():
        stream = engine.stream([1], _sp())
        first = await stream.__anext__()
        FakeLLM.instances[-1].results[-1]._aborted = True
        return first, [d async for d in stream]

    first, rest = asyncio.run(run())
    assert first.token_ids == [11] and rest[-1].finish_reason == "abort"


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
    # The EOS that ended the answer is a training token (vLLM's token_ids include it too).
    assert msg["generation_token_ids"] == [*answer, EOS] and len(msg["generation_log_probs"]) == len(answer) + 1
    res = FakeLLM.instances[-1].results[-1]
    assert res.prompt_token_ids == msg["prompt_token_ids"]
    assert res.sampling_params.seed == 3 and res.sampling_params.max_tokens == 4096 - len(msg["prompt_token_ids"])


# ---- control plane --------------------------------------------------------------------------------


def test_pause_at_the_adapter_door(engine):
    """abort aborts the requests in flight (aborted answers keeping their tokens), new ones wait for
    resume; wait returns once they finished; keep is 501."""
    from gymserve.errors import NotSupportedError

    FakeLLM.instances[-1].step_delay = 0.005
    _script([11] * 300)

    async def run():
        stream = engine.stream([1], _sp(max_tokens=300))
        first = await stream.__anext__()
        await engine.pause_generation("abort", timeout=30)
        rest = [d async for d in stream]
        assert await engine.is_paused() and engine.control_status()["paused"] == "abort"
        held = asyncio.ensure_future(engine.generate([1], _sp(max_tokens=3)))
        await asyncio.sleep(0.05)
        assert not held.done() and len(FakeLLM.instances[-1].results) == 1  # not sent to TensorRT-LLM
        await engine.resume_generation()
        done = await held
        running = asyncio.ensure_future(engine.generate([1], _sp(max_tokens=20)))
        await asyncio.sleep(0.02)
        await engine.pause_generation("wait")
        assert running.done() and (await running).finish_reason == "length"
        await engine.resume_generation()
        return first, rest, done

    first, rest, done = asyncio.run(run())
    assert rest[-1].finish_reason == "abort" and 1 + sum(len(d.token_ids) for d in rest) < 300
    assert done.finish_reason == "length" and done.token_ids == [11, 11, 11]
    with pytest.raises(NotSupportedError, match="mode=wait"):
        asyncio.run(engine.pause_generation("keep"))


def test_update_weights_through_the_rl_worker_extension(fake_trtllm, model_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    from gymserve.engine.trtllm_engine import TRTLLMEngine
    from gymserve.errors import NotSupportedError

    plain = TRTLLMEngine(model_dir)
    with pytest.raises(NotSupportedError, match="ray_worker_extension_cls"):
        asyncio.run(plain.update_weights({"w": torch.zeros(1)}))
    asyncio.run(plain.close())

    eng = TRTLLMEngine(
        model_dir,
        engine_args={
            "orchestrator_type": "ray",
            "ray_worker_extension_cls": "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension",
            "tensor_parallel_size": 2,
        },
    )
    llm = FakeLLM.instances[-1]
    try:
        new = {"model.norm.weight": torch.arange(4.0), "lm_head.weight": torch.ones(2, 3)}
        assert asyncio.run(eng.update_weights(new, weight_version="step-1")) == "step-1"
        # One set of handles per GPU of the tensor-parallel group, then the finalizing call.
        assert llm.rpc_calls == [[get_device_uuid(0), get_device_uuid(1)], None]
        assert set(llm.reloaded) == set(new) and all(torch.equal(llm.reloaded[k], v) for k, v in new.items())
        gen = asyncio.run(eng.generate([1], _sp()))
        assert {s["version"] for s in gen.weight_version_spans} == {"step-1"}
        save_file({"model.norm.weight": torch.full((4,), 2.0)}, str(tmp_path / "model.safetensors"))
        assert asyncio.run(eng.update_weights(path=tmp_path)) == 2
        assert torch.equal(llm.reloaded["model.norm.weight"], torch.full((4,), 2.0))
        asyncio.run(eng.update_weight_version("named"))
        assert eng.control_status()["weight_version"] == "named" and eng.control_status()["weight_updates"] == 3
    finally:
        asyncio.run(eng.close())


def test_lora_request_goes_with_every_generation(engine, tmp_path):
    from gymserve.errors import ConflictError

    llm = FakeLLM.instances[-1]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text('{"r": 4}')
    assert asyncio.run(engine.load_lora_adapter("policy", str(tmp_path / "a"))) == 1
    asyncio.run(engine.generate([1], _sp()))
    req = llm.lora_requests[-1]
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("policy", 1, str(tmp_path / "a"))
    with pytest.raises(ConflictError):
        asyncio.run(engine.load_lora_adapter("other", str(tmp_path / "b")))
    asyncio.run(engine.load_lora_adapter("policy", str(tmp_path / "b"), load_inplace=True))
    asyncio.run(engine.generate([1], _sp()))
    assert llm.lora_requests[-1].lora_int_id == 2 and llm.lora_requests[-1].lora_path == str(tmp_path / "b")
    assert asyncio.run(engine.unload_lora_adapter("policy")) == 3
    asyncio.run(engine.generate([1], _sp()))
    assert llm.lora_requests[-1] is None


def test_serve_policy_around_the_trainers_own_llm(fake_trtllm, model_dir, tokenizer):
    """A trainer's tensorrt_llm.LLM behind gymserve's HTTP server: abort pauses reach it through the
    adapter's door, and stop() leaves it running."""
    import httpx
    import openai

    from gymserve.server.embed import serve_policy

    llm = FakeLLM(str(model_dir), max_seq_len=4096)
    srv = serve_policy(llm, tokenizer, backend_config={"tool_call_parser": "none"}, model_name="policy")
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
        done = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
        assert done.choices[0].message.model_extra["generation_token_ids"] == [11, 12, 13, 14, 15, EOS]
        root = srv.base_url.removesuffix("/v1")
        assert httpx.post(root + "/pause", params={"mode": "wait"}).status_code == 200
        assert httpx.get(root + "/is_paused").json()["is_paused"] is True
        r = httpx.post(root + "/pause", params={"mode": "keep"})
        assert r.status_code == 501 and "mode=wait" in r.json()["error"]["message"]
        assert httpx.post(root + "/resume").status_code == 200
        r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(model_dir)}})
        assert r.status_code == 501 and "ray_worker_extension_cls" in r.json()["error"]["message"]
    finally:
        srv.stop()
    assert llm.shut_down is False


def test_top_logprobs_leave_the_sampled_tokens_and_log_probs_unchanged(engine):
    """The adapter reads the sampled token's own entry whatever the alternatives asked for."""
    from helpers.engine_contract import assert_top_logprobs_leave_sampling_unchanged

    assert_top_logprobs_leave_sampling_unchanged(engine, [1, 2, 3], max_tokens=4, top_n=2)
