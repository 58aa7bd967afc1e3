"""Pure conversions between the Responses API and Chat Completions (no I/O).

- ``responses_to_chat(request, options)``: Responses create request → Chat Completions request.
- ``chat_to_response(completion, request)``: ChatCompletion → Response.
- ``ResponseStreamBuilder``: chat-completion chunks → Responses streaming events.
- ``context_exceeded_response`` / ``context_exceeded_chat_completion``: the clean, empty,
  length-terminated answers for a context-window overflow (case CL-01); ``aborted_chat_completion``:
  the empty answer of a call an abort pause ended before anything came back.

Training fields (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``) are
carried both ways: chat assistant message ⇄ last output item of a model call.
"""

from gymserve.convert.chat_to_responses import (
    aborted_chat_completion,
    chat_to_response,
    context_exceeded_chat_completion,
    context_exceeded_response,
)
from gymserve.convert.chunks import ChunkAccumulator
from gymserve.convert.options import ConvertOptions
from gymserve.convert.responses_to_chat import responses_to_chat
from gymserve.convert.stream import ResponseStreamBuilder
from gymserve.wire.think import split_think

__all__ = [
    "ChunkAccumulator",
    "ConvertOptions",
    "ResponseStreamBuilder",
    "aborted_chat_completion",
    "chat_to_response",
    "context_exceeded_chat_completion",
    "context_exceeded_response",
    "responses_to_chat",
    "split_think",
]
