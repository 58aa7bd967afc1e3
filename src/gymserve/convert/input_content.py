"""The content of Responses input items as chat message content (pure, no I/O).

Used by ``responses_to_chat``: text parts of any Responses spelling (``input_text``,
``output_text``, ``reasoning_text``...) joined as vLLM's "string" content format joins them,
``input_image`` parts as chat ``image_url`` parts, and everything else refused with the path of
the part (``input[2].content[1].type``), following OpenAI's Responses API reference.
"""

from __future__ import annotations

from typing import Any

from gymserve.convert.message_checks import json_type
from gymserve.errors import InvalidRequestError

_TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def content_parts(content: Any, path: str) -> list[dict[str, Any]]:
    """``content`` checked as a list of part objects; ``path`` names it in errors."""
    if content is None:
        raise InvalidRequestError(f"{path} is required: a string or a list of content parts", param=path)
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{path} must be a string or a list of content parts, got {json_type(content)}", param=path
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise InvalidRequestError(
                f"{path}[{j}] must be a content part object, got {json_type(part)}", param=f"{path}[{j}]"
            )
    return content


def part_text(part: dict[str, Any], where: str) -> str | None:
    """Text of a text-like part; None when the part is not text-like."""
    kind = part.get("type")
    if kind in _TEXT_PART_TYPES:
        key = "text"
    elif kind == "refusal":
        key = "refusal"
    else:
        return None
    value = part.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string, got {json_type(value)}", param=f"{where}.{key}")
    return value


def unsupported_part(part: dict[str, Any], where: str) -> InvalidRequestError:
    """The 400 for a part chat backends cannot take (files, audio, video, unknown types)."""
    kind = part.get("type")
    if kind in ("input_file", "input_audio", "input_video"):
        return InvalidRequestError(
            f"{where}: content part type '{kind}' is not supported by chat backends; send text or input_image",
            param=f"{where}.type",
        )
    return InvalidRequestError(f"{where}: unknown content part type {kind!r}", param=f"{where}.type")


def plain_text(content: Any, path: str) -> str:
    """System/developer/assistant content: text only (templates take no images there)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content_parts(content, path)):
        text = part_text(part, f"{path}[{j}]")
        if text is None:
            raise unsupported_part(part, f"{path}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def user_content(content: Any, path: str) -> Any:
    """A string, or chat content parts when images are present.

    All-text parts collapse to one string joined with newlines, as vLLM's "string" content format
    does, because many HF chat templates cannot render a list of parts.
    """
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content_parts(content, path)):
        at = f"{path}[{j}]"
        text = part_text(part, at)
        if text is not None:
            parts.append({"type": "text", "text": text})
        elif part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise InvalidRequestError(
                    f"{at}.image_url is required (a URL or data URL; file_id is not supported)", param=f"{at}.image_url"
                )
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise unsupported_part(part, at)
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def reasoning_text(item: dict[str, Any], where: str) -> str:
    """reasoning_text content if any, else the summaries; "" for encrypted-only items."""
    for key in ("content", "summary"):
        value = item.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            raise InvalidRequestError(
                f"{where}.{key} must be a list of text parts, got {json_type(value)}", param=f"{where}.{key}"
            )
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.{key}[{j}].text must be a string", param=f"{where}.{key}[{j}].text")
            texts.append(part["text"])
        if texts:
            return "\n\n".join(texts)
    return ""
