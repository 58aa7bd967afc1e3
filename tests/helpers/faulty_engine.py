"""``FaultyEngine``: a real ``WorkerEngine`` (the worker thread, inbox, control commands and fault
handling of ``gymserve.engine.worker``) whose "model" emits one scripted token per step per call and
whose worker loop raises after ``fail_after`` steps: the fault seam for the engine-down tests."""

from __future__ import annotations

import time
from typing import Any

from gymserve.engine.base import SamplingParams, TokenDelta
from gymserve.engine.control import ControlState
from gymserve.engine.worker import WorkerEngine, WorkerRequest


class FaultyEngine(WorkerEngine):
    """Emits token ``token`` (log-prob -0.5) once per step for every call in its batch, ``delay``
    seconds per step, and finishes a call at its ``max_tokens``; the worker raises
    ``RuntimeError("injected fault in step N")`` at step ``fail_after + 1`` (None: never)."""

    engine_name = "faulty"

    def __init__(self, tokenizer: Any, *, fail_after: int | None = 3, delay: float = 0.05, token: int = 9707):
        self.model_name = "faulty"
        self.model_type = "qwen2"
        self.eos_token_ids = (int(tokenizer.convert_tokens_to_ids("<|im_end|>")),)
        self.context_window = 32768
        self.vocab_size = len(tokenizer)
        self.model = None
        self.pause_timeout = 300.0
        self._control = ControlState(0)
        self._update_lock = None
        self.fail_after, self.delay, self.token = fail_after, delay, token
        self.steps = 0
        self._active: list[WorkerRequest] = []
        self._counts: dict[int, int] = {}
        self._start_worker(self._run, "gymserve-faulty")

    def _new_request(self, prompt_ids: list[int], sampling: SamplingParams, **common: Any) -> WorkerRequest:
        return WorkerRequest(prompt_ids, sampling, **common)

    def _running(self) -> list[WorkerRequest]:
        return self._active

    def _abort_running(self) -> None:
        for r in self._active:
            r.emit(TokenDelta([], [], "abort"))
        self._active = []

    def _run(self) -> None:
        ctl = self._control
        while self._serve_inbox():
            self._active = [r for r in self._active if not r.cancelled]
            if ctl.admitting:
                while self._waiting:
                    self._active.append(self._waiting.popleft())
            if self._active and ctl.decoding:
                self.steps += 1
                if self.fail_after is not None and self.steps > self.fail_after:
                    raise RuntimeError(f"injected fault in step {self.steps}")
                for r in list(self._active):
                    n = self._counts[r.id] = self._counts.get(r.id, 0) + 1
                    done = n >= r.sampling.max_tokens
                    r.emit(TokenDelta([self.token], [-0.5], "length" if done else None))
                    if done:
                        self._active.remove(r)
                time.sleep(self.delay)
            ctl.settle(len(self._active))
