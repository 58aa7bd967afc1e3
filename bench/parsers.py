"""Streaming parser cost against generation length: it must stay linear.

A streamed generation is fed to ``StreamingParser`` one character at a time (the worst case; a
token is ~4 characters) for texts of N and 2N characters. Each case stretches one part of the
text: a tool call's arguments in every format (Qwen3-Coder's parameter values, harmony's channel
messages included), plain content, a bare JSON answer that is not a call, whitespace the scanner
waits on, a long call name, reasoning before ``</think>`` or in harmony's analysis channel. Printed:
seconds at N and 2N and their ratio — about 2 for linear cost, about 4 for quadratic (the
target: every ratio below 3).

Usage: ``python bench/parsers.py [--quick] [--n 20000]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from gymserve.parsers import StreamingParser, get_reasoning_parser, get_tool_call_parser  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '{"name": "get_weather", "arguments": {}}'


def cases(n: int) -> dict[str, tuple[str, str | None, str]]:
    """name -> (tool-call parser, reasoning parser, text of about ``n`` characters)."""
    words = ("lorem ipsum dolor " * (n // 18 + 1))[:n]
    args = '{"city": "' + words + '"}'
    call = '{"name": "get_weather", "arguments": ' + args + "}"
    return {
        "hermes arguments": ("hermes", None, f"<tool_call>\n{call}\n</tool_call>"),
        "qwen2_5_coder bare arguments": ("qwen2_5_coder", None, call),
        "qwen2_5_coder fenced arguments": ("qwen2_5_coder", None, f"```json\n{call}\n```"),
        "llama3_json arguments": ("llama3_json", None, "<|python_tag|>" + call.replace("arguments", "parameters")),
        "mistral list arguments": ("mistral", None, f"[TOOL_CALLS][{call}]"),
        "mistral name[ARGS]": ("mistral", None, f"[TOOL_CALLS]get_weather[ARGS]{args}"),
        "arguments as a string": ("hermes", None, '<tool_call>{"name": "get_weather", "arguments": "' + words + '"}'),
        "plain content": ("hermes", None, words),
        "bare JSON answer": ("qwen2_5_coder", None, '{"answer": "' + words + '"}'),
        "extra member after arguments": (
            "hermes",
            None,
            '<tool_call>{"name": "get_weather", "arguments": {}, "x": "' + words + '"}</tool_call>',
        ),
        "whitespace before a close tag": ("hermes", None, f"<tool_call>{CALL}" + "\n" * n + "</tool_call>"),
        "whitespace before bare JSON": ("qwen2_5_coder", None, "\n" * n + CALL),
        "long call name": ("qwen2_5_coder", None, '{"name": "' + words + '", "arguments": {}}'),
        "reasoning (pre-filled <think>)": ("hermes", "qwen3", words + "</think>ok"),
        "reasoning (model's <think>)": ("hermes", "qwen3", "<think>" + words + "</think>ok"),
        "mistral name{...}": ("mistral", None, f"[TOOL_CALLS]get_weather{args}"),
        "deepseek_v3 arguments": (
            "deepseek_v3",
            None,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            + args
            + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
        "qwen3_coder parameter value": (
            "qwen3_coder",
            None,
            f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{words}\n</parameter>\n</function>\n</tool_call>",
        ),
        "harmony analysis": ("openai", "openai_gptoss", f"<|channel|>analysis<|message|>{words}<|end|>"),
        "harmony call arguments": ("openai", None, f"<|channel|>commentary to=functions.get_weather<|message|>{args}"),
        "harmony final answer": ("openai", None, f"<|channel|>final<|message|>{words}<|return|>"),
    }


def feed_seconds(tool: str, reasoning: str | None, text: str) -> float:
    parser = StreamingParser(
        get_tool_call_parser(tool),
        get_reasoning_parser(reasoning) if reasoning else None,
        "<|im_start|>assistant\n" if reasoning is None else "",
        TOOLS,
    )
    t0 = time.perf_counter()
    for ch in text:
        parser.feed(ch)
    parser.finish("stop")
    return time.perf_counter() - t0


def run(n: int, quick: bool) -> dict:
    small, large = cases(n), cases(2 * n)
    rows = []
    for name in small:
        a, b = feed_seconds(*small[name]), feed_seconds(*large[name])
        rows.append({"case": name, "small_s": a, "large_s": b, "ratio": b / a})
    return {"machine": common.machine(), "quick": quick, "n": n, "rows": rows}


def report(res: dict) -> str:
    n = res["n"]
    rows = [[r["case"], f"{r['small_s']:.3f}", f"{r['large_s']:.3f}", f"{r['ratio']:.2f}"] for r in res["rows"]]
    worst = max(r["ratio"] for r in res["rows"])
    return "\n".join(
        [
            common.machine_line(res["machine"], n=n, mode="quick" if res["quick"] else "full"),
            common.table(
                ["case", f"{n} chars s", f"{2 * n} chars s", "ratio"],
                rows,
                "StreamingParser, fed one character at a time",
            ),
            "\nTargets",
            f"  {common.verdict(worst < 3)}  worst 2N/N ratio {worst:.2f} (below 3: linear, not quadratic)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="characters of the shorter text (20,000; 5,000 quick)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run(args.n or (5000 if args.quick else 20000), args.quick)
    common.save_results("parsers-quick" if args.quick else "parsers", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
