"""Tables of request fields that more than one test module uses: each API's fields sent to the
other API's route, with the words of the hint that names the right field
(``convert.request_checks`` refuses them; the server tests check the same refusals over HTTP)."""

from __future__ import annotations

MSG = [{"role": "user", "content": "hi"}]

# Chat Completions fields sent to /v1/responses: (field, value, the words that name the right field).
CHAT_ON_RESPONSES = [
    ("max_tokens", 4, "use max_output_tokens"),
    ("max_completion_tokens", 4, "use max_output_tokens"),
    ("messages", MSG, "use input"),
    ("n", 2, "one response per request; send n requests"),
    ("logprobs", True, "use top_logprobs"),
    ("response_format", {"type": "json_object"}, "use text.format"),
    ("reasoning_effort", "low", "use reasoning.effort"),
    ("functions", [{"name": "f"}], "use tools"),
    ("function_call", "auto", "use tool_choice"),
    ("verbosity", "low", "use text.verbosity"),
    ("logit_bias", {"1": 5}, "send it to /v1/chat/completions instead"),
    ("modalities", ["text"], "send it to /v1/chat/completions instead"),
]
# Responses API fields sent to /v1/chat/completions.
RESPONSES_ON_CHAT = [
    ("input", "hi", "use messages"),
    ("instructions", "be brief", "put them in a system message at the start of messages"),
    ("max_output_tokens", 4, "use max_completion_tokens (or max_tokens)"),
    ("text", {"format": {"type": "json_object"}}, "use response_format"),
    ("reasoning", {"effort": "low"}, "use reasoning_effort"),
    ("previous_response_id", "resp_1", "send the whole conversation in messages"),
    ("conversation", "conv_1", "send the whole conversation in messages"),
    ("include", ["reasoning.encrypted_content"], "send it to /v1/responses instead"),
    ("truncation", "auto", "send it to /v1/responses instead"),
]
