"""Config loading: layouts, interpolation, aliases, validation errors that name the key, secrets."""

from __future__ import annotations

import textwrap

import pytest

from gymserve.config import (
    AzureBackendConfig,
    ChatBackendConfig,
    ConfigError,
    GymserveConfig,
    LocalBackendConfig,
    OpenAIBackendConfig,
    load_config,
    validate_config,
)

KEY = "sk-test-SECRET-0123456789"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_are_the_local_embedded_model():
    cfg = load_config(None)
    assert isinstance(cfg, GymserveConfig)
    assert isinstance(cfg.backend, LocalBackendConfig)
    assert cfg.backend.model == "embedded" and cfg.backend.sampling.pin == "off"
    assert (cfg.server.host, cfg.server.port, cfg.server.max_queue, cfg.server.max_body_bytes) == (
        "127.0.0.1",
        8000,
        1024,
        16 << 20,
    )


def test_chat_backend_with_env_yaml_interpolation_and_policy_names(tmp_path):
    write(
        tmp_path,
        "env.yaml",
        f"""
        policy_base_url: http://127.0.0.1:9000/v1/
        policy_api_key: {KEY}
        policy_model_name: Qwen/Qwen3-8B
    """,
    )
    path = write(
        tmp_path,
        "gymserve.yaml",
        """
        server: {port: 9100}
        backend:
          type: chat
          base_urls: ["${policy_base_url}", "http://127.0.0.1:9001/v1"]
          api_key: ${policy_api_key}
          model: ${policy_model_name}
          return_token_id_information: true
          chat_template_kwargs: {enable_thinking: false}
    """,
    )
    cfg = load_config(str(path))
    b = cfg.backend
    assert isinstance(b, ChatBackendConfig)
    assert b.base_urls == ["http://127.0.0.1:9000/v1", "http://127.0.0.1:9001/v1"]  # trailing slash dropped
    assert b.api_key.get_secret_value() == KEY and b.model == "Qwen/Qwen3-8B"
    assert b.return_token_id_information and b.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.server.port == 9100
    assert KEY not in repr(cfg) and KEY not in str(cfg.model_dump())


def test_nemo_gym_flat_keys_make_a_chat_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("GYMSERVE_TEST_KEY", KEY)
    path = write(
        tmp_path,
        "flat.yaml",
        """
        policy_base_url: http://127.0.0.1:8000/v1
        policy_api_key: ${oc.env:GYMSERVE_TEST_KEY}
        policy_model_name: policy
        num_concurrent_requests: 8
    """,
    )
    b = load_config(str(path)).backend
    assert isinstance(b, ChatBackendConfig)
    assert b.base_urls == ["http://127.0.0.1:8000/v1"] and b.model == "policy" and b.num_concurrent_requests == 8
    assert b.api_key.get_secret_value() == KEY


def test_nemo_gym_nested_azure_config_loads_unchanged(tmp_path):
    write(
        tmp_path,
        "env.yaml",
        f"""
        policy_base_url: https://RESOURCE.openai.azure.com
        policy_api_key: {KEY}
        policy_model_name: gpt-5-nano
    """,
    )
    path = write(
        tmp_path,
        "azure_openai_model.yaml",
        """
        policy_model:
          responses_api_models:
            azure_openai_model:
              entrypoint: app.py
              openai_base_url: ${policy_base_url}
              openai_api_key: ${policy_api_key}
              openai_model: ${policy_model_name}
              default_query:
                api-version: 2024-10-21
              num_concurrent_requests: 8
    """,
    )
    b = load_config(str(path)).backend
    assert isinstance(b, AzureBackendConfig)
    assert b.api_version == "2024-10-21" and b.default_query == {}
    assert b.deployment_name == "gpt-5-nano" and b.num_concurrent_requests == 8
    assert b.chat_base == "https://RESOURCE.openai.azure.com/openai/deployments/gpt-5-nano"


def test_nemo_gym_vllm_model_options(tmp_path):
    path = write(
        tmp_path,
        "vllm_model.yaml",
        """
        policy_model:
          responses_api_models:
            vllm_model:
              entrypoint: app.py
              base_url: http://127.0.0.1:8000/v1
              api_key: dummy
              model: policy
              return_token_id_information: true
              uses_reasoning_parser: true
              replace_developer_role_with_system: true
              extra_body: {top_k: 20}
    """,
    )
    b = load_config(str(path)).backend
    assert isinstance(b, ChatBackendConfig)
    assert b.developer_role == "system" and b.extra_body == {"top_k": 20} and b.return_token_id_information


def test_openai_backend_aliases_and_default_url():
    b = validate_config({"backend": {"type": "openai", "openai_api_key": KEY, "openai_model": "gpt-4.1"}}).backend
    assert isinstance(b, OpenAIBackendConfig)
    assert b.base_url == "https://api.openai.com/v1" and b.model == "gpt-4.1"


def test_overrides_apply_last(tmp_path):
    path = write(tmp_path, "c.yaml", "backend: {type: chat, base_url: 'http://127.0.0.1:1/v1'}\n")
    cfg = load_config(str(path), overrides={"server.port": 9999, "backend.model": "x"})
    assert cfg.server.port == 9999 and cfg.backend.model == "x"


@pytest.mark.parametrize(
    "backend, key_path",
    [
        (
            {"type": "chat", "base_urls": ["http://h/v1"], "num_concurrent_requests": 0},
            "backend.num_concurrent_requests",
        ),
        ({"type": "chat", "base_urls": ["http://h/v1"], "tool_parzer": "hermes"}, "backend.tool_parzer"),
        ({"type": "chat", "base_urls": ["localhost:8000/v1"]}, "backend.base_urls"),
        ({"type": "chat"}, "backend.base_urls"),
        ({"type": "nope"}, "backend"),
        ({"type": "local", "sampling": {"temperature": -1}}, "backend.sampling.temperature"),
    ],
)
def test_validation_errors_name_the_key(backend, key_path):
    with pytest.raises(ConfigError) as info:
        validate_config({"backend": backend})
    assert f"{key_path}:" in str(info.value)


def test_the_old_sampling_switch_names_its_replacement():
    """sampling.on_mismatch (requests could never choose) became sampling.pin (off by default)."""
    with pytest.raises(ConfigError) as info:
        validate_config({"backend": {"type": "local", "sampling": {"on_mismatch": "reject"}}})
    assert "backend.sampling" in str(info.value) and "sampling.pin" in str(info.value)


def test_unknown_top_level_key_and_missing_variable(tmp_path):
    with pytest.raises(ConfigError, match="sever: unknown top-level key"):
        load_config(str(write(tmp_path, "a.yaml", "sever: {port: 1}\n")))
    with pytest.raises(ConfigError, match="backend.model"):
        load_config(
            str(write(tmp_path, "b.yaml", "backend: {type: chat, base_url: 'http://h/v1', model: '${nope}'}\n"))
        )
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_secret_never_in_validation_errors():
    with pytest.raises(ConfigError) as info:
        validate_config(
            {
                "backend": {
                    "type": "azure",
                    "endpoint": "https://r.openai.azure.com",
                    "deployment": "d",
                    "api_key": KEY,
                    "api_version": "v",
                    "timeout": -1,
                }
            }
        )
    assert "backend.timeout" in str(info.value) and KEY not in str(info.value)
    with pytest.raises(ConfigError) as info:
        validate_config({"backend": {"type": "chat", "base_urls": [f"http://user:{KEY}@h/v1", f"h/v1?api_key={KEY}"]}})
    assert KEY not in str(info.value)


# ------------------------------------------------------------------------------------ Azure
AZ = {
    "type": "azure",
    "endpoint": "https://RESOURCE.openai.azure.com/",
    "deployment": "DEPLOYMENT",
    "api_version": "API_VERSION",
    "api_key": KEY,
}


def test_azure_urls_from_endpoint():
    b = validate_config({"backend": AZ}).backend
    assert b.chat_base == "https://RESOURCE.openai.azure.com/openai/deployments/DEPLOYMENT"
    assert b.responses_base == "https://RESOURCE.openai.azure.com/openai"
    for ep in (
        "https://RESOURCE.openai.azure.com/openai/",
        "https://RESOURCE.openai.azure.com/openai/deployments/DEPLOYMENT/",
    ):
        b = validate_config({"backend": {**AZ, "endpoint": ep}}).backend
        assert b.chat_base == "https://RESOURCE.openai.azure.com/openai/deployments/DEPLOYMENT"
        assert "/deployments/" not in b.responses_base and "//openai" not in b.responses_base
    v1 = validate_config({"backend": {**AZ, "api_version": "preview", "api": "responses"}}).backend
    assert v1.responses_base == "https://RESOURCE.openai.azure.com/openai/v1"
    v1 = validate_config({"backend": {**AZ, "endpoint": "https://RESOURCE.openai.azure.com/openai/v1/"}}).backend
    assert v1.responses_base == "https://RESOURCE.openai.azure.com/openai/v1"


def test_azure_deployment_taken_from_a_deployment_scoped_endpoint():
    b = validate_config(
        {"backend": {**AZ, "deployment": None, "endpoint": "https://R.openai.azure.com/openai/deployments/dep1"}}
    ).backend
    assert b.deployment_name == "dep1" and b.responses_base == "https://R.openai.azure.com/openai"


def test_azure_api_version_required_or_from_default_query():
    with pytest.raises(ConfigError, match=r"backend\.api_version: .*api-version"):
        validate_config({"backend": {k: v for k, v in AZ.items() if k != "api_version"}})
    b = validate_config(
        {
            "backend": {
                **{k: v for k, v in AZ.items() if k != "api_version"},
                "default_query": {"api-version": "2024-10-21", "x": "1"},
            }
        }
    ).backend
    assert b.api_version == "2024-10-21" and b.default_query == {"x": "1"}
    b = validate_config(
        {"backend": {**{k: v for k, v in AZ.items() if k != "api_version"}, "policy_api_version": "2025-01-01"}}
    ).backend
    assert b.api_version == "2025-01-01"


def test_azure_endpoint_needs_a_scheme_and_chat_needs_a_deployment():
    with pytest.raises(ConfigError) as info:
        validate_config({"backend": {**AZ, "endpoint": "RESOURCE.openai.azure.com/openai"}})
    assert "backend.endpoint" in str(info.value) and "RESOURCE.openai.azure.com/openai" in str(info.value)
    assert "http:// or https://" in str(info.value) and KEY not in str(info.value)
    with pytest.raises(ConfigError, match="backend: .*deployment is required"):
        validate_config({"backend": {**AZ, "deployment": None}})


def test_azure_gateway_bases_without_endpoint():
    b = validate_config(
        {
            "backend": {
                "type": "azure_openai",
                "chat_base_url": "https://GATEWAY/azure/",
                "responses_base_url": "https://GATEWAY/azure/v1",
                "api_version": "V",
            }
        }
    ).backend
    assert b.chat_base == "https://GATEWAY/azure" and b.responses_base == "https://GATEWAY/azure/v1"


def test_every_backend_type_has_a_config_model_and_a_backend_class():
    """``BACKENDS`` (what build_backend, the CLI and the messages read) and the config's backend
    models name the same kinds, and each entry is a ``Backend``."""
    from typing import get_args

    from gymserve.backends import BACKENDS, Backend
    from gymserve.config import BackendConfig

    models = get_args(get_args(BackendConfig)[0])
    assert [get_args(m.model_fields["type"].annotation)[0] for m in models] == list(BACKENDS.names())
    assert all(issubclass(BACKENDS.get(name), Backend) for name in BACKENDS.names())
    with pytest.raises(ConfigError, match="backend.type must be one of local, chat, openai, azure, anthropic, ray"):
        validate_config({"backend": {"type": "nope"}})
