"""How gymserve's per-request work grows with the length of a rollout (local engine path).

A weather-agent rollout of N turns is built the way a trainer drives gymserve: each turn's model
call returns a tool call whose output item carries ``prompt_token_ids``, ``generation_token_ids``
and ``generation_log_probs``; the agent sends the whole conversation back, with those fields, plus
the tool's output. For the request that carries N turns, this times what the local backend does
around the engine, with the real embedded tokenizer and chat template:

- ``convert``: ``responses_to_chat`` (Responses request → chat messages);
- ``prompt``: ``build_prompt`` (chat template + prefix splice → prompt token IDs);
- ``back``: ``chat_to_response`` (the completion, with token fields, → Response).

The engine is excluded (the generation is a fixed tool-call JSON, tokenized once per turn).
Reported: µs per request for each stage and in total, µs per turn, and the growth of the total
relative to 1 turn next to the growth in turns; growth no faster than linear means µs per turn
does not rise from 10 to 100 turns.

Usage: ``python bench/growth.py [--quick] [--turns 1,10,50,100]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo", "Dublin", "Athens"]


class Pipeline:
    """The local backend's work around the engine, stage by stage."""

    def __init__(self):
        from transformers import AutoTokenizer

        from gymserve.convert import ConvertOptions
        from gymserve.engine.model_store import embedded_model_dir
        from gymserve.prompting import ChatTemplate

        model_dir = embedded_model_dir()
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.template = ChatTemplate(self.tokenizer)
        cfg = json.loads((model_dir / "config.json").read_text())
        gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
        eos = gen_cfg.get("eos_token_id", cfg.get("eos_token_id"))
        self.eos = tuple(eos) if isinstance(eos, list) else (eos,)
        self.vocab_size = int(cfg["vocab_size"])
        self.options = ConvertOptions()  # what LocalBackend uses

    def convert(self, request):
        from gymserve.convert import responses_to_chat

        return responses_to_chat(request, self.options)

    def prompt(self, chat):
        from gymserve.prompting import build_prompt

        return build_prompt(
            self.template,
            chat["messages"],
            tools=chat.get("tools"),
            chat_template_kwargs=chat.get("chat_template_kwargs"),
            eos_token_ids=self.eos,
            vocab_size=self.vocab_size,
        )

    def completion(self, prompt_ids: list[int], gen_ids: list[int], city: str) -> dict[str, Any]:
        return {
            "id": "chatcmpl-growth",
            "object": "chat.completion",
            "created": 0,
            "model": "embedded",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "logprobs": None,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": f"call_{len(prompt_ids)}",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                            }
                        ],
                        "prompt_token_ids": prompt_ids,
                        "generation_token_ids": gen_ids,
                        "generation_log_probs": [-0.25] * len(gen_ids),
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(gen_ids),
                "total_tokens": len(prompt_ids) + len(gen_ids),
            },
        }

    def back(self, completion, request):
        from gymserve.convert import chat_to_response

        return chat_to_response(completion, request)

    def generation(self, city: str) -> list[int]:
        """What the embedded model emits for a tool call (a bare JSON object), ended by its EOS as
        gymserve returns it."""
        text = json.dumps({"name": "get_weather", "arguments": {"city": city}})
        return self.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)


def build_rollouts(pipe: Pipeline, max_turns: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(request, completion)`` for turns 1..max_turns of one rollout, each request holding every
    earlier turn with its token fields (built by running the pipeline itself, turn by turn)."""
    request: dict[str, Any] = {
        "model": "embedded",
        "instructions": "You are a weather assistant. Use the tools.",
        "input": [{"type": "message", "role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS,
        "max_output_tokens": 48,
    }
    out = []
    for t in range(max_turns):
        city = CITIES[t % len(CITIES)]
        snapshot = json.loads(json.dumps(request))
        chat = pipe.convert(snapshot)
        prompt = pipe.prompt(chat)
        if t and not prompt.spliced:
            raise RuntimeError(f"turn {t + 1}: the prompt was not spliced; the rollout is not token-contiguous")
        completion = pipe.completion(prompt.token_ids, pipe.generation(city), city)
        out.append((snapshot, completion))
        response = pipe.back(completion, snapshot)
        call = response["output"][-1]
        report = {"city": city, "temperature_c": 10 + t % 17, "conditions": "partly cloudy", "wind_kph": 5 + t % 30}
        request["input"] += response["output"] + [
            {"type": "function_call_output", "call_id": call["call_id"], "output": json.dumps(report)},
        ]
    return out


def time_turn(pipe: Pipeline, request, completion, reps: int, min_time: float) -> dict[str, float]:
    """Best-of and median µs per stage over ``reps`` repetitions (at least ``min_time`` seconds)."""
    samples = {"convert": [], "prompt": [], "back": [], "total": []}
    start = time.perf_counter()
    i = 0
    while i < reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        chat = pipe.convert(request)
        t1 = time.perf_counter()
        pipe.prompt(chat)
        t2 = time.perf_counter()
        pipe.back(completion, request)
        t3 = time.perf_counter()
        for k, v in (("convert", t1 - t0), ("prompt", t2 - t1), ("back", t3 - t2), ("total", t3 - t0)):
            samples[k].append(v * 1e6)
        i += 1
        if i >= reps * 20:
            break
    return {k: common.percentile(v, 50) for k, v in samples.items()} | {"reps": i, "total_min": min(samples["total"])}


def run(args) -> dict[str, Any]:
    turns = sorted(int(t) for t in args.turns.split(","))
    reps, min_time = (5, 0.2) if args.quick else (30, 2.0)
    info = common.machine()
    pipe = Pipeline()
    rollout = build_rollouts(pipe, max(turns))
    rows = []
    for n in turns:
        request, completion = rollout[n - 1]
        r = time_turn(pipe, request, completion, reps, min_time)
        r.update(
            turns=n,
            request_bytes=len(json.dumps(request)),
            prompt_tokens=len(completion["choices"][0]["message"]["prompt_token_ids"]),
        )
        rows.append(r)
        print(
            f"  {n:>3} turns: {r['total']:9.0f} µs/request (convert {r['convert']:.0f}, prompt {r['prompt']:.0f}, "
            f"back {r['back']:.0f}; {r['reps']} reps)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "machine": info,
        "quick": args.quick,
        "rows": rows,
        "model": pipe.model_dir.name,
        "tokenizer": type(pipe.tokenizer).__name__,
    }


def report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    base = rows[0]
    out = [
        common.machine_line(
            res["machine"],
            tokenizer=f"{res['model']} ({res['tokenizer']})",
            client="direct function calls, median of repetitions",
            mode="quick" if res["quick"] else "full",
        )
    ]
    table_rows = []
    for r in rows:
        table_rows.append(
            [
                r["turns"],
                f"{r['request_bytes'] / 1024:.0f} KB",
                r["prompt_tokens"],
                r["convert"],
                r["prompt"],
                r["back"],
                r["total"],
                r["total"] / r["turns"],
                r["total"] / base["total"],
                r["turns"] / base["turns"],
            ]
        )
    out.append(
        common.table(
            [
                "turns",
                "request",
                "prompt tokens",
                "convert µs",
                "template+splice µs",
                "back µs",
                "total µs",
                "µs per turn",
                "total ÷ 1 turn",
                "turns ÷ 1 turn",
            ],
            table_rows,
            "Per-request work around the engine (local backend path; engine excluded)",
        )
    )
    out.append("\nTarget: growth no faster than linear in turns")
    for line in targets(res):
        out.append("  " + line)
    return "\n".join(out)


def targets(res: dict[str, Any]) -> list[str]:
    rows = res["rows"]
    if len(rows) < 2:
        return []
    lo = next((r for r in rows if r["turns"] >= 10), rows[0])
    hi = rows[-1]
    per_lo, per_hi = lo["total"] / lo["turns"], hi["total"] / hi["turns"]
    # Linear or better: the cost per turn at the longest rollout is not above that at 10 turns
    # (10% allowance for timer noise on a shared machine).
    ok = per_hi <= per_lo * 1.1
    growth = (hi["total"] / lo["total"]) / (hi["turns"] / lo["turns"])
    return [
        f"{common.verdict(ok)}  µs per turn: {per_lo:.0f} at {lo['turns']} turns, {per_hi:.0f} at {hi['turns']} "
        f"turns; total grew {hi['total'] / lo['total']:.1f}× for {hi['turns'] / lo['turns']:.0f}× the turns "
        f"(growth ÷ linear = {growth:.2f}; ≤ 1.1 passes)"
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few repetitions (seconds)")
    p.add_argument("--turns", default="1,10,50,100")
    args = p.parse_args(argv)
    res = run(args)
    common.save_results("growth-quick" if args.quick else "growth", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
