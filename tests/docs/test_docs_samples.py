"""The docs' sample output of real runs is what the code prints, and is consistent with itself.

``scripts/gen_samples.py`` writes each sample from a real run on the embedded model; nothing in them
is typed by hand. These tests check the committed samples against the code without the slow real
model:

- the demo sample (getting-started) follows the demo's line format, checked by parsing a demo run
  on the tiny test model with the same grammar; it names the embedded model as ``/v1/models`` lists
  it; its counts agree with each other (each turn's prompt holds the previous prompt + generation,
  the teacher-forced total is the sum of the generated counts, the contiguity line counts the
  rollouts shown);
- the rollout sample (tutorial) holds real token IDs: decoded with the embedded model's tokenizer,
  the prompt is the task's conversation in the model's chat template and the generation is the
  function call shown; its fields are the Responses API's item fields plus gymserve's training
  and weight-version fields.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from helpers.docs_markdown import DOCS, ROOT, doc_files, prose_of

sys.path.insert(0, str(ROOT / "scripts"))
try:
    import gen_samples
finally:
    sys.path.pop(0)

_MARKER = re.compile(r"<!-- sample: (\w+)\b")


def sample_body(name: str) -> str:
    """The code inside sample ``name``'s fence, from the page ``gen_samples.SAMPLES`` names."""
    path = gen_samples.SAMPLES[name][0]
    [body] = gen_samples.sample_pattern(name).findall(path.read_text(encoding="utf-8"))
    m = re.fullmatch(
        r"Recorded by `scripts/gen_samples.py` on \d+ cores, load average [\d.]+ at the start and "
        r"[\d.]+ at the end\.\n\n```(\w+)\n(.*)```\n",
        body[1],
        re.S,
    )
    assert m, (
        f"sample {name} in {path.relative_to(ROOT)} is not the script's note and one fenced block: "
        f"run scripts/gen_samples.py {name}"
    )
    return m.group(2)


def test_every_sample_is_generated_by_the_script():
    found = {(p, name) for p in doc_files() for name in _MARKER.findall(p.read_text(encoding="utf-8"))}
    expected = {(path, name) for name, (path, _) in gen_samples.SAMPLES.items()}
    assert found == expected, f"sample markers {sorted(found)} != samples gen_samples.py writes {sorted(expected)}"
    for name in gen_samples.SAMPLES:
        assert sample_body(name).strip(), f"sample {name} is empty: run scripts/gen_samples.py {name}"


# ------------------------------------------------------------------------------------------ demo
# The demo's output, line by line (first match wins). Lines before "serving" are free text.
DEMO_GRAMMAR = [
    ("serving", r"serving (?P<name>\S+) in process at (?P<url>http://127\.0\.0\.1:\d+/v1) \([\d.]+ s to load\)"),
    ("model", r"model (?P<name>\S+) at (?P<url>\S+); running (?P<n>\d+) requests with the weather tools"),
    ("rollouts", r"rollouts: (?P<n>\d+) in [\d.]+ s \(run at once\)"),
    ("checks", r"=== checks"),
    ("request", r"=== (?P<request>.+)"),
    (
        "turn",
        r"--- turn (?P<k>\d+): prompt (?P<p>\d+) tokens, generated (?P<g>\d+) tokens, [\d.]+ s, "
        r"status (?P<status>completed|incomplete)",
    ),
    ("stop", r"--- stop: (?P<reason>\w+), reward (?P<reward>\d\.\d\d|n/a)(?:, error: .*)?"),
    ("call", r"  function_call: (?P<name>\w+)\((?P<args>.*)\)  call_id=(?P<call_id>\S+)"),
    ("item", r"  (?P<kind>function_call_output|message|reasoning|[a-z_]+): (?P<text>.*)"),
    ("no_items", r"  \(no output items\)"),
    (
        "answers",
        r"answers: (?P<n>\d+)/(?P<total>\d+) rollouts called the tool, then answered; mean reward (?P<mean>\d\.\d\d|n/a)",
    ),
    ("contiguity", r"contiguity: (?P<ok>\d+)/(?P<total>\d+) rollouts token-contiguous \((?P<multi>\d+) multi-turn\)"),
    (
        "log_probs",
        r"log-probs: (?P<k>\d+) generated tokens teacher-forced on the served weights, max \|diff\| = "
        r"(?P<diff>\S+) \(tolerance (?P<tol>\S+), [\d.]+ s\)",
    ),
    ("tolerance", r"  tolerance (?P<tol>\S+): (?P<why>.+)"),
    ("verdict", r"verdict: (?P<verdict>PASS|FAIL)"),
    ("blank", r""),
]


def parse_demo(text: str) -> dict:
    """The demo output as ``{"header": {...}, "rollouts": [...], "checks": {...}}``; AssertionError
    naming the first line the grammar does not know."""
    out: dict = {"header": {}, "rollouts": [], "checks": {}}
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("serving ")), None)
    assert start is not None, "no 'serving MODEL in process at URL' line"
    rollout = None
    for n, line in enumerate(lines[start:], start + 1):
        kind, m = next(((k, m) for k, rx in DEMO_GRAMMAR if (m := re.fullmatch(rx, line))), (None, None))
        assert m is not None, f"line {n} is not in the demo's format: {line!r}"
        g = m.groupdict()
        if kind in ("serving", "model"):
            out["header"][kind] = g
        elif kind == "request":
            rollout = {"request": g["request"], "turns": [], "stop": None}
            out["rollouts"].append(rollout)
        elif kind == "turn":
            rollout["turns"].append({"k": int(g["k"]), "p": int(g["p"]), "g": int(g["g"]), "items": []})
        elif kind in ("call", "item"):
            rollout["turns"][-1]["items"].append((kind, g))
        elif kind == "stop":
            rollout["stop"] = g
        elif kind in ("answers", "contiguity", "log_probs", "tolerance", "verdict", "rollouts"):
            out["checks"][kind] = g
    return out


@pytest.fixture(scope="module")
def tiny_demo(tiny_gguf_dir) -> str:
    """What ``gymserve demo`` prints on the tiny model (its GGUF, on the demo's llamacpp engine):
    the current code's output format."""
    import contextlib
    import io

    from gymserve.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["demo", "--model", str(tiny_gguf_dir), "--max-output-tokens", "8"])
    assert code == 0, out.getvalue()
    return out.getvalue()


def _preamble(text: str) -> list[str]:
    lines = text.splitlines()
    return lines[: next(i for i, line in enumerate(lines) if line.startswith("serving "))]


def test_demo_sample_is_in_the_demos_format(tiny_demo):
    assert _preamble(sample_body("demo")) == _preamble(tiny_demo), (
        "the demo's first lines changed: run scripts/gen_samples.py demo"
    )
    sample, now = parse_demo(sample_body("demo")), parse_demo(tiny_demo)
    # Rollouts are printed as they end, so in any order.
    assert sorted(r["request"] for r in sample["rollouts"]) == sorted(r["request"] for r in now["rollouts"]), (
        "the demo's requests changed: run scripts/gen_samples.py demo"
    )
    checks = {"answers", "contiguity", "log_probs", "tolerance", "verdict", "rollouts"}
    assert set(sample["checks"]) == set(now["checks"]) == checks


def test_demo_sample_counts_agree():
    from gymserve.engine.embedded_models import find_embedded
    from gymserve.harness.demo import DEMO_MODEL

    demo = parse_demo(sample_body("demo"))
    header, rollouts, checks = demo["header"], demo["rollouts"], demo["checks"]
    assert header["serving"]["name"] == header["model"]["name"] == find_embedded(DEMO_MODEL).name
    assert header["serving"]["url"] == header["model"]["url"] and int(header["model"]["n"]) == len(rollouts)
    call_ids = []
    for r in rollouts:
        turns = r["turns"]
        assert [t["k"] for t in turns] == list(range(1, len(turns) + 1)) and r["stop"], r["request"]
        for prev, t in zip(turns, turns[1:]):
            # Contiguous: the next prompt holds the previous prompt + generation (its EOS included),
            # plus at least the tool's answer.
            assert t["p"] > prev["p"] + prev["g"], (r["request"], t)
        for t in turns:
            kinds = [g.get("kind", kind) for kind, g in t["items"]]
            for i, (kind, g) in enumerate(t["items"]):
                if kind == "call":
                    json.loads(g["args"])
                    call_ids.append(g["call_id"])
                elif kinds[i] == "function_call_output":
                    # The tool's answer is printed right under the call it answers.
                    assert i > 0 and kinds[i - 1] == "call", f"{r['request']}: an output without its call"
    assert len(call_ids) == len(set(call_ids)), "call_ids repeat"
    a = checks["answers"]
    done = [
        r
        for r in rollouts
        if r["stop"]["reason"] == "message" and any(k == "call" for t in r["turns"] for k, _ in t["items"])
    ]
    assert int(a["n"]) == len(done) and int(a["total"]) == len(rollouts)
    rewards = [float(r["stop"]["reward"]) for r in rollouts]
    assert a["mean"] == f"{sum(rewards) / len(rewards):.2f}"
    # What the demo is for (issue #16): the agent calls the tool and then answers, on most tasks.
    assert 2 * len(done) > len(rollouts), f"only {len(done)}/{len(rollouts)} rollouts answered after the tool call"
    c = checks["contiguity"]
    assert int(c["ok"]) == int(c["total"]) == len(rollouts)
    assert int(c["multi"]) == sum(len(r["turns"]) > 1 for r in rollouts)
    lp = checks["log_probs"]
    assert int(lp["k"]) == sum(t["g"] for r in rollouts for t in r["turns"])
    assert float(lp["diff"]) <= float(lp["tol"]) and checks["verdict"]["verdict"] == "PASS"
    # The tolerance is said with its reason: the documented one for the quantized GGUF on llama.cpp.
    from gymserve.harness.verify import QUANTIZED_TOLERANCE

    tol = checks["tolerance"]
    assert float(tol["tol"]) == float(lp["tol"]) == QUANTIZED_TOLERANCE and "quantized weights" in tol["why"]
    documented = re.search(r"`stop_reason` \(([^)]*)\)", " ".join(prose_of(DOCS / "tutorial.md").split())).group(1)
    reasons = set(re.findall(r"`(\w+)`", documented))
    assert {r["stop"]["reason"] for r in rollouts} <= reasons, f"stop reasons beyond the documented {reasons}"


# --------------------------------------------------------------------------------------- rollout
def test_rollout_sample_is_a_real_model_call(tokenizer):
    from openai.types.responses import ResponseFunctionToolCall
    from openai.types.responses.response_input_item import FunctionCallOutput

    from gymserve.protocol import TRAINING_FIELDS, VERSION_FIELDS

    items = json.loads(sample_body("rollout"))
    with_fields = [i for i, it in enumerate(items) if "prompt_token_ids" in it]
    outputs = [it for it in items if it["type"] == "function_call_output"]
    calls = [it for it in items if it["type"] == "function_call"]
    assert len(with_fields) == 1 and with_fields[0] == len(items) - len(outputs) - 1, (
        "the training fields sit on the model call's last output item"
    )
    assert calls and [o["call_id"] for o in outputs] == [c["call_id"] for c in calls]
    for call in calls:
        assert set(call) <= set(ResponseFunctionToolCall.model_fields) | set(TRAINING_FIELDS) | set(VERSION_FIELDS), (
            sorted(call)
        )
    for out in outputs:
        assert set(out) <= set(FunctionCallOutput.model_fields), sorted(out)

    last = items[with_fields[0]]
    prompt, gen, logps = (last[f] for f in TRAINING_FIELDS)
    assert len(gen) == len(logps) > 0 and all(math.isfinite(x) and x <= 0 for x in logps)
    assert all(0 <= i < len(tokenizer) for i in prompt + gen)
    task = gen_samples.tutorial_tasks()[0]
    rendered = tokenizer.decode(prompt)
    assert rendered.startswith("<|im_start|>system") and rendered.endswith("<|im_start|>assistant\n")
    assert task["responses_create_params"]["input"] in rendered
    generated = tokenizer.decode(gen)
    for call in calls:
        assert call["name"] in generated
        for key, value in json.loads(call["arguments"]).items():
            assert json.dumps(key) in generated and json.dumps(value) in generated, (generated, call)
        assert json.loads(call["arguments"])["city"] in outputs[calls.index(call)]["output"]


def test_sample_json_formatter_round_trips():
    items = [
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Zürich"}',
            "status": "completed",
            "prompt_token_ids": list(range(151600, 151700)),
            "generation_token_ids": [1, 2, 3],
            "generation_log_probs": [-0.000123456789, -1.5, 0.0],
        },
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_c": 18}'},
    ]
    text = gen_samples.format_items(items)
    assert json.loads(text) == items
    assert max(len(line) for line in text.splitlines()) <= gen_samples.WIDTH
    assert gen_samples.first_call_items({"output": items + [dict(items[0], call_id="call_2")]}) == items
