"""``RequestContext``: what the server knows about one request beyond its OpenAI body."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestContext:
    """Per-request facts that are not part of the OpenAI body.

    ``session_id``: from the ``X-Session-ID`` header or the session cookie; routes a rollout's turns
    to one replica. ``request_id``: for logs and capture. ``extra``: what the backend reports back
    about the call (``extra["replica"]``: the replica that served it, for metrics and capture).
    """

    session_id: str | None = None
    request_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
