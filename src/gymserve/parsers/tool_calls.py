"""Tool-call parsers, one registered class per output format, named as ``vllm serve
--tool-call-parser`` names them, plus ``infer_tool_call_parser`` for ``auto``.

Every parser implements ``scan`` (see :class:`ToolCallParser`): it decides text only once no
continuation can change the decision, which is what makes streaming agree with the whole-text
parse. Formats marked by a tag (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``) accept any
tool name; formats that are bare JSON need a *declared* tool name, since ordinary JSON answers are
common and must stay content.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gymserve.parsers.base import (
    ParsedToolCall,
    ScanItem,
    ToolCallParser,
    register,
    tool_call_parser_names,
)
from gymserve.parsers.json_scan import (
    call_from_obj,
    calls_from_sequence,
    calls_from_value,
    declared_tool_names,
    json_end,
    loads,
    partial_tag_len,
)

Tools = list[dict[str, Any]] | None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _content_until(text: str, start: int, stop: int, items: list[ScanItem]) -> None:
    if stop > start:
        items.append(text[start:stop])


def _plain_tail(text: str, start: int, final: bool, tag: str, items: list[ScanItem]) -> int:
    """Content from ``start`` to the end, holding back a suffix that may be the start of ``tag``."""
    end = len(text) if final else len(text) - partial_tag_len(text[start:], tag)
    _content_until(text, start, end, items)
    return max(end, start)


def _json_calls_at(
    text: str, pos: int, final: bool, declared: set[str] | None = None
) -> tuple[list[ParsedToolCall] | None, int] | None:
    """Calls from the JSON value at ``text[pos]`` (``{`` or ``[``): ``(calls, end)``,
    ``(None, end)`` when malformed, None when the value is not closed yet and more text may come."""
    end = json_end(text, pos)
    if end is None:
        return None if not final else (None, len(text))
    try:
        return calls_from_value(loads(text[pos:end]), declared), end
    except ValueError:
        return None, end


# --------------------------------------------------------------------------------------- hermes

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def _hermes_block(text: str, at: int, final: bool) -> tuple[list[ParsedToolCall] | None, int] | None:
    """The ``<tool_call>`` block opening at ``text[at]``: ``(calls, end)``, ``(None, _)`` when
    malformed, None while undecided.

    Inside the tags: one or more JSON call values separated by whitespace. Several objects in one
    block (Qwen2.5 sometimes does this, case TP-04's malformed variant) are several calls. A block
    cut off by the end of the text after a complete call counts (stop strings often eat the close
    tag).
    """
    pos = at + len(HERMES_OPEN)
    calls: list[ParsedToolCall] = []
    n = len(text)
    while True:
        pos = _skip_ws(text, pos)
        if pos == n:
            if not final:
                return None
            return (calls or None), n
        if text.startswith(HERMES_CLOSE, pos):
            return (calls or None), pos + len(HERMES_CLOSE)
        if not final and HERMES_CLOSE.startswith(text[pos:]):
            return None  # a close tag still arriving
        if text[pos] not in "{[":
            return None, pos
        found = _json_calls_at(text, pos, final)
        if found is None:
            return None
        value_calls, pos = found
        if value_calls is None:
            return None, pos
        calls.extend(value_calls)


def hermes_scan(text: str, start: int, final: bool) -> tuple[list[ScanItem], int]:
    """Scan for ``<tool_call>{json}</tool_call>`` blocks; text around them is content.

    A malformed block leaves its ``<tool_call>`` tag as content and scanning resumes right after
    the tag, so the block's text stays in content verbatim.
    """
    return scan_tagged(text, start, final, HERMES_OPEN, _hermes_block)


def scan_tagged(text: str, start: int, final: bool, tag: str,
                parse_block: Callable[[str, int, bool], tuple[list[ParsedToolCall] | None, int] | None],
                ) -> tuple[list[ScanItem], int]:
    """The scan loop of every format whose calls follow a literal ``tag``.

    ``parse_block(text, tag_at, final)`` returns None when more text is needed to decide (the scan
    stops before the tag), ``(None, _)`` for a malformed block (the tag stays content and scanning
    resumes after it), or ``(calls, end)``. Returns the items decided and where scanning stopped.
    """
    items: list[ScanItem] = []
    i = start
    while True:
        j = text.find(tag, i)
        if j < 0:
            return items, _plain_tail(text, i, final, tag, items)
        _content_until(text, i, j, items)
        block = parse_block(text, j, final)
        if block is None:
            return items, j
        calls, end = block
        if calls is None:
            items.append(tag)
            i = j + len(tag)
        else:
            items.extend(calls)
            i = end


@register("hermes")
class HermesToolCallParser(ToolCallParser):
    """Hermes / Qwen2.5 / Qwen3 format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    Source: the Hermes-2-Pro and Qwen2.5/Qwen3 chat templates (their system prompt asks for this
    shape); vLLM ``--tool-call-parser hermes``. Calls are found by JSON boundaries (a balanced
    scan that respects strings), so ``</tool_call>`` inside an argument string does not end a call.
    Several blocks per turn are several calls; any tool name is accepted (the tags are explicit).
    """

    def scan(self, text: str, tools: Tools, *, start: int, final: bool) -> tuple[list[ScanItem], int]:
        return hermes_scan(text, start, final)


# ------------------------------------------------------------------------------- qwen2_5_coder

_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)\s*```", re.S | re.I)


def _may_be_whole_json(stripped: str) -> bool:
    """Whether a message starting like this may still turn out to be a bare JSON call."""
    return stripped == "" or stripped[0] in "{[" or "```".startswith(stripped[:3])


def bare_json_calls(text: str, declared: set[str]) -> list[ParsedToolCall] | None:
    """Calls when the whole message is JSON call values (an object, a list of them, or several
    separated by whitespace), bare or inside one ```json / ``` fence, every name declared."""
    body = text.strip()
    fence = _FENCE.fullmatch(body)
    if fence:
        body = fence.group(1)
    return calls_from_sequence(body, declared)


@register("qwen2_5_coder")
class Qwen25CoderToolCallParser(ToolCallParser):
    """Qwen2.5-Coder-Instruct (the embedded model): hermes tags, or a whole message that is a bare
    ``{"name": N, "arguments": {...}}`` (or a list of them, or either inside one ```json fence).

    Source: measured on this machine (see DESIGN.md): the model ignores its template's
    ``<tool_call>`` instruction and answers with bare JSON. Bare JSON is a call only when it is the
    whole message and every ``N`` is a declared tool; otherwise (JSON inside an answer, an unknown
    name, no tools declared) it stays content. No vLLM parser exists for this.

    Streaming: a message whose first non-blank character is ``{``, ``[`` or a backtick cannot be
    decided before it ends, so it is held until the end; any other message streams as hermes.
    """

    def scan(self, text: str, tools: Tools, *, start: int, final: bool) -> tuple[list[ScanItem], int]:
        declared = declared_tool_names(tools)
        if declared and _may_be_whole_json(text.lstrip()):
            # Nothing has been consumed yet: while a message may be bare JSON, scan decides nothing.
            if not final:
                return [], start
            calls = bare_json_calls(text, declared)
            if calls:
                return list(calls), len(text)
        return hermes_scan(text, start, final)


# --------------------------------------------------------------------------------- llama3_json

PYTHON_TAG = "<|python_tag|>"


@register("llama3_json")
class Llama3JsonToolCallParser(ToolCallParser):
    """Llama 3.1/3.2/3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` (``arguments``
    accepted too), several separated by ``;``, optionally after ``<|python_tag|>``.

    Source: Meta's Llama 3.1 model card (JSON-based tool calling) and chat template; vLLM
    ``--tool-call-parser llama3_json``. Without the tag the whole message must be the calls and
    every name declared (ordinary JSON answers stay content); after the tag any name is accepted,
    and text before the tag is content. Anything else is content.
    """

    def scan(self, text: str, tools: Tools, *, start: int, final: bool) -> tuple[list[ScanItem], int]:
        items: list[ScanItem] = []
        tag_at = text.find(PYTHON_TAG)
        if tag_at < 0:
            declared = declared_tool_names(tools)
            stripped = text.lstrip()
            if declared and (stripped == "" or stripped[0] in "{["):
                if not final:
                    return [], start
                calls = calls_from_sequence(text, declared, ";")
                return (list(calls), len(text)) if calls else ([text[start:]], len(text))
            return items, _plain_tail(text, start, final, PYTHON_TAG, items)
        _content_until(text, start, tag_at, items)
        if not final:
            return items, max(tag_at, start)
        calls = calls_from_sequence(text[tag_at + len(PYTHON_TAG) :], None, ";")
        if calls:
            return items + list(calls), len(text)
        items.append(text[max(tag_at, start) :])
        return items, len(text)


# ------------------------------------------------------------------------------------- mistral

MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_NAME_ARGS = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")
_MISTRAL_PARTIAL = re.compile(r"[A-Za-z0-9_.\-]*(?:\[(?:A(?:R(?:G(?:S)?)?)?)?)?")


def _mistral_calls(text: str, pos: int, final: bool) -> tuple[list[ParsedToolCall] | None, int] | None:
    """Calls after a ``[TOOL_CALLS]`` tag: a JSON array/object, or ``name[ARGS]{...}`` (the
    v11+ tokenizer form). ``(None, _)`` when malformed, None while undecided."""
    n = len(text)
    pos = _skip_ws(text, pos)
    if pos == n:
        return None if not final else (None, n)
    if text[pos] in "{[":
        return _json_calls_at(text, pos, final)
    match = _MISTRAL_NAME_ARGS.match(text, pos)
    if match is None:
        if not final and _MISTRAL_PARTIAL.fullmatch(text, pos):
            return None
        return None, pos
    args_at = _skip_ws(text, match.end())
    if args_at == n:
        return None if not final else (None, n)
    if text[args_at] != "{":
        return None, args_at
    end = json_end(text, args_at)
    if end is None:
        return None if not final else (None, n)
    try:
        call = call_from_obj({"name": match.group(1), "arguments": loads(text[args_at:end])})
    except ValueError:
        call = None
    return ([call] if call else None), end


@register("mistral")
class MistralToolCallParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects, or
    (v11+ tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` per call.

    Source: mistral-common's tokenizer formats; vLLM ``--tool-call-parser mistral``. Text before
    the tag is content; a malformed call leaves the tag and its text in content.
    """

    def scan(self, text: str, tools: Tools, *, start: int, final: bool) -> tuple[list[ScanItem], int]:
        return scan_tagged(text, start, final, MISTRAL_TAG,
                           lambda t, at, fin: _mistral_calls(t, at + len(MISTRAL_TAG), fin))


# ------------------------------------------------------------------------------------ inference


def infer_tool_call_parser(
    model_type: str | None, model_name: str | None, chat_template: str | None
) -> tuple[str, str]:
    """Pick a tool-call parser for ``auto``: returns ``(parser name, reason)``.

    ``model_type`` is the HF config's ``model_type`` (e.g. ``qwen2``), ``model_name`` a repo id,
    path or GGUF ``general.name``, ``chat_template`` the template text. Rules, first match wins:
    Qwen2.5-Coder (qwen family + "coder", not Qwen3) → ``qwen2_5_coder`` even though its template
    mentions ``<tool_call>`` (the model never uses the tags); a template using ``<function=`` XML
    (Qwen3-Coder) → ValueError (not supported); Mistral → ``mistral``; a template with
    ``<tool_call>`` → ``hermes``; Llama 3.x → ``llama3_json``; other Qwen2/Qwen3 or Hermes →
    ``hermes``. Raises ValueError naming the choices when nothing matches.
    """
    mtype = (model_type or "").lower()
    name = (model_name or "").lower()
    template = chat_template or ""
    choices = ", ".join(tool_call_parser_names())
    qwen = mtype.startswith("qwen") or "qwen" in name
    qwen3 = mtype.startswith("qwen3") or "qwen3" in name
    if "<function=" in template:
        raise ValueError(
            f"the chat template uses the <function=...> XML tool format (Qwen3-Coder), which no parser "
            f"here reads; pass a tool-call parser explicitly, one of: {choices}"
        )
    if qwen and "coder" in name and not qwen3:
        return "qwen2_5_coder", f"Qwen2.5-Coder model ({model_name!r}) answers tool requests with bare JSON"
    if "[TOOL_CALLS]" in template or mtype in ("mistral", "mixtral") or re.search(r"mi[sx]tral", name):
        return "mistral", "Mistral model or template with [TOOL_CALLS]"
    if "<tool_call>" in template:
        return "hermes", "chat template contains <tool_call>"
    if PYTHON_TAG in template or re.search(r"llama[-_ ]?3", name):
        return "llama3_json", "Llama 3.x model or template with <|python_tag|>"
    if qwen:
        return "hermes", f"Qwen model ({model_type or model_name!r}) uses <tool_call> tags"
    if "hermes" in name:
        return "hermes", "Hermes model"
    raise ValueError(
        f"cannot infer a tool-call parser for model_type={model_type!r}, model_name={model_name!r}; "
        f"set one explicitly, one of: {choices}"
    )
