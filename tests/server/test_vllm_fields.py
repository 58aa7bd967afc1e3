"""Every field of vLLM's chat and completions requests is applied by the local backend or refused with
a 400 naming it — never accepted and dropped (issue #29, item 5).

``tests/data/vllm_request_fields.json`` lists vLLM's field names (with the ``guided_*`` names of
earlier releases). Each one is classified here: ``APPLIED`` names the test that shows its effect (the
test must exist and mention the field); ``REFUSED`` fields are sent to the tiny model's server with a
value that asks for something, and must come back as a 400 whose ``param`` is the field; ``NO_EFFECT``
lists the few that vLLM itself leaves without effect on a single engine, with the reason. A field
vLLM adds later fails ``test_every_vllm_field_is_classified`` until someone decides.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from gymserve.backends.local.vllm_fields import CHAT_ONLY_REFUSED, REFUSED

ROOT = Path(__file__).resolve().parents[2]
FIELDS = json.loads((ROOT / "tests" / "data" / "vllm_request_fields.json").read_text())
CHAT = set(FIELDS["ChatCompletionRequest"]) | set(FIELDS["legacy_fields"])
COMPLETIONS = set(FIELDS["CompletionRequest"]) | set(FIELDS["legacy_fields"])

X = "tests/server/test_vllm_extras.py"
L = "tests/server/test_server_local.py"
C = "tests/backends/test_local_completions.py"
APPLIED: dict[str, str] = {
    # field: a test file (or file::test) whose assertions show its effect
    "messages": L,
    "model": L,
    "prompt": C,
    "logprobs": L,
    "top_logprobs": L,
    "max_tokens": L,
    "max_completion_tokens": f"{X}::test_max_completion_tokens_bounds_the_generation",
    "n": L,
    "seed": L,
    "stream": L,
    "stream_options": "tests/backends/test_local_choices.py",
    "temperature": L,
    "top_p": L,
    "top_k": L,
    "min_p": L,
    "tools": L,
    "tool_choice": "tests/server/test_server_messages.py",
    "reasoning_effort": "tests/backends/test_harmony_backends.py",
    "stop": f"{X}::test_stop_strings_end_after_the_completing_token_with_exact_tokens",
    "stop_token_ids": f"{X}::test_per_request_stop_token_ids_end_the_generation_on_that_token",
    "include_stop_str_in_output": f"{X}::test_stop_strings_end_after_the_completing_token_with_exact_tokens",
    "min_tokens": f"{X}::test_min_tokens_keeps_the_stop_set_out_until_reached",
    "ignore_eos": "tests/engine/test_ending.py::test_engines_end_on_eos_keep_it_and_ignore_eos_runs_past_it",
    "prompt_logprobs": f"{X}::test_prompt_logprobs_on_chat_score_the_rendered_prompt",
    "request_id": f"{X}::test_request_id_names_the_answer_as_vllm_does",
    "echo": C,  # completions; refused on chat (CHAT_ONLY_REFUSED)
    "add_generation_prompt": "tests/server/test_tokens.py",
    "continue_final_message": "tests/server/test_tokens.py",
    "add_special_tokens": L,
    "chat_template_kwargs": "tests/prompting/test_template.py",
    "return_tokens_as_token_ids": L,
    "return_token_ids": L,
    "skip_special_tokens": f"{X}::test_structured_output_and_unapplied_extras_are_400s_naming_the_field",
    "response_format": f"{X}::test_structured_output_is_a_token_mask_or_a_400_naming_the_field",
    "structured_outputs": f"{X}::test_structured_output_is_a_token_mask_or_a_400_naming_the_field",
    "guided_json": f"{X}::test_structured_output_is_a_token_mask_or_a_400_naming_the_field",
    "guided_regex": f"{X}::test_structured_output_is_a_token_mask_or_a_400_naming_the_field",
    "guided_choice": f"{X}::test_structured_output_is_a_token_mask_or_a_400_naming_the_field",
    "guided_json_object": "tests/backends/test_structured.py",
}
NO_EFFECT: dict[str, str] = {
    "user": "vLLM ignores it too (its protocol: 'NOTE this will be ignored by vLLM')",
    "session_id": "a routing key: one engine has nothing to route (the Ray backend routes on X-Session-ID)",
    "return_mm_kwargs": "vLLM ignores it on generation routes (render routes only)",
    "parallel_tool_calls": "the OpenAI API's field: the generic request checks' (not a vLLM extra)",
}
# Refused by the local backend's own checks (request.check_supported, the completions checks).
OTHER_REFUSED: dict[str, object] = {
    "frequency_penalty": 1.0,
    "presence_penalty": 1.0,
    "logit_bias": {"1": 5},
    "suffix": "tail",
}
SAMPLES: dict[str, object] = {
    "use_beam_search": True,
    "length_penalty": 2.0,
    "repetition_penalty": 1.3,
    "watermarking": True,
    "truncate_prompt_tokens": 4,
    "truncation_side": "left",
    "logprob_token_ids": [1, 2],
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "spaces_between_special_tokens": False,
    "documents": [{"title": "a", "text": "b"}],
    "chat_template": "{{ messages }}",
    "priority": 1,
    "return_token_offsets": True,
    "return_prompt_text": True,
    "routed_experts_prompt_start": 2,
    "cache_salt": "salt",
    "stream_interval": 4,
    "thinking_token_budget": 10,
    "include_reasoning": False,
    "echo": True,
    "guided_json_object": True,
}


def _refused(fields: set[str], chat: bool) -> list[tuple[str, object]]:
    table = {**REFUSED, **(CHAT_ONLY_REFUSED if chat else {})}
    out = [(f, SAMPLES.get(f, {"any": "value"})) for f in sorted(fields) if f in table]
    out += [(f, v) for f, v in OTHER_REFUSED.items() if f in fields and not (chat and f == "suffix")]
    if not chat:  # /v1/completions has no response_format (structured output is chat's, or structured_outputs)
        out.append(("response_format", {"type": "json_object"}))
    return out


def test_every_vllm_field_is_classified():
    for route, fields, chat in (("chat", CHAT, True), ("completions", COMPLETIONS, False)):
        refused = {f for f, _ in _refused(fields, chat)}
        unclassified = sorted(f for f in fields if f not in APPLIED and f not in NO_EFFECT and f not in refused)
        assert not unclassified, f"vLLM {route} fields neither applied nor refused: {unclassified}"


@pytest.mark.parametrize("field", sorted(APPLIED))
def test_each_applied_field_has_a_test_that_uses_it(field):
    where = APPLIED[field]
    path, _, name = where.partition("::")
    text = (ROOT / path).read_text()
    assert field in text, f"{path} never mentions {field}"
    if name:
        assert re.search(rf"def {name}\(", text), f"{path} has no test {name}"


@pytest.mark.parametrize(("field", "value"), _refused(CHAT, True), ids=lambda x: str(x)[:24])
def test_each_refused_chat_field_is_a_400_naming_it(tiny_local_server, field, value):
    body = {"model": "t", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, field: value}
    r = httpx.post(tiny_local_server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(("field", "value"), _refused(COMPLETIONS, False), ids=lambda x: str(x)[:24])
def test_each_refused_completions_field_is_a_400_naming_it(tiny_local_server, field, value):
    body = {"model": "t", "prompt": "a", "max_tokens": 2, field: value}
    r = httpx.post(tiny_local_server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
