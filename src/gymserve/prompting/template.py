"""Chat templating: OpenAI chat messages → the prompt text and token IDs the policy model sees.

``ChatTemplate`` wraps ``tokenizer.apply_chat_template`` the way ``vllm serve`` does:

- the template is the tokenizer's own, or an override (``--chat-template FILE`` or the template
  text itself);
- ``chat_template_kwargs`` (e.g. ``enable_thinking``) are the server's defaults overridden key by
  key by the request's;
- messages are first made fit for Hugging Face templates (``prepare_messages``): OpenAI puts
  tool-call arguments in a JSON *string* while HF templates do ``arguments | tojson`` on an object,
  ``content`` may be ``None`` or a list of parts, reasoning travels as ``reasoning`` (newer vLLM) or
  ``reasoning_content`` (what Qwen3-style templates read), and agents send a ``developer`` role that
  most open-model templates reject or silently drop.

Token IDs come from tokenizing the rendered text with ``add_special_tokens=False``: chat templates
already write the special tokens (``<|im_start|>``…), so adding a BOS would double it. Control
tokens come only from the template: text inside messages and tools that spells one is tokenized as
plain text (``message_text``; ``split_special_tokens=False`` restores the tokenizer's plain
behaviour, in which such text becomes the token).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gymserve.errors import InvalidRequestError
from gymserve.prompting.message_text import MessageText
from gymserve.protocol import TRAINING_FIELDS

TAIL_CHARS = 64
"""How much of the end of the rendered prompt the reasoning parser gets (``generation_prompt_tail``)."""

ROLES = ("system", "developer", "user", "assistant", "tool")

_TEXT_PARTS = ("text", "input_text", "output_text")
_MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video_url")

# apply_chat_template arguments a request must not set through chat_template_kwargs: they would
# change what the call returns or which template runs, not what the template renders.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


class ChatTemplate:
    """A tokenizer's chat template, ready to render OpenAI chat messages.

    ``tokenizer``: a Hugging Face tokenizer (``PreTrainedTokenizerBase``).
    ``chat_template``: ``None`` (the tokenizer's own template), the Jinja text of a template, or the
    path of a file holding one (as ``vllm serve --chat-template FILE``); text is told from a path
    by the presence of ``{``.
    ``default_kwargs``: the server's ``chat_template_kwargs``; a request's own override them key by key.
    ``split_special_tokens``: message and tool text that spells a control token is tokenized as
    plain text (``message_text``); False tokenizes the rendering as one text, as ``vllm serve`` does.
    Rendered text may then hold placeholders: read it with :meth:`visible`, tokenize it with
    :meth:`encode`. ``turn_end_tokens``: tokens that end an assistant turn in rendered history
    besides the model's EOS (``parsers.harmony.HISTORY_TURN_END``), for the prefix splice.

    Raises ``ValueError`` when there is no template at all or the file cannot be read (a
    configuration error, raised at start-up, never per request).
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        default_kwargs: Mapping[str, Any] | None = None,
        *,
        split_special_tokens: bool = True,
        turn_end_tokens: Sequence[str] = (),
    ):
        self.tokenizer = tokenizer
        # Tokens that close an assistant turn in the rendered history besides the engine's EOS ids
        # (harmony renders the sampled <|return|> as <|end|>): the prefix splice needs them.
        ids = [(t, tokenizer.convert_tokens_to_ids(t)) for t in turn_end_tokens]
        self.turn_end_ids: tuple[int, ...] = tuple(
            tid for t, tid in ids if isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == t
        )
        self.message_text = MessageText(tokenizer) if split_special_tokens else None
        if chat_template is not None and "{" not in chat_template:
            try:
                with open(os.path.expanduser(chat_template), encoding="utf-8") as f:
                    chat_template = f.read()
            except OSError as e:
                raise ValueError(f"cannot read the chat template file {chat_template!r}: {e}") from e
        if chat_template is None:
            chat_template = tokenizer.chat_template
            if isinstance(chat_template, dict):  # named templates: the "default" one is the chat template
                chat_template = chat_template.get("default")
        if not chat_template:
            raise ValueError("the tokenizer has no chat template; pass one (a Jinja file) as chat_template")
        self.template: str = chat_template
        self.default_kwargs: dict[str, Any] = dict(default_kwargs or {})
        self._check_kwargs(self.default_kwargs, "default chat_template_kwargs")
        # A template that names the role handles it itself; all others get it merged into system.
        self.handles_developer = "developer" in self.template

    # ------------------------------------------------------------------ messages

    def prepare_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """A copy of ``messages`` fit for Hugging Face chat templates (the input is not modified).

        - tool-call ``function.arguments`` JSON strings become objects (templates do ``| tojson``);
        - ``content: None`` becomes ``""`` (never rendered as "None", never breaks ``+``);
        - content given as a list of text parts becomes one string, parts joined by ``"\\n"`` as
          vLLM joins them (so the local engine and a vLLM backend see the same prompt);
        - ``reasoning`` is copied to ``reasoning_content`` unless that is set (Qwen3-style templates
          read ``reasoning_content``; RC-01);
        - training fields (``prompt_token_ids``…) are dropped;
        - with ``split_special_tokens``, every string is escaped (``message_text``) so that the text
          of a control token in it is tokenized as plain text (in assistant messages, the tokens
          flagged special);
        - when the template does not mention ``developer``: the leading run of system/developer
          messages becomes one system message (texts joined by a blank line, order kept) and a later
          developer message becomes a system message in place (RC-05: exactly one leading system
          message, nothing dropped).

        Raises ``InvalidRequestError`` (param names the offending field) for: an empty list, a
        message that is not an object, an unknown role, image/audio/file parts ("model is
        text-only"), unknown part types, arguments that are not valid JSON.
        """
        return self.prepare_messages_indexed(messages)[0]

    def prepare_messages_indexed(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
        """``prepare_messages`` plus, for each input index, the index of its message in the output
        (merging leading system/developer messages shifts later ones)."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of chat messages", param="messages")
        out: list[dict[str, Any]] = []
        index: list[int] = []
        leading = True  # still inside the leading run of system/developer messages
        for i, msg in enumerate(messages):
            m = _prepare_one(msg, i)
            is_system = m["role"] in ("system", "developer")
            if is_system and not self.handles_developer:
                m["role"] = "system"
                if leading and out:  # out[0] is the leading system message: merge into it
                    head = out[0]
                    head["content"] = "\n\n".join(t for t in (head["content"], m["content"]) if t)
                    index.append(0)
                    continue
            if not is_system:
                leading = False
            index.append(len(out))
            out.append(m)
        if self.message_text is not None:
            out = [self.message_text.escape_message(m) for m in out]
        return out, index

    # ------------------------------------------------------------------ rendering

    def merged_kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """Server defaults overridden key by key by the request's ``chat_template_kwargs``.

        Raises ``InvalidRequestError`` when the request sets an ``apply_chat_template`` argument
        (``tokenize``, ``add_generation_prompt``, ``chat_template``…) through them.
        """
        if not kwargs:
            return self.default_kwargs
        if not isinstance(kwargs, Mapping):
            raise InvalidRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        self._check_kwargs(kwargs, "chat_template_kwargs")
        return {**self.default_kwargs, **kwargs}

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The rendered prompt text of already-prepared ``messages`` (see ``prepare_messages``).

        ``tools``: chat-form tools (``[{"type": "function", "function": {...}}]``) or None.
        ``kwargs``: the request's ``chat_template_kwargs`` (merged over the server defaults here).
        ``continue_final_message``: leave the final message open (no end-of-turn token), so the
        model continues it (Hugging Face's ``apply_chat_template`` argument, which vLLM exposes).
        Raises ``InvalidRequestError`` when the template itself refuses the conversation (Jinja
        ``raise_exception``, e.g. roles out of order; a final message that cannot be continued) —
        the client sent something this model's template cannot express.
        """
        import jinja2

        merged = self.merged_kwargs(kwargs)
        extra = {"continue_final_message": True} if continue_final_message else {}
        if tools and self.message_text is not None:
            tools = self.message_text.escape(list(tools))  # descriptions are text an environment wrote
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **extra,
                **merged,
            )
        except (jinja2.TemplateError, TypeError) as e:
            raise InvalidRequestError(
                f"the model's chat template cannot render these messages: {e}", param="messages"
            ) from e
        except ValueError as e:  # transformers' own checks of continue_final_message
            if not continue_final_message:
                raise
            raise InvalidRequestError(
                f"continue_final_message cannot be applied to these messages: {e}", param="continue_final_message"
            ) from e
        if not isinstance(text, str):  # batched input would give a list; we never batch
            raise InvalidRequestError("the chat template did not render a single prompt", param="messages")
        return text

    def encode(self, text: str) -> list[int]:
        """Token IDs of rendered template text, without adding special tokens (the text has them);
        escaped message text becomes plain-text tokens (``message_text.MessageText.encode``)."""
        if self.message_text is not None:
            return self.message_text.encode(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def visible(self, text: str) -> str:
        """Rendered text as the prompt reads (placeholders of escaped message text restored)."""
        return self.message_text.unescape(text) if self.message_text is not None else text

    def render_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``encode(render_text(...))``: the prompt token IDs when nothing is spliced."""
        return self.encode(self.render_text(messages, tools, kwargs, add_generation_prompt))

    def generation_prompt_tail(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The last ``TAIL_CHARS`` characters of the prompt rendered with the generation prompt.

        The reasoning parser needs them: a template that pre-fills ``<think>`` makes the model
        output only ``</think>`` (RP-01). ``build_prompt`` returns the same tail without an extra
        render; use this only when the prompt was built elsewhere.
        """
        return self.visible(self.render_text(messages, tools, kwargs, True))[-TAIL_CHARS:]

    @staticmethod
    def _check_kwargs(kwargs: Mapping[str, Any], what: str) -> None:
        bad = sorted(k for k in kwargs if k in _RESERVED_KWARGS)
        if bad:
            raise InvalidRequestError(
                f"{what} may not set {', '.join(bad)}: these are arguments of the templating call, "
                "not variables of the template; use the request's own fields instead",
                param="chat_template_kwargs",
            )


def _content_text(content: Any, where: str) -> str:
    """``content`` as one string: None → "", a list of text parts → texts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string, null or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        param = f"{where}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{param} must be a content part object", param=param)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{param}.text must be a string", param=param)
            texts.append(text)
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        elif kind in _MEDIA_PARTS:
            raise InvalidRequestError(
                f"{param} is a {kind!r} part but the model is text-only; send text content only", param=param
            )
        else:
            raise InvalidRequestError(f"{param} has unknown content part type {kind!r}", param=param)
    return "\n".join(texts)


def _prepare_one(msg: Any, i: int) -> dict[str, Any]:
    if not isinstance(msg, Mapping):
        raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
    role = msg.get("role")
    if role not in ROLES:
        raise InvalidRequestError(
            f"messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}", param=f"messages[{i}].role"
        )
    m = {k: v for k, v in msg.items() if k not in TRAINING_FIELDS}
    m["content"] = _content_text(msg.get("content"), f"messages[{i}].content")
    if m.get("reasoning_content") is None and isinstance(m.get("reasoning"), str):
        m["reasoning_content"] = m["reasoning"]
    calls = msg.get("tool_calls")
    if calls is None:
        m.pop("tool_calls", None)  # `tool_calls: null` would make `for c in message.tool_calls` fail
    elif not isinstance(calls, list):
        raise InvalidRequestError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    elif not calls:
        m.pop("tool_calls")  # an empty list means "no calls"; templates test truthiness anyway
    else:
        m["tool_calls"] = [_prepare_call(c, i, j) for j, c in enumerate(calls)]
    return m


def _prepare_call(call: Any, i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    c = dict(call)
    fn = call.get("function")
    if isinstance(fn, Mapping):
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                # Arguments the model wrote as invalid JSON (or cut by max_tokens) come back in the
                # next turn's history: templates render a string verbatim (Qwen3's checks `is string`),
                # so the rollout goes on and the model sees what it wrote.
                pass
        elif args is None:
            fn["arguments"] = {}
        c["function"] = fn
    return c
