"""``StreamEnd``: whether an upstream event stream reached its API's terminal event.

An upstream that closes its stream cleanly before the end of the answer (a crashed or restarted
vLLM worker behind a proxy does) looks like a finished stream to the openai and anthropic SDKs,
which stop at the end of the body and at ``data: [DONE]`` alike. The remote backends' caller
(``caller.UpstreamCaller.events``) and the Ray backend feed every event to a ``StreamEnd`` and
raise ``UpstreamStreamIncompleteError`` (502, code ``stream_incomplete``) when the stream ended
without the terminal event, so a cut-off answer never reaches a client as a finished one.
"""

from __future__ import annotations

from typing import Any

_TERMINAL = {
    # OpenAI Responses streaming: a response ends with one of these (or an ``error`` event).
    "responses": frozenset({"response.completed", "response.incomplete", "response.failed", "error"}),
    # Anthropic "Streaming Messages": ``message_stop`` ends a message; an ``error`` event ends a failed one.
    "messages": frozenset({"message_stop", "error"}),
}


class StreamEnd:
    """Whether an upstream event stream of ``kind`` reached its API's terminal event.

    Chat and completions (vLLM, OpenAI): every choice that appeared got a ``finish_reason`` (the
    ``data: [DONE]`` line after it is hidden by the openai SDK's stream, which stops at it and at a
    closed connection alike, so the finish reasons are what can be checked). Responses: an event
    of type ``response.completed`` / ``.incomplete`` / ``.failed`` / ``error``. Messages:
    ``message_stop`` or ``error``. Other kinds are not streamed and count as complete.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._choices: set[int] = set()
        self._finished: set[int] = set()
        self._ended = False

    def see(self, event: dict[str, Any]) -> None:
        """Note one event (a parsed JSON object) of the stream."""
        if self.kind in ("chat", "completions"):
            for choice in event.get("choices") or []:
                if isinstance(choice, dict):
                    index = choice.get("index", 0)
                    self._choices.add(index if isinstance(index, int) else 0)
                    if choice.get("finish_reason"):
                        self._finished.add(index if isinstance(index, int) else 0)
        elif event.get("type") in _TERMINAL.get(self.kind, ()):
            self._ended = True

    @property
    def complete(self) -> bool:
        if self.kind in ("chat", "completions"):
            return bool(self._choices) and self._choices <= self._finished
        return self._ended or self.kind not in _TERMINAL

    @property
    def expected(self) -> str:
        """What the stream lacked, for the error message."""
        if self.kind in ("chat", "completions"):
            missing = sorted(self._choices - self._finished)
            return f"a finish_reason for choice {missing[0]}" if missing else "any choice"
        return " or ".join(sorted(_TERMINAL[self.kind] - {"error"}))
