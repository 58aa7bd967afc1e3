"""RL clients written for vLLM, against a real ``gymserve serve`` (tiny model, 127.0.0.1): each
client's request shape and token-parsing rules, replayed as its repository documents them (none of
these clients installs here without its GPU stack; nothing is copied, each docstring cites where the
rule is read), must give the IDs and log-probs of gymserve's own training fields — the sampled stop
token included — and a 3-turn rollout must stay token-contiguous.

The server runs as a user starts it for these clients: ``gymserve serve MODEL
--return-tokens-as-token-ids`` (ART's vLLM setting), with a fixed seed (every call samples the same
tokens) and, as the tiny model rarely samples its EOS, ``--stop-token-ids`` set to a token it samples
early: the stop rule is the EOS's (``test_sampled_stop_token.py``; the real model's own
``<|im_end|>``: ``test_real_model.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("Tell me a story.", "Name a colour.", "Write a poem about the sea.", "What is 2 + 2?")
TRAINING = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _start(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("GYMSERVE_API_KEY", None)
    argv = [sys.executable, "-m", "gymserve.cli", "serve", str(model_dir), "--port", "0", "--seed", "1234", *flags]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 300
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        match = re.search(r"serving .* on (http://127\.0\.0\.1:\d+/v1)$", line.strip())
        if match:
            return proc, match.group(1)
    proc.kill()
    pytest.fail("gymserve serve did not print its 'serving' line within 300 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """``(base_url, messages, stop_id)``: a ``gymserve serve`` whose ``--stop-token-ids`` holds a
    token the model samples (seeded) early for ``messages``, not as its first token."""
    proc, url = _start(tiny_model_dir)
    try:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        for text in PROMPTS:
            messages = [{"role": "user", "content": text}]
            ids = client.chat.completions.create(model="m", messages=messages, max_tokens=8).choices[0]
            gen = ids.message.model_extra["generation_token_ids"]
            k = next((i for i in range(1, len(gen)) if gen[i] not in gen[:i]), None)
            if k is not None:
                break
        else:
            pytest.fail("the tiny model repeats one token for every prompt")
    finally:
        _stop(proc)
    proc, url = _start(tiny_model_dir, "--return-tokens-as-token-ids", "--stop-token-ids", str(gen[k]))
    yield url, messages, gen[k]
    _stop(proc)


def _own(obj: Any) -> dict[str, Any]:
    """gymserve's own training fields of a message, choice or dict."""
    extra = obj if isinstance(obj, dict) else (obj.model_extra or {})
    return {k: extra[k] for k in TRAINING}


def _agree(parsed_ids, parsed_lps, own: dict[str, Any], finish: str, stop_id: int) -> None:
    """The client's parse equals gymserve's fields; a generation that stopped ends on the stop token."""
    assert parsed_ids == own["generation_token_ids"]
    assert parsed_lps == pytest.approx(own["generation_log_probs"], abs=1e-6)
    if finish == "stop":
        assert parsed_ids[-1] == stop_id


def _contiguous(turns: list[dict[str, Any]]) -> None:
    for prev, nxt in zip(turns, turns[1:]):
        head = prev["prompt_token_ids"] + prev["generation_token_ids"]
        assert nxt["prompt_token_ids"][: len(head)] == head


def _chat_rollout(url: str, messages: list[dict], stop_id: int, ask, parse) -> list[str]:
    """Three chat turns: ``ask(client, messages)`` sends the client's request, ``parse(completion,
    raw)`` returns its ``(prompt_ids, ids, logprobs)``; the assistant message goes back as the SDK
    dumps it (gymserve's fields ride along as extras, so the prefix splice applies). Returns the
    finish reasons."""
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    messages, turns, finishes = list(messages), [], []
    for turn in range(3):
        raw = ask(client, messages)
        done = openai.types.chat.ChatCompletion.model_validate(raw)
        choice = done.choices[0]
        prompt_ids, ids, lps = parse(done, raw)
        own = _own(choice.message)
        assert prompt_ids is None or prompt_ids == own["prompt_token_ids"]
        _agree(ids, lps, own, choice.finish_reason, stop_id)
        turns.append(own)
        finishes.append(choice.finish_reason)
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "user", "content": f"Go on ({turn + 2})."},
        ]
    _contiguous(turns)
    return finishes


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's prompt as token IDs, as a client with its own tokenizer builds it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _post(client: openai.OpenAI, path: str, body: dict) -> dict:
    r = httpx.post(str(client.base_url).rstrip("/") + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_nemo_gym_vllm_model(served):
    """NeMo Gym's ``vllm_model`` server (NVIDIA-NeMo/Gym ``responses_api_models/vllm_model/app.py``,
    nemo-gym 0.7.0) in training mode: a non-streamed chat call adding ``logprobs: true``,
    ``top_logprobs: 0``, ``return_tokens_as_token_ids: true``; it reads the three training fields of
    ``choices[0].message`` when present, else vLLM's top-level ``prompt_token_ids`` +
    ``choices[0].token_ids`` + ``token_id:N`` log-prob tokens. Both readings must agree."""
    url, messages, stop_id = served

    def ask(client, msgs):
        body = {"model": "m", "messages": msgs, "max_tokens": 8, "logprobs": True, "top_logprobs": 0}
        return _post(client, "/chat/completions", {**body, "return_tokens_as_token_ids": True})

    def parse(done, raw):
        content = done.choices[0].logprobs.content
        fallback = [int(e.token.removeprefix("token_id:")) for e in content]
        fields = _own(done.choices[0].message)
        assert fallback == fields["generation_token_ids"]
        return fields["prompt_token_ids"], fields["generation_token_ids"], fields["generation_log_probs"]

    assert "stop" in _chat_rollout(url, messages, stop_id, ask, parse)


def test_verifiers_chat_client(served):
    """verifiers' chat client, as prime-rl configures it for a vLLM server (``logprobs: true``,
    ``extra_body: {"return_tokens_as_token_ids": true}``: prime-rl's orchestrator client config),
    parsed by ``parse_chat_completion_tokens`` / ``parse_chat_completion_logprobs``
    (willccbb/verifiers ``verifiers/utils/processing_utils.py``): IDs are
    ``int(token.split(":")[-1])`` of every ``logprobs.content`` entry, log-probs their ``logprob``;
    its ``return_token_ids`` form reads ``prompt_token_ids`` and ``choices[0].token_ids``."""
    url, messages, stop_id = served

    def ask(client, msgs):
        extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
        return client.chat.completions.create(
            model="m", messages=msgs, max_tokens=8, logprobs=True, extra_body=extra
        ).model_dump()

    def parse(done, raw):
        content = done.choices[0].logprobs.content
        ids = [int(e.token.split(":")[-1]) for e in content]
        assert ids == raw["choices"][0]["token_ids"]
        return raw["prompt_token_ids"], ids, [e.logprob for e in content]

    assert "stop" in _chat_rollout(url, messages, stop_id, ask, parse)


def test_art(served):
    """ART (OpenPipe/ART ``src/art/preprocessing/tokenize.py``): the current reader
    (``tokenize_vllm_trajectory_histories`` with ``vllm_tokens.choice_vllm_token_metadata``, main at
    03fd13dc) takes the response's top-level ``prompt_token_ids`` and ``choices[0].token_ids`` and
    requires exactly one ``logprobs.content`` entry per token; older releases read each token as
    ``int(token.split(":")[1])`` from ``logprobs.content``, which needs vLLM's server-wide
    ``--return-tokens-as-token-ids`` (an ``IndexError`` otherwise) — the flag this server runs with;
    the request does not send it. A history is one sequence while each prompt starts with the tokens
    so far (else ART splits it)."""
    url, messages, stop_id = served

    def ask(client, msgs):
        return client.chat.completions.create(
            model="m", messages=msgs, max_tokens=8, logprobs=True, extra_body={"return_token_ids": True}
        ).model_dump()

    def parse(done, raw):
        content = done.choices[0].logprobs.content
        ids = raw["choices"][0]["token_ids"]
        assert len(content) == len(ids)
        assert [int(e.token.split(":")[1]) for e in content] == ids  # the older releases' reading
        return raw["prompt_token_ids"], ids, [e.logprob for e in content]

    assert "stop" in _chat_rollout(url, messages, stop_id, ask, parse)
    # The server flag is a default: a request's own return_tokens_as_token_ids: false wins (vLLM's rule).
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    plain = client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, logprobs=True, extra_body={"return_tokens_as_token_ids": False}
    )
    assert not any(e.token.startswith("token_id:") for e in plain.choices[0].logprobs.content)


def test_art_streamed_chat_in_vllm_places(served):
    """A streamed call with ``return_token_ids`` (vLLM's ``chat_completion_stream_generator``): the
    first chunk carries the top-level ``prompt_token_ids``, every later chunk its step's
    ``choices[0].token_ids``; joined, they are the generation gymserve reports, stop token included."""
    url, messages, stop_id = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    chunks = [
        c.model_dump()
        for c in client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=8,
            logprobs=True,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    ]
    assert "prompt_token_ids" in chunks[0]
    ids = [t for c in chunks[1:] if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    lps = [
        e["logprob"]
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    final = next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    own = final["delta"]
    assert chunks[0]["prompt_token_ids"] == own["prompt_token_ids"]
    _agree(ids, lps, own, final["finish_reason"], stop_id)


def test_rllm_openai_engine_completion(served, tokenizer):
    """rLLM's ``OpenAIEngine.completion`` (rllm-org/rllm ``rllm/engine/rollout/openai_engine.py`` at
    0f4ccf9a): ``/v1/completions`` with the prompt as token IDs; IDs from ``choices[0].token_ids``
    (vLLM's ``return_token_ids``; without them it re-tokenizes the text, which drops the stop token
    on vLLM too), log-probs from ``choices[0].logprobs.token_logprobs``. rLLM builds each turn's
    prompt itself: the previous prompt + the IDs it parsed + the next user turn."""
    url, messages, stop_id = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    prompt = _template_ids(tokenizer, messages)
    turns, finishes = [], []
    for turn in range(3):
        done = client.completions.create(
            model="m", prompt=prompt, max_tokens=8, logprobs=0, extra_body={"return_token_ids": True}
        )
        choice = done.choices[0]
        extra = choice.model_extra
        ids, lps = extra["token_ids"], choice.logprobs.token_logprobs
        _agree(ids, lps, _own(extra), choice.finish_reason, stop_id)
        assert done.usage.completion_tokens == len(ids) and extra["prompt_token_ids"] == prompt
        turns.append(_own(extra))
        finishes.append(choice.finish_reason)
        user = f"<|im_end|>\n<|im_start|>user\nGo on ({turn + 2}).<|im_end|>\n<|im_start|>assistant\n"
        prompt = prompt + ids + tokenizer.encode(user, add_special_tokens=False)
    _contiguous(turns)
    assert "stop" in finishes


def test_skyrl_remote_inference_engine(served, tokenizer):
    """SkyRL's ``RemoteInferenceEngine.generate`` with a vLLM backend (NovaSky-AI/SkyRL
    ``skyrl-train/skyrl_train/inference_engines/remote_inference_engine.py`` at 01dc9de5): one
    ``/v1/completions`` call whose ``prompt`` is a batch of token-ID lists, choice ``i`` answering
    prompt ``i``; that version re-encodes each choice's ``text`` (its TODO: vLLM returned no IDs over
    HTTP then), which — on vLLM as here — leaves the stop token out. With ``return_token_ids``, as the
    TODO plans, ``choices[i].token_ids`` are the generation, stop token included."""
    url, messages, stop_id = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    first = _template_ids(tokenizer, messages)
    second = _template_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    raw = _post(
        client, "/completions", {"model": "m", "prompt": [first, second], "max_tokens": 8, "return_token_ids": True}
    )
    assert [c["index"] for c in raw["choices"]] == [0, 1]
    for choice, prompt in zip(raw["choices"], (first, second)):
        own = _own(choice)
        assert own["prompt_token_ids"] == prompt and choice["token_ids"] == own["generation_token_ids"]
        text_ids = tokenizer.encode(choice["text"], add_special_tokens=False)
        if choice["finish_reason"] == "stop":
            assert choice["token_ids"][-1] == stop_id
            assert tokenizer.decode(text_ids) == tokenizer.decode(own["generation_token_ids"][:-1])
