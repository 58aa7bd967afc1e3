"""The control plane of a policy being trained, declared once: ``Control``.

A backend answers requests (``backends.base.Backend``: the data path only); what owns the weights
or the servers answers the control verbs, and the backend *holds* it as ``backend.control``:

=======================================  ===========================================================
``backend.control``                      what it is
=======================================  ===========================================================
``backends.local.control.LocalControl``  the local backend's engine (``engine.base.Engine``'s verbs)
``backends.chat_control.ChatControl``    the chat gateway: a pause gate at its door, the rest
                                         forwarded to its servers (``backends.upstream_control``)
``ray_cluster.control.FleetControl``     a Ray fleet: every replica, all or none, one version
None (openai, azure, anthropic)          ``control_of`` answers every verb 501 naming the backend
=======================================  ===========================================================

The verbs are vLLM's names (``POST /pause`` → ``pause_generation`` …); the HTTP routes that call
them are ``server.control_routes``, the in-process handle ``server.embed.ServedPolicy``. Every verb
of ``Control`` itself raises ``NotSupportedError`` (501, code ``control_not_supported``) naming the
verb and the backend, so an implementation overrides what it can do and inherits the refusal of
the rest.

Adding a verb (e.g. vLLM's ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``): one method here
(the signature, its docstring, ``raise self.unsupported("verb")``), overridden by the controls that
can do it, and one route in ``server.control_routes`` calling ``control_of(backend).verb(...)``.
No backend changes.

The argument checks every implementation shares (``check_mode``, ``check_timeout``,
``check_version``) live here too: 400 ``InvalidRequestError`` naming the parameter, with the
vocabulary (``WeightVersion``, ``PauseMode``) that engines (``engine.base`` re-exports it) and
backends share. This module imports nothing of gymserve but ``errors``: layer 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from gymserve.errors import InvalidRequestError, NotSupportedError

__all__ = [
    "MAX_VERSION_CHARS",
    "PAUSE_MODES",
    "Control",
    "PauseMode",
    "WeightVersion",
    "check_mode",
    "check_timeout",
    "check_version",
    "control_of",
]

WeightVersion = int | str
"""Which weights a token came from: an int the engine counts (0 for the weights it loaded, then one
more per update), or the string a trainer gave (SGLang's ``weight_version``)."""

PauseMode = Literal["abort", "wait", "keep"]
"""vLLM's pause modes: ``abort`` ends in-flight calls now, ``wait`` lets them finish, ``keep``
freezes them until ``resume_generation``."""
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")

MAX_VERSION_CHARS = 256


def check_mode(mode: Any) -> PauseMode:
    """``mode`` if it is a pause mode, else ``InvalidRequestError`` (400, param ``mode``)."""
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
    return mode


#: The longest pause, in seconds (one day). A pause is a training step's weight swap, minutes at
#: most; a bound keeps every deadline a time the OS can wait for (``1e300`` s overflowed ``time_t``
#: in the engine worker's ``queue.get(timeout=...)`` and killed it: issue #24).
MAX_PAUSE_SECONDS = 86400.0


def check_timeout(timeout: Any) -> float:
    """A pause timeout in seconds: a number with ``0 < timeout <= MAX_PAUSE_SECONDS`` (one day),
    else ``InvalidRequestError`` (400, param ``timeout``)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_PAUSE_SECONDS:
        raise InvalidRequestError(
            f"timeout must be a number of seconds > 0 and at most {MAX_PAUSE_SECONDS:g} (one day), got {timeout!r}",
            param="timeout",
        )
    return float(timeout)


def check_version(version: Any, param: str = "weight_version") -> WeightVersion:
    """A weight version a caller names: an int or a non-empty string of at most 256 characters
    (SGLang's ``weight_version`` is a string; gymserve counts ints), else ``InvalidRequestError``."""
    if (
        isinstance(version, bool)
        or not isinstance(version, (int, str))
        or version == ""
        or (isinstance(version, str) and len(version) > MAX_VERSION_CHARS)
    ):
        raise InvalidRequestError(
            f"{param} must be an integer or a non-empty string of at most "
            f"{MAX_VERSION_CHARS} characters, got {version!r}",
            param=param,
        )
    return version


class Control:
    """The control verbs (see the module docstring). ``owner``: the backend's registry name, for
    messages. This class itself is the control of a backend that serves weights it does not own:
    every verb raises ``NotSupportedError`` (501); ``control_status`` and ``lora_adapters`` are empty.

    Errors: ``GymserveError`` subclasses only (the server turns them into error objects)."""

    def __init__(self, owner: str = "backend"):
        self.owner = owner

    def unsupported(self, verb: str) -> NotSupportedError:
        """The 501 of a verb this control cannot do."""
        return NotSupportedError(
            f"{verb} is not supported by the {self.owner} backend yet: it serves weights it does not own. "
            "Use the local backend (backend.type: local) for weight updates and pauses in gymserve, or "
            "drive your upstream server's own control API",
            code="control_not_supported",
        )

    # ---- pause (vLLM's POST /pause, /resume, GET /is_paused) ------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """Pause in ``mode`` (``abort`` | ``wait`` | ``keep``) for at most ``timeout`` s (then
        generation resumes by itself); returns once the pause took effect. See
        docs/concepts/training-control.md. 409 ``pause_ended`` when a ``wait`` pause ends first."""
        raise self.unsupported("pause_generation")

    async def resume_generation(self) -> None:
        """End a pause."""
        raise self.unsupported("resume_generation")

    async def is_paused(self) -> bool:
        """Whether generation is paused."""
        raise self.unsupported("is_paused")

    # ---- weights (vLLM's POST /update_weights, /update_weight_version) --------------------------

    async def update_weights(
        self,
        tensors: Any = None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Swap in a state dict (``tensors``: name → ``torch.Tensor``) or the safetensors under
        ``path``, all or nothing; returns the new weight version (``weight_version``, else the count
        of updates). 400 ``WeightUpdateError`` naming the tensor or file; the old weights keep serving."""
        raise self.unsupported("update_weights")

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        """Name the serving weights ``new_version`` (after the caller changed them itself)."""
        raise self.unsupported("update_weight_version")

    # ---- LoRA (vLLM's POST /v1/load_lora_adapter, /v1/unload_lora_adapter) ----------------------

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | os.PathLike | None = None,
        *,
        tensors: Mapping[str, Any] | None = None,
        config: Any = None,
        load_inplace: bool = False,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Merge a PEFT adapter (directory ``lora_path``, or ``tensors`` + ``config`` in process);
        returns the new weight version (see ``engine.lora``)."""
        raise self.unsupported("load_lora_adapter")

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Remove the LoRA adapter ``lora_name``; returns the new weight version (404 when not loaded)."""
        raise self.unsupported("unload_lora_adapter")

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded LoRA adapters, ``[{"name", ...}]``; ``[]`` when none (or no LoRA)."""
        return []

    # ---- status (``/health``, ``/metrics``, ``GET /weight_info``) ------------------------------

    def control_status(self) -> list[dict[str, Any]]:
        """Per replica ``{"replica", "weight_version", "weight_updates", "paused", ...}``; empty for
        a backend without weights of its own."""
        return []

    async def refresh(self) -> None:
        """Read what the control reports from where it lives (a gateway reads its servers'
        versions); ``/health`` calls it first. Nothing by default."""
        return None

    async def close(self) -> None:
        """Release what the control holds (gates, clients); idempotent. Nothing by default."""
        return None


def control_of(backend: Any) -> Control:
    """``backend.control``, or a ``Control`` answering every verb 501 naming the backend when it
    has none (a cloud backend serves weights it does not own)."""
    control = getattr(backend, "control", None)
    return control if control is not None else Control(getattr(backend, "name", "backend"))
