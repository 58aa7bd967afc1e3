"""``gymserve check``: probe a configured backend and say what works and what to change.

Four probes, each independent: the model list (``GET {base}/models``), a one-token Chat
Completions call, a short Responses call (native for openai/azure ``api: responses``, through
the converter otherwise) and a short Anthropic Messages call (native for the anthropic backend,
through the converter otherwise). Each result carries the upstream error message, which names the URL
tried, the cause and the fix (see ``gymserve.backends.upstream_errors``); keys never appear.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from gymserve.backends.base import RequestContext
from gymserve.wire.reasoning import field_reasoning


@dataclass
class CheckResult:
    """One probe: ``name`` ("models", "chat", "responses", "messages"), ``ok``, what came back or went wrong."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0
    required: bool = True


@dataclass
class CheckReport:
    """All probes of one backend. ``ok``: every required probe passed."""

    backend: str
    target: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results if r.required)

    def format(self) -> str:
        lines = [f"gymserve check: {self.backend} backend at {self.target}"]
        for r in self.results:
            mark = "ok  " if r.ok else ("FAIL" if r.required else "warn")
            lines.append(f"  [{mark}] {r.name:<9} ({r.seconds:.2f} s) {r.detail}")
        lines.append(
            "all probes passed" if self.ok else "some probes failed: read the messages above for what to change"
        )
        return "\n".join(lines)


async def _probe(name: str, fn, describe, *, required: bool = True) -> CheckResult:
    start = time.perf_counter()
    try:
        value = await fn()
    except Exception as exc:  # every failure is a result to print, not a crash
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        return CheckResult(name, False, message, time.perf_counter() - start, required)
    return CheckResult(name, True, describe(value), time.perf_counter() - start, required)


def _chat_detail(c: dict[str, Any]) -> str:
    choice = (c.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    text = msg.get("content") or field_reasoning(msg) or ""
    extra = ", token IDs returned" if msg.get("generation_token_ids") is not None else ""
    return f"model {c.get('model')!r} answered {text[:40]!r} (finish_reason {choice.get('finish_reason')}){extra}"


def _responses_detail(r: dict[str, Any]) -> str:
    kinds = [i.get("type") for i in r.get("output") or []]
    return f"model {r.get('model')!r}, status {r.get('status')}, output {kinds}"


def _messages_detail(m: dict[str, Any]) -> str:
    kinds = [b.get("type") for b in m.get("content") or [] if isinstance(b, dict)]
    return f"model {m.get('model')!r}, stop_reason {m.get('stop_reason')}, content {kinds}"


async def run_check(config: Any) -> CheckReport:
    """Probe the backend of ``config`` (a ``GymserveConfig``) and return what worked.

    The model list is informational for chat servers (``required=False``): some gateways do not
    serve it while chat works. Never raises for upstream failures; they become failed results.
    """
    from gymserve.backends import build_backend

    backend = build_backend(config)
    b = config.backend
    report = CheckReport(backend.name, backend.describe()["target"])
    ctx = RequestContext(request_id="gymserve-check")
    model = getattr(b, "model", None) or "default"
    max_field = backend.convert_options().max_tokens_field
    try:
        report.results.append(
            await _probe(
                "models",
                backend.upstream_models,
                lambda ids: f"{len(ids)} model(s): {', '.join(ids[:5])}",
                required=False,
            )
        )
        chat_req = {"model": model, "messages": [{"role": "user", "content": "Say OK."}], max_field: 1}
        report.results.append(
            await _probe(
                "chat",
                lambda: backend.chat(chat_req, ctx),
                _chat_detail,
                required=not (b.type == "azure" and b.api == "responses"),
            )
        )
        # 16 is the smallest max_output_tokens the OpenAI Responses API accepts.
        resp_req = {"model": model, "input": "Say OK.", "max_output_tokens": 16}
        report.results.append(
            await _probe(
                "responses",
                lambda: backend.responses(resp_req, ctx),
                _responses_detail,
                required=not (b.type == "azure" and b.api == "chat"),
            )
        )
        messages_req = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "Say OK."}]}
        report.results.append(
            await _probe(
                "messages",
                lambda: backend.messages(messages_req, ctx),
                _messages_detail,
                required=b.type == "anthropic",  # elsewhere it is the chat call again, converted
            )
        )
    finally:
        await backend.close()
    return report


def main_check(
    config: Any, *, env_path: str | None = None, overrides: dict[str, Any] | None = None, out: TextIO | None = None
) -> int:
    """CLI entry: run the probes for ``config`` (a loaded ``GymserveConfig``, or a config file path /
    None to load one with ``env_path``/``overrides``) and print the report. Returns 0 when every
    required probe passed, 1 when one failed, 2 when the config itself is invalid."""
    import asyncio

    from gymserve.config import ConfigError, GymserveConfig, load_config

    out = out or sys.stdout
    if not isinstance(config, GymserveConfig):
        try:
            config = load_config(config, env_path=env_path, overrides=overrides)
        except ConfigError as exc:
            print(f"gymserve check: {exc}", file=out)
            return 2
    if config.backend.type == "local":
        print("gymserve check: the local backend runs in-process; there is no upstream to probe", file=out)
        return 0
    report = asyncio.run(run_check(config))
    print(report.format(), file=out)
    return 0 if report.ok else 1
