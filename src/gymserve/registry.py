"""One registry mechanism: a name → class table with lazy imports, for backends, engines and parsers.

A registry entry is either a class (registered where it is defined) or a ``"module:Attr"`` string,
imported on first use, so naming a heavy backend or engine (vLLM, TensorRT-LLM, Ray) costs nothing
until it is asked for. Config validation, CLI ``choices`` and error messages all read
:meth:`Registry.names`, so a new implementation is one class and one ``register`` line.

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

__all__ = ["ROUTING_POLICIES", "Registry", "UnknownNameError"]


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


# routing.policy -> the RoutingPolicy class (gymserve.backends.routing), by name: the config (which
# validates the name) sits below the backends, so the entries are imported only when a pool is built.
ROUTING_POLICIES: Registry[Any] = Registry("routing policy")
ROUTING_POLICIES.register("sticky-least-loaded", "gymserve.backends.routing.sticky_least_loaded:StickyLeastLoaded")
ROUTING_POLICIES.register("round-robin", "gymserve.backends.routing.round_robin:RoundRobin")
ROUTING_POLICIES.register("consistent-hash", "gymserve.backends.routing.consistent_hash:ConsistentHash")
