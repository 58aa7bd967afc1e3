"""The vllm engine in process (``engine: vllm``, vLLM's ``AsyncLLM``) on a real vLLM.

One gymserve server (local backend) over one ``AsyncLLM`` for the module, float32 so log-probs can
be held to teacher forcing tightly; answers are short (a CPU decodes a few tokens a second under
load). What is checked: exact token IDs with the sampled EOS, log-probs against teacher forcing
(chat, streamed, prompt log-probs), three turns contiguous across a tool call, every pause mode,
per-token versions on a non-streamed call a ``keep`` pause carried across a version change, and a
weight update from a checkpoint directory (vLLM's ``reload_weights``) that changes the answers and
the version, then back.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from helpers.real_vllm import fields

EOS = 151645  # <|im_end|>, Qwen2.5's end of turn
COUNT = "Count from 1 to 100, one number per line, nothing else."  # no early end of turn


@pytest.fixture(scope="module")
def server(model_dir):
    from gymserve.backends.local import LocalBackend
    from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
    from gymserve.server.run import start_background_server

    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(
            model=str(model_dir),
            engine="vllm",
            max_num_seqs=8,
            sampling=SamplingConfig(temperature=1.0, top_p=1.0),
            engine_args={"dtype": "float32", "max_model_len": 2048, "enforce_eager": True},
        ),
    )
    t0 = time.perf_counter()
    srv = start_background_server(
        cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend), startup_timeout=900
    )
    print(f"[vllm] in-process engine up in {time.perf_counter() - t0:.0f} s")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def root(server):
    return server.base_url.removesuffix("/v1")


def chat(client, content: str, max_tokens: int, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, **kw
    )


def test_tokens_end_with_the_sampled_eos_and_match_teacher_forcing(client, check):
    r = chat(client, "Reply with the single word: yes", 24, temperature=0)
    msg = r.choices[0].message
    f = fields(msg)
    assert r.choices[0].finish_reason == "stop"
    assert f["generation_token_ids"][-1] == EOS, f["generation_token_ids"]
    check(f["prompt_token_ids"], f["generation_token_ids"], f["generation_log_probs"], "greedy chat")
    r2 = chat(client, "Name a colour.", 12, temperature=1.0, seed=7)
    f2 = fields(r2.choices[0].message)
    check(f2["prompt_token_ids"], f2["generation_token_ids"], f2["generation_log_probs"], "sampled chat")


def test_stream_fields_match_teacher_forcing(client, check):
    chunks = list(chat(client, "Count: 1, 2,", 10, stream=True, temperature=0))
    last = [c for c in chunks if c.choices][-1].choices[0].delta
    f = fields(last)
    check(f["prompt_token_ids"], f["generation_token_ids"], f["generation_log_probs"], "stream")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text  # the text streamed with the tokens


def test_prompt_logprobs_come_from_vllm_and_match_teacher_forcing(root, teacher, tol):
    from gymserve.harness.verify import teacher_forced_log_probs

    prompt = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198]  # <|im_start|>user\nHello, world!<|im_end|>\n
    r = httpx.post(
        root + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    got = [plp[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))]
    want = teacher_forced_log_probs(teacher, prompt[:1], prompt[1:])
    worst = max(abs(a - b) for a, b in zip(got, want))
    print(f"[vllm] prompt log-probs: {len(got)} tokens, max |vllm - teacher forcing| = {worst:.2e}")
    assert worst <= tol
    assert all(len(plp[i]) >= 2 for i in range(1, len(prompt)))  # the prompt token and its top 2


def test_three_turns_across_a_tool_call_are_contiguous(client, check):
    tools = [
        {
            "type": "function",
            "name": "get_time",
            "description": "The current time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    inp: list = [{"role": "user", "content": "What time is it in Paris? Use the tool."}]
    prev = None
    for turn in range(3):
        r = client.responses.create(model="m", input=inp, tools=tools, max_output_tokens=40, temperature=0)
        f = fields(r.output[-1])
        check(f["prompt_token_ids"], f["generation_token_ids"], f["generation_log_probs"], f"turn {turn + 1}")
        if prev is not None:
            prefix = prev["prompt_token_ids"] + prev["generation_token_ids"]
            assert f["prompt_token_ids"][: len(prefix)] == prefix, f"turn {turn + 1} is not contiguous"
        prev = f
        inp += [it.model_dump(exclude_none=True) for it in r.output]
        calls = [it for it in r.output if it.type == "function_call"]
        if calls:
            inp.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"time": "10:04"}'})
        else:
            inp.append({"role": "user", "content": "And in Rome?"})


def _in_background(fn):
    """Run ``fn()`` in a thread; returns ``(thread, box)`` where ``box`` gets its result or error."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _a_few_tokens_in(client) -> float:
    """Seconds after which a call of ``COUNT`` has a few tokens out, far from 64: measured on a
    streamed call of the same prompt (its prefix then cached, as the next call's will be), since
    the CPU's speed depends on what else runs."""
    t0 = time.perf_counter()
    stamps = [time.perf_counter() - t0 for c in chat(client, COUNT, 6, stream=True, temperature=0) if c.choices]
    return stamps[-1] * 1.2


def test_keep_pause_across_a_version_change_gives_a_non_streamed_call_its_spans(client, root):
    """The non-streamed call that a keep pause carried over a version change names both versions:
    tokens before the pause the old one, after it the new one (vLLM's DELTA outputs, per token)."""
    before = httpx.get(root + "/weight_info", timeout=30).json()["weight_version"]
    wait = _a_few_tokens_in(client)
    t, box = _in_background(lambda: chat(client, COUNT, 64, temperature=0))
    time.sleep(wait)
    assert httpx.post(root + "/pause", params={"mode": "keep"}, timeout=60).status_code == 200
    assert t.is_alive(), "the call ended before the pause"
    r = httpx.post(root + "/update_weight_version", json={"new_version": "keep-test"}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(root + "/resume", timeout=60).status_code == 200
    t.join(600)
    assert "error" not in box, box.get("error")
    msg = box["result"].choices[0].message.model_extra
    spans = msg["weight_version_spans"]
    n = len(msg["generation_token_ids"])
    print(f"[vllm] non-streamed call across a keep pause: spans {spans}")
    assert [s["version"] for s in spans] == [before, "keep-test"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
    assert msg["weight_version"] == before  # the version that sampled the first token


def test_abort_pause_ends_a_call_in_flight_with_its_tokens(client, root):
    wait = _a_few_tokens_in(client)
    t, box = _in_background(lambda: chat(client, COUNT, 64, temperature=0))
    time.sleep(wait)
    r = httpx.post(root + "/pause", params={"mode": "abort"}, timeout=60)
    assert r.status_code == 200, r.text
    t.join(300)
    httpx.post(root + "/resume", timeout=60)
    assert "error" not in box, box.get("error")
    choice = box["result"].choices[0]
    assert choice.finish_reason == "abort"
    f = fields(choice.message)
    assert 0 < len(f["generation_token_ids"]) < 64 and len(f["generation_log_probs"]) == len(f["generation_token_ids"])


def test_wait_pause_lets_the_call_in_flight_finish(client, root):
    t, box = _in_background(lambda: chat(client, "Say hello.", 8, temperature=0))
    time.sleep(3)
    r = httpx.post(root + "/pause", params={"mode": "wait"}, timeout=600)
    assert r.status_code == 200, r.text
    assert httpx.get(root + "/is_paused", timeout=30).json()["is_paused"] is True
    t.join(300)
    httpx.post(root + "/resume", timeout=60)
    assert "error" not in box, box.get("error")
    assert box["result"].choices[0].finish_reason in ("stop", "length")


def test_update_weights_from_a_checkpoint_directory_changes_answers_and_version(client, root, model_dir, perturbed_dir):
    """POST /update_weights {"update_info": {"path": DIR}} on vLLM 0.32 (no disk weight transfer):
    vLLM's reload_weights swaps the checkpoint in; the answers change, the version is the one named;
    reloading the original gives the first answer back exactly."""

    def greedy():
        f = fields(chat(client, "What is 2 + 2?", 8, temperature=0).choices[0].message)
        return f["generation_token_ids"], f["generation_log_probs"]

    ids0, lps0 = greedy()
    r = httpx.post(
        root + "/update_weights",
        json={"update_info": {"path": str(perturbed_dir)}, "weight_version": "p1"},
        timeout=900,
    )
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "p1"
    print(f"[vllm] reload of the perturbed checkpoint: {r.json().get('seconds')} s")
    assert httpx.get(root + "/weight_info", timeout=30).json()["weight_version"] == "p1"
    ids1, lps1 = greedy()
    n = min(len(lps0), len(lps1))
    assert ids1 != ids0 or max(abs(a - b) for a, b in zip(lps0[:n], lps1[:n])) > 0.01, "the answers did not change"
    r = httpx.post(
        root + "/update_weights", json={"update_info": {"path": str(model_dir)}, "weight_version": "orig"}, timeout=900
    )
    assert r.status_code == 200, r.text
    ids2, lps2 = greedy()
    assert ids2 == ids0
    assert max(abs(a - b) for a, b in zip(lps0, lps2)) < 1e-4


def test_update_weights_from_a_missing_directory_is_a_400(root):
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": "/nonexistent/ckpt"}}, timeout=60)
    assert r.status_code == 400, r.text
    assert "/nonexistent/ckpt" in r.json()["error"]["message"]
