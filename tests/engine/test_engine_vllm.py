"""The vLLM engine adapter against a test double of vLLM (no GPU, no vLLM install).

The double is a small module tree put in ``sys.modules`` that follows vLLM's real names and
signatures (read from vLLM's source): ``vllm.SamplingParams`` (same field names and defaults, so a
misspelt keyword fails here as it would there), ``vllm.sampling_params.RequestOutputKind``,
``vllm.inputs.TokensPrompt``, ``vllm.engine.arg_utils.AsyncEngineArgs``,
``vllm.v1.engine.async_llm.AsyncLLM`` (``from_engine_args``, ``generate(prompt, sampling_params,
request_id)`` as an async generator of ``RequestOutput``, ``abort``, ``shutdown``), and
``vllm.outputs.RequestOutput`` / ``CompletionOutput`` / ``vllm.logprobs.Logprob``. Its scheduler
mimics ``vllm.v1.core.sched.utils.check_stop``: the EOS or stop token stays in ``token_ids``.

The control plane follows ``AsyncLLM``'s RL API (``vllm/v1/engine/async_llm.py``):
``pause_generation(*, mode="abort", wait_for_inflight_requests=None, clear_cache=True)`` (abort ends
the requests in flight with ``finish_reason "abort"``, wait lets them finish, keep freezes them),
``resume_generation()``, ``is_paused()``, ``start_weight_update()``,
``update_weights(request: WeightTransferUpdateRequest)`` with the disk backend's checks
(``DiskWeightTransferUpdateInfo``: an absolute directory holding ``*.safetensors``; one checkpoint
per session), ``finish_weight_update(weight_version: str | None)``,
``update_weight_version(new_version: str)``, ``get_weight_version()``,
``add_lora(lora_request: LoRARequest) -> bool``, ``remove_lora(lora_id: int) -> bool``, and
``vllm.lora.request.LoRARequest`` with its fields (``lora_int_id >= 1``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, TypedDict

import pytest

from gymserve.engine.base import SamplingParams
from gymserve.errors import EngineError, InvalidRequestError, WeightUpdateError

EOS = 151645
EOS2 = 151643


# ---- the vLLM double ----------------------------------------------------------------------------


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)
class VSamplingParams:
    """vllm.SamplingParams' fields used by gymserve, with vLLM's names and defaults."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str
    multi_modal_data: Any


@dataclass
class AsyncEngineArgs:
    model: str = "facebook/opt-125m"
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    logprobs_mode: str = "raw_logprobs"
    enforce_eager: bool = False
    enable_log_requests: bool = False
    disable_log_stats: bool = False
    weight_transfer_config: Any = None


@dataclass
class OldAsyncEngineArgs:  # a release before logprobs_mode
    model: str = "facebook/opt-125m"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None


def fake_step(prompt: list[int], generated: list[int]) -> tuple[int, list[tuple[int, float]]]:
    """The double's "model": the next token and the raw distribution's top entries, best first.

    ``FakeAsyncLLM.script`` (a list of token IDs) is followed, then ``EOS``. The sampled token's
    log-prob is ``-0.1 * (step + 1)``; three alternatives rank around it.
    """
    step = len(generated)
    script = FakeAsyncLLM.script
    tok = script[step] if step < len(script) else EOS
    lp = -0.1 * (step + 1)
    dist = [(tok, lp), (500 + step, lp - 1.0), (600 + step, lp - 2.0), (700 + step, lp - 3.0)]
    if step % 3 == 2:  # now and then the sampled token is not the most likely one
        dist = [(900 + step, lp + 0.05)] + dist
    return tok, dist


class FakeAsyncLLM:
    """``vllm.v1.engine.async_llm.AsyncLLM`` as far as gymserve uses it."""

    script: list[int] = []
    instances: list[FakeAsyncLLM] = []

    def __init__(self, engine_args):
        self.engine_args = engine_args
        self.model_config = types.SimpleNamespace(
            max_model_len=engine_args.max_model_len or 32768, model=engine_args.model, logprobs_mode="raw_logprobs"
        )
        transfer = getattr(engine_args, "weight_transfer_config", None)
        if isinstance(transfer, dict):  # AsyncEngineArgs turns the dict into a WeightTransferConfig
            transfer = types.SimpleNamespace(**transfer)
        self.vllm_config = types.SimpleNamespace(weight_transfer_config=transfer)
        self.calls: list[tuple[Any, VSamplingParams, str]] = []
        self.lora_requests: list[Any] = []
        self.aborted: list[str] = []
        self.finished_ids: list[str] = []
        self.shut_down = False
        self.step_delay = 0.0
        self.paused: str | None = None
        self.running = 0
        self.session = False
        self.loaded: dict | None = None
        self.update_weights_error: Exception | None = None  # what update_weights raises (a test sets it)
        self.weight_version: str | None = None
        self.loras: dict[int, Any] = {}
        self.control_calls: list[tuple] = []
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(
        cls, engine_args, start_engine_loop: bool = True, usage_context: Any = None, stat_loggers: Any = None
    ):
        return cls(engine_args)

    async def generate(
        self,
        prompt,
        sampling_params: VSamplingParams,
        request_id: str,
        *,
        prompt_text=None,
        lora_request=None,
        tokenization_kwargs=None,
        trace_headers=None,
        priority: int = 0,
        data_parallel_rank=None,
    ):
        assert isinstance(prompt, dict) and "prompt_token_ids" in prompt
        self.calls.append((prompt, sampling_params, request_id))
        self.lora_requests.append(lora_request)
        while self.paused is not None:  # new requests wait while paused
            await asyncio.sleep(0.001)
        self.running += 1
        p = sampling_params
        prompt_ids = list(prompt["prompt_token_ids"])
        gen: list[int] = []
        lps: list[dict[int, Logprob]] = []
        sent = 0
        try:
            while True:
                await asyncio.sleep(self.step_delay)
                await self._gate(request_id)
                if request_id in self.aborted:
                    finish = "abort"
                else:
                    tok, dist = fake_step(prompt_ids, gen)
                    gen.append(tok)
                    if p.logprobs is not None:
                        top = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(dist[: p.logprobs])}
                        rank = next(r + 1 for r, (t, _) in enumerate(dist) if t == tok)
                        top.setdefault(tok, Logprob(dict(dist)[tok], rank))
                        lps.append(top)
                    finish = None
                    if not p.ignore_eos and (tok == EOS or tok in (p.stop_token_ids or ())):
                        finish = "stop"
                    elif len(gen) >= p.max_tokens or len(prompt_ids) + len(gen) >= self.model_config.max_model_len:
                        finish = "length"
                finished = finish is not None
                if not finished and p.output_kind == RequestOutputKind.FINAL_ONLY:
                    continue
                if p.output_kind == RequestOutputKind.DELTA:
                    ids, lp_out = gen[sent:], lps[sent:] if p.logprobs is not None else None
                    sent = len(gen)
                else:
                    ids, lp_out = list(gen), list(lps) if p.logprobs is not None else None
                comp = CompletionOutput(0, "", ids, None, lp_out, finish_reason=finish)
                plp = None
                if p.prompt_logprobs is not None:
                    # vLLM's shape: None at position 0, then the prompt token (rank 2) and a better one.
                    plp = [None] + [
                        {t: Logprob(-0.5 * i, 2), 9000 + i: Logprob(-0.1, 1)} for i, t in enumerate(prompt_ids[1:], 1)
                    ]
                yield RequestOutput(request_id, None, prompt_ids, plp, [comp], finished)
                if finished:
                    self.finished_ids.append(request_id)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id, internal=True)  # what vLLM's generate() does
            raise
        finally:
            self.running -= 1

    async def abort(self, request_id, internal: bool = False) -> None:
        self.aborted.append(request_id)

    def shutdown(self, timeout=None) -> None:
        self.shut_down = True

    # ---- the RL API --------------------------------------------------------------------------

    async def _gate(self, request_id: str) -> None:
        """Between two steps: a keep pause freezes the request, an abort pause ends it."""
        while self.paused == "keep":
            await asyncio.sleep(0.001)
        if self.paused == "abort":
            self.aborted.append(request_id)

    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None, clear_cache: bool = True):
        assert mode in ("abort", "wait", "keep")
        self.control_calls.append(("pause_generation", mode))
        self.paused = mode
        if mode == "wait":
            while self.running:
                await asyncio.sleep(0.001)

    async def resume_generation(self) -> None:
        self.control_calls.append(("resume_generation",))
        self.paused = None

    async def is_paused(self) -> bool:
        return self.paused is not None

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs: dict | None = None):
        """``reload_weights(weights_path=DIR)`` as the workers run it: every tensor of the complete
        checkpoint in ``DIR`` (vLLM's ``reload_weights`` reads the directory with the model loader)."""
        self.control_calls.append(("collective_rpc", method, dict(kwargs or {})))
        assert method == "reload_weights", method
        path = (kwargs or {})["weights_path"]
        files = [p for p in os.listdir(path) if p.endswith(".safetensors")] if os.path.isdir(path) else []
        if not files:
            raise RuntimeError(f"Cannot find any model weights with `{path}`")
        from safetensors.torch import load_file

        self.loaded = load_file(os.path.join(path, files[0]))
        return [None]

    async def start_weight_update(self) -> None:
        if self.session:
            raise RuntimeError("A shared-disk weight update is already active")
        self.session, self.loaded = True, None
        self.control_calls.append(("start_weight_update",))

    async def update_weights(self, request) -> None:
        assert type(request).__name__ == "WeightTransferUpdateRequest"
        path = request.update_info.get("path")
        self.control_calls.append(("update_weights", dict(request.update_info)))
        try:
            if self.update_weights_error is not None:
                raise self.update_weights_error
            if not self.session:
                raise RuntimeError("start_weight_update must be called before loading a checkpoint")
            if not isinstance(path, str) or not os.path.isabs(path):
                raise ValueError("`path` must be an absolute local directory")
            if not os.path.isdir(path) or not any(p.endswith(".safetensors") for p in os.listdir(path)):
                raise ValueError(f"Shared-disk checkpoint directory contains no safetensors files: {path}")
        except Exception:
            self.session = False
            raise
        from safetensors.torch import load_file

        self.loaded = load_file(os.path.join(path, "model.safetensors"))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.control_calls.append(("finish_weight_update", weight_version))
        if not self.session or self.loaded is None:
            self.session = False
            raise RuntimeError("No checkpoint was loaded during the shared-disk update session")
        self.session = False
        if weight_version is not None:
            assert isinstance(weight_version, str)
            self.weight_version = weight_version

    async def update_weight_version(self, new_version: str) -> None:
        assert isinstance(new_version, str)
        self.weight_version = new_version

    async def get_weight_version(self) -> str:
        return self.weight_version

    async def add_lora(self, lora_request) -> bool:
        assert type(lora_request).__name__ == "LoRARequest"
        self.control_calls.append(("add_lora", lora_request))
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.control_calls.append(("remove_lora", lora_id))
        return self.loras.pop(lora_id, None) is not None


@dataclass
class LoRARequest:
    """vllm.lora.request.LoRARequest's fields."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")


@dataclass
class WeightTransferUpdateRequest:
    """vllm.distributed.weight_transfer.base.WeightTransferUpdateRequest."""

    update_info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def install_fake_vllm(monkeypatch, *, engine_args_cls=AsyncEngineArgs, with_output_kind: bool = True) -> None:
    sp_attrs = {"SamplingParams": VSamplingParams}
    if with_output_kind:
        sp_attrs["RequestOutputKind"] = RequestOutputKind
    mods = {
        "vllm": _module(
            "vllm",
            SamplingParams=VSamplingParams,
            TokensPrompt=TokensPrompt,
            AsyncEngineArgs=engine_args_cls,
            AsyncLLMEngine=FakeAsyncLLM,
        ),
        "vllm.sampling_params": _module("vllm.sampling_params", **sp_attrs),
        "vllm.inputs": _module("vllm.inputs", TokensPrompt=TokensPrompt),
        "vllm.engine": _module("vllm.engine"),
        "vllm.engine.arg_utils": _module("vllm.engine.arg_utils", AsyncEngineArgs=engine_args_cls),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.engine": _module("vllm.v1.engine"),
        "vllm.v1.engine.async_llm": _module("vllm.v1.engine.async_llm", AsyncLLM=FakeAsyncLLM),
        "vllm.outputs": _module("vllm.outputs", RequestOutput=RequestOutput, CompletionOutput=CompletionOutput),
        "vllm.logprobs": _module("vllm.logprobs", Logprob=Logprob),
        "vllm.lora": _module("vllm.lora"),
        "vllm.lora.request": _module("vllm.lora.request", LoRARequest=LoRARequest),
        "vllm.distributed": _module("vllm.distributed"),
        "vllm.distributed.weight_transfer": _module("vllm.distributed.weight_transfer"),
        "vllm.distributed.weight_transfer.base": _module(
            "vllm.distributed.weight_transfer.base", WeightTransferUpdateRequest=WeightTransferUpdateRequest
        ),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


# ---- fixtures -----------------------------------------------------------------------------------


def write_model_dir(path, *, vocab_size=151936, max_pos=32768):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "vocab_size": vocab_size,
                "max_position_embeddings": max_pos,
                "eos_token_id": EOS,
            }
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, EOS2]}))
    return path


@pytest.fixture
def model_dir(tmp_path):
    return write_model_dir(tmp_path / "Qwen2.5-Coder-0.5B-Instruct")


@pytest.fixture
def fake_vllm(monkeypatch):
    install_fake_vllm(monkeypatch)
    FakeAsyncLLM.script = [11, 12, 13, 14, 15]
    FakeAsyncLLM.instances = []
    yield FakeAsyncLLM


@pytest.fixture
def engine(fake_vllm, model_dir):
    from gymserve.engine.vllm_engine import VLLMEngine

    eng = VLLMEngine(model_dir, model_name="policy")
    yield eng
    asyncio.run(eng.close())


def _sp(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 16)
    kw.setdefault("stop_token_ids", (EOS, EOS2))
    return SamplingParams(**kw)


# ---- construction, engine args, missing package ------------------------------------------------


def test_missing_vllm_says_what_to_install(monkeypatch, model_dir):
    from gymserve.config import LocalBackendConfig
    from gymserve.engine import create_engine
    from gymserve.engine.model_store import ResolvedModel

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm → ImportError
    with pytest.raises(ImportError, match=r"pip install vllm"):
        create_engine(LocalBackendConfig(engine="vllm"), ResolvedModel("m", model_dir))


def test_unknown_engine_lists_choices(model_dir):
    from gymserve.config import LocalBackendConfig
    from gymserve.engine import create_engine
    from gymserve.engine.model_store import ResolvedModel

    with pytest.raises(ValueError, match="transformers, llamacpp, vllm, trtllm"):
        create_engine(LocalBackendConfig(engine="tgi"), ResolvedModel("m", model_dir))


def test_gymserve_imports_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    import importlib

    import gymserve.engine.vllm_engine as mod

    importlib.reload(mod)  # the module itself never imports vllm


def test_create_engine_passes_engine_args_from_config(fake_vllm, model_dir):
    from gymserve.config import LocalBackendConfig
    from gymserve.engine import create_engine
    from gymserve.engine.model_store import ResolvedModel

    cfg = LocalBackendConfig(
        engine="vllm",
        engine_args={
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.8,
            "max_model_len": 2048,
            "dtype": "bfloat16",
        },
    )
    eng = create_engine(cfg, ResolvedModel("policy", model_dir))
    args = fake_vllm.instances[-1].engine_args
    assert (args.model, args.tensor_parallel_size, args.gpu_memory_utilization, args.max_model_len, args.dtype) == (
        str(model_dir),
        2,
        0.8,
        2048,
        "bfloat16",
    )
    assert args.logprobs_mode == "raw_logprobs"
    assert eng.context_window == 2048
    assert eng.model_name == "policy"
    assert eng.eos_token_ids == (EOS, EOS2)
    assert eng.vocab_size == 151936
    assert eng.model_type == "qwen2"  # config.json's, for tool-call parser inference


def test_context_window_becomes_max_model_len(fake_vllm, model_dir):
    from gymserve.engine.vllm_engine import VLLMEngine

    eng = VLLMEngine(model_dir, context_window=4096)
    assert fake_vllm.instances[-1].engine_args.max_model_len == 4096
    assert eng.context_window == 4096


def test_non_raw_logprobs_mode_is_refused(fake_vllm, model_dir):
    from gymserve.engine.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="raw_logprobs"):
        VLLMEngine(model_dir, engine_args={"logprobs_mode": "processed_logprobs"})


def test_unknown_engine_arg_is_a_value_error(fake_vllm, model_dir):
    from gymserve.engine.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="AsyncEngineArgs"):
        VLLMEngine(model_dir, engine_args={"tensor_paralel_size": 2})


def test_older_vllm_without_logprobs_mode(monkeypatch, model_dir):
    from gymserve.engine.vllm_engine import VLLMEngine

    install_fake_vllm(monkeypatch, engine_args_cls=OldAsyncEngineArgs)
    FakeAsyncLLM.instances = []
    VLLMEngine(model_dir)
    assert not hasattr(FakeAsyncLLM.instances[-1].engine_args, "logprobs_mode")


def test_missing_config_json_is_an_engine_error(fake_vllm, tmp_path):
    from gymserve.engine.vllm_engine import VLLMEngine

    with pytest.raises(EngineError, match="config.json"):
        VLLMEngine(tmp_path)


# ---- sampling params mapping --------------------------------------------------------------------


def test_sampling_mapping_defaults(engine):
    p = engine.sampling_params(_sp(max_tokens=7), stream=False)
    assert isinstance(p, VSamplingParams)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens, p.min_tokens) == (
        1,
        1.0,
        1.0,
        -1,
        0.0,
        None,
        7,
        0,
    )
    assert p.stop_token_ids == [EOS, EOS2] and p.ignore_eos is False
    assert p.logprobs == 0  # the sampled token's log-prob only
    assert p.detokenize is False and p.skip_special_tokens is False
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.output_kind == RequestOutputKind.DELTA  # non-streamed too: each token stamped as it arrives
    assert p.prompt_logprobs is None
    assert p.stop is None


@pytest.mark.parametrize("top_k, want", [(None, -1), (0, -1), (-1, -1), (40, 40)])
def test_sampling_mapping_top_k(engine, top_k, want):
    assert engine.sampling_params(_sp(top_k=top_k), stream=True).top_k == want


def test_sampling_mapping_pinned_values(engine):
    p = engine.sampling_params(_sp(temperature=0.7, top_p=0.9, top_k=20, seed=1234, top_logprobs=5), stream=True)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.logprobs) == (0.7, 0.9, 20, 1234, 5)
    assert p.output_kind == RequestOutputKind.DELTA
    greedy = engine.sampling_params(_sp(temperature=0), stream=False)
    assert greedy.temperature == 0.0  # vLLM's greedy


# ---- outputs: tokens, log-probs, finish reasons -------------------------------------------------


def test_eos_is_kept_with_its_log_prob(engine):
    gen = asyncio.run(engine.generate([1, 2, 3], _sp()))
    assert gen.token_ids == [11, 12, 13, 14, 15, EOS]
    assert gen.finish_reason == "stop"
    assert gen.log_probs == pytest.approx([-0.1 * (i + 1) for i in range(6)])
    assert gen.top_logprobs == []
    prompt, params, _ = FakeAsyncLLM.instances[-1].calls[-1]
    assert prompt == {"prompt_token_ids": [1, 2, 3]}


def test_stop_token_id_is_kept(engine):
    gen = asyncio.run(engine.generate([1, 2], _sp(stop_token_ids=(EOS, EOS2, 13))))
    assert gen.token_ids == [11, 12, 13] and gen.finish_reason == "stop"
    assert len(gen.log_probs) == 3


def test_length_finish(engine):
    gen = asyncio.run(engine.generate([1], _sp(max_tokens=2)))
    assert gen.token_ids == [11, 12] and gen.finish_reason == "length"


def test_top_logprobs_ranked_and_sampled_kept(engine):
    gen = asyncio.run(engine.generate([1], _sp(top_logprobs=2, max_tokens=4)))
    assert len(gen.top_logprobs) == 4
    for i, (tok, lp, tops) in enumerate(zip(gen.token_ids, gen.log_probs, gen.top_logprobs)):
        assert len(tops) == 2
        assert [v for _, v in tops] == sorted((v for _, v in tops), reverse=True)
        if i == 2:  # the sampled token ranked second: the alternatives are ranks 1 and 2
            assert tops[0][0] == 902 and tops[1] == (tok, pytest.approx(lp))
        else:
            assert tops[0] == (tok, pytest.approx(lp))


def test_abort_finish_reason_is_an_aborted_answer_keeping_its_tokens(engine):
    """vLLM ends an aborted request with finish_reason "abort" (a pause, gymserve's or the trainer's
    own on its AsyncLLM): an aborted answer with the tokens sampled before it."""

    async def run():
        stream = engine.stream([1], _sp())
        first = await stream.__anext__()
        FakeAsyncLLM.instances[-1].aborted.append(FakeAsyncLLM.instances[-1].calls[-1][2])
        rest = [d async for d in stream]
        return first, rest

    first, rest = asyncio.run(run())
    assert first.token_ids == [11] and rest[-1].finish_reason == "abort" and rest[-1].token_ids == []


def test_missing_sampled_logprob_is_an_engine_error():
    from gymserve.engine.request_output import parse_positions

    with pytest.raises(EngineError, match="sampled token"):
        parse_positions([5], [{6: Logprob(-1.0, 1)}], 0, "vLLM")
    with pytest.raises(EngineError, match="1 log-probs for 2 tokens"):
        parse_positions([5, 6], [{5: Logprob(-1.0, 1)}], 0, "vLLM")


def test_flat_logprobs_form_is_read():
    """``flat_logprobs=True`` gives a ``FlatLogprobs`` sequence whose items are the same dicts."""
    from gymserve.engine.request_output import parse_positions

    class Flat:  # indexable, iterable of per-position dicts, like vllm.logprobs.FlatLogprobs
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def __iter__(self):
            return iter(self.rows)

    ids, lps, _ = parse_positions([5, 6], Flat([{5: Logprob(-0.5, 1)}, {6: Logprob(-0.25, 1)}]), 0, "vLLM")
    assert (ids, lps) == ([5, 6], [-0.5, -0.25])


# ---- streaming and cancellation -----------------------------------------------------------------


def test_stream_yields_deltas_that_add_up_to_generate(engine):
    async def run():
        deltas = [d async for d in engine.stream([1, 2], _sp(top_logprobs=1))]
        whole = await engine.generate([1, 2], _sp(top_logprobs=1))
        return deltas, whole

    deltas, whole = asyncio.run(run())
    assert [len(d.token_ids) for d in deltas] == [1] * 6
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["stop"]
    assert sum((d.token_ids for d in deltas), []) == whole.token_ids
    assert sum((d.log_probs for d in deltas), []) == whole.log_probs
    assert sum((d.top_logprobs for d in deltas), []) == whole.top_logprobs


def test_cumulative_outputs_are_diffed(monkeypatch, model_dir):
    """A vLLM without ``output_kind`` streams cumulative outputs; the adapter yields only what is new."""
    from gymserve.engine.vllm_engine import VLLMEngine

    install_fake_vllm(monkeypatch, with_output_kind=False)
    FakeAsyncLLM.script = [11, 12, 13]
    eng = VLLMEngine(model_dir)

    async def run():
        return [d async for d in eng.stream([1], _sp())]

    deltas = asyncio.run(run())
    assert [d.token_ids for d in deltas] == [[11], [12], [13], [EOS]]
    assert [len(d.log_probs) for d in deltas] == [1, 1, 1, 1]


def test_closing_the_stream_aborts_the_request(engine):
    FakeAsyncLLM.script = list(range(100, 200))

    async def run():
        stream = engine.stream([1], _sp(max_tokens=100))
        got = []
        async for d in stream:
            got += d.token_ids
            if len(got) == 2:
                break
        await stream.aclose()
        return got

    got = asyncio.run(run())
    fake = FakeAsyncLLM.instances[-1]
    rid = fake.calls[-1][2]
    assert got == [100, 101]
    assert rid in fake.aborted and rid not in fake.finished_ids


def test_cancelled_task_aborts_the_request(engine):
    FakeAsyncLLM.script = list(range(100, 200))
    FakeAsyncLLM.instances[-1].step_delay = 0.01

    async def run():
        task = asyncio.create_task(engine.generate([1], _sp(max_tokens=100)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    fake = FakeAsyncLLM.instances[-1]
    assert fake.calls[-1][2] in fake.aborted


def test_closed_engine_refuses_and_shuts_vllm_down(engine):
    asyncio.run(engine.close())
    assert FakeAsyncLLM.instances[-1].shut_down

    async def run():
        return await engine.generate([1], _sp())

    with pytest.raises(EngineError, match="shut down"):
        asyncio.run(run())


# ---- the whole local backend over the double ----------------------------------------------------


@pytest.fixture
def backend(fake_vllm, model_dir, tokenizer):
    from gymserve.backends.local import LocalBackend
    from gymserve.config import LocalBackendConfig, SamplingConfig
    from gymserve.engine.vllm_engine import VLLMEngine

    cfg = LocalBackendConfig(
        engine="vllm", sampling=SamplingConfig(temperature=0.8, top_p=0.95, seed=7), engine_args={"max_model_len": 4096}
    )
    eng = VLLMEngine(model_dir, model_name="Qwen2.5-Coder-0.5B-Instruct", engine_args=cfg.engine_args)
    return LocalBackend(cfg, eng, tokenizer)


def test_local_backend_chat_over_vllm(backend, tokenizer):
    from gymserve.backends.base import RequestContext

    answer = tokenizer.encode("Hello there!", add_special_tokens=False)
    FakeAsyncLLM.script = answer
    req = {
        "model": "Qwen2.5-Coder-0.5B-Instruct",
        "messages": [{"role": "user", "content": "Say hello"}],
        "logprobs": True,
        "top_logprobs": 2,
    }
    out = asyncio.run(backend.chat(req, RequestContext()))
    msg = out["choices"][0]["message"]
    assert msg["content"] == "Hello there!"
    assert out["choices"][0]["finish_reason"] == "stop"
    # Exactly what the engine sampled, the EOS that ended it included with its log-prob (vLLM's own
    # token_ids include it); the text does not show it.
    assert msg["generation_token_ids"] == [*answer, EOS]
    assert msg["generation_log_probs"] == pytest.approx([-0.1 * (i + 1) for i in range(len(answer) + 1)])
    assert len(out["choices"][0]["logprobs"]["content"]) == len(answer) + 1
    prompt, params, _ = FakeAsyncLLM.instances[-1].calls[-1]
    assert prompt["prompt_token_ids"] == msg["prompt_token_ids"]
    assert tokenizer.decode(prompt["prompt_token_ids"]).endswith("<|im_start|>assistant\n")
    # Pinned sampling reached vLLM; max_tokens is what is left of the context window.
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.8, 0.95, -1, 7)
    assert params.max_tokens == 4096 - len(prompt["prompt_token_ids"])
    assert EOS in params.stop_token_ids and params.logprobs == 2
    assert out["usage"]["completion_tokens"] == len(answer) + 1


def test_local_backend_max_tokens_clamp_and_length(backend, tokenizer):
    from gymserve.backends.base import RequestContext

    FakeAsyncLLM.script = tokenizer.encode("one two three four five", add_special_tokens=False)
    req = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 3}
    out = asyncio.run(backend.chat(req, RequestContext()))
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["message"]["generation_token_ids"] == FakeAsyncLLM.script[:3]
    assert FakeAsyncLLM.instances[-1].calls[-1][1].max_tokens == 3


def test_local_backend_stream_over_vllm(backend, tokenizer):
    from gymserve.backends.base import RequestContext

    answer = tokenizer.encode("Streaming works.", add_special_tokens=False)
    FakeAsyncLLM.script = answer

    async def run():
        req = {"messages": [{"role": "user", "content": "stream"}], "stream": True}
        return [c async for c in backend.chat_stream(req, RequestContext())]

    chunks = asyncio.run(run())
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Streaming works."
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop"
    assert last["delta"]["generation_token_ids"] == [*answer, EOS]
    assert len(last["delta"]["generation_log_probs"]) == len(answer) + 1
    assert FakeAsyncLLM.instances[-1].calls[-1][1].output_kind == RequestOutputKind.DELTA


def test_local_backend_multi_turn_stays_contiguous(backend, tokenizer):
    """Turn 2's prompt starts with turn 1's prompt + generation (the model's EOS closing the turn,
    not followed by a second one from the template)."""
    from gymserve.backends.base import RequestContext

    FakeAsyncLLM.script = tokenizer.encode("First answer.", add_special_tokens=False)
    msgs = [{"role": "user", "content": "one"}]
    first = asyncio.run(backend.chat({"messages": msgs}, RequestContext()))["choices"][0]["message"]
    FakeAsyncLLM.script = tokenizer.encode("Second.", add_special_tokens=False)
    msgs2 = msgs + [
        {
            "role": "assistant",
            "content": first["content"],
            "prompt_token_ids": first["prompt_token_ids"],
            "generation_token_ids": first["generation_token_ids"],
            "generation_log_probs": first["generation_log_probs"],
        },
        {"role": "user", "content": "two"},
    ]
    second = asyncio.run(backend.chat({"messages": msgs2}, RequestContext()))["choices"][0]["message"]
    prefix = first["prompt_token_ids"] + first["generation_token_ids"]
    assert first["generation_token_ids"][-1] == EOS
    assert second["prompt_token_ids"][: len(prefix)] == prefix
    assert tokenizer.decode(second["prompt_token_ids"][len(prefix) :]).startswith("\n<|im_start|>user\ntwo")


def test_fake_sampling_params_mirror_vllm_field_names():
    """Guard for the double itself: the fields gymserve sets exist under these names in vLLM."""
    from gymserve.engine.vllm_engine import vllm_sampling_kwargs

    names = {f.name for f in dataclasses.fields(VSamplingParams)}
    assert set(vllm_sampling_kwargs(_sp())) <= names


# ---- control plane: AsyncLLM's RL API -------------------------------------------------------


def test_pause_modes_map_onto_async_llm_and_a_pause_ends_at_its_deadline(engine, caplog):
    import logging

    fake = FakeAsyncLLM.instances[-1]
    fake.step_delay = 0.005
    FakeAsyncLLM.script = [11] * 200

    async def run():
        stream = engine.stream([1], _sp(max_tokens=200))
        first = await stream.__anext__()
        await engine.pause_generation("abort", timeout=30)
        rest = [d async for d in stream]
        assert await engine.is_paused() and engine.control_status()["paused"] == "abort"
        await engine.resume_generation()
        await engine.pause_generation("keep")
        assert engine.control_status()["pause_seconds_left"] == pytest.approx(300, abs=1)  # pause_timeout
        await engine.resume_generation()
        with caplog.at_level(logging.WARNING, "gymserve.engine"):
            await engine.pause_generation("wait", timeout=0.05)
            await asyncio.sleep(0.3)
        assert not await engine.is_paused()
        return first, rest

    first, rest = asyncio.run(run())
    assert rest[-1].finish_reason == "abort" and 1 + sum(len(d.token_ids) for d in rest) < 200
    assert [c for c in fake.control_calls if c[0] in ("pause_generation", "resume_generation")] == [
        ("pause_generation", "abort"),
        ("resume_generation",),
        ("pause_generation", "keep"),
        ("resume_generation",),
        ("pause_generation", "wait"),
        ("resume_generation",),
    ]
    assert "reached its deadline of 0.05 s without resume_generation; resuming by itself" in caplog.text
    with pytest.raises(InvalidRequestError):
        asyncio.run(engine.pause_generation("sleep"))


def test_update_weights_without_a_disk_transfer_reloads_through_collective_rpc(engine, tmp_path):
    """vLLM 0.32 registers no disk weight transfer: the checkpoint goes in by vLLM's reload_weights."""
    import torch
    from safetensors.torch import save_file

    fake = FakeAsyncLLM.instances[-1]
    save_file({"lm_head.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    assert engine.weight_transfer_backend() is None
    assert asyncio.run(engine.update_weights(path=tmp_path, weight_version="step-1")) == "step-1"
    assert fake.control_calls == [("collective_rpc", "reload_weights", {"weights_path": str(tmp_path)})]
    assert fake.weight_version == "step-1" and engine.weight_version == "step-1"
    assert torch.equal(fake.loaded["lm_head.weight"], torch.ones(2, 2))
    gen = asyncio.run(engine.generate([1], _sp()))
    assert gen.weight_version_spans == [{"version": "step-1", "start": 0, "end": len(gen.token_ids)}]
    # A directory that is not there: 400 naming it, before vLLM is asked; nothing changed.
    with pytest.raises(WeightUpdateError, match="/nonexistent/ckpt is not a safetensors checkpoint directory"):
        asyncio.run(engine.update_weights(path="/nonexistent/ckpt"))
    assert engine.weight_version == "step-1" and len(fake.control_calls) == 1


def test_update_weights_runs_the_disk_weight_transfer_and_versions_every_token(fake_vllm, model_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    from gymserve.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, engine_args={"weight_transfer_config": {"backend": "disk"}})
    fake = FakeAsyncLLM.instances[-1]
    assert engine.weight_transfer_backend() == "disk"
    save_file({"lm_head.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    assert asyncio.run(engine.update_weights(path=tmp_path, weight_version="step-1")) == "step-1"
    assert fake.control_calls == [
        ("start_weight_update",),
        ("update_weights", {"path": str(tmp_path)}),
        ("finish_weight_update", "step-1"),
    ]
    assert fake.weight_version == "step-1" and engine.weight_version == "step-1"
    gen = asyncio.run(engine.generate([1], _sp()))
    assert gen.weight_version_spans == [{"version": "step-1", "start": 0, "end": len(gen.token_ids)}]

    # In-process tensors go through a temporary safetensors directory (the engine core is another process).
    fake.control_calls.clear()
    new = {"lm_head.weight": torch.full((2, 2), 3.0)}
    assert asyncio.run(engine.update_weights(new)) == 2  # the count of changes
    path = fake.control_calls[1][1]["path"]
    assert os.path.isabs(path) and not os.path.exists(path)  # removed after the update
    assert torch.equal(fake.loaded["lm_head.weight"], new["lm_head.weight"]) and fake.weight_version == "2"

    # A directory without safetensors: refused before vLLM sees it (a reload that fails part way can
    # leave vLLM's engine dead); vLLM's own ValueError is a 400 with its words; the next update works.
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightUpdateError, match="empty is not a safetensors checkpoint directory"):
        asyncio.run(engine.update_weights(path=tmp_path / "empty"))
    assert engine.weight_version == 2 and not fake.session
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
    fake.update_weights_error = ValueError("Shared-disk checkpoint is not a valid safetensors file")
    with pytest.raises(WeightUpdateError, match="vLLM refused the weight update from .*bad: .*not a valid"):
        asyncio.run(engine.update_weights(path=tmp_path / "bad"))
    fake.update_weights_error = None
    assert engine.weight_version == 2 and not fake.session
    assert asyncio.run(engine.update_weights(path=tmp_path)) == 3
    asyncio.run(engine.update_weight_version("renamed"))
    assert fake.weight_version == "renamed" and engine.control_status()["weight_version"] == "renamed"
    with pytest.raises(WeightUpdateError, match="exactly one"):
        asyncio.run(engine.update_weights())
    asyncio.run(engine.close())


def test_lora_adapter_goes_with_every_generation_one_at_a_time(engine, tmp_path):
    from gymserve.errors import ConflictError, NotFoundError, NotSupportedError

    fake = FakeAsyncLLM.instances[-1]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text('{"r": 4, "peft_type": "LORA"}')
    assert asyncio.run(engine.load_lora_adapter("policy", str(tmp_path / "a"))) == 1
    added = fake.control_calls[-1][1]
    assert (added.lora_name, added.lora_int_id, added.lora_path, added.load_inplace) == (
        "policy",
        1,
        str(tmp_path / "a"),
        False,
    )
    asyncio.run(engine.generate([1], _sp()))
    assert fake.lora_requests[-1] is added
    assert engine.lora_adapters() == [{"name": "policy", "source": str(tmp_path / "a"), "weight_version": 1}]
    with pytest.raises(ConflictError):
        asyncio.run(engine.load_lora_adapter("other", str(tmp_path / "b")))
    # A swap in place under the same name keeps the id and asks vLLM to reload it in place.
    asyncio.run(engine.load_lora_adapter("policy", str(tmp_path / "b"), load_inplace=True))
    assert fake.control_calls[-1][1].lora_int_id == 1 and fake.control_calls[-1][1].load_inplace is True
    # Under another name: a new id, and the old adapter is removed.
    asyncio.run(engine.load_lora_adapter("other", str(tmp_path / "a"), load_inplace=True))
    assert fake.control_calls[-2][1].lora_int_id == 2 and fake.control_calls[-1] == ("remove_lora", 1)
    with pytest.raises(NotFoundError):
        asyncio.run(engine.unload_lora_adapter("policy"))
    assert asyncio.run(engine.unload_lora_adapter("other")) == 4  # the fourth change
    assert fake.control_calls[-1] == ("remove_lora", 2) and engine.lora_adapters() == []
    asyncio.run(engine.generate([1], _sp()))
    assert fake.lora_requests[-1] is None
    with pytest.raises(WeightUpdateError, match="adapter_config.json"):
        asyncio.run(engine.load_lora_adapter("x", str(tmp_path)))
    with pytest.raises(NotSupportedError, match="from a directory"):
        asyncio.run(engine.load_lora_adapter("x", tensors={}, config=object()))


def test_a_vllm_without_the_rl_api_answers_501(monkeypatch, model_dir):
    from gymserve.engine.vllm_engine import VLLMEngine
    from gymserve.errors import NotSupportedError

    class OldAsyncLLM(FakeAsyncLLM):
        start_weight_update = None  # type: ignore[assignment]
        collective_rpc = None  # type: ignore[assignment]

        async def pause_generation(self, wait_for_inflight_requests: bool = False, clear_cache: bool = True):
            self.control_calls.append(("pause_generation", wait_for_inflight_requests))
            self.paused = "wait" if wait_for_inflight_requests else "abort"

    install_fake_vllm(monkeypatch)
    monkeypatch.setattr(sys.modules["vllm.v1.engine.async_llm"], "AsyncLLM", OldAsyncLLM)
    eng = VLLMEngine(model_dir)
    try:
        with pytest.raises(NotSupportedError, match="collective_rpc"):
            asyncio.run(eng.update_weights(path="/x"))
        with pytest.raises(NotSupportedError, match="no keep mode"):
            asyncio.run(eng.pause_generation("keep"))

        async def pause_and_resume():
            await eng.pause_generation("wait", timeout=30)
            await eng.resume_generation()

        asyncio.run(pause_and_resume())
        assert eng.engine.control_calls[-2:] == [("pause_generation", True), ("resume_generation",)]
    finally:
        asyncio.run(eng.close())


def test_serve_policy_around_the_trainers_own_async_llm(fake_vllm, model_dir, tokenizer, tmp_path):
    """A trainer's AsyncLLM behind gymserve's HTTP server (serve_policy): answers carry the
    version, the control routes drive the trainer's engine, and stop() leaves it running."""
    import httpx
    import openai
    import torch
    from safetensors.torch import save_file

    from gymserve.server.embed import serve_policy

    llm = FakeAsyncLLM(
        AsyncEngineArgs(model=str(model_dir), max_model_len=4096, weight_transfer_config={"backend": "disk"})
    )
    srv = serve_policy(llm, tokenizer, backend_config={"tool_call_parser": "none"}, model_name="policy")
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
        root = srv.base_url.removesuffix("/v1")

        def ask():
            done = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
            return done.choices[0].message.model_extra

        first = ask()
        assert first["generation_token_ids"] == [11, 12, 13, 14, 15, EOS] and first["weight_version"] == 0
        assert httpx.post(root + "/pause", params={"mode": "keep"}).status_code == 200 and llm.paused == "keep"
        save_file({"lm_head.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
        r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}, "weight_version": "s1"})
        assert r.status_code == 200, r.text
        assert httpx.post(root + "/resume").status_code == 200 and llm.paused is None
        assert [c[0] for c in llm.control_calls] == [
            "pause_generation",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "resume_generation",
        ]
        assert ask()["weight_version"] == "s1" and llm.weight_version == "s1"
        assert httpx.get(root + "/weight_info").json()["weight_version"] == "s1"
    finally:
        srv.stop()
    assert llm.shut_down is False  # the trainer's engine, left running


def test_top_logprobs_leave_the_sampled_tokens_and_log_probs_unchanged(engine):
    """The adapter reads the sampled token's own entry whatever the alternatives asked for."""
    from helpers.engine_contract import assert_top_logprobs_leave_sampling_unchanged

    assert_top_logprobs_leave_sampling_unchanged(engine, [1, 2, 3], max_tokens=4, top_n=2)


def test_prompt_logprobs_come_from_vllm(engine):
    """vLLM's prompt_logprobs (asked for with SamplingParams.prompt_logprobs) arrive on the first
    delta, mapped onto PromptLogprobs: the prompt token's log-prob and rank, the k best by rank."""
    assert engine.supports_prompt_logprobs
    gen = asyncio.run(engine.generate([5, 6, 7], _sp(prompt_logprobs=1)))
    assert FakeAsyncLLM.instances[-1].calls[-1][1].prompt_logprobs == 1
    plp = gen.prompt_logprobs
    assert plp.log_probs == [None, -0.5, -1.0] and plp.ranks == [None, 2, 2]
    assert plp.top_logprobs == [[], [(9001, -0.1)], [(9002, -0.1)]]
    assert asyncio.run(engine.generate([5, 6, 7], _sp())).prompt_logprobs is None


def test_lora_on_an_engine_started_without_it_is_a_501_naming_the_setting(engine, tmp_path):
    from gymserve.errors import NotSupportedError

    (tmp_path / "adapter_config.json").write_text('{"r": 4, "peft_type": "LORA"}')
    engine.engine.vllm_config.lora_config = None  # vLLM's VllmConfig without enable_lora
    with pytest.raises(NotSupportedError, match="enable_lora: true") as err:
        asyncio.run(engine.load_lora_adapter("policy", str(tmp_path)))
    assert err.value.status_code == 501 and not any(c[0] == "add_lora" for c in engine.engine.control_calls)


def test_a_dead_vllm_engine_core_is_the_engine_fault(engine, tokenizer):
    """vLLM's own death report (``AsyncLLM.errored``, ``dead_error``) is the engine's ``fault``: the
    local backend's /health says down and a new call is a 503 naming vLLM and the cause."""
    from gymserve.backends.local import LocalBackend
    from gymserve.config import LocalBackendConfig
    from gymserve.errors import EngineDownError

    assert engine.fault is None
    engine.engine.errored = True
    engine.engine.dead_error = RuntimeError("EngineCore encountered an issue. See stack trace above.")
    assert engine.fault == "RuntimeError: EngineCore encountered an issue. See stack trace above."
    backend = LocalBackend(LocalBackendConfig(model="policy"), engine, tokenizer)
    health = asyncio.run(backend.health())
    assert health["status"] == "down" and health["engine"] == "vllm"
    assert "RuntimeError: EngineCore encountered an issue" in health["reason"]
    with pytest.raises(EngineDownError, match="the vllm engine is down"):
        backend.check_engine()
