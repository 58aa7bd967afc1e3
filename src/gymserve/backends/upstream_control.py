"""The control endpoints of a trainer's own servers behind the chat backend: vLLM's and SGLang's.

``backend.upstream_control`` names the flavour; every operation goes to every replica (its base URL
without ``/v1``: the server's root) at once. What each operation is on each server, from their
source (vLLM ``vllm/entrypoints/serve/dev/rlhf/api_router.py`` and ``.../lora/api_router.py``, served
with ``VLLM_SERVER_DEV_MODE=1``, runtime LoRA with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; SGLang
``python/sglang/srt/entrypoints/http_server.py`` and ``managers/io_struct.py``):

==========================  ==========================================  ==============================================
operation                   ``vllm``                                    ``sglang``
==========================  ==========================================  ==============================================
pause(mode)                 ``POST /pause?mode=abort|wait|keep``        ``POST /pause_generation {"mode": "abort"}``;
                                                                        keep → ``{"mode": "retract"}`` (the KV cache is
                                                                        recomputed, as gymserve's keep does); wait has
                                                                        no SGLang mode: the gateway lets its calls
                                                                        finish, then ``retract``
resume                      ``POST /resume``                            ``POST /continue_generation {}``
update_weights(path, v)     ``POST /start_weight_update``,              ``POST /update_weights_from_disk
                            ``POST /update_weights {"update_info":      {"model_path": P, "weight_version": "v"}``
                            {"path": P}}`` (the ``disk`` weight
                            transfer), ``POST /finish_weight_update
                            {"weight_version": "v"}``
update_weight_version(v)    ``POST /update_weight_version               the same
                            {"new_version": "v"}``
weight_version()            ``GET /weight_info`` → ``weight_version``   ``GET /model_info`` → ``weight_version``
                                                                        (before it: ``GET /get_weight_version``)
load_lora(name, path, ip)   ``POST /v1/load_lora_adapter {"lora_name",  ``POST /load_lora_adapter {"lora_name",
                            "lora_path", "load_inplace"}``              "lora_path"}``; in place: ``POST
                                                                        /unload_lora_adapter`` of the name first
unload_lora(name)           ``POST /v1/unload_lora_adapter              ``POST /unload_lora_adapter {"lora_name"}``
                            {"lora_name"}``
==========================  ==========================================  ==============================================

vLLM's ``update_weights`` row needs a server started with a disk weight transfer (``GET
/server_info?config_format=json`` shows it); without one (vLLM 0.32 registers no ``disk`` backend)
it is ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": P}}``, then
``POST /update_weight_version`` (``VLLMControl.reload_weights``).

Both servers take versions as strings; gymserve sends ``str(version)``. The ``none`` flavour
forwards nothing: the gateway pauses at its door only, and weight operations answer 501 naming the
operation and the setting. Answers: 2xx as JSON or text; a 404 of a route the server lacks (FastAPI's
``{"detail": "Not Found"}``) is 501 ``control_not_supported`` saying how that server enables it;
another 404 (an adapter that is not loaded) is 404; 401/403 ``upstream_auth``; other 4xx pass on
with their status and the server's message; 5xx ``upstream_server_error``; connection failures
``upstream_unreachable``, timeouts ``upstream_timeout`` — each naming the URL. SGLang's
``{"success": false, ...}`` answers are errors with its message. A failure on some replicas names
them and the ones where the operation took effect.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from gymserve.backends.chat_versions import root_of
from gymserve.engine.base import PauseMode, WeightVersion
from gymserve.errors import (
    GymserveError,
    NotFoundError,
    NotSupportedError,
    UpstreamAuthError,
    UpstreamRejectedError,
    UpstreamServerError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gymserve.redaction import redact_url

FLAVOURS = ("none", "vllm", "sglang")


class UpstreamControl:
    """The ``none`` flavour and the HTTP plumbing of the others: ``roots`` (one per replica),
    ``headers`` (auth, ``default_headers``), ``timeout`` seconds per call. Subclasses implement the
    operations of the table in the module docstring; here each one answers ``NotSupportedError``."""

    flavour: ClassVar[str] = "none"
    enable_hint: ClassVar[str] = ""

    def __init__(self, roots: list[str], *, headers: dict[str, str] | None = None, timeout: float = 600.0):
        self.roots = roots
        self.headers = dict(headers or {})
        self.timeout = timeout
        self._client: Any = None

    # ---- operations (``none``: forward nothing) ---------------------------------------------------

    def unsupported(self, op: str) -> NotSupportedError:
        return NotSupportedError(
            f"{op} is not forwarded: backend.upstream_control is {self.flavour!r}. Set it to 'vllm' or 'sglang' "
            "when your servers have those control endpoints, or call them on the servers yourself",
            code="control_not_supported",
        )

    async def pause(self, mode: PauseMode) -> None:
        return None  # the gateway pauses at its door

    async def resume(self) -> None:
        return None

    async def update_weights(self, path: str, version: WeightVersion) -> None:
        raise self.unsupported("update_weights")

    async def update_weight_version(self, version: WeightVersion) -> None:
        raise self.unsupported("update_weight_version")

    async def weight_versions(self) -> dict[str, Any]:
        """``{root: the version it reports}`` (``{}`` without a flavour)."""
        return {}

    async def load_lora(self, name: str, path: str, inplace: bool) -> None:
        raise self.unsupported("load_lora_adapter")

    async def unload_lora(self, name: str) -> None:
        raise self.unsupported("unload_lora_adapter")

    # ---- HTTP ---------------------------------------------------------------------------------

    def _http(self):
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(headers=self.headers, timeout=self.timeout)
        return self._client

    async def request(
        self, method: str, root: str, path: str, *, json: Any = None, params: dict[str, str] | None = None
    ) -> Any:
        """``method root+path``: the parsed JSON answer (the text when it is not JSON); raises the
        ``GymserveError`` of the module docstring."""
        import httpx

        url = root + path
        shown = redact_url(url)
        try:
            # A fresh connection per control call: a server closes its end after an unhandled error
            # (uvicorn after a bare 500), and a pooled connection would then fail the next call.
            resp = await self._http().request(method, url, json=json, params=params, headers={"Connection": "close"})
        except httpx.TimeoutException:
            raise UpstreamTimeoutError(
                f"{shown} did not answer within {self.timeout:g} s (backend.control_timeout)", url=shown
            ) from None
        except httpx.HTTPError as exc:
            raise UpstreamUnreachableError(
                f"cannot reach {shown} ({type(exc).__name__}: {exc}); is the server up?", url=shown
            ) from None
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        if resp.status_code < 400 and not (isinstance(body, dict) and body.get("success") is False):
            return body
        raise self._error(resp.status_code, body, shown, path)

    def _error(self, status: int, body: Any, url: str, path: str) -> GymserveError:
        said = _message(body)
        if status == 404 and body == {"detail": "Not Found"}:
            return NotSupportedError(
                f"{url} answered 404: this {self.flavour} server has no {path} endpoint{self.enable_hint}",
                code="control_not_supported",
            )
        if status == 404:
            return NotFoundError(f"{url}: {said}", code="upstream_not_found")
        if status in (401, 403):
            return UpstreamAuthError(
                f"{url} refused the credentials ({status}: {said}); set backend.control_api_key to the "
                "server's admin key (default: backend.api_key)",
                url=url,
            )
        if status >= 500:
            return UpstreamServerError(f"{url} failed ({status}): {said}", url=url, status_code=502)
        return UpstreamRejectedError(f"{url} refused the call ({status}): {said}", url=url, status_code=status)

    async def everywhere(self, op: str, call) -> list[Any]:
        """``call(root)`` on every replica at once; the results, or the first failure's error
        naming where ``op`` took effect and where not."""
        results = await asyncio.gather(*(call(root) for root in self.roots), return_exceptions=True)
        failed = [(root, r) for root, r in zip(self.roots, results) if isinstance(r, BaseException)]
        if not failed:
            return list(results)
        root, first = failed[0]
        if not isinstance(first, GymserveError):
            raise first
        if len(self.roots) > 1:
            ok = [redact_url(r) for r, res in zip(self.roots, results) if not isinstance(res, BaseException)]
            where = f"; it took effect on {', '.join(ok)}" if ok else "; it took effect on no replica"
            first.message = f"{op} failed on {len(failed)} of {len(self.roots)} replicas: {first.message}{where}"
            first.args = (first.message,)
        raise first

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class VLLMControl(UpstreamControl):
    """vLLM's RL and LoRA endpoints (see the module docstring)."""

    flavour = "vllm"
    enable_hint = (
        " (vLLM serves /pause, /resume, /update_weights... with VLLM_SERVER_DEV_MODE=1 and weight updates from "
        'disk with --weight-transfer-config \'{"backend": "disk"}\'; /v1/load_lora_adapter with --enable-lora '
        "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
    )

    async def pause(self, mode: PauseMode) -> None:
        await self.everywhere("pause", lambda root: self.request("POST", root, "/pause", params={"mode": mode}))

    async def resume(self) -> None:
        await self.everywhere("resume", lambda root: self.request("POST", root, "/resume"))

    async def update_weights(self, path: str, version: WeightVersion) -> None:
        async def one(root: str) -> None:
            if await self.transfer_backend(root) != "disk":
                await self.reload_weights(root, path, version)
                return
            await self.request("POST", root, "/start_weight_update")
            await self.request("POST", root, "/update_weights", json={"update_info": {"path": path}})
            await self.request("POST", root, "/finish_weight_update", json={"weight_version": str(version)})

        await self.everywhere("update_weights", one)

    async def transfer_backend(self, root: str) -> str | None:
        """The weight transfer backend the server was started with (``--weight-transfer-config``),
        from ``GET /server_info?config_format=json`` (dev mode): ``vllm_config.weight_transfer_config
        .backend``, None when there is none. Asked before every update instead of trying
        ``/start_weight_update``: without a transfer vLLM 0.32's worker raises "Weight transfer not
        configured", which the route does not catch (a bare 500, and uvicorn closes the connection).
        A server without ``/server_info`` (an older vLLM, or a gymserve, which answers the disk
        sequence itself) is assumed to have the disk transfer, the only way it could update from a
        directory."""
        try:
            info = await self.request("GET", root, "/server_info", params={"config_format": "json"})
        except (NotSupportedError, NotFoundError):  # an older vLLM, or a gymserve (its own 404 body)
            return "disk"
        config = info.get("vllm_config") if isinstance(info, dict) else None
        transfer = config.get("weight_transfer_config") if isinstance(config, dict) else None
        backend = transfer.get("backend") if isinstance(transfer, dict) else None
        return str(backend) if backend is not None else None

    async def reload_weights(self, root: str, path: str, version: WeightVersion) -> None:
        """A server started without a disk weight transfer (vLLM 0.32 registers no ``disk`` backend):
        vLLM's own in-place reload of a complete checkpoint, ``POST /collective_rpc {"method": "reload_weights", "kwargs":
        {"weights_path": P}}`` (``vllm/entrypoints/serve/dev/rpc``, dev mode), then ``POST
        /update_weight_version``. A reload vLLM fails (a missing or incomplete checkpoint) is a 400
        naming the path, not a 502: the request was wrong, not the server. A failed reload can leave
        vLLM 0.32's engine dead (its layers were being replaced when the checkpoint failed; seen with
        a directory that does not exist: the next generation ends in ``EngineDeadError``), so the
        message says whether the server still answers ``GET /health``."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        try:
            await self.request("POST", root, "/collective_rpc", json=body)
        except UpstreamServerError as exc:
            try:
                await self.request("GET", root, "/health")
                alive = (
                    "vLLM still answers GET /health, but a failed reload can leave its engine unable to generate "
                    "(seen on vLLM 0.32): check a call, or restart the server"
                )
            except GymserveError as health:
                alive = (
                    f"vLLM's engine did not survive the failed reload ({health.message}): restart the server, "
                    "and give a complete safetensors checkpoint of the served model"
                )
            raise UpstreamRejectedError(
                f"vLLM could not reload weights from {path}: {exc.message}; {alive}",
                url=exc.url,
                status_code=400,
                param="update_info.path",
            ) from None
        await self.request("POST", root, "/update_weight_version", json={"new_version": str(version)})

    async def update_weight_version(self, version: WeightVersion) -> None:
        await self.everywhere(
            "update_weight_version",
            lambda root: self.request("POST", root, "/update_weight_version", json={"new_version": str(version)}),
        )

    async def weight_versions(self) -> dict[str, Any]:
        answers = await self.everywhere("weight_info", lambda root: self.request("GET", root, "/weight_info"))
        return {root: (a or {}).get("weight_version") for root, a in zip(self.roots, answers)}

    async def load_lora(self, name: str, path: str, inplace: bool) -> None:
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        await self.everywhere(
            "load_lora_adapter", lambda root: self.request("POST", root, "/v1/load_lora_adapter", json=body)
        )

    async def unload_lora(self, name: str) -> None:
        await self.everywhere(
            "unload_lora_adapter",
            lambda root: self.request("POST", root, "/v1/unload_lora_adapter", json={"lora_name": name}),
        )


class SGLangControl(UpstreamControl):
    """SGLang's native control endpoints (see the module docstring)."""

    flavour = "sglang"
    enable_hint = " (SGLang serves them from python -m sglang.launch_server; is the base URL SGLang's?)"

    async def pause(self, mode: PauseMode) -> None:
        body = {"mode": "abort" if mode == "abort" else "retract"}
        await self.everywhere("pause", lambda root: self.request("POST", root, "/pause_generation", json=body))

    async def resume(self) -> None:
        await self.everywhere("resume", lambda root: self.request("POST", root, "/continue_generation", json={}))

    async def update_weights(self, path: str, version: WeightVersion) -> None:
        body = {"model_path": path, "weight_version": str(version)}
        await self.everywhere(
            "update_weights", lambda root: self.request("POST", root, "/update_weights_from_disk", json=body)
        )

    async def update_weight_version(self, version: WeightVersion) -> None:
        await self.everywhere(
            "update_weight_version",
            lambda root: self.request("POST", root, "/update_weight_version", json={"new_version": str(version)}),
        )

    async def weight_versions(self) -> dict[str, Any]:
        async def one(root: str) -> Any:
            try:
                return (await self.request("GET", root, "/model_info")).get("weight_version")
            except (NotSupportedError, NotFoundError):  # SGLang before /model_info
                return (await self.request("GET", root, "/get_weight_version")).get("weight_version")

        answers = await self.everywhere("weight_version", one)
        return dict(zip(self.roots, answers))

    async def load_lora(self, name: str, path: str, inplace: bool) -> None:
        async def one(root: str) -> None:
            if inplace:  # SGLang has no in-place load: unload the name first (absent is fine)
                try:
                    await self.request("POST", root, "/unload_lora_adapter", json={"lora_name": name})
                except (UpstreamRejectedError, NotFoundError):
                    pass
            await self.request("POST", root, "/load_lora_adapter", json={"lora_name": name, "lora_path": path})

        await self.everywhere("load_lora_adapter", one)

    async def unload_lora(self, name: str) -> None:
        await self.everywhere(
            "unload_lora_adapter",
            lambda root: self.request("POST", root, "/unload_lora_adapter", json={"lora_name": name}),
        )


CONTROLS: dict[str, type[UpstreamControl]] = {"none": UpstreamControl, "vllm": VLLMControl, "sglang": SGLangControl}


def control_for(config: Any) -> UpstreamControl:
    """The ``UpstreamControl`` of a ``ChatBackendConfig``: its flavour, one root per base URL, the
    control key (``control_api_key``, else ``api_key``) as ``Authorization: Bearer``."""
    from gymserve.backends.upstream import secret_value

    key = secret_value(config.control_api_key) or secret_value(config.api_key)
    headers = dict(config.default_headers or {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    roots = [root_of(b) for b in config.base_urls]
    return CONTROLS[config.upstream_control](roots, headers=headers, timeout=config.control_timeout)


def _message(body: Any) -> str:
    """The server's own words from an error body (vLLM, SGLang, FastAPI and OpenAI shapes)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "error_message", "detail", "error"):
            if body.get(key):
                return str(body[key])
        return str(body)[:500]
    return str(body)[:500] or "no message"
