"""Tokens in, tokens out over HTTP: vLLM's ``POST /inference/v1/generate`` and SGLang's
``POST /generate`` on a real server (tiny model, 127.0.0.1), each fed and read the way an RL client
that uses it does, and a 501 on a backend without an engine.

The request and parse shapes replayed here (no client code is copied):

- verifiers' training client goes through the renderers library's ``generate``
  (``renderers/client.py`` in PrimeIntellect-ai's renderers): it POSTs ``{"model", "token_ids",
  "sampling_params"}`` to ``{root}/inference/v1/generate`` with ``sampling_params.logprobs`` 1 (or
  ``k + 2`` with ``flat_logprobs`` and ``extra_args.prl_compact_logprobs`` for a top-k head),
  ``stop_token_ids`` and ``skip_special_tokens: false``; it reads ``choices[0].token_ids`` and
  requires ``logprobs.content[i].token == "token_id:<id i>"`` with a finite log-prob that is not
  vLLM's -9999 sentinel, and at least ``k + 2`` ``top_logprobs`` for a head.
- slime's ``generate`` (``slime/rollout/sglang_rollout.py`` in THUDM/slime) POSTs ``{"input_ids",
  "sampling_params": {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids",
  "skip_special_tokens", "no_stop_trim": true, "spaces_between_special_tokens": false},
  "return_logprob": true}`` to ``/generate`` and reads ``meta_info.output_token_logprobs`` as
  ``[logprob, token_id, ...]``, ``text`` and ``meta_info.finish_reason.type``.

Both must give the tokens and log-probs the chat route gives for the same prompt and seed, the stop
token that ended the generation included.
"""

from __future__ import annotations

import math

import httpx
import pytest

SEED = 11


@pytest.fixture(scope="module")
def root(tiny_local_server) -> str:
    return tiny_local_server.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def chat(tiny_local_server):
    """The chat route's answer for one prompt and seed: ``(prompt_ids, ids, log_probs)``."""
    body = {
        "model": "t",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "seed": SEED,
        "max_tokens": 8,
    }
    msg = httpx.post(tiny_local_server.base_url + "/chat/completions", json=body, timeout=120).json()
    msg = msg["choices"][0]["message"]
    return msg["prompt_token_ids"], msg["generation_token_ids"], msg["generation_log_probs"]


def _post(root: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(root + path, json=body, timeout=120)


def _renderers_parse(answer: dict, head: int | None) -> tuple[list[int], list[float]]:
    """What the renderers client checks of a native-JSON answer (its documented rules)."""
    choice = answer["choices"][0]
    ids = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert len(content) == len(ids)
    lps = []
    for tid, entry in zip(ids, content):
        assert entry["token"] == f"token_id:{tid}"
        assert math.isfinite(entry["logprob"]) and entry["logprob"] != -9999.0
        if head is not None:
            assert len(entry["top_logprobs"]) >= head + 2
            assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
        lps.append(entry["logprob"])
    return ids, lps


def test_vllm_generate_as_the_renderers_client_calls_it(root, chat):
    prompt, ids, lps = chat
    stop = ids[3]
    k = ids.index(stop)
    body = {
        "model": "t",
        "token_ids": prompt,
        "sampling_params": {
            "max_tokens": 8,
            "seed": SEED,
            "stop_token_ids": [stop],
            "logprobs": 1,
            "skip_special_tokens": False,
        },
    }
    r = _post(root, "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    got_ids, got_lps = _renderers_parse(answer, None)
    assert got_ids == ids[: k + 1]  # the stop token that ended it, with its log-prob
    assert got_lps == pytest.approx(lps[: k + 1], abs=1e-4)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": k + 1,
        "total_tokens": len(prompt) + k + 1,
    }


def test_vllm_generate_with_a_top_k_head(root, chat):
    prompt, ids, lps = chat
    head = 2
    sp = {
        "max_tokens": 8,
        "seed": SEED,
        "logprobs": head + 2,
        "flat_logprobs": True,
        "extra_args": {"prl_compact_logprobs": True},
        "detokenize": False,
        "skip_special_tokens": False,
    }
    answer = _post(root, "/inference/v1/generate", {"model": "t", "token_ids": prompt, "sampling_params": sp}).json()
    got_ids, got_lps = _renderers_parse(answer, head)
    assert got_ids == ids and got_lps == pytest.approx(lps, abs=1e-4)
    first = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert first[0]["token"] == f"token_id:{ids[0]}"  # vLLM's order: the sampled token first
    assert sorted(e["logprob"] for e in first[1:]) == [e["logprob"] for e in first[1:]][::-1]


def test_vllm_generate_continues_a_rollout_from_its_own_tokens(root, chat):
    prompt, ids, _ = chat
    turn2 = prompt + ids + [198]
    answer = _post(root, "/inference/v1/generate", {"token_ids": turn2, "sampling_params": {"max_tokens": 3}}).json()
    assert answer["usage"]["prompt_tokens"] == len(turn2) and len(answer["choices"][0]["token_ids"]) == 3


def test_sglang_generate_as_slime_calls_it(root, chat):
    prompt, ids, lps = chat
    stop = ids[2]
    k = ids.index(stop)
    payload = {
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 8,
            "stop": None,
            "stop_token_ids": [stop],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "sampling_seed": SEED,
        },
        "return_logprob": True,
        "input_ids": prompt,
    }
    r = _post(root, "/generate", payload)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]]
    log_probs = [item[0] for item in meta["output_token_logprobs"]]
    assert tokens == ids[: k + 1] and out["output_ids"] == tokens
    assert log_probs == pytest.approx(lps[: k + 1], abs=1e-4)
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert meta["completion_tokens"] == k + 1 and meta["prompt_tokens"] == len(prompt)
    assert meta["weight_version"] == "0"
    assert isinstance(out["text"], str)


def test_sglang_length_finish_and_top_logprobs(root, chat):
    prompt, ids, lps = chat
    payload = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 4, "sampling_seed": SEED},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = _post(root, "/generate", payload).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert [t[1] for t in meta["output_token_logprobs"]] == ids[:4]
    assert all(isinstance(t[2], str) for t in meta["output_token_logprobs"])
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"logit_bias": {"1": 3}}}, "sampling_params.logit_bias"),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ("/inference/v1/generate", {"token_ids": [1, 2], "stream": True}, "stream"),
        ("/inference/v1/generate", {"token_ids": [1, 10**9]}, "token_ids[1]"),
        ("/inference/v1/generate", {"sampling_params": {}}, "token_ids"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "sampling_params.min_new_tokens"),
        ("/generate", {"input_ids": [1, 2], "lora_path": "x"}, "lora_path"),
    ],
)  # fmt: skip
def test_unapplied_fields_are_400s_naming_them(root, path, body, param):
    r = _post(root, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_backend_without_an_engine_answers_501(tiny_gateway):
    root = tiny_gateway.base_url.removesuffix("/v1")
    for path, body in (("/inference/v1/generate", {"token_ids": [1, 2]}), ("/generate", {"input_ids": [1, 2]})):
        r = _post(root, path, body)
        assert r.status_code == 501, r.text
        assert r.json()["error"]["code"] == "route_not_supported"
