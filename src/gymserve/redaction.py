"""Keeping credentials out of text: URLs and messages as they may be logged, captured or returned.

Used by the config errors, the upstream error translation, metrics labels and the capture file, so
one rule decides what counts as a secret: every configured value, anything shaped like a key
(``sk-…``, ``Bearer …``), and query parameters named like a key (``api_key``, ``sig``, ``token``…;
``api-version`` is not one).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_SECRET_QUERY = re.compile(r"(key|token|secret|sig|signature|password|code)", re.I)
# Key shapes worth masking even when we were not told the value (an upstream echoing a key back).
_KEY_PATTERNS = re.compile(r"\b(sk-[A-Za-z0-9_\-]{6,}|Bearer\s+[A-Za-z0-9._\-]{8,})")


def redact(text: str, secrets: tuple[str, ...] | list[str] = ()) -> str:
    """``text`` with every configured secret (and anything shaped like a key) replaced by ``***``."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return _KEY_PATTERNS.sub(lambda m: m.group(0)[:3] + "***", text)


def redact_url(url: str) -> str:
    """``url`` without user-info and with key-like query values replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode(
        [
            (k, "***" if _SECRET_QUERY.search(k) and k != "api-version" else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe=":/*",
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
