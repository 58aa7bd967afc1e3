"""LoRA adapters on the local backend: which model name serves which weights.

The engine merges one adapter at a time into its weights (``engine.lora``). The names clients use
follow vLLM's ``--lora-modules`` convention, where a request's ``model`` picks the adapter:

- no adapter loaded: the base model serves every request, whatever its ``model`` (as before);
- an adapter loaded under the base model's name (``lora_name`` = the served model name): it
  replaces the policy under that name — what a trainer pushing its LoRA each step wants, since its
  agents keep calling the same model;
- an adapter loaded under its own name: requests must name it. The base weights are not available
  while it is merged, so a request naming the base model is refused (409, saying how to get it
  back) and any other name gets 404 ``model_not_found`` listing the served name.

Answers (``model`` field) and ``GET /v1/models`` give the served name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gymserve.engine.base import Engine, WeightVersion
from gymserve.errors import ConflictError, NotFoundError


class LocalLora:
    """Mixed into ``LocalBackend`` (which sets ``self.engine``): the ``Backend`` LoRA methods,
    delegated to the engine, and the model-name rule of the module docstring."""

    engine: Engine
    model_name: str  # the served name (config's served_model_name, else the engine's)

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
        returns the new weight version. See ``engine.lora.LoraEngine.load_lora_adapter``."""
        kwargs: dict[str, Any] = {"load_inplace": load_inplace, "weight_version": weight_version}
        if tensors is not None:
            kwargs.update(tensors=tensors, config=config)
        return await self.engine.load_lora_adapter(lora_name, None if lora_path is None else str(lora_path), **kwargs)

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Restore the base weights; returns the new weight version (404 for an adapter not loaded)."""
        return await self.engine.unload_lora_adapter(lora_name, weight_version=weight_version)

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapter(s), as ``engine.lora.LoraEngine.lora_adapters`` lists them."""
        return self.engine.lora_adapters()

    def served_model_name(self) -> str:
        """The name answers carry: the adapter's when it is loaded under its own name, else the model's."""
        # An engine a trainer hands to serve_policy may implement only generation: then no adapters.
        loaded: list[dict[str, Any]] = getattr(self.engine, "lora_adapters", list)()
        return loaded[0]["name"] if loaded else self.model_name

    def check_model(self, requested: Any) -> None:
        """Refuse a request whose ``model`` cannot be served now (see the module docstring):
        ``ConflictError`` (409) for the base model while an adapter of another name is merged,
        ``NotFoundError`` (404, code ``model_not_found``) for any other name then."""
        served, base = self.served_model_name(), self.model_name
        if served == base or requested == served:
            return
        if requested == base:
            raise ConflictError(
                f"model {base!r} (the base weights) is not served now: LoRA adapter {served!r} is merged "
                f"into them. Request model {served!r}, or unload the adapter "
                "(POST /v1/unload_lora_adapter) to serve the base model again",
                param="model",
                code="base_model_unavailable",
            )
        raise NotFoundError(
            f"The model {requested!r} does not exist: this server serves {served!r} (a LoRA adapter on {base!r})",
            param="model",
            code="model_not_found",
        )
