"""Fake vLLM and SGLang servers that speak their chat and RL control APIs exactly, for the chat
backend's training gateway (``gymserve.backends.chat_control``).

Each is a handler for ``fakes.FakeServer`` (which records method, path, query, headers and body)
and follows its server's source:

- vLLM (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config '{"backend":
  "disk"}'``, runtime LoRA): ``POST /pause?mode=abort|wait|keep`` → ``{"status": "paused"}``,
  ``POST /resume`` → ``{"status": "resumed"}``, ``GET /is_paused`` → ``{"is_paused"}``,
  ``POST /start_weight_update`` / ``/update_weights {"update_info": {"path"}}`` /
  ``/finish_weight_update {"weight_version"}`` (``vllm/entrypoints/serve/dev/rlhf/api_router.py``;
  the disk backend's ``DiskWeightTransferUpdateInfo`` wants an absolute directory holding
  ``*.safetensors``, and one checkpoint per started session — its ValueError/RuntimeError are not
  caught by the route: a bare 500), ``POST /update_weight_version {"new_version": str}``,
  ``GET /weight_info``, ``POST /v1/load_lora_adapter`` (plain-text ``Success: ...``; 400 error object
  for a name already loaded without ``load_inplace``), ``POST /v1/unload_lora_adapter`` (404 error
  object for an unknown name). An unknown route is FastAPI's 404 ``{"detail": "Not Found"}``.
- SGLang (``python/sglang/srt/entrypoints/http_server.py``): ``POST /pause_generation {"mode":
  "abort"|"retract"|"in_place"}``, ``POST /continue_generation``, ``POST /update_weights_from_disk``
  (``{"success", "message", "num_paused_requests"}``, 400 with ``success: false``),
  ``POST /update_weight_version``, ``GET /model_info`` (and the deprecated ``/get_weight_version``:
  a 404 saying so), ``POST /load_lora_adapter`` / ``/unload_lora_adapter`` (``{"success",
  "error_message", "loaded_adapters"}``, 400 when not successful).

Both serve ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (streamed or not),
generating ``tokens`` words ``delay`` seconds apart. Neither names a weight version in a streamed
chunk; SGLang's whole answers carry ``metadata: {"weight_version": v}`` (its
``ChatCompletionResponse`` / ``CompletionResponse``, set from the generation's ``meta_info``), and
with ``return_meta_info: true`` each chat choice the generation's ``meta_info``; vLLM's name none.
Both and honour their own pause: an abort pause ends the requests in
flight with what they generated and ``finish_reason: "abort"``; a keep/retract/in_place pause
freezes them until resumed; new requests wait while paused. ``api_key``: when set, every route
wants ``Authorization: Bearer <api_key>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from helpers.fakes import Recorded

NOT_FOUND = (404, {"detail": "Not Found"})


class _FakeInference:
    """Chat generation under the server's own pause state (shared by both fakes)."""

    flavour = "?"

    def __init__(self, *, tokens: int = 30, delay: float = 0.02, api_key: str | None = None):
        self.tokens, self.delay, self.api_key = tokens, delay, api_key
        self.paused: str | None = None  # the mode, as the server names it
        self.weight_version: str | None = None
        self.loras: dict[str, str] = {}
        self.in_flight = 0
        self.finished: list[str] = []  # finish reasons of the requests served
        self._resumed: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    def _pause(self, mode: str) -> None:
        self.paused = mode
        self._event().clear()

    def _resume(self) -> None:
        self.paused = None
        self._event().set()

    def _frozen(self) -> bool:
        return self.paused not in (None, "abort", "wait")

    async def _tokens(self):
        """Yield words until ``tokens`` are out (then "stop") or an abort pause ("abort")."""
        while self.paused is not None:  # new requests wait while paused
            await self._event().wait()
        self.in_flight += 1
        try:
            for i in range(self.tokens):
                while self._frozen():
                    await self._event().wait()
                if self.paused == "abort":
                    self.finished.append("abort")
                    yield None, "abort"
                    return
                await asyncio.sleep(self.delay)
                yield f"w{i} ", None
            self.finished.append("stop")
            yield None, "stop"
        finally:
            self.in_flight -= 1

    def whole_extras(self) -> dict[str, Any]:
        """What a whole (non-streamed) answer adds at its top level: nothing (vLLM)."""
        return {}

    def choice_extras(self, body: dict[str, Any]) -> dict[str, Any]:
        """What a whole chat answer adds to its choice: nothing (vLLM)."""
        return {}

    async def chat(self, r: Recorded) -> Any:
        return await self._generate(r, chat=True)

    async def completions(self, r: Recorded) -> Any:
        return await self._generate(r, chat=False)

    async def _generate(self, r: Recorded, *, chat: bool) -> Any:
        model = r.body.get("model", "policy")
        prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        head = {"id": f"{prefix}-{int(time.time() * 1e6)}", "created": int(time.time()), "model": model}
        if r.body.get("stream"):

            async def events():
                async for text, finish in self._tokens():
                    if chat:
                        choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
                    else:
                        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
                    chunk = {**head, "object": "chat.completion.chunk" if chat else kind, "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text, finish = "", "stop"
        async for piece, fin in self._tokens():
            text += piece or ""
            finish = fin or finish
        n = len(text.split())
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                **self.choice_extras(r.body),
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return 200, {
            **head,
            "object": kind,
            "choices": [choice],
            "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
            **self.whole_extras(),
        }

    async def __call__(self, r: Recorded) -> Any:
        if self.api_key is not None and r.headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, {"error": "Unauthorized"}
        if r.method == "GET" and r.path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]}
        if r.method == "POST" and r.path == "/v1/chat/completions":
            return await self.chat(r)
        if r.method == "POST" and r.path == "/v1/completions":
            return await self.completions(r)
        return await self.control(r)

    async def control(self, r: Recorded) -> Any:
        raise NotImplementedError


def _safetensors_dir(path: Any) -> str | None:
    """Why vLLM's disk transfer refuses ``path`` (DiskWeightTransferUpdateInfo), or None."""
    if not isinstance(path, str) or not path:
        return "`path` must be a non-empty absolute local directory"
    if not os.path.isabs(path):
        return "`path` must be an absolute local directory"
    if not os.path.isdir(path):
        return f"Shared-disk checkpoint path must be a local directory: {path}"
    if not any(p.name.endswith(".safetensors") for p in Path(path).iterdir() if p.is_file()):
        return f"Shared-disk checkpoint directory contains no safetensors files: {path}"
    return None


class FakeVLLM(_FakeInference):
    """vLLM's dev-mode RL endpoints and runtime LoRA endpoints (see the module docstring)."""

    flavour = "vllm"

    def __init__(self, *, transfer: str | None = "disk", **kwargs: Any):
        super().__init__(**kwargs)
        self.weight_version = None
        self.transfer = transfer  # --weight-transfer-config's backend (vLLM 0.32 has no "disk": None)
        self.session = False  # a disk weight update session is open
        self.loaded_path: str | None = None

    async def control(self, r: Recorded) -> Any:
        body = r.body if isinstance(r.body, dict) else {}
        route = (r.method, r.path)
        if route == ("POST", "/pause"):
            mode = r.query.get("mode", "abort")
            if mode not in ("abort", "wait", "keep"):
                return 422, {
                    "detail": [
                        {
                            "type": "literal_error",
                            "loc": ["query", "mode"],
                            "msg": "Input should be 'abort', 'wait' or 'keep'",
                        }
                    ]
                }
            self._pause(mode)
            if mode == "wait":
                while self.in_flight:
                    await asyncio.sleep(0.01)
            return 200, {"status": "paused"}
        if route == ("POST", "/resume"):
            self._resume()
            return 200, {"status": "resumed"}
        if route == ("GET", "/is_paused"):
            return 200, {"is_paused": self.paused is not None}
        if route == ("GET", "/health"):
            return 200, {}
        if route == ("GET", "/server_info"):  # dev mode; config_format=json: the VllmConfig as JSON
            transfer = {"backend": self.transfer} if self.transfer else None
            return 200, {"vllm_config": {"weight_transfer_config": transfer}, "vllm_env": {}, "system_env": {}}
        if route == ("POST", "/collective_rpc"):
            # vllm/entrypoints/serve/dev/rpc: the workers' method; reload_weights(weights_path=DIR) reads
            # a complete checkpoint. A worker's exception is not caught by the route: a bare 500.
            if body.get("method") != "reload_weights":
                return 500, {"error": {"message": f"unknown method {body.get('method')}", "code": 500}}
            path = (body.get("kwargs") or {}).get("weights_path")
            if _safetensors_dir(path) is not None:
                return PlainTextResponse("Internal Server Error", status_code=500)
            self.loaded_path = path
            return 200, {"results": [None]}
        if route == ("POST", "/start_weight_update"):
            if not self.transfer:  # RuntimeError: Weight transfer not configured (uncaught)
                return PlainTextResponse("Internal Server Error", status_code=500)
            if self.session:
                return PlainTextResponse("Internal Server Error", status_code=500)  # RuntimeError: already active
            self.session, self.loaded_path = True, None
            return 200, {"message": "Weight update started"}
        if route == ("POST", "/update_weights"):
            if "update_info" not in body:
                return 400, {"detail": "Missing 'update_info' in request body"}
            info = body["update_info"]
            why = _safetensors_dir(info.get("path")) if isinstance(info, dict) else "update_info must be an object"
            if why is not None or not self.session or set(info) != {"path"}:
                self.session = False  # the disk engine aborts the session on any failure
                return PlainTextResponse("Internal Server Error", status_code=500)
            self.loaded_path = info["path"]
            return 200, {"message": "Weights updated"}
        if route == ("POST", "/finish_weight_update"):
            if not self.session or self.loaded_path is None:
                self.session = False
                return PlainTextResponse("Internal Server Error", status_code=500)
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                return 422, {
                    "detail": [
                        {
                            "type": "string_type",
                            "loc": ["body", "weight_version"],
                            "msg": "Input should be a valid string",
                        }
                    ]
                }
            self.session = False
            if version is not None:
                self.weight_version = version
            return 200, {"message": "Weight update finished"}
        if route == ("POST", "/update_weight_version"):
            version = body.get("new_version")
            if not isinstance(version, str):
                return 422, {
                    "detail": [
                        {"type": "string_type", "loc": ["body", "new_version"], "msg": "Input should be a valid string"}
                    ]
                }
            self.weight_version = version
            return 200, {"success": True, "new_version": version}
        if route == ("GET", "/weight_info"):
            return 200, {"weight_version": self.weight_version}
        if route == ("POST", "/v1/load_lora_adapter"):
            name, path = body.get("lora_name"), body.get("lora_path")
            if name in self.loras and not body.get("load_inplace", False):
                return 400, {
                    "object": "error",
                    "message": f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            self.loras[name] = path
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
        if route == ("POST", "/v1/unload_lora_adapter"):
            name = body.get("lora_name")
            if name not in self.loras:
                return 404, {
                    "object": "error",
                    "message": f"The lora adapter '{name}' cannot be found.",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            del self.loras[name]
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
        return NOT_FOUND


class FakeSGLang(_FakeInference):
    """SGLang's native control endpoints (see the module docstring)."""

    flavour = "sglang"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.weight_version = "default"  # SGLang's --weight-version default
        self.model_path = "/models/policy"

    def whole_extras(self) -> dict[str, Any]:
        return {"metadata": {"weight_version": self.weight_version}}

    def choice_extras(self, body: dict[str, Any]) -> dict[str, Any]:
        if not body.get("return_meta_info"):
            return {}
        return {"meta_info": {"id": "req-1", "finish_reason": {"type": "stop"}, "weight_version": self.weight_version}}

    async def control(self, r: Recorded) -> Any:
        body = r.body if isinstance(r.body, dict) else {}
        route = (r.method, r.path)
        if route == ("POST", "/pause_generation"):
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                return 400, {
                    "object": "error",
                    "message": f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].",
                    "type": "Bad Request",
                    "param": None,
                    "code": 400,
                }
            self._pause(mode)
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if route == ("POST", "/continue_generation"):
            self._resume()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if route == ("POST", "/update_weights_from_disk"):
            path = body.get("model_path")
            if not isinstance(path, str) or not os.path.isdir(path):
                return JSONResponse(
                    {
                        "success": False,
                        "message": f"Failed to get weights iterator: {path} (repository not found).",
                        "num_paused_requests": 0,
                    },
                    status_code=400,
                )
            self.model_path = path
            message = "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
                message += f" Weight version updated to {body['weight_version']}."
            return 200, {"success": True, "message": message, "num_paused_requests": 0}
        if route == ("POST", "/update_weight_version"):
            self.weight_version = body.get("new_version")
            return 200, {
                "success": True,
                "message": f"Weight version updated to {self.weight_version}",
                "new_version": self.weight_version,
            }
        if route == ("GET", "/model_info"):
            return 200, {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        if route in (("GET", "/get_weight_version"), ("GET", "/weight_version")):
            return 404, {
                "detail": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
            }
        if route == ("POST", "/load_lora_adapter"):
            name, path = body.get("lora_name"), body.get("lora_path")
            if name in self.loras:
                return JSONResponse(
                    {
                        "success": False,
                        "error_message": f"The LoRA adapter with name '{name}' is already loaded.",
                        "loaded_adapters": dict(self.loras),
                    },
                    status_code=400,
                )
            self.loras[name] = path
            return 200, {"success": True, "error_message": None, "loaded_adapters": dict(self.loras)}
        if route == ("POST", "/unload_lora_adapter"):
            name = body.get("lora_name")
            if name not in self.loras:
                return JSONResponse(
                    {
                        "success": False,
                        "error_message": f"LoRA adapter '{name}' is not loaded.",
                        "loaded_adapters": dict(self.loras),
                    },
                    status_code=400,
                )
            del self.loras[name]
            return 200, {"success": True, "error_message": None, "loaded_adapters": dict(self.loras)}
        return NOT_FOUND


def routes(server: Any) -> list[tuple[str, str]]:
    """``(method, path)`` of every request a ``FakeServer`` recorded, except chat and model listing."""
    inference = ("/v1/chat/completions", "/v1/completions", "/v1/models")
    return [(r.method, r.path) for r in server.requests if r.path not in inference]
