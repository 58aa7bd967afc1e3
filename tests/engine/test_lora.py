"""LoRA adapters (PEFT format) merged into the transformers engine: the merge equals PEFT's own
unmerged forward pass, bad adapters are refused naming the tensor with the old weights serving,
and a real gymserve on 127.0.0.1 serves, swaps and unloads adapters through vLLM's endpoints with
the official openai SDK as the client, every reported log-prob checked by teacher forcing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from gymserve.engine.lora import merge_adapter, read_adapter
from gymserve.engine.transformers_engine import TransformersEngine
from gymserve.errors import ConflictError, InvalidRequestError, NotFoundError, WeightUpdateError
from gymserve.harness.verify import load_model, teacher_forced_log_probs
from gymserve.server.embed import serve_policy

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
TOL = 1e-4  # fp32: W + s·B·A merged vs PEFT's x·W + s·(x·A)·B differ by rounding (~1e-6 measured)


def make_adapter(tiny_model_dir, out, seed: int, **cfg):
    """A PEFT LoRA on a fresh copy of the tiny model with random ``lora_B`` (PEFT starts it at 0,
    which would change nothing); saved to ``out``. Returns the PEFT model (the teacher)."""
    config = LoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0, **cfg}
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(load_model(tiny_model_dir), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(str(out))
    peft_model.eval()
    return peft_model


def rewrite(src, dst, *, tensors=None, config=None):
    """A copy of adapter ``src`` at ``dst`` with its tensors or config changed."""
    dst.mkdir()
    sd = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(sd) if tensors else sd, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return dst


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two adapters, ``a`` (ranks and alphas per module, rsLoRA) and ``b`` (other modules), with teachers."""
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(
        tiny_model_dir, root / "a", 1, rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 16}, use_rslora=True
    )
    b = make_adapter(tiny_model_dir, root / "b", 2, target_modules=["k_proj", "o_proj", "up_proj"], r=8)
    return {"a": (root / "a", a), "b": (root / "b", b), "root": root}


def test_merge_equals_peft_forward(tiny_model_dir, adapters):
    path, teacher = adapters["a"]
    model = load_model(tiny_model_dir)
    config, tensors = read_adapter(path)
    adapter = merge_adapter(model, "a", config, tensors, {})
    assert len(adapter.merged) == 6  # q, v, down in 2 layers
    model.load_state_dict(adapter.merged, strict=False)
    ids = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 0, 151645]])
    with torch.no_grad():
        got, want = model(ids).logits, teacher(ids).logits
        base = load_model(tiny_model_dir)(ids).logits
    assert (got - want).abs().max() < TOL
    assert (got - base).abs().max() > 0.1  # the adapter really changes the policy


BAD = [
    (
        "unknown-module",
        lambda sd: {k.replace("q_proj", "qq_proj"): v for k, v in sd.items()},
        None,
        f"{Q0.replace('q_proj', 'qq_proj')}.lora_A.weight",
        "unknown target module .*did you mean",
    ),
    (
        "rank",
        lambda sd: {**sd, f"{Q0}.lora_A.weight": torch.zeros(3, 64)},
        None,
        f"{Q0}.lora_A.weight",
        r"shape \[3, 64\], expected \[4, 64\]",
    ),
    (
        "shape",
        lambda sd: {**sd, f"{Q0}.lora_B.weight": torch.zeros(65, 4)},
        None,
        f"{Q0}.lora_B.weight",
        r"shape \[65, 4\], expected \[64, 4\]",
    ),
    (
        "nan",
        lambda sd: {**sd, f"{Q0}.lora_B.weight": torch.full((64, 4), float("nan"))},
        None,
        f"{Q0}.lora_B.weight",
        "256 NaN or infinite",
    ),
    (
        "missing-partner",
        lambda sd: {k: v for k, v in sd.items() if k != f"{Q0}.lora_B.weight"},
        None,
        f"{Q0}.lora_A.weight",
        "lora_B partner .* is missing",
    ),
    (
        "not-lora",
        lambda sd: {**sd, f"{Q0}.lora_magnitude_vector": torch.ones(64)},
        None,
        f"{Q0}.lora_magnitude_vector",
        "not a LoRA matrix",
    ),
    (
        "not-linear",
        lambda sd: {
            **sd,
            "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(64, 4),
        },
        None,
        "base_model.model.model.embed_tokens.lora_A.weight",
        "is a Embedding; only torch.nn.Linear",
    ),
    ("dora", None, lambda c: {**c, "use_dora": True}, "use_dora", "DoRA"),
]


@pytest.mark.parametrize("case, tensors, config, param, match", BAD, ids=[b[0] for b in BAD])
def test_bad_adapter_names_the_tensor(tiny_model_dir, adapters, tmp_path, case, tensors, config, param, match):
    path = rewrite(adapters["a"][0], tmp_path / case, tensors=tensors, config=config)
    model = load_model(tiny_model_dir)
    cfg, sd = read_adapter(path)
    with pytest.raises(WeightUpdateError, match=match) as info:
        merge_adapter(model, case, cfg, sd, {})
    assert info.value.status_code == 400 and info.value.code == "invalid_weights" and info.value.param == param


def test_tied_lm_head_refused(tiny_model_dir, adapters):
    model = load_model(tiny_model_dir)
    cfg, sd = read_adapter(adapters["a"][0])
    head = {
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(model.config.vocab_size, 4),
    }
    with pytest.raises(WeightUpdateError, match="tied to another tensor") as info:
        merge_adapter(model, "head", cfg, {**sd, **head}, {})
    assert info.value.param == "base_model.model.lm_head.lora_A.weight"


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "no such directory"),
        ("no-config", "adapter_config.json: missing"),
        ("bin-only", "adapter_model.bin is not read"),
        ("not-lora", "peft_type is 'IA3'"),
        ("corrupt", "cannot read safetensors"),
    ],
)
def test_unreadable_adapter(adapters, tmp_path, case, match):
    d = tmp_path / case
    if case != "missing":
        d.mkdir()
        cfg = json.loads((adapters["a"][0] / "adapter_config.json").read_text())
        if case != "no-config":
            (d / "adapter_config.json").write_text(
                json.dumps({**cfg, "peft_type": "IA3"} if case == "not-lora" else cfg)
            )
        if case == "bin-only":
            (d / "adapter_model.bin").write_bytes(b"x")
        elif case in ("corrupt", "not-lora"):
            (d / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(WeightUpdateError, match=match):
        read_adapter(d)


# ---------------------------------------------------------------------------- the engine
async def test_engine_load_swap_unload(tiny_model_dir, adapters):
    engine = TransformersEngine(tiny_model_dir, num_threads=1)
    try:
        original = {k: v.clone() for k, v in engine.model.state_dict().items()}
        assert await engine.load_lora_adapter("a", str(adapters["a"][0])) == 1
        assert engine.lora_adapters()[0] | {"source": None} == {
            "name": "a",
            "source": None,
            "rank": 4,
            "modules": 6,
            "weight_version": 1,
        }
        assert engine.control_status()["lora_adapter"] == "a"
        with pytest.raises(ConflictError, match="one adapter at a time"):
            await engine.load_lora_adapter("b", str(adapters["b"][0]))
        with pytest.raises(InvalidRequestError, match="already been loaded"):
            await engine.load_lora_adapter("a", str(adapters["a"][0]))
        with pytest.raises(ConflictError, match="Unload it first"):
            await engine.update_weights(original)
        bad = rewrite(
            adapters["b"][0],
            adapters["root"] / "b-nan",
            tensors=lambda sd: {k: v * float("nan") if "k_proj" in k else v for k, v in sd.items()},
        )
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        with pytest.raises(WeightUpdateError, match="NaN"):
            await engine.load_lora_adapter("b", str(bad), load_inplace=True)
        assert engine.weight_version == 1 and all(
            torch.equal(before[k], v) for k, v in engine.model.state_dict().items()
        )
        # A swap to an adapter on other modules restores what only the first one changed, in one update.
        assert (
            await engine.load_lora_adapter("b", str(adapters["b"][0]), load_inplace=True, weight_version="b1") == "b1"
        )
        state = engine.model.state_dict()
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(state[q], original[q]) and not torch.equal(
            state["model.layers.0.self_attn.k_proj.weight"], original["model.layers.0.self_attn.k_proj.weight"]
        )
        with pytest.raises(NotFoundError, match="'a' cannot be found"):
            await engine.unload_lora_adapter("a")
        assert await engine.unload_lora_adapter("b") == 3
        assert all(torch.equal(original[k], v) for k, v in engine.model.state_dict().items())  # bit for bit
        assert engine.lora_adapters() == [] and await engine.update_weights(original) == 4  # full updates again
    finally:
        await engine.close()


# ---------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def policy(tiny_model_dir, tokenizer):
    srv = serve_policy(
        load_model(tiny_model_dir),
        tokenizer,
        model_name="tiny",
        backend_config={"sampling": {"temperature": 1.0, "seed": 7}, "num_threads": 1, "tool_call_parser": "none"},
    )
    yield srv
    srv.stop()


def chat(client, model: str):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)


def check_teacher(teacher, completion) -> None:
    extra = completion.choices[0].message.model_extra
    tf = teacher_forced_log_probs(teacher, extra["prompt_token_ids"], extra["generation_token_ids"])
    assert max(abs(x - y) for x, y in zip(tf, extra["generation_log_probs"])) < TOL


def test_http_load_swap_unload(policy, adapters, tiny_model_dir):
    root = policy.base_url.removesuffix("/v1")
    client = openai.OpenAI(base_url=policy.base_url, api_key="unused", max_retries=0, timeout=120)
    start = policy.weight_version
    r = httpx.post(f"{root}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapters["a"][0])})
    assert r.status_code == 200, r.text
    assert r.json()["message"] == "Success: LoRA adapter 'sql' added successfully."
    assert r.json()["weight_version"] == start + 1
    assert [m.id for m in client.models.list()] == ["sql"]
    done = chat(client, "sql")
    assert done.model == "sql" and done.choices[0].message.model_extra["weight_version"] == start + 1
    check_teacher(adapters["a"][1], done)
    resp = client.responses.create(model="sql", input="Hi", max_output_tokens=4)
    assert resp.model == "sql"
    with pytest.raises(openai.ConflictError, match="base weights"):
        chat(client, "tiny")
    with pytest.raises(openai.ConflictError, match="base weights"):  # streamed: refused before the stream starts
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True)
    with pytest.raises(openai.ConflictError, match="base weights"):
        client.responses.create(model="tiny", input="Hi", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        chat(client, "other")
    assert httpx.get(f"{root}/weight_info").json()["lora_adapter"] == "sql"

    # A second adapter is refused; the same name in place is a swap; a bad one names its tensor.
    r = httpx.post(f"{root}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"][0])})
    assert r.status_code == 409 and r.json()["error"]["code"] == "lora_slot_taken"
    bad = rewrite(
        adapters["b"][0],
        adapters["root"] / "b-shape",
        tensors=lambda sd: {**sd, f"{Q0.replace('q_', 'k_')}.lora_B.weight": torch.zeros(31, 8)},
    )
    r = httpx.post(
        f"{root}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(bad), "load_inplace": True}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == f"{Q0.replace('q_', 'k_')}.lora_B.weight"
    check_teacher(adapters["a"][1], chat(client, "sql"))  # the old adapter keeps serving
    r = httpx.post(
        f"{root}/v1/load_lora_adapter",
        json={"lora_name": "sql", "lora_path": str(adapters["b"][0]), "load_inplace": True, "weight_version": "step-2"},
    )
    assert r.status_code == 200 and r.json()["weight_version"] == "step-2"
    done = chat(client, "sql")
    assert done.choices[0].message.model_extra["weight_version"] == "step-2"
    check_teacher(adapters["b"][1], done)

    r = httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"
    r = httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 1})
    assert r.status_code == 200 and r.json()["message"] == "Success: LoRA adapter 'sql' removed successfully."
    done = chat(client, "anything")  # no adapter: any name, as before
    assert done.model == "tiny"
    check_teacher(load_model(tiny_model_dir), done)

    # Under the base model's name the adapter replaces the policy; every name keeps working.
    r = httpx.post(f"{root}/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(adapters["a"][0])})
    assert r.status_code == 200
    done = chat(client, "whatever")
    assert done.model == "tiny"
    check_teacher(adapters["a"][1], done)
    assert httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": "tiny"}).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"lora_name": "", "lora_path": "x"}, "lora_name"),
        ({"lora_name": "a"}, "lora_path"),
        ({"lora_name": "a", "lora_path": "x", "load_inplace": "yes"}, "load_inplace"),
        ({"lora_name": "a", "lora_path": "x", "extra": 1}, "extra"),
    ],
)
def test_http_bad_body(policy, body, param):
    r = httpx.post(policy.base_url.removesuffix("/v1") + "/v1/load_lora_adapter", json=body)
    assert r.status_code == 400 and param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


def test_http_missing_adapter_dir(policy, tmp_path):
    r = httpx.post(
        policy.base_url.removesuffix("/v1") + "/v1/load_lora_adapter",
        json={"lora_name": "a", "lora_path": str(tmp_path / "gone")},
    )
    assert r.status_code == 400 and "no such directory" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == str(tmp_path / "gone")


# ---------------------------------------------------------------------------- who may call them
LORA_CALLS = [
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
    ("/v1/unload_lora_adapter", {"lora_name": "a"}),
]


def test_lora_routes_take_the_admin_key(tiny_model_dir):
    from gymserve.config import validate_config
    from gymserve.server.control_routes import LORA_PATHS
    from gymserve.server.run import start_background_server

    assert {p for p, _ in LORA_CALLS} == LORA_PATHS
    cfg = validate_config(
        {
            "server": {"port": 0, "api_key": "server-key-123", "admin_api_key": "admin-key-456"},
            "backend": {"type": "local", "model": str(tiny_model_dir), "num_threads": 1},
        }
    )
    with start_background_server(cfg) as srv:
        root = srv.base_url.removesuffix("/v1")
        for path, body in LORA_CALLS:
            for key in (None, "server-key-123"):
                r = httpx.post(root + path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {})
                assert r.status_code == 401 and "admin API key" in r.json()["error"]["message"], (path, key)
            r = httpx.post(root + path, json=body, headers={"Authorization": "Bearer admin-key-456"})
            assert r.status_code in (400, 404), r.text  # past the key: no such adapter directory / adapter


def test_lora_routes_closed_or_unsupported(monkeypatch):
    from gymserve.config import validate_config
    from gymserve.server.run import start_background_server
    from helpers.fakes import ChatScript, FakeServer

    with FakeServer(ChatScript(name="up")) as up:
        cfg = validate_config({"server": {"port": 0}, "backend": {"type": "chat", "base_urls": [up.url + "/v1"]}})
        with start_background_server(cfg) as srv:  # a chat backend serves weights it does not own
            for path, body in LORA_CALLS:
                r = httpx.post(srv.base_url.removesuffix("/v1") + path, json=body)
                assert r.status_code == 501 and r.json()["error"]["code"] == "control_not_supported", r.text
        monkeypatch.setattr(
            "gymserve.server.control_routes.control_allowed", lambda host, *keys: False
        )  # as for 0.0.0.0
        with start_background_server(cfg) as srv:
            for path, body in LORA_CALLS:
                r = httpx.post(srv.base_url.removesuffix("/v1") + path, json=body)
                assert r.status_code == 403 and r.json()["error"]["code"] == "control_closed", r.text
