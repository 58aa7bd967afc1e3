"""Rollout collection: task files, durable appends, interrupt + resume, and concurrent rollouts
against the real local backend (tiny model) checked by verify."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_agent import make_fake_responses_app

from gymserve.harness.envs import BackgroundApp
from gymserve.harness.rollout import (
    JsonlAppender,
    TaskFileError,
    collect_rollouts,
    load_tasks,
    main_rollout,
    prepare_output,
)

CITIES = ("Paris", "London", "Tokyo", "Cairo", "Berlin", "Sydney")


def _tasks(n, max_output_tokens=16):
    return [
        {
            "id": f"t{i}",
            "env": "weather",
            "responses_create_params": {
                "input": f"What's the weather in {CITIES[i % len(CITIES)]}?",
                "max_output_tokens": max_output_tokens,
            },
        }
        for i in range(n)
    ]


def _write_tasks(path: Path, tasks):
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def _read_jsonl(path: Path):
    text = path.read_text()
    assert text == "" or text.endswith("\n"), "file must end with a complete line"
    return [json.loads(line) for line in text.splitlines()]


def _client(url):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=url, api_key="test", max_retries=0)


def test_load_tasks(tmp_path):
    p = tmp_path / "tasks.jsonl"
    p.write_text(
        '{"responses_create_params": {"input": "Paris?"}}\n\n{"id": 7, "responses_create_params": {"input": []}}\n'
    )
    tasks = load_tasks(p)
    assert [t["id"] for t in tasks] == ["line-1", "7"] and all(t["env"] == "weather" for t in tasks)
    for bad, msg in [
        ('{"id": "a", "responses_create_params": {}}', "input"),
        ('{"env": "chess", "responses_create_params": {"input": "x"}}', "unknown env"),
        ("[1]", "JSON object"),
        ("{oops", "not valid JSON"),
        (
            '{"id": "a", "responses_create_params": {"input": "x"}}\n{"id": "a", "responses_create_params": {"input": "y"}}',
            "duplicate id",
        ),
    ]:
        p.write_text(bad + "\n")
        with pytest.raises(TaskFileError, match=msg):
            load_tasks(p)


def test_prepare_output_resume_drops_partial_line(tmp_path):
    out = tmp_path / "sub" / "r.jsonl"
    assert prepare_output(out, resume=False) == set() and out.parent.is_dir()
    with JsonlAppender(out) as w:
        w.append({"id": "a", "x": "é"})
        w.append({"id": "b"})
    with pytest.raises(FileExistsError, match="--resume"):
        prepare_output(out, resume=False)
    with open(out, "ab") as f:
        f.write(b'{"id": "c", "output": [1, 2')  # a crash mid-append
    assert prepare_output(out, resume=True) == {"a", "b"}
    assert [r["id"] for r in _read_jsonl(out)] == ["a", "b"]
    with open(out, "ab") as f:
        f.write(b'{"id": "c", "trunc\n')  # a corrupt last line is dropped too
    assert prepare_output(out, resume=True) == {"a", "b"}
    out.write_text('{"id": "a"}\n{broken\n{"id": "b"}\n')
    with pytest.raises(TaskFileError, match=":2: corrupt"):
        prepare_output(out, resume=True)


async def test_collect_against_fake_server(tmp_path):
    app = make_fake_responses_app(delay=0.01)
    out = tmp_path / "rollouts.jsonl"
    with BackgroundApp(app) as bg:
        async with _client(f"{bg.url}/v1") as client:
            summary = await collect_rollouts(
                _tasks(8), out, client=client, model="fake-model", concurrency=3, progress=False
            )
    assert summary.written == 8 and summary.errors == 0 and summary.mean_reward == 1.0
    recs = _read_jsonl(out)
    assert sorted(r["id"] for r in recs) == [f"t{i}" for i in range(8)]
    r = recs[0]
    assert r["stop_reason"] == "message" and r["num_turns"] == 2 and r["reward"] == 1.0 and r["error"] is None
    assert [t["output_types"] for t in r["turns"]] == [["reasoning", "function_call"], ["message"]]
    assert [it["type"] for it in r["output"]] == ["reasoning", "function_call", "function_call_output", "message"]
    assert r["output"][1]["prompt_token_ids"] == r["turns"][0]["prompt_token_ids"]
    assert r["generated_tokens"] == sum(len(t["generation_token_ids"]) for t in r["turns"])
    assert r["timings"]["total_s"] >= r["timings"]["model_s"] > 0 and r["model"] == "fake-model"
    assert r["input"] == [{"type": "message", "role": "user", "content": r["responses_create_params"]["input"]}]
    # Each rollout's turns went out with its id as the session.
    assert {q["headers"]["x-session-id"] for q in app.state.requests} == {f"t{i}" for i in range(8)}


async def test_interrupt_then_resume(tmp_path):
    """Cancel mid-run: the file holds only whole lines; --resume finishes the rest, no duplicates."""
    app = make_fake_responses_app(delay=0.05)
    out = tmp_path / "rollouts.jsonl"
    tasks = _tasks(12)
    with BackgroundApp(app) as bg:
        async with _client(f"{bg.url}/v1") as client:
            job = asyncio.create_task(
                collect_rollouts(tasks, out, client=client, model="fake-model", concurrency=2, progress=False)
            )
            while not out.exists() or out.read_text().count("\n") < 2:
                await asyncio.sleep(0.01)
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job
            first = _read_jsonl(out)
            assert 2 <= len(first) < len(tasks)
            with open(out, "ab") as f:
                f.write(b'{"id": "t11", "half')  # as if a crash had cut a write
            with pytest.raises(FileExistsError):
                await collect_rollouts(tasks, out, client=client, model="fake-model", progress=False)
            summary = await collect_rollouts(
                tasks, out, client=client, model="fake-model", concurrency=4, resume=True, progress=False
            )
    assert summary.skipped == len(first) and summary.written == len(tasks) - len(first)
    recs = _read_jsonl(out)
    assert sorted(r["id"] for r in recs) == sorted(t["id"] for t in tasks)
    assert recs[: len(first)] == first


def test_main_rollout_cli(tmp_path, capsys):
    app = make_fake_responses_app()
    tasks = _write_tasks(tmp_path / "tasks.jsonl", _tasks(3))
    out = tmp_path / "out.jsonl"
    with BackgroundApp(app) as bg:
        assert main_rollout(str(tasks), str(out), f"{bg.url}/v1", 2, False, None) == 0
        assert "3 rollouts written" in capsys.readouterr().out
        assert main_rollout(str(tasks), str(out), f"{bg.url}/v1", 2, False, None) == 2  # exists, no --resume
        assert main_rollout(str(tasks), str(out), f"{bg.url}/v1", 2, True, "fake-model") == 0
        assert "0 rollouts written" in capsys.readouterr().out
    assert len(_read_jsonl(out)) == 3
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    assert (
        main_rollout(str(tmp_path / "bad.jsonl"), str(tmp_path / "o2.jsonl"), "http://127.0.0.1:9/v1", 1, False, None)
        == 2
    )
    # A dead endpoint: every rollout is written with its error, and the exit code says so.
    assert main_rollout(str(tasks), str(tmp_path / "o3.jsonl"), "http://127.0.0.1:9/v1", 3, False, "m") == 1
    errs = _read_jsonl(tmp_path / "o3.jsonl")
    assert len(errs) == 3 and all(r["error"] and r["reward"] is None and r["stop_reason"] == "error" for r in errs)


# ---------------------------------------------------------------------------------------------
# Against the real local backend (tiny random-weight model)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
    from gymserve.server.run import start_background_server

    cfg = GymserveConfig(
        backend=LocalBackendConfig(model=str(tiny_model_dir), sampling=SamplingConfig(seed=0)),
        server=ServerConfig(port=0),
    )
    with start_background_server(cfg) as srv:
        yield srv


async def test_concurrent_rollouts_real_backend_verify(tiny_server, tiny_model_dir, tmp_path):
    from gymserve.harness.rollout import served_model_name
    from gymserve.harness.verify import load_model, main_verify, verify_rollouts

    out = tmp_path / "rollouts.jsonl"
    tasks = _tasks(6, max_output_tokens=16)
    async with _client(tiny_server.base_url) as client:
        model = await served_model_name(client)
        summary = await collect_rollouts(
            tasks, out, client=client, model=model, concurrency=4, max_steps=3, progress=False
        )
    assert summary.written == 6 and summary.errors == 0
    recs = _read_jsonl(out)
    assert sorted(r["id"] for r in recs) == sorted(t["id"] for t in tasks)
    for r in recs:
        assert r["turns"] and all(len(t["generation_token_ids"]) <= 16 for t in r["turns"])
        assert (
            r["output"][len(r["turns"][0]["output_types"]) - 1]["generation_token_ids"]
            == r["turns"][0]["generation_token_ids"]
        )
    report = verify_rollouts(recs, load_model(tiny_model_dir))
    assert report.contiguity_ok and report.num_tokens > 0 and report.max_diff <= 1e-4, report
    assert main_verify(str(out), str(tiny_model_dir)) == 0


async def test_interrupt_resume_real_backend(tiny_server, tmp_path):
    from gymserve.harness.rollout import served_model_name

    out = tmp_path / "rollouts.jsonl"
    tasks = _tasks(8, max_output_tokens=16)
    async with _client(tiny_server.base_url) as client:
        model = await served_model_name(client)
        job = asyncio.create_task(
            collect_rollouts(tasks, out, client=client, model=model, concurrency=2, max_steps=2, progress=False)
        )
        while not out.exists() or out.read_text().count("\n") < 1:
            await asyncio.sleep(0.005)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        first = _read_jsonl(out)
        assert 1 <= len(first) <= len(tasks)
        await collect_rollouts(
            tasks, out, client=client, model=model, concurrency=4, max_steps=2, resume=True, progress=False
        )
    ids = [r["id"] for r in _read_jsonl(out)]
    assert sorted(ids) == sorted(t["id"] for t in tasks) and len(ids) == len(set(ids))


def test_sigint_leaves_whole_lines(tmp_path):
    """A real SIGINT to a running ``main_rollout``: exit 130, only whole lines, resume completes."""
    import signal
    import subprocess
    import sys
    import time

    app = make_fake_responses_app(delay=0.1)
    tasks = _write_tasks(tmp_path / "tasks.jsonl", _tasks(40))
    out = tmp_path / "out.jsonl"
    with BackgroundApp(app) as bg:
        code = (
            f"import sys; from gymserve.harness.rollout import main_rollout; "
            f"sys.exit(main_rollout({str(tasks)!r}, {str(out)!r}, {bg.url + '/v1'!r}, 2, False, 'fake-model'))"
        )
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_text().count("\n") < 2) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "--resume" in err
        first = _read_jsonl(out)
        assert 2 <= len(first) < 40
        assert main_rollout(str(tasks), str(out), f"{bg.url}/v1", 8, True, "fake-model") == 0
    ids = [r["id"] for r in _read_jsonl(out)]
    assert sorted(ids) == sorted(f"t{i}" for i in range(40)) and len(set(ids)) == 40
