"""The token-exact contract over the vLLM engine on a GPU: log-probs against teacher forcing,
multi-turn contiguity, retokenization-drift survival, streaming, concurrency.

One gymserve server (local backend, ``engine: vllm``) for the module; the teacher-forced reference
is a float32 transformers copy of the same weights on the CPU (so this process never initialises
CUDA and vLLM's engine process owns the GPU). Skipped without vLLM + CUDA (see conftest.py).
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from gymserve.harness.verify import teacher_forced_log_probs


@pytest.fixture(scope="module")
def server(gpu_model_dir, gpu_settings):
    from gymserve.backends.local import LocalBackend
    from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
    from gymserve.server.run import start_background_server

    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(
            model=str(gpu_model_dir),
            engine="vllm",
            max_num_seqs=64,
            sampling=SamplingConfig(temperature=1.0, top_p=1.0),
            engine_args={
                "dtype": gpu_settings["dtype"],
                "max_model_len": 4096,
                "gpu_memory_utilization": gpu_settings["memory"],
            },
        ),
    )
    srv = start_background_server(
        cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend), startup_timeout=900
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def teacher(server, gpu_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gpu_model_dir), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


def _fields(msg) -> dict:
    extra = msg.model_extra if hasattr(msg, "model_extra") else msg
    return {k: extra[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}


def _check(teacher, f: dict, tol: float, what: str) -> float:
    assert len(f["generation_token_ids"]) == len(f["generation_log_probs"]) > 0, what
    tf = teacher_forced_log_probs(teacher, f["prompt_token_ids"], f["generation_token_ids"])
    worst = max(abs(a - b) for a, b in zip(tf, f["generation_log_probs"]))
    print(f"[gpu] {what}: {len(tf)} tokens, max |vllm - teacher forcing| = {worst:.2e}")
    assert worst <= tol, f"{what}: log-prob differs from teacher forcing by {worst} > {tol}"
    return worst


def test_logprobs_match_teacher_forcing(client, teacher, gpu_settings):
    prompts = [
        "Write a haiku about GPUs.",
        "What is 17 * 23? Think step by step.",
        "List three prime numbers.",
        "Explain recursion in one paragraph.",
    ]
    for p in prompts:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": p}], max_tokens=96)
        _check(teacher, _fields(r.choices[0].message), gpu_settings["tol"], f"chat {p[:20]!r}")


def test_multi_turn_is_contiguous_and_exact(client, teacher, gpu_settings):
    inp: list = [{"role": "user", "content": "Name a city in France."}]
    prev = None
    for turn, follow_up in enumerate(["Another one, please.", "And one in Italy?", "Thanks!"]):
        r = client.responses.create(model="m", input=inp, max_output_tokens=48)
        item = r.output[-1]
        f = _fields(item)
        _check(teacher, f, gpu_settings["tol"], f"turn {turn + 1}")
        if prev is not None:
            prefix = prev["prompt_token_ids"] + prev["generation_token_ids"]
            assert f["prompt_token_ids"][: len(prefix)] == prefix, f"turn {turn + 1} is not contiguous"
        prev = f
        inp += [it.model_dump(exclude_none=True) for it in r.output]
        inp.append({"role": "user", "content": follow_up})


def test_drift_survival(client, teacher, gpu_settings, gpu_model_dir):
    """A sampled answer that re-encodes to other IDs still comes back as the sampled IDs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gpu_model_dir))
    msgs: list = [{"role": "user", "content": "用中文写两句关于大海的话。"}]
    drifted = 0
    for attempt in range(4):
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=64)
        m = r.choices[0].message
        f = _fields(m)
        _check(teacher, f, gpu_settings["tol"], f"chinese answer {attempt + 1}")
        drifted += tok.encode(m.content, add_special_tokens=False) != f["generation_token_ids"]
        turn2 = msgs + [{"role": "assistant", "content": m.content, **f}, {"role": "user", "content": "再来一句。"}]
        r2 = client.chat.completions.create(model="m", messages=turn2, max_tokens=16)
        f2 = _fields(r2.choices[0].message)
        prefix = f["prompt_token_ids"] + f["generation_token_ids"]
        assert f2["prompt_token_ids"][: len(prefix)] == prefix
        _check(teacher, f2, gpu_settings["tol"], f"turn 2 after answer {attempt + 1}")
    print(f"[gpu] retokenization drift seen in {drifted}/4 sampled answers (the splice kept the sampled IDs)")


def test_stream_fields_match_teacher_forcing(client, teacher, gpu_settings):
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count to ten."}], max_tokens=64, stream=True
    )
    chunks = list(stream)
    last = [c for c in chunks if c.choices][-1].choices[0].delta
    _check(teacher, _fields(last), gpu_settings["tol"], "stream")


def test_concurrent_requests_are_exact(server, teacher, gpu_settings):
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)

    async def one(i):
        r = await aclient.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Tell me fact number {i} about the moon."}], max_tokens=48
        )
        return _fields(r.choices[0].message)

    async def run():
        return await asyncio.gather(*[one(i) for i in range(32)])

    results = asyncio.run(run())
    worst = max(_check(teacher, f, gpu_settings["tol"], f"concurrent {i}") for i, f in enumerate(results[:8]))
    print(f"[gpu] 32 concurrent requests; worst of the first 8 checked: {worst:.2e}")
