"""vLLM's sampling extras over HTTP on each in-process CPU engine: applied (``min_tokens``,
``ignore_eos``'s engine rule is in ``tests/engine/test_ending.py``, per-request ``stop_token_ids``,
``stop`` strings with exact tokens, ``prompt_logprobs`` on chat, ``request_id``) or refused with a 400
naming the field (structured output, the rest of ``backends.local.vllm_fields.REFUSED``).

The tiny model samples with a fixed per-request seed here (greedy decoding repeats one token), so a
first call gives the tokens every later call starts from; each test then asks for one extra and
checks what it changed.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
from gymserve.server.run import start_background_server

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(local_engine):
    engine, model = local_engine
    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(
            model=str(model), engine=engine, sampling=SamplingConfig(temperature=1.0), context_window=512
        ),
    )
    srv = start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))
    yield srv, engine
    srv.stop()


def _chat(srv, **body):
    r = httpx.post(
        srv.base_url + "/chat/completions",
        json={"model": "t", "messages": MESSAGES, "seed": 7, "max_tokens": 8, **body},
        timeout=120,
    )
    return r


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def base(server):
    """The greedy answer without extras: ``(ids, log_probs, text)``."""
    srv, _ = server
    msg = _ok(_chat(srv))["choices"][0]["message"]
    return msg["generation_token_ids"], msg["generation_log_probs"], msg["content"]


def test_per_request_stop_token_ids_end_the_generation_on_that_token(server, base, tokenizer):
    srv, _ = server
    ids, lps, _ = base
    stop = ids[2]
    k = ids.index(stop)
    choice = _ok(_chat(srv, stop_token_ids=[stop]))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["generation_token_ids"] == ids[: k + 1]  # the stop token is kept
    assert choice["message"]["generation_log_probs"] == pytest.approx(lps[: k + 1], abs=1e-4)
    # (The chat text's parser trims whitespace at a message's edges.)
    assert choice["message"]["content"] == tokenizer.decode(ids[:k]).strip()


def test_min_tokens_keeps_the_stop_set_out_until_reached(server, base):
    srv, _ = server
    ids, _, _ = base
    first = ids[0]
    stopped = _ok(_chat(srv, stop_token_ids=[first]))["choices"][0]["message"]["generation_token_ids"]
    assert stopped == [first]
    held = _ok(_chat(srv, stop_token_ids=[first], min_tokens=4))["choices"][0]["message"]["generation_token_ids"]
    assert len(held) >= 4 and first not in held[:4]


def test_min_tokens_above_max_tokens_is_a_400(server):
    srv, _ = server
    r = _chat(srv, min_tokens=9)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def _stop_string(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string that starts inside the text of one of ``ids`` and ends inside a later one's,
    first found where it starts, and the index of the token whose text completes it."""
    full = tokenizer.decode(ids)
    for a in range(1, len(ids) - 2):
        start = len(tokenizer.decode(ids[:a]))
        end = len(tokenizer.decode(ids[: a + 1]))
        for s0 in (max(start - 1, 0), start):
            for e in (end + 1, end + 2):
                stop = full[s0:e]
                # No edge whitespace: the chat text's parser trims it at the end of a message.
                if len(stop) >= 2 and stop == stop.strip() and full.find(stop) == s0:
                    j = next(j for j in range(len(ids)) if stop in tokenizer.decode(ids[: j + 1]))
                    return stop, j
    pytest.skip("no usable stop string in the tiny model's text")


def test_stop_strings_end_after_the_completing_token_with_exact_tokens(server, base, tokenizer):
    srv, _ = server
    ids, lps, _ = base
    stop, j = _stop_string(tokenizer, ids)
    full = tokenizer.decode(ids)
    choice = _ok(_chat(srv, stop=[stop], logprobs=True))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["generation_token_ids"] == ids[: j + 1]  # whole tokens, the completing one too
    assert choice["message"]["generation_log_probs"] == pytest.approx(lps[: j + 1], abs=1e-4)
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(lps[: j + 1], abs=1e-4)
    assert choice["message"]["content"] == full[: full.find(stop)].strip()
    kept = _ok(_chat(srv, stop=[stop], include_stop_str_in_output=True))["choices"][0]["message"]["content"]
    assert kept == full[: full.find(stop) + len(stop)].strip()


def test_stop_strings_stream_the_same_text_and_tokens(server, base, tokenizer):
    srv, _ = server
    ids, _, _ = base
    stop, j = _stop_string(tokenizer, ids)
    full = tokenizer.decode(ids)
    text, finish, stop_reason, gen = "", None, None, None
    with httpx.stream(
        "POST",
        srv.base_url + "/chat/completions",
        json={"model": "t", "messages": MESSAGES, "seed": 7, "max_tokens": 8, "stop": stop, "stream": True},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
                if choice.get("finish_reason"):
                    stop_reason = choice.get("stop_reason")
                    gen = choice["delta"]["generation_token_ids"]
    assert text.strip() == full[: full.find(stop)].strip()
    assert (finish, stop_reason, gen) == ("stop", stop, ids[: j + 1])


def test_stop_strings_on_completions(server, base, tokenizer):
    srv, _ = server
    ids, _, _ = base
    prompt = _ok(_chat(srv, max_tokens=1))["choices"][0]["message"]["prompt_token_ids"]
    stop, j = _stop_string(tokenizer, ids)
    full = tokenizer.decode(ids)
    r = httpx.post(
        srv.base_url + "/completions",
        json={"model": "t", "prompt": prompt, "seed": 7, "max_tokens": 8, "stop": [stop]},
        timeout=120,
    )
    choice = _ok(r)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["generation_token_ids"] == ids[: j + 1] and choice["text"] == full[: full.find(stop)]


def test_prompt_logprobs_on_chat_score_the_rendered_prompt(server):
    srv, engine = server
    r = _chat(srv, prompt_logprobs=1, max_tokens=2)
    if engine == "llamacpp":  # the engine does not score prompts: the capability's 501
        assert r.status_code == 501 and "prompt log-probs" in r.json()["error"]["message"]
        return
    answer = _ok(r)
    prompt = answer["choices"][0]["message"]["prompt_token_ids"]
    scores = answer["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    comp = _ok(
        httpx.post(
            srv.base_url + "/completions",
            json={"model": "t", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1},
            timeout=120,
        )
    )
    assert scores == comp["choices"][0]["prompt_logprobs"]  # the same teacher-forced scores
    assert all(str(prompt[i]) in scores[i] for i in range(1, len(prompt)))


def test_prompt_logprobs_with_stream_is_refused(server):
    srv, _ = server
    r = _chat(srv, prompt_logprobs=1, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_request_id_names_the_answer_as_vllm_does(server):
    srv, _ = server
    assert _ok(_chat(srv, request_id="abc", max_tokens=1))["id"] == "chatcmpl-abc"


SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "boolean"}},
    "required": ["colour", "n"],
    "additionalProperties": False,
}
STRUCTURED = [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
    ("structured_outputs", {"json": SCHEMA}),
    ("guided_json", SCHEMA),
    ("guided_choice", ["alpha", "beta"]),
    ("guided_regex", "(yes|no)[0-9]{2}"),
    ("structured_outputs", {"choice": ["alpha", "beta"]}),
]


def _structured_applies(engine: str) -> bool:
    if engine != "transformers":
        return False
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(("field", "value"), STRUCTURED, ids=lambda x: str(x)[:20])
def test_structured_output_is_a_token_mask_or_a_400_naming_the_field(server, field, value):
    """On the transformers engine (with llguidance) the text follows the grammar and ends with the
    EOS, a training token with its raw log-prob; on engines without a token mask, a 400."""
    srv, engine = server
    r = _chat(srv, **{field: value}, max_tokens=40)
    if not _structured_applies(engine):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        return
    choice = _ok(r)["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", choice
    if field in ("response_format", "guided_json") or (field == "structured_outputs" and "json" in value):
        data = json.loads(text)
        assert set(data) == {"colour", "n"} and data["colour"] in ("red", "green", "blue")
        assert isinstance(data["n"], bool)
    elif field == "guided_regex":
        assert re.fullmatch("(yes|no)[0-9]{2}", text), text
    else:
        assert text in ("alpha", "beta")
    ids = choice["message"]["generation_token_ids"]
    assert ids[-1] == 151645  # the grammar ends with the EOS, kept as a training token
    assert all(lp < 0 for lp in choice["message"]["generation_log_probs"])  # raw model log-probs


def test_structured_output_refuses_an_unbuildable_grammar_by_name(server):
    srv, engine = server
    r = _chat(srv, guided_regex="(unclosed")
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


@pytest.mark.parametrize(
    "field, value",
    [
        ("guided_grammar", "root ::= 'a'"),
        ("structural_tag", "{}"),
        ("use_beam_search", True),
        ("allowed_token_ids", [1, 2]),
        ("skip_special_tokens", True),
        ("echo", True),
    ],
)
def test_structured_output_and_unapplied_extras_are_400s_naming_the_field(server, field, value):
    srv, _ = server
    r = _chat(srv, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_max_completion_tokens_bounds_the_generation(server):
    srv, _ = server
    r = httpx.post(
        srv.base_url + "/chat/completions",
        json={"model": "t", "messages": MESSAGES, "seed": 7, "max_completion_tokens": 3},
        timeout=120,
    )
    choice = _ok(r)["choices"][0]
    assert len(choice["message"]["generation_token_ids"]) == 3 and choice["finish_reason"] == "length"
