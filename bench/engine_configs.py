"""The configurations ``bench/engine.py`` measures on the transformers side, and the prompts all of
them get: ``raw generate`` (``model.generate`` in this process, the ceiling), ``HttpServer`` (any
OpenAI-compatible chat server in its own process, driven by ``AsyncOpenAI``), ``gymserve serve``
with the transformers engine, and ``transformers serve`` from ``.venv-peer``. Each configuration
has ``one(n)``, ``eight(n)`` (tokens, latencies, wall seconds), ``prefill(nonce)`` (prompt tokens,
seconds), ``rss()`` and ``close()``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import tempfile
import time
from pathlib import Path

import common

TASKS = [
    "parses a CSV file of sales records and returns the total revenue per region",
    "implements an LRU cache class with get and put methods",
    "computes the shortest path in a weighted graph with Dijkstra's algorithm",
    "validates an email address with a regular expression and explains each part",
    "merges two sorted linked lists into one sorted list",
    "downloads a web page with urllib and counts the words in it",
    "converts a Roman numeral string to an integer and back",
    "implements binary search over a sorted list, iteratively and recursively",
]


LONG_CODE = "\n".join(f"def step_{i}(values):\n    return [v * {i} + {i * i} for v in values]" for i in range(40))


def prefill_messages(nonce: str) -> list[dict[str, str]]:
    """A ~1,000-token prompt whose first tokens differ every call (no prompt cache can serve it)."""
    return [{"role": "user", "content": f"[{nonce}] Explain what this code does:\n{LONG_CODE}"}]


def messages(i: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f"Write a Python function that {TASKS[i % len(TASKS)]}. "
            "Include type hints, a docstring, comments and an example.",
        }
    ]


# ---------------------------------------------------------------------------------- raw generate
class RawGenerate:
    """``model.generate`` in this process: one prompt, or the 8 prompts as one left-padded batch."""

    name = "raw generate"

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = {self.tok.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])}
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.texts = [
            self.tok.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False) for i in range(8)
        ]

    def generate(self, batch: list[str], n: int) -> tuple[int, float]:
        enc = self.tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad,
                top_p=None,
                top_k=None,
                temperature=None,
            )
        dt = time.perf_counter() - t0
        count = 0
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            for t in row:
                count += 1
                if t in self.eos:
                    break
        return count, dt

    def one(self, n: int) -> tuple[int, list[float], float]:
        count, dt = self.generate(self.texts[:1], n)
        return count, [dt], dt

    def eight(self, n: int) -> tuple[int, list[float], float]:
        count, dt = self.generate(self.texts, n)
        return count, [dt] * 8, dt

    def prefill(self, nonce: str) -> tuple[int, float]:
        """Prompt tokens and seconds for one forward pass over ``prefill_messages(nonce)``."""
        text = self.tok.apply_chat_template(prefill_messages(nonce), add_generation_prompt=True, tokenize=False)
        enc = self.tok([text], return_tensors="pt", add_special_tokens=False)
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            self.model(**enc, logits_to_keep=1)
        return int(enc["input_ids"].shape[1]), time.perf_counter() - t0

    def rss(self) -> float:
        import psutil

        return psutil.Process().memory_info().rss / 2**20

    def close(self) -> None:
        del self.model
        gc.collect()


# ---------------------------------------------------------------------------------- HTTP servers
class HttpServer:
    """A chat server in its own process, driven by ``AsyncOpenAI`` (non-streaming, temperature 0)."""

    def __init__(self, name: str, child: common.Child, model: str):
        self.name, self.child, self.model = name, child, model
        self.base_url = f"http://127.0.0.1:{child.port}/v1"

    async def _run(self, idx: list[int], n: int) -> tuple[int, list[float], float]:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=1800)

        async def one(i: int) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(
                model=self.model, messages=messages(i), max_tokens=n, temperature=0
            )
            return r.usage.completion_tokens, time.perf_counter() - t0

        try:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(i) for i in idx))
            return sum(c for c, _ in res), [dt for _, dt in res], time.perf_counter() - t0
        finally:
            await client.close()

    async def _prefill(self, nonce: str) -> tuple[int, float]:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=1800)
        try:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(
                model=self.model, messages=prefill_messages(nonce), max_tokens=1, temperature=0
            )
            return r.usage.prompt_tokens, time.perf_counter() - t0
        finally:
            await client.close()

    def prefill(self, nonce: str) -> tuple[int, float]:
        """Prompt tokens and seconds of one call with 1 new token on ``prefill_messages(nonce)``."""
        return asyncio.run(self._prefill(nonce))

    def one(self, n: int):
        return asyncio.run(self._run([0], n))

    def eight(self, n: int):
        return asyncio.run(self._run(list(range(8)), n))

    def rss(self) -> float:
        return common.rss_mib(self.child.pid)

    def close(self) -> None:
        self.child.stop()


def start_gymserve(model_dir: Path, threads: int) -> HttpServer:
    port = common.free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "backend": {
            "type": "local",
            "model": str(model_dir),
            "max_num_seqs": 8,
            "num_threads": threads,
            "sampling": {"temperature": 0},
        },
    }
    path = Path(tempfile.gettempdir()) / f"gymserve-bench-engine-{port}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    child = common.start_child(
        "gymserve-local",
        common.gymserve_cmd("serve", "--config", str(path)),
        port,
        env={"OMP_NUM_THREADS": str(threads)},
        caller_env=True,
    )
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 600)
    return HttpServer("gymserve transformers", child, "embedded")


def start_peer(model_dir: Path, threads: int, cb: bool, install: bool) -> HttpServer | None:
    exe = common.peer_venv(install=install)
    if exe is None:
        return None
    port = common.free_port()
    cmd = [str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    name = "transformers serve"
    if cb:
        # KV cache capped at 20% of free memory (its default is 60%): 8 short sequences need far
        # less, and other processes share this machine.
        cmd += ["--continuous-batching", "--cb-max-memory-percent", "0.2"]
        name += " --continuous-batching"
    child = common.start_child(
        "transformers-serve" + ("-cb" if cb else ""),
        cmd,
        port,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)},
        caller_env=True,  # as its users run it: nothing this benchmark set for itself
    )
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 600)
    return HttpServer(name, child, str(model_dir))
