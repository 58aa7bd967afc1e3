"""Settings: one YAML file → validated pydantic models.

Shape::

    server:  {host, port, api_key, admin_api_key, max_body_bytes, capture_path, max_queue, shutdown_timeout}
    backend: {type: local | chat | openai | azure | anthropic | ray, ...}

``${var}`` in the YAML resolves against the keys of an ``env.yaml`` (beside the config file, or
given) and ``${oc.env:VAR}`` against environment variables (OmegaConf interpolation, as NeMo Gym
does). The vocabulary NeMo Gym users already have works unchanged: ``policy_base_url``,
``policy_api_key``, ``policy_model_name``, ``policy_api_version`` and the model-server options
``openai_base_url``, ``openai_api_key``, ``openai_model``, ``default_query``,
``num_concurrent_requests``, ``return_token_id_information``, ``chat_template_kwargs``,
``extra_body``. Three layouts are accepted:

1. a ``backend:`` section (the gymserve layout);
2. NeMo Gym's nesting ``policy_model: {responses_api_models: {vllm_model | openai_model |
   azure_openai_model: {...}}}`` (mapped to chat | openai | azure);
3. flat top-level keys (``policy_base_url: ...`` and no backend section) → a chat backend.

Errors: ``ConfigError`` (a ``ValueError``) whose message lists every problem as
``key.path: what is wrong``; secret values (``SecretStr`` fields) never appear in it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gymserve.registry import BACKENDS, ENGINES, ROUTING_POLICIES
from gymserve.wire.reasoning import ReasoningField


class ConfigError(ValueError):
    """The configuration is invalid; the message names each key path and what to change."""


class _Model(BaseModel):
    # extra="forbid": a misspelt option is an error naming the key, not a silently ignored line.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# Keys renamed to ``vllm serve``'s flag names where the concept is the same (``--max-model-len``,
# ``--max-num-seqs``, ``--tool-call-parser``): old key → new key, in every backend section that has
# the new key. The old keys are read for one more release with a FutureWarning; giving both is an error.
RENAMED_KEYS: dict[str, str] = {
    "context_window": "max_model_len",
    "max_batch_size": "max_num_seqs",
    "tool_parser": "tool_call_parser",
}


def _renamed_keys(data: Any, fields: Any, section: str) -> Any:
    """``data`` (a section's raw mapping) with each old key of ``RENAMED_KEYS`` whose new key is one
    of ``fields`` moved to the new key, warning (``FutureWarning``) once per key; ``ValueError``
    (a ``ConfigError`` once loaded) when a section gives both."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old, new in RENAMED_KEYS.items():
        if old not in data or new not in fields:
            continue
        if new in data:
            raise ValueError(
                f"{section}.{old} and {section}.{new} both given: {old} is the old name of {new}; keep {new}"
            )
        warnings.warn(
            f"config key {section}.{old} is now {section}.{new} (vllm serve's name); the old key is read until the "
            "next release",
            FutureWarning,
            stacklevel=2,
        )
        data[new] = data.pop(old)
    return data


class ServerConfig(_Model):
    """gymserve's own HTTP server. ``api_key`` is the key clients must present (None: open; the CLI
    falls back to the ``GYMSERVE_API_KEY`` environment variable, as ``vllm serve`` reads ``VLLM_API_KEY``);
    ``admin_api_key``, when set, is the only key the control routes (pause, weight updates) take."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    admin_api_key: SecretStr | None = Field(
        None,
        description="key for the control routes (/pause, /update_weights, "
        "...); default: api_key. Without any key they answer 403 beyond loopback",
    )
    max_body_bytes: int = Field(16 << 20, ge=1024)
    capture_path: str | None = None
    max_queue: int = Field(1024, ge=0)
    shutdown_timeout: float = Field(30.0, gt=0, description="seconds in-flight requests get to finish after SIGTERM")
    return_tokens_as_token_ids: bool = Field(
        False,
        description="vLLM's server flag: every log-prob token of /v1/chat/completions and /v1/completions is "
        "spelled token_id:N unless the request sends return_tokens_as_token_ids itself",
    )


class _ServedModelNames(_Model):
    """The names clients use for the model, as ``vllm serve --served-model-name NAME [NAME ...]``:
    the first is what answers report in ``model`` and ``/v1/models`` lists first; the others are
    aliases, listed after it. ``served_model_name`` also takes a list (vLLM's form), which is split
    into the name and ``served_model_aliases``."""

    served_model_name: str | None = Field(
        None,
        description="Name clients see in answers (`model`) and `/v1/models` (default: the model's own "
        "name). A list is the name followed by aliases, as `--served-model-name A B`.",
    )
    served_model_aliases: list[str] = Field(
        default_factory=list,
        description="Other names `/v1/models` lists for the same model (vLLM lists every `--served-model-name`).",
    )

    @model_validator(mode="before")
    @classmethod
    def _name_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("served_model_name"), (list, tuple)):
            names = [str(n) for n in data["served_model_name"]]
            if not names or not all(n.strip() for n in names):
                raise ValueError("served_model_name: give at least one non-empty name")
            data = {
                **data,
                "served_model_name": names[0],
                "served_model_aliases": [*names[1:], *(data.get("served_model_aliases") or [])],
            }
        return data

    @property
    def served_model_names(self) -> list[str]:
        """``[served_model_name, *aliases]`` without repeats; empty when no name is configured."""
        if not self.served_model_name:
            return []
        return list(dict.fromkeys([self.served_model_name, *self.served_model_aliases]))


class SamplingConfig(_Model):
    """Local-engine sampling: the server's ``temperature``/``top_p``/``top_k``/``min_p``/``seed``
    and whether requests may choose their own.

    ``pin``: ``off`` (the default, as ``vllm serve``): these are the defaults, and a request's own
    values are applied; ``reject``: these are fixed, and a request sending another value gets a 400
    naming it (code ``sampling_param_pinned``) — what an on-policy trainer wants, so every rollout
    is sampled from the distribution it assumes (``gymserve train-demo`` pins); ``override``: these
    are fixed and a request's other values are ignored (for clients that always send their own).
    ``min_p`` 0 and ``top_p`` 1 are off; ``top_k`` None, 0 or -1 is off."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    pin: Literal["off", "reject", "override"] = "off"

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "on_mismatch" in data:
            raise ValueError(
                "sampling.on_mismatch is now sampling.pin: off (requests choose their own sampling, as in "
                "vLLM; the default), reject (the server's values are fixed: a request asking for others is "
                "a 400; on_mismatch: reject) or override (on_mismatch: override)"
            )
        return data


class LocalBackendConfig(_ServedModelNames):
    """The engine runs in this process (token-exact). ``model``: "embedded", an embedded model's name
    (``engine.embedded_models``), a directory or a .gguf."""

    type: Literal["local"] = "local"
    model: str = "embedded"

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        return _renamed_keys(data, cls.model_fields, "backend")

    engine: str = "transformers"
    chat_template: str | None = None  # a file, or `harmony` (prompting.harmony_template)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = None
    split_special_tokens: bool = Field(
        True,
        description="text inside messages and tools (user text, tool outputs, assistant content, tool "
        "descriptions) that spells a control token (`<|im_start|>`, `[INST]`, `<|start|>`...) is tokenized "
        "as plain text, so only the chat template writes control tokens; false tokenizes the whole "
        "rendered prompt as one text, as `vllm serve` does (such text then becomes the token)",
    )
    max_num_seqs: int = Field(8, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    num_threads: int | None = Field(None, ge=1)
    reasoning_field: ReasoningField = "reasoning_content"
    pause_timeout: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="seconds a pause (POST /pause) lasts at most when it "
        "names no timeout; then generation resumes by itself and the log says so",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine arguments. `llamacpp`: `kv_cells`, `kv_unified`, `cache_sessions`, `n_batch`, "
        "`n_ubatch`, `n_threads_batch`, `flash_attn`, `type_k`, `type_v`, `use_mmap`. GPU engines (`vllm`, "
        "`trtllm`): `tensor_parallel_size`, `gpu_memory_utilization`, `max_model_len`, `dtype`, and any other "
        "engine argument by its vLLM `AsyncEngineArgs` / TensorRT-LLM `LLM` name. Ignored by `transformers`.",
    )

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        if value not in ENGINES:
            raise ValueError(f"unknown engine {value!r}; choices: {', '.join(ENGINES.names())}")
        return value


# NeMo Gym model-server options with no meaning here (process layout, its own server), accepted so a
# copied config loads; they are dropped before validation.
_NEMO_GYM_IGNORED = frozenset(
    {
        "entrypoint",
        "host",
        "port",
        "domain",
        "uses_reasoning_parser",
        "spinup_server",
        "server_args",
        "router_dp_size",
        "enable_router",
        "name",
        "description",
    }
)


class _RemoteBackendConfig(_ServedModelNames):
    """Options shared by every backend that calls a remote HTTP API."""

    api_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("api_key", "policy_api_key", "openai_api_key")
    )
    model: str | None = Field(None, validation_alias=AliasChoices("model", "policy_model_name", "openai_model"))
    num_concurrent_requests: int = Field(64, ge=1)
    timeout: float = Field(600.0, gt=0)
    max_retries: int = Field(3, ge=0)
    retry_backoff: float = Field(0.5, ge=0, description="first retry delay in seconds; doubles, capped at 8 s")
    default_query: dict[str, Any] = Field(default_factory=dict)
    default_headers: dict[str, str] = Field(default_factory=dict)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # How Responses requests are rendered as chat (gymserve.convert.ConvertOptions); None: the
    # backend's default (chat: "system" / "max_tokens"; openai, azure: "keep" / "max_completion_tokens").
    reasoning_mode: Literal["reasoning_content", "reasoning", "think_tags", "drop"] = "reasoning_content"
    developer_role: Literal["system", "keep"] | None = None
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nemo_gym_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k not in _NEMO_GYM_IGNORED}
        if data.pop("replace_developer_role_with_system", False):
            data.setdefault("developer_role", "system")
        return data

    @property
    def public_model_name(self) -> str | None:
        """The model name clients see in responses and ``/v1/models``."""
        return self.served_model_name or self.model


def _check_url(value: str, key: str) -> str:
    from gymserve.redaction import redact_url

    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        shown = redact_url(str(value))
        raise ValueError(
            f"{key} must start with http:// or https://, got {shown!r} "
            f"(for example https://{shown.split('://')[-1].lstrip('/') or 'host'})"
        )
    return value.rstrip("/")


class RoutingConfig(_Model):
    """How a backend with several replicas (``chat`` with several ``base_urls``, ``ray``) routes calls
    and survives a failing replica (``backends.pool.ReplicaPool``; docs/model-servers/vllm.md).

    ``policy``: ``sticky-least-loaded`` keeps a session's turns on one replica (its prefix cache)
    and places new sessions on the least-loaded one; ``round-robin`` spreads every call;
    ``consistent-hash`` hashes the session ID onto a ring of the replicas. The circuit breaker and
    retry budget apply to every remote backend, one replica or many.
    """

    policy: str = Field(
        "sticky-least-loaded",
        description="sticky-least-loaded, round-robin or consistent-hash (gymserve.registry.ROUTING_POLICIES)",
    )
    rebalance_ratio: float = Field(
        2.0,
        ge=1,
        description="sticky-least-loaded: a session leaves its replica only when that replica has this many "
        "times the calls in flight of the least-loaded one ...",
    )
    rebalance_min_gap: int = Field(
        8, ge=1, description="... and at least this many more (both must hold; a move costs one cold prefill)"
    )
    session_idle_timeout: float = Field(
        300.0, gt=0, description="seconds without a call after which a session stops counting as active on its replica"
    )
    max_sessions: int = Field(
        100_000, ge=1, description="sessions remembered (least recently used forgotten); a forgotten one is placed anew"
    )
    breaker_failures: int = Field(
        5,
        ge=1,
        description="consecutive failed calls (5xx, timeout, unreadable answer) that open a replica's circuit "
        "breaker; a refused connection opens it at once",
    )
    breaker_cooldown: float = Field(
        10.0,
        gt=0,
        description="seconds an open breaker keeps calls away before one trial call (half-open); doubles "
        "each time it re-opens in a row, up to 8x",
    )
    retry_budget_ratio: float = Field(
        0.2, ge=0, description="retries allowed per successful call in the last retry_budget_window (Finagle's 20%)"
    )
    retry_budget_min_per_s: float = Field(
        10.0, ge=0, description="retries per second allowed whatever the successes (the budget's floor)"
    )
    retry_budget_window: float = Field(
        10.0, ge=1, le=60, description="seconds a success counts toward the retry budget"
    )

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {value!r}; choices: {', '.join(ROUTING_POLICIES.names())}")
        return value


class ChatBackendConfig(_RemoteBackendConfig):
    """Any OpenAI-compatible Chat Completions server (vLLM, SGLang, TensorRT-LLM, llama.cpp,
    ``transformers serve``, another gymserve), one or more replicas.

    ``base_urls`` end where ``/chat/completions`` is appended (usually ``http://host:port/v1``).
    ``tool_call_parser``/``reasoning_parser`` parse raw text on gymserve's side for servers that run no
    parser. ``return_token_id_information`` asks for prompt/generation token IDs and log-probs.
    """

    type: Literal["chat"] = "chat"
    base_urls: list[str] = Field(
        validation_alias=AliasChoices("base_urls", "policy_base_url", "openai_base_url", "base_url")
    )
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    return_token_id_information: bool = False

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        return _renamed_keys(data, cls.model_fields, "backend")

    tokenizer: str | None = Field(
        None,
        description="a Hugging Face tokenizer directory (the served model's, chat template included): "
        "POST /tokenize and /detokenize are answered from it by gymserve instead of forwarded to the "
        "upstream's /tokenize (which transformers serve and the clouds lack)",
    )
    health_check_interval: float = Field(
        10.0,
        ge=0,
        description="seconds between probes of each replica (GET {base}/models; the first at start-up); 0 disables",
    )
    upstream_control: Literal["none", "vllm", "sglang"] = Field(
        "none",
        description="the control API the servers at base_urls speak: gymserve's POST /pause, /resume, "
        "/update_weights, /update_weight_version and LoRA routes are forwarded to vLLM's (vllm: "
        "VLLM_SERVER_DEV_MODE=1) or SGLang's endpoints; none: the gateway pauses at its door only",
    )
    control_api_key: SecretStr | None = Field(
        None, description="key for the servers' control endpoints (SGLang's --admin-api-key); default: api_key"
    )
    control_timeout: float = Field(
        600.0, gt=0, description="seconds a forwarded control call may take (a weight update from disk is slow)"
    )
    pause_timeout: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="seconds a pause at the gateway (POST /pause) lasts at most when it names no timeout; then "
        "calls are let through again and the log says so",
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig, description="replica choice, circuit breakers, retry budget"
    )
    forward_session_id: bool = Field(
        True,
        description="send the session ID upstream as X-Session-ID, so a router in front of the replicas can "
        "keep the session's turns together too",
    )

    @field_validator("base_urls", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [u.strip() for u in value.split(",") if u.strip()]
        return value

    @field_validator("base_urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one base URL is needed, e.g. http://127.0.0.1:8000/v1")
        return [_check_url(u, "base_urls") for u in value]


class OpenAIBackendConfig(_RemoteBackendConfig):
    """The OpenAI API or any Responses-native server: ``/v1/responses`` passes through as is."""

    type: Literal["openai"] = "openai"
    base_url: str = Field(
        "https://api.openai.com/v1", validation_alias=AliasChoices("base_url", "policy_base_url", "openai_base_url")
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _check_url(value, "base_url")


class AzureBackendConfig(_RemoteBackendConfig):
    """Azure OpenAI. The two APIs live under DIFFERENT base URLs for the same deployment:

    - Chat Completions is deployment-scoped: ``{endpoint}/openai/deployments/{deployment}/chat/completions``;
    - Responses is not: ``{endpoint}/openai/responses`` (dated api-version) or
      ``{endpoint}/openai/v1/responses`` (``api_version: preview|latest``); the deployment goes in
      the body's ``model``. A ``/deployments/`` base used for Responses gets a bare 404.

    Gateways: ``chat_base_url``/``responses_base_url`` replace the derived bases (the path is
    appended to them as is). ``api_version`` is sent as the ``api-version`` query parameter on
    every request (Azure answers a bare 404 "Resource not found" without it); it may also be given
    as ``default_query: {api-version: ...}`` (NeMo Gym's form). The key goes in the ``api-key``
    header, or ``azure_ad_token`` as ``Authorization: Bearer`` (Entra ID).
    """

    type: Literal["azure"] = "azure"
    endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("endpoint", "azure_endpoint", "policy_base_url", "openai_base_url", "base_url"),
    )
    deployment: str | None = Field(None, validation_alias=AliasChoices("deployment", "azure_deployment"))
    api: Literal["chat", "responses"] = "chat"
    chat_base_url: str | None = None
    responses_base_url: str | None = None
    azure_ad_token: SecretStr | None = None
    # default_query precedes api_version so api_version's validator can read it.
    api_version: str | None = Field(
        None, validate_default=True, validation_alias=AliasChoices("api_version", "policy_api_version")
    )

    @field_validator("endpoint", "chat_base_url", "responses_base_url")
    @classmethod
    def _urls(cls, value: str | None, info) -> str | None:
        return None if value is None else _check_url(value, info.field_name)

    @field_validator("api_version")
    @classmethod
    def _version(cls, value: str | None, info) -> str:
        value = value or (info.data.get("default_query") or {}).get("api-version")
        if not value:
            raise ValueError(
                "Azure OpenAI needs api_version (e.g. 2025-04-01-preview; or default_query: {api-version: ...}): "
                "without the api-version query parameter Azure answers every request with a bare 404 'Resource not found'"
            )
        return str(value)

    @model_validator(mode="after")
    def _bases(self) -> AzureBackendConfig:
        # api-version travels as its own field (the SDK adds it to every request); keeping it in
        # default_query too would send it twice.
        self.default_query = {k: v for k, v in self.default_query.items() if k != "api-version"}
        if self.api == "chat" and self.chat_base_url is None:
            if self.endpoint is None:
                raise ValueError(
                    "endpoint is required (https://RESOURCE.openai.azure.com), or chat_base_url for a gateway"
                )
            if self.deployment_name is None:
                raise ValueError(
                    "deployment is required for Azure Chat Completions (the deployment name, not the model name)"
                )
        if self.api == "responses" and self.responses_base_url is None and self.endpoint is None:
            raise ValueError(
                "endpoint is required (https://RESOURCE.openai.azure.com), or responses_base_url for a gateway"
            )
        return self

    @property
    def resource_endpoint(self) -> str | None:
        """``https://RESOURCE.openai.azure.com``: ``endpoint`` without any ``/openai...`` tail."""
        if self.endpoint is None:
            return None
        head, sep, _ = self.endpoint.partition("/openai")
        return head if sep and (self.endpoint[len(head) + 7 : len(head) + 8] in ("", "/")) else self.endpoint

    @property
    def deployment_name(self) -> str | None:
        """``deployment``, else the one named in a ``/deployments/NAME`` endpoint, else ``model``."""
        if self.deployment:
            return self.deployment
        if self.endpoint and "/deployments/" in self.endpoint:
            return self.endpoint.split("/deployments/", 1)[1].split("/")[0] or None
        return self.model

    @property
    def chat_base(self) -> str:
        """Where ``/chat/completions`` is appended: deployment-scoped unless a gateway base is given."""
        if self.chat_base_url:
            return self.chat_base_url
        return f"{self.resource_endpoint}/openai/deployments/{self.deployment_name}"

    @property
    def responses_base(self) -> str:
        """Where ``/responses`` is appended; never deployment-scoped (Azure has no such route)."""
        if self.responses_base_url:
            return self.responses_base_url
        if self.endpoint and self.endpoint.endswith("/openai/v1"):
            return self.endpoint
        v1 = self.api_version in ("preview", "latest", "v1")
        return f"{self.resource_endpoint}/openai/v1" if v1 else f"{self.resource_endpoint}/openai"


class AnthropicBackendConfig(_RemoteBackendConfig):
    """An Anthropic-compatible Messages API: Anthropic itself, or any server that speaks it.

    ``base_url`` is the server root, as the anthropic SDK takes it (``https://api.anthropic.com``):
    gymserve appends ``/v1/messages``, ``/v1/messages/count_tokens`` and ``/v1/models`` (a base
    ending in ``/v1`` is taken as its root). The key travels as ``x-api-key`` (``api_key``; without
    one the SDK reads ``ANTHROPIC_API_KEY``), with ``anthropic-version``. ``/v1/messages`` passes
    through; chat and Responses requests are converted, with ``default_max_tokens`` where they give
    no limit (the Messages API requires one).
    """

    type: Literal["anthropic"] = "anthropic"
    base_url: str = Field(
        "https://api.anthropic.com", validation_alias=AliasChoices("base_url", "policy_base_url", "anthropic_base_url")
    )
    anthropic_version: str = Field("2023-06-01", description="the anthropic-version header sent with every call")
    default_max_tokens: int = Field(
        4096, ge=1, description="max_tokens for a chat or Responses request that sets no limit"
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _check_url(value, "base_url").removesuffix("/v1")


class RayResourcesConfig(_Model):
    """What one replica reserves on the Ray cluster (one placement-group bundle per replica).

    ``num_cpus`` also sets the replica's torch threads when ``num_threads`` is not given, so replicas
    sharing a node do not oversubscribe its cores. ``resources``: custom Ray resources (e.g.
    ``{"accelerator_type:H100": 0.001}`` or a node label resource) to pin replicas to kinds of node.
    """

    num_cpus: float = Field(1.0, ge=0, description="CPUs per replica; also its torch threads unless num_threads is set")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (fractions share a GPU)")
    memory: int | None = Field(None, ge=0, description="bytes of Ray logical memory per replica")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica")


class RayBackendConfig(_Model):
    """N local-engine replicas as Ray actors behind one gymserve front end (``gymserve launch``).

    Every option of the local backend (``model``, ``engine``, ``sampling``, ``max_model_len``, ...)
    may be written flat beside the Ray options; they are gathered into ``local``, the config each
    replica builds its ``LocalBackend`` from. ``ray_address``: None starts or joins a local Ray
    instance (``ray.init()``'s own search: ``RAY_ADDRESS``, then a ``ray start`` cluster on this
    machine, else a new one), ``"auto"`` joins the running cluster, ``"ray://host:10001"`` uses Ray
    Client. See docs/scaling.md.
    """

    type: Literal["ray"] = "ray"
    replicas: int = Field(1, ge=1, description="number of engine replicas (Ray actors)")
    ray_address: str | None = Field(
        None,
        description="None: start or join a local Ray instance; 'local': always "
        "start one; 'auto', HOST:6379 or ray://HOST:10001: join that cluster",
    )
    namespace: str = Field("gymserve", description="Ray namespace of the replica actors")
    replica_resources: RayResourcesConfig = Field(default_factory=RayResourcesConfig)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how the replicas' placement-group bundles are spread over nodes"
    )
    health_check_interval: float = Field(5.0, ge=0, description="seconds between replica probes; 0 disables")
    health_check_timeout: float = Field(10.0, gt=0, description="seconds a replica has to answer a probe")
    startup_timeout: float = Field(600.0, gt=0, description="seconds to wait for resources and model loading")
    max_concurrent_requests: int = Field(64, ge=1, description="per replica, in flight from the front end")
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig, description="replica choice, circuit breakers, retry budget"
    )
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime_env for the replicas (env_vars, pip, ...)"
    )
    # Only used when gymserve starts the Ray instance itself (ray_address unset and none running).
    object_store_memory: int | None = Field(
        None, ge=78_643_200, description="bytes; only for a Ray instance gymserve starts"
    )
    local: LocalBackendConfig = Field(
        default_factory=LocalBackendConfig, description="each replica's local backend (may be written flat)"
    )

    @model_validator(mode="before")
    @classmethod
    def _gather_local_options(cls, data: Any) -> Any:
        # Flat local-engine options (``model: x``) read as ``local: {model: x}``, so the CLI's
        # ``backend.model`` override and a copied local config work unchanged.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        local = dict(data.get("local") or {})
        for key in list(data):
            local_key = (
                key in LocalBackendConfig.model_fields or RENAMED_KEYS.get(key) in LocalBackendConfig.model_fields
            )
            if local_key and key not in ("type", "local") and key not in cls.model_fields:
                # Merged, not replaced: a flag's flat ``sampling.seed`` must not drop the file's
                # ``local: {sampling: {temperature}}``.
                local[key] = _merged(local.get(key), data.pop(key))
        data["local"] = local
        return data

    @property
    def served_model_names(self) -> list[str]:
        """The replicas' served names (``local.served_model_names``)."""
        return self.local.served_model_names


def _merged(base: Any, top: Any) -> Any:
    """``top`` over ``base``, dicts merged key by key (recursively)."""
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in top.items()}}
    return top


BackendConfig = Annotated[
    LocalBackendConfig
    | ChatBackendConfig
    | OpenAIBackendConfig
    | AzureBackendConfig
    | AnthropicBackendConfig
    | RayBackendConfig,
    Field(discriminator="type"),
]

# Other spellings of the backend type (NeMo Gym server names, the AZ-01 case's "azure_openai").
_TYPE_ALIASES = {
    "vllm": "chat",
    "vllm_model": "chat",
    "openai_compatible": "chat",
    "openai_model": "openai",
    "azure_openai": "azure",
    "azure_openai_model": "azure",
}


class GymserveConfig(_Model):
    """The whole configuration: ``server`` and one ``backend``."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    backend: BackendConfig = Field(default_factory=LocalBackendConfig)

    @property
    def served_model_names(self) -> list[str]:
        """Every name ``/v1/models`` lists (``backend.served_model_name`` then its aliases); empty when
        none is configured (the backend then names its model itself)."""
        return list(self.backend.served_model_names)

    @field_validator("backend", mode="before")
    @classmethod
    def _type_alias(cls, value: Any) -> Any:
        if isinstance(value, dict):
            value = dict(value)
            kind = str(value.get("type", "local"))
            value["type"] = _TYPE_ALIASES.get(kind, kind)
        return value


def _format_errors(exc: ValidationError, prefix: str = "") -> str:
    kinds = BACKENDS.names()
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = [str(p) for p in err["loc"]]
        # The discriminated union puts the tag ("azure") in the path; users never wrote it.
        if len(loc) >= 2 and loc[0] == "backend" and loc[1] in kinds:
            loc.pop(1)
        path = prefix + ".".join(loc) if loc else prefix.rstrip(".") or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "union_tag_invalid":
            msg = f"backend.type must be one of {', '.join(kinds)}"
        lines.append(f"{path}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def validate_config(data: dict[str, Any]) -> GymserveConfig:
    """Validate a plain dict (already interpolated). Raises ``ConfigError`` naming the key paths."""
    try:
        return GymserveConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


_NEMO_GYM_SERVERS = {"vllm_model": "chat", "openai_model": "openai", "azure_openai_model": "azure"}
_FLAT_KEYS = {
    "policy_base_url",
    "policy_api_key",
    "policy_model_name",
    "policy_api_version",
    "openai_base_url",
    "openai_api_key",
    "openai_model",
}


def _shape(data: dict[Any, Any], variables: set[str]) -> dict[str, Any]:
    """Map the three accepted layouts onto ``{server, backend}``; ``variables`` (env.yaml keys and
    ``policy_*`` values) are interpolation sources, not options."""
    out: dict[str, Any] = {k: data[k] for k in ("server", "backend") if k in data}
    rest = {k: v for k, v in data.items() if k not in ("server", "backend")}
    if "backend" not in out:
        nested = (
            ((rest.get("policy_model") or {}).get("responses_api_models") or {})
            if isinstance(rest.get("policy_model"), dict)
            else {}
        )
        if nested:
            ((name, options),) = list(nested.items())[:1]
            out["backend"] = {"type": _NEMO_GYM_SERVERS.get(name, name), **(options or {})}
            if out["backend"]["type"] == "azure" and "policy_api_version" in rest:
                out["backend"].setdefault("api_version", rest["policy_api_version"])
            rest.pop("policy_model")
        elif any(k in rest for k in _FLAT_KEYS):
            flat = {k: rest.pop(k) for k in list(rest) if k in _FLAT_KEYS or k in ChatBackendConfig.model_fields}
            flat.pop("policy_api_version", None)
            out["backend"] = {"type": "chat", **flat}
    unknown = [k for k in rest if k not in variables and not k.startswith("policy_")]
    if unknown:
        raise ConfigError(
            "invalid configuration:\n  "
            + "\n  ".join(f"{k}: unknown top-level key (expected server, backend)" for k in unknown)
        )
    return out


def load_config(
    path: str | os.PathLike | None,
    *,
    env_path: str | os.PathLike | None = None,
    overrides: dict[str, Any] | None = None,
) -> GymserveConfig:
    """Read, interpolate and validate a config file.

    ``path``: the YAML file (None: defaults, i.e. the local embedded model). ``env_path``: the
    ``env.yaml`` whose keys are interpolation variables (default: ``env.yaml`` beside ``path`` when
    it exists). ``overrides``: ``{"backend.model": "x", "server.port": 9000}`` (dotted or nested)
    applied last. Raises ``ConfigError`` for a missing file, bad YAML, an unresolved ``${var}`` or
    invalid values; each message names the key.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        env: DictConfig | ListConfig = OmegaConf.create()
        if env_path is None and path is not None and (Path(path).parent / "env.yaml").is_file():
            env_path = Path(path).parent / "env.yaml"
        if env_path is not None:
            env = OmegaConf.load(str(env_path))
        cfg = OmegaConf.load(str(path)) if path is not None else OmegaConf.create()
        if not isinstance(cfg, type(env)) or not hasattr(cfg, "keys"):
            raise ConfigError(f"{path}: the top level must be a mapping")
        merged = OmegaConf.merge(env, cfg)
        for key, value in (overrides or {}).items():
            # A flag naming a renamed key (--max-model-len: backend.max_model_len) overrides the
            # file's old key for it too, rather than meeting it as "both given".
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else None
            for old in (o for o, new in RENAMED_KEYS.items() if new == leaf):
                if isinstance(node, DictConfig) and old in node:
                    del node[old]
            OmegaConf.update(merged, key, value, force_add=True)
        data = OmegaConf.to_container(merged, resolve=True)
        if not isinstance(data, dict):  # cannot happen: the top level was checked to be a mapping above
            raise ConfigError(f"{path}: the top level must be a mapping")
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {exc.filename}") from None
    except OmegaConfBaseException as exc:
        full_key = getattr(exc, "full_key", None)
        raise ConfigError(f"{full_key or path}: {str(exc).splitlines()[0]}") from None
    except ConfigError:
        raise
    except Exception as exc:  # YAML syntax errors and the like
        raise ConfigError(f"{path}: cannot read config ({type(exc).__name__}: {exc})") from None
    variables = set(env.keys()) if hasattr(env, "keys") else set()
    return validate_config(_shape(data, {str(k) for k in variables}))
