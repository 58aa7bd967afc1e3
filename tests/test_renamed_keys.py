"""Config keys renamed to ``vllm serve``'s flag names (``config.RENAMED_KEYS``): the new keys are
read, the old ones still work for one release with a ``FutureWarning`` naming the new key, and a
section giving both is a ``ConfigError`` naming both."""

from __future__ import annotations

import warnings

import pytest

from gymserve.config import RENAMED_KEYS, ChatBackendConfig, ConfigError, LocalBackendConfig, load_config


def test_the_rename_table_is_vllms_flag_vocabulary():
    assert RENAMED_KEYS == {
        "context_window": "max_model_len",
        "max_batch_size": "max_num_seqs",
        "tool_parser": "tool_call_parser",
    }


def test_new_keys_are_read_without_a_warning(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend:\n  type: local\n  max_model_len: 512\n  max_num_seqs: 3\n  tool_call_parser: hermes\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = load_config(str(path)).backend
    assert (b.max_model_len, b.max_num_seqs, b.tool_call_parser) == (512, 3, "hermes")


@pytest.mark.parametrize(
    ("old", "new", "value"), [(o, n, v) for (o, n), v in zip(RENAMED_KEYS.items(), (512, 3, "hermes"))]
)
def test_an_old_key_still_works_and_warns(tmp_path, old, new, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"backend:\n  type: local\n  {old}: {value}\n")
    with pytest.warns(FutureWarning, match=f"backend.{old} is now backend.{new}"):
        b = load_config(str(path)).backend
    assert getattr(b, new) == value and old not in type(b).model_fields


def test_giving_both_names_is_a_config_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend:\n  type: local\n  context_window: 256\n  max_model_len: 512\n")
    with pytest.raises(ConfigError, match="context_window and backend.max_model_len both given"):
        load_config(str(path))


def test_a_flag_overrides_the_files_old_key(tmp_path):
    """``--max-model-len`` over a file that still says ``context_window``: the flag wins, no error."""
    path = tmp_path / "c.yaml"
    path.write_text("backend:\n  type: local\n  context_window: 256\n")
    b = load_config(str(path), overrides={"backend.max_model_len": 1024}).backend
    assert b.max_model_len == 1024


def test_models_built_in_code_and_the_chat_and_ray_sections_read_old_keys_too(tmp_path):
    with pytest.warns(FutureWarning):
        assert LocalBackendConfig(context_window=64).max_model_len == 64  # type: ignore[call-arg]
    with pytest.warns(FutureWarning):
        assert ChatBackendConfig(base_urls=["http://127.0.0.1:1/v1"], tool_parser="hermes").tool_call_parser == "hermes"  # type: ignore[call-arg]
    path = tmp_path / "ray.yaml"
    path.write_text("backend:\n  type: ray\n  max_batch_size: 2\n")
    with pytest.warns(FutureWarning):
        assert load_config(str(path)).backend.local.max_num_seqs == 2  # flat local options, gathered into local
