"""Tool-call formats both ways through real servers and the official SDK: what a family's model
writes is parsed, and the history goes back in the form the family accepts (Mistral's 9-character
ids in its template and in requests to a Mistral-format upstream)."""

from __future__ import annotations

import openai
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, SamplingConfig, validate_config
from gymserve.parsers import get_tool_call_parser
from gymserve.server.run import start_background_server
from helpers import synthetic_tokenizer as syn
from helpers import templates
from helpers.fakes import ChatScript, FakeServer, ScriptedEngine, completion

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Lyon?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0123456789abcdef", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "18 C"},
]


@pytest.fixture(scope="module")
def mistral_tokenizer():
    return syn.synthetic_tokenizer(syn.MISTRAL, templates.MISTRAL_LIKE, bos_token="<s>", eos_token="</s>")


def test_local_mistral_history_ids_fit_the_template_and_new_ids_are_mistrals(mistral_tokenizer):
    tok = mistral_tokenizer
    engine = ScriptedEngine(tok, '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}', eos_tokens=("</s>",))
    config = LocalBackendConfig(model="scripted", tool_parser="mistral", sampling=SamplingConfig(temperature=0.0))
    cfg = validate_config({"server": {"port": 0}, "backend": config.model_dump()})
    with start_background_server(cfg, backend_factory=lambda: LocalBackend(config, engine, tok)) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=30)
        # The family's template refuses ids that are not 9 characters; the history's are mapped.
        out = client.chat.completions.create(model="m", messages=HISTORY, tools=TOOLS)
    call = out.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Lyon"}')
    assert len(call.id) == 9 and call.id.isalnum()
    prompt = tok.decode(out.model_dump()["choices"][0]["message"]["prompt_token_ids"], skip_special_tokens=False)
    mapped = get_tool_call_parser("mistral").history_call_id("call_0123456789abcdef")
    assert prompt.count(f'"{mapped}"') == 2  # the call and the tool result agree


def test_chat_backend_sends_mistral_format_history_and_parses_its_raw_text():
    raw = '[TOOL_CALLS]get_weather{"city": "Lyon"}'
    script = ChatScript(default=lambda r: (200, completion(raw)))
    with FakeServer(script) as upstream:
        cfg = validate_config(
            {
                "server": {"port": 0},
                "backend": {"type": "chat", "base_urls": [upstream.url + "/v1"], "tool_parser": "mistral"},
            }
        )
        with start_background_server(cfg) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=30)
            out = client.chat.completions.create(model="m", messages=HISTORY, tools=TOOLS)
        sent = upstream.chat_requests()[-1].body
    ids = [sent["messages"][1]["tool_calls"][0]["id"], sent["messages"][2]["tool_call_id"]]
    assert ids[0] == ids[1] and len(ids[0]) == 9 and ids[0].isalnum()
    assert sent["skip_special_tokens"] is False  # [TOOL_CALLS] must reach the raw text
    call = out.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments, len(call.id)) == ("get_weather", '{"city": "Lyon"}', 9)
