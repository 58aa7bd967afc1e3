"""The token-exact local backend, as a package: ``backend`` (``LocalBackend``), ``request`` (one
request → one engine call), ``output`` (the call's chunks), ``stream`` (engine deltas → chunks),
``control`` (pause/resume and weight updates, delegated to the engine; weight-version fields).
Imports point one way: backend → stream → output → control, request."""

from gymserve.backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]
