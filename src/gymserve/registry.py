"""The one registry home: every name a config or flag may give for an implementation, and where it
lives — backends, engines, tool-call and reasoning parsers, routing policies.

=======================  ======================  ===============================================
registry                 config / flag           entries are
=======================  ======================  ===============================================
``BACKENDS``             ``backend.type``        ``Backend`` subclasses (``gymserve.backends``)
``ENGINES``              ``backend.engine``      ``Engine`` subclasses (``gymserve.engine``)
``TOOL_CALL_PARSERS``    ``tool_call_parser``    ``ToolCallParser`` subclasses (``gymserve.parsers``)
``REASONING_PARSERS``    ``reasoning_parser``    ``ReasoningParser`` subclasses
``ROUTING_POLICIES``     ``routing.policy``      ``RoutingPolicy`` subclasses (``backends.routing``)
=======================  ======================  ===============================================

An entry is a ``"module:Attr"`` string, imported on first use, so naming a heavy backend or engine
(vLLM, TensorRT-LLM, Ray) costs nothing until it is asked for, and this module (layer 0) imports
nothing above it; a plugin may register a class itself (``parsers.register``). Config validation,
CLI ``choices`` and error messages all read :meth:`Registry.names`, so a new implementation is one
class and one ``register`` line here. ``scripts/check_layers.py`` reads this file: every entry must
name a module of the tree, and no other module may build a ``Registry`` (one home).

    >>> engines = Registry("engine")
    >>> engines.register("transformers", "gymserve.engine.transformers_engine:TransformersEngine")
    >>> engines.names()
    ('transformers',)

Errors: :meth:`Registry.get` raises :class:`UnknownNameError` (a ``ValueError``) naming the kind and
every registered choice; an entry whose module cannot be imported raises ``ImportError`` carrying the
install hint given at registration (e.g. ``pip install vllm``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = [
    "BACKENDS",
    "ENGINES",
    "REASONING_PARSERS",
    "ROUTING_POLICIES",
    "TOOL_CALL_PARSERS",
    "Registry",
    "UnknownNameError",
]


class UnknownNameError(ValueError):
    """A name no entry of the registry has; the message lists the choices."""

    def __init__(self, kind: str, name: object, choices: tuple[str, ...]):
        super().__init__(f"unknown {kind} {name!r}; choices: {', '.join(choices) or '(none registered)'}")
        self.kind = kind
        self.name = name
        self.choices = choices


class Registry(Generic[T]):
    """Name → implementation, in registration order.

    ``kind`` names what the entries are ("backend", "engine", "tool-call parser") in messages.
    Entries are classes or ``"package.module:Attr"`` strings resolved lazily by :meth:`get`.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T | str] = {}
        self._hints: dict[str, str] = {}

    def register(self, name: str, target: T | str, *, install_hint: str | None = None) -> None:
        """Add ``name``. ``target``: the class, or ``"module:Attr"`` to import on first :meth:`get`.
        ``install_hint``: what to tell a user whose install lacks the entry's dependencies.
        Raises ``ValueError`` when ``name`` is already registered to something else."""
        known = self._entries.get(name)
        if known is not None and known is not target and known != target:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = target
        if install_hint:
            self._hints[name] = install_hint

    def decorator(self, name: str) -> Callable[[T], T]:
        """``@registry.decorator("name")`` on a class registers it under ``name``."""

        def wrap(cls: T) -> T:
            self.register(name, cls)
            return cls

        return wrap

    def copy(self) -> Registry[T]:
        """An independent registry with the same entries (a test registers without leaking)."""
        clone: Registry[T] = Registry(self.kind)
        clone._entries, clone._hints = dict(self._entries), dict(self._hints)
        return clone

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order (for config validation and CLI choices)."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> T:
        """The implementation registered as ``name``, importing it on first use.

        Raises :class:`UnknownNameError` for an unregistered name and ``ImportError`` (with the
        install hint) when the entry's module or its dependencies are missing."""
        try:
            target = self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.kind, name, self.names()) from None
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            try:
                resolved: Any = getattr(importlib.import_module(module), attr)
            except ImportError as exc:
                hint = self._hints.get(name)
                if hint is None:
                    raise
                raise ImportError(f"the {name} {self.kind} is not installed ({exc}); {hint}") from exc
            self._entries[name] = resolved
            return resolved
        return target


# backend.type -> the Backend class. Same order as ``config.BackendConfig``.
BACKENDS: Registry[Any] = Registry("backend")
BACKENDS.register("local", "gymserve.backends.local:LocalBackend")
BACKENDS.register("chat", "gymserve.backends.chat:ChatBackend")
BACKENDS.register("openai", "gymserve.backends.openai_backend:OpenAIBackend")
BACKENDS.register("azure", "gymserve.backends.azure:AzureBackend")
BACKENDS.register("anthropic", "gymserve.backends.anthropic:AnthropicBackend")
BACKENDS.register("ray", "gymserve.ray_cluster.backend:RayBackend")

# backend.engine -> the Engine class (``from_config(config, resolved)``); a missing library's
# ImportError carries the hint.
ENGINES: Registry[Any] = Registry("engine")
ENGINES.register(
    "transformers",
    "gymserve.engine.transformers_engine:TransformersEngine",
    install_hint='install the local extra: pip install "gymserve[local]"',
)
ENGINES.register(
    "llamacpp",
    "gymserve.engine.llamacpp_engine:LlamaCppEngine",
    install_hint='install the llamacpp extra: pip install "gymserve[llamacpp]"',
)
ENGINES.register("vllm", "gymserve.engine.vllm_engine:VLLMEngine", install_hint="pip install vllm")
ENGINES.register("trtllm", "gymserve.engine.trtllm_engine:TRTLLMEngine", install_hint="pip install tensorrt_llm")

# tool_call_parser / reasoning_parser -> the parser class (vLLM's names for the same formats).
TOOL_CALL_PARSERS: Registry[Any] = Registry("tool-call parser")
TOOL_CALL_PARSERS.register("hermes", "gymserve.parsers.tool_calls:HermesToolCallParser")
TOOL_CALL_PARSERS.register("qwen2_5_coder", "gymserve.parsers.tool_calls:Qwen25CoderToolCallParser")
TOOL_CALL_PARSERS.register("llama3_json", "gymserve.parsers.tool_calls:Llama3JsonToolCallParser")
TOOL_CALL_PARSERS.register("mistral", "gymserve.parsers.tool_calls:MistralToolCallParser")
TOOL_CALL_PARSERS.register("deepseek_v3", "gymserve.parsers.tool_calls:DeepSeekV3ToolCallParser")
TOOL_CALL_PARSERS.register("openai", "gymserve.parsers.harmony:HarmonyToolCallParser")
TOOL_CALL_PARSERS.register("qwen3_coder", "gymserve.parsers.xml_calls:Qwen3CoderToolCallParser")
REASONING_PARSERS: Registry[Any] = Registry("reasoning parser")
REASONING_PARSERS.register("deepseek_r1", "gymserve.parsers.reasoning:DeepSeekR1ReasoningParser")
REASONING_PARSERS.register("qwen3", "gymserve.parsers.reasoning:Qwen3ReasoningParser")
REASONING_PARSERS.register("openai_gptoss", "gymserve.parsers.harmony:HarmonyReasoningParser")

# routing.policy -> the RoutingPolicy class (gymserve.backends.routing).
ROUTING_POLICIES: Registry[Any] = Registry("routing policy")
ROUTING_POLICIES.register("sticky-least-loaded", "gymserve.backends.routing.sticky_least_loaded:StickyLeastLoaded")
ROUTING_POLICIES.register("round-robin", "gymserve.backends.routing.round_robin:RoundRobin")
ROUTING_POLICIES.register("consistent-hash", "gymserve.backends.routing.consistent_hash:ConsistentHash")
