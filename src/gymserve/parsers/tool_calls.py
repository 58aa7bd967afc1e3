"""Tool-call parsers, one registered class per output format, named as ``vllm serve
--tool-call-parser`` names them, plus ``infer_tool_call_parser`` for ``auto``.

Each format is a :class:`~gymserve.parsers.call_scan.CallSyntax`: the shared incremental scanner
(:mod:`gymserve.parsers.call_scan`) applies one set of rules to all of them, so every format streams
a call's arguments as they are generated and agrees with its whole-text parse. Formats marked by a
tag accept any tool name; bare-JSON formats need a *declared* name, since ordinary JSON answers are
common and must stay content.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from typing import Any

from gymserve.parsers.base import ToolCallParser, get_tool_call_parser, tool_call_parser_names
from gymserve.parsers.call_heads import ID, NAME
from gymserve.parsers.call_scan import CallSyntax

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_ALNUM = string.ascii_letters + string.digits


class HermesToolCallParser(ToolCallParser):
    """Hermes / Qwen2.5 / Qwen3 format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    Source: the Hermes-2-Pro and Qwen2.5/Qwen3 chat templates (their system prompt asks for this
    shape); vLLM ``--tool-call-parser hermes``. Several blocks per turn are several calls, and so
    are several objects (or a list) in one block (Qwen2.5 sometimes does this, case TP-04's
    malformed variant). A block cut off by the end of the text after a call counts (stop strings
    often eat the close tag).
    """

    name = "hermes"

    syntax = CallSyntax(tag=HERMES_OPEN, close_tag=HERMES_CLOSE)


class Qwen25CoderToolCallParser(ToolCallParser):
    """Qwen2.5-Coder-Instruct (the embedded model): hermes tags, or a message that starts with a
    bare ``{"name": N, "arguments": {...}}`` (or a list of them, or either inside a ```json fence)
    where ``N`` is a declared tool.

    Source: measured on this machine (see DESIGN.md): the model ignores its template's
    ``<tool_call>`` instruction and answers with bare JSON. JSON that is not a declared-tool call
    (an ordinary JSON answer, an unknown name, no tools declared) stays content. No vLLM parser
    exists for this.
    """

    name = "qwen2_5_coder"

    syntax = CallSyntax(tag=HERMES_OPEN, close_tag=HERMES_CLOSE, bare=True, fence=True)


class Llama3JsonToolCallParser(ToolCallParser):
    """Llama 3.1/3.2/3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` (``arguments``
    accepted too, each call spelt either way), several separated by ``;``, by line breaks, or each
    after its own ``<|python_tag|>``, optionally after ``<|python_tag|>``.

    Source: Meta's Llama 3.1 model card (JSON-based tool calling: ``parameters``) and chat template;
    vLLM ``--tool-call-parser llama3_json`` (its pattern splits calls on ``;`` and reads
    ``arguments`` or ``parameters``); Llama 3.2/3.3 answers put one call per line. Without the tag a
    message must start with a call to a declared tool; after the tag any name is accepted, and text
    before the tag is content.
    """

    name = "llama3_json"

    syntax = CallSyntax(tag=PYTHON_TAG, separator=";", bare=True, newline_separates=True)


class MistralToolCallParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects
    (tokenizers up to v7, e.g. Mistral-7B-Instruct-v0.3), or per call ``[TOOL_CALLS]name[ARGS]{...}``
    (v11+: Mistral Small 3.x, Magistral, Devstral), ``name[CALL_ID]id[ARGS]{...}`` (v11 with call
    ids), or ``name{...}`` (how vLLM's parser sees v11 output once the ``[ARGS]`` control token is
    skipped in decoding).

    Tool-call ids are 9 alphanumerics (:meth:`new_call_id`), and ids in the history are mapped to
    that form (:meth:`history_call_id`): mistral-common's validator and the Mistral chat templates
    refuse any other. Source: mistral-common's tokenizer formats and ``validator.py``; vLLM
    ``--tool-call-parser mistral`` (its ``MistralToolCall`` ids). Text before the tag is content; a
    malformed call leaves the tag and its text in content.
    """

    name = "mistral"

    syntax = CallSyntax(
        tag=MISTRAL_TAG,
        one_value=True,
        heads=((NAME, "[ARGS]"), (NAME, "[CALL_ID]", ID, "[ARGS]"), (NAME,)),
    )

    def new_call_id(self) -> str:
        """9 random alphanumerics, the only ids Mistral's formats accept."""
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def history_call_id(self, call_id: str) -> str:
        """``call_id`` itself when it is 9 alphanumerics, else 9 alphanumerics derived from it (the
        same for the call and the tool message that answers it, and on every turn)."""
        if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
            return call_id
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        out = []
        for _ in range(9):
            digest, r = divmod(digest, len(_ALNUM))
            out.append(_ALNUM[r])
        return "".join(out)

    def adjust_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """History ids mapped (:meth:`history_call_id`) and, when tools are offered,
        ``skip_special_tokens: false`` so ``[TOOL_CALLS]`` reaches the raw text (as vLLM's
        parser's ``adjust_request`` does for HF-tokenizer Mistral models)."""
        body = super().adjust_request(body)
        if body.get("tools") and body.get("tool_choice") != "none":
            body.setdefault("skip_special_tokens", False)
        return body


class DeepSeekV3ToolCallParser(ToolCallParser):
    """DeepSeek V3 / R1: ``<｜tool▁calls▁begin｜>``, then per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>``, then
    ``<｜tool▁calls▁end｜>``; V3.1's ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
    is read too.

    Source: the DeepSeek-V3 / R1 / V3.1 chat templates and model cards; vLLM
    ``--tool-call-parser deepseek_v3`` (and ``deepseek_v31``). Text before the calls is content; a
    call cut by the end of the text keeps the arguments written; a malformed block stays content.
    """

    name = "deepseek_v3"

    syntax = CallSyntax(
        tag=DEEPSEEK_CALLS_BEGIN,
        close_tag=DEEPSEEK_CALLS_END,
        heads=(
            (DEEPSEEK_CALL_BEGIN + "function" + DEEPSEEK_SEP, NAME, "\n```json\n"),
            (DEEPSEEK_CALL_BEGIN + "function" + DEEPSEEK_SEP, NAME, "\n```\n"),
            (DEEPSEEK_CALL_BEGIN, NAME, DEEPSEEK_SEP),
        ),
        call_tail=("```", DEEPSEEK_CALL_END),
    )


# ------------------------------------------------------------------------------------ inference


def infer_tool_call_parser(
    model_type: str | None, model_name: str | None, chat_template: str | None
) -> tuple[str, str]:
    """Pick a tool-call parser for ``auto``: returns ``(parser name, reason)``.

    ``model_type`` is the HF config's ``model_type`` (e.g. ``qwen2``), ``model_name`` a repo id,
    path or GGUF ``general.name``, ``chat_template`` the template text. Rules, first match wins:
    gpt-oss (``model_type`` ``gpt_oss`` or a harmony template) → ``openai``; Qwen2.5-Coder (qwen
    family + "coder", not Qwen3) → ``qwen2_5_coder`` even though its template
    mentions ``<tool_call>`` (the model never uses the tags); a template using ``<function=`` XML
    (Qwen3-Coder) → ``qwen3_coder``; DeepSeek V3/R1 → ``deepseek_v3``; Mistral → ``mistral``; a template with
    ``<tool_call>`` → ``hermes``; Llama 3.x → ``llama3_json``; other Qwen2/Qwen3 or Hermes →
    ``hermes``. Raises ValueError naming the choices when nothing matches.
    """
    mtype = (model_type or "").lower()
    name = (model_name or "").lower()
    template = chat_template or ""
    choices = ", ".join(tool_call_parser_names())
    qwen = mtype.startswith("qwen") or "qwen" in name
    qwen3 = mtype.startswith("qwen3") or "qwen3" in name
    if "<|channel|>" in template or mtype == "gpt_oss" or re.search(r"gpt[-_]?oss", name):
        return "openai", "gpt-oss model or harmony template (<|channel|>)"
    if "<function=" in template:
        return "qwen3_coder", "chat template uses the <function=...> XML tool format (Qwen3-Coder)"
    if DEEPSEEK_CALLS_BEGIN in template or mtype.startswith("deepseek_v3") or re.search(r"deepseek[-_ ]?(v3|r1)", name):
        return "deepseek_v3", "DeepSeek V3/R1 model or template with <｜tool▁calls▁begin｜>"
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


def tool_call_parser_for(
    name: str | None, *, model_type: str | None = None, model_name: str | None = None, chat_template: str | None = None
) -> tuple[ToolCallParser | None, str]:
    """The parser a ``tool_call_parser`` option names, and why: ``(parser, reason)``.

    ``None`` or ``"none"`` → no parser (``"disabled"``); ``"auto"`` → :func:`infer_tool_call_parser`
    over the model facts given (its reason); any other name → the registered parser
    (``"configured"``). Raises ``ValueError`` (``registry.UnknownNameError`` for an unknown name)
    naming the choices.
    """
    if name is None or name == "none":
        return None, "disabled"
    reason = "configured"
    if name == "auto":
        name, reason = infer_tool_call_parser(model_type, model_name, chat_template)
    return get_tool_call_parser(name), reason
