"""The llama.cpp side of ``bench/engine.py``: its configurations, the memory-bandwidth bound, and the
log-prob gap of the llamacpp engine.

Configurations (each its own process, driven over HTTP like the others):

- ``gymserve llamacpp``: ``gymserve serve --engine llamacpp`` on the embedded model's GGUF;
- ``llama-server -np 8``: llama.cpp's own server with 8 slots and continuous batching, on the same
  GGUF, with its defaults otherwise; built from the llama.cpp source llama-cpp-python's sdist
  vendors, outside this repository, and named with ``--llama-server PATH`` (skipped without it);
- ``llama_cpp.server``: llama-cpp-python's own OpenAI-compatible server, from ``.venv-llama-peer``
  (``llama-cpp-python[server]``; pip reuses the wheel it built for the main environment).

The bandwidth bound: every decode step reads each weight once (all tensors but the token embedding,
whose rows are gathered), so ``bytes per step × steps/s`` is the memory traffic a configuration
needs; divided by a copy bandwidth measured in the same run (numpy copying 512 MiB: bytes read +
written per second, best of 3) it is the fraction of the machine's bound the configuration reaches.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

LLAMA_PEER = common.ROOT / ".venv-llama-peer"


# ----------------------------------------------------------------------------------- weight bytes
def gguf_step_bytes(gguf: Path) -> int:
    """Bytes of every tensor of ``gguf`` except ``token_embd.weight`` (read once per decode step)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")


def safetensors_step_bytes(model_dir: Path) -> int:
    """Bytes of ``model.safetensors`` (read from its header): with tied embeddings the one matrix is
    the LM head, read once per step; without, the embedding (gathered rows only) is left out."""
    with open(model_dir / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    return sum(sizes.values())


def copy_bandwidth(mib: int = 512, reps: int = 3) -> float:
    """Bytes per second numpy moves copying a ``mib`` MiB array (read + write), best of ``reps``."""
    import numpy as np

    src = np.ones(mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


# ----------------------------------------------------------------------------------- raw loop
class RawLlama:
    """llama.cpp's ceiling in this process: a greedy decode loop on ``llamacpp_runtime`` with no
    engine around it (8 streams: 8 sequences decoded in one ``llama_decode`` per step; prompts
    cached between runs, as the servers cache them), what the llamacpp engine's scheduling,
    sampling and HTTP are measured against. Its memory is this process's, shared with ``raw
    generate``, so no RSS is reported for it."""

    name = "raw llama.cpp loop"

    def __init__(self, gguf: Path, tokenizer_dir: Path, threads: int, messages, prefill_messages):
        import numpy as np
        from transformers import AutoTokenizer

        from gymserve.engine.llamacpp_runtime import LlamaContext, LlamaModel, RuntimeOptions

        self.np = np
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.encode = lambda msgs: tok(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
        self.prompts = [self.encode(messages(i)) for i in range(8)]
        self.prefill_messages = prefill_messages
        self.eos = tok.eos_token_id
        self.model = LlamaModel(gguf)
        self.ctx = LlamaContext(self.model, RuntimeOptions(n_ctx=8 * 2048, n_seq_max=9, n_threads=threads))
        self.cached: dict[int, list[int]] = {}  # sequence → the prompt whose KV it holds

    def _run(self, prompts: list[list[int]], n: int) -> tuple[int, list[float], float]:
        """Greedy ``n`` tokens for each prompt, one ``llama_decode`` per step. A prompt whose KV is
        cached from an earlier run is not prefilled again (as the servers' prompt caches do): only
        its last token is fed, for the logits of the first new token."""
        ctx, np = self.ctx, self.np
        t0 = time.perf_counter()
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        want: list[bool] = []
        for s, p in enumerate(prompts):
            start = len(p) - 1 if self.cached.get(s) == p else 0
            ctx.seq_rm(s, start, -1)
            toks += p[start:]
            pos += range(start, len(p))
            seqs += [s] * (len(p) - start)
            want += [False] * (len(p) - start - 1) + [True]
            self.cached[s] = p
        logits = ctx.decode(toks, pos, seqs, want)
        nxt = [int(np.argmax(row)) for row in logits]
        lens = [len(p) for p in prompts]
        done = [False] * len(prompts)
        count = [1] * len(prompts)
        for _ in range(n - 1):
            for s in range(len(prompts)):
                done[s] = done[s] or nxt[s] == self.eos
            live = [s for s in range(len(prompts)) if not done[s]]
            if not live:
                break
            logits = ctx.decode([nxt[s] for s in live], [lens[s] for s in live], live, [True] * len(live))
            for s, row in zip(live, logits):
                lens[s] += 1
                nxt[s] = int(np.argmax(row))
                count[s] += 1
        dt = time.perf_counter() - t0
        return sum(count), [dt] * len(prompts), dt

    def one(self, n: int):
        return self._run(self.prompts[:1], n)

    def eight(self, n: int):
        return self._run(self.prompts, n)

    def prefill(self, nonce: str) -> tuple[int, float]:
        """Prompt tokens and seconds to prefill ``prefill_messages(nonce)`` (in sequence 8)."""
        ids = self.encode(self.prefill_messages(nonce))
        self.ctx.seq_rm(8)
        t0 = time.perf_counter()
        for lo in range(0, len(ids), self.ctx.n_batch):
            chunk = ids[lo : lo + self.ctx.n_batch]
            self.ctx.decode(chunk, list(range(lo, lo + len(chunk))), [8] * len(chunk), [False] * len(chunk))
        self.ctx.seq_rm(8)
        return len(ids), time.perf_counter() - t0

    def rss(self) -> float:
        return float("nan")

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


# ----------------------------------------------------------------------------------- servers
def start_gymserve_llamacpp(gguf: Path, threads: int, http_server):
    port = common.free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "backend": {
            "type": "local",
            "engine": "llamacpp",
            "model": str(gguf),
            "max_num_seqs": 8,
            "num_threads": threads,
            "sampling": {"temperature": 0},
        },
    }
    path = Path(tempfile.gettempdir()) / f"gymserve-bench-engine-llamacpp-{port}.yaml"
    path.write_text(json.dumps(cfg))
    # The caller's environment: the engine then picks its own OpenMP wait policy (llamacpp_runtime).
    child = common.start_child(
        "gymserve-llamacpp", common.gymserve_cmd("serve", "--config", str(path)), port, caller_env=True
    )
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 900)
    return http_server("gymserve llamacpp", child, gguf.stem)


def start_llama_server(exe: Path, gguf: Path, threads: int, http_server, slots: int = 8):
    port = common.free_port()
    cmd = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(slots), "-c", str(2048 * slots), "-t", str(threads), "-tb", str(threads)]
    # As its users run it: llama.cpp's defaults, nothing this benchmark set for itself (issue #30).
    child = common.start_child("llama-server", cmd, port, caller_env=True)
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 300)
    return http_server(f"llama-server -np {slots}", child, gguf.stem)


def llama_peer_python(install: bool = True) -> Path | None:
    """``.venv-llama-peer``'s python with ``llama-cpp-python[server]`` (the main environment's
    version, so pip takes the wheel it cached); None when absent and ``install`` is False."""
    from importlib.metadata import version

    py = LLAMA_PEER / "bin" / "python"
    ok = py.exists() and (LLAMA_PEER / "bin" / "uvicorn").exists()
    if ok or not install:
        return py if ok else None
    if not py.exists():
        common._run([sys.executable, "-m", "venv", str(LLAMA_PEER)], "llama-cpp-python peer venv", 300)
    spec = f"llama-cpp-python[server]=={version('llama-cpp-python')}"
    common._run([str(LLAMA_PEER / "bin" / "pip"), "install", spec], "llama-cpp-python server (cached wheel)", 3600)
    return py


def start_llama_cpp_python_server(gguf: Path, threads: int, http_server, install: bool = True):
    py = llama_peer_python(install)
    if py is None:
        return None
    port = common.free_port()
    cmd = [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096"]
    child = common.start_child("llama_cpp.server", cmd, port, caller_env=True)
    common.wait_http(child, f"http://127.0.0.1:{port}/v1/models", 300)
    return http_server("llama_cpp.server", child, gguf.stem)


# ----------------------------------------------------------------------------------- log-prob gap
def logprob_gap(gguf: Path, tokenizer_dir: Path, threads: int, prompts: list[list[int]], max_tokens: int) -> dict:
    """|generation-time − teacher-forced| log-probs (max, p99, mean, tokens) of the llamacpp engine on ``gguf``,
    sampling (temperature 1, seeded) at 1 stream (one request at a time), at 8 concurrent streams,
    and for a second turn served from the first turn's cached KV; teacher forcing is
    ``LlamaCppScorer`` (what ``verify-rollouts --engine llamacpp`` runs)."""
    from gymserve.engine.base import SamplingParams
    from gymserve.engine.llamacpp_engine import LlamaCppEngine
    from gymserve.engine.llamacpp_runtime import LlamaCppScorer

    engine = LlamaCppEngine(gguf, tokenizer_dir=tokenizer_dir, num_threads=threads, context_window=4096)
    scorer = LlamaCppScorer(gguf, n_threads=threads)

    def worst(pairs) -> list[float]:
        """``[max, p99, mean |difference|, tokens]``."""
        diffs = [
            abs(a - b) for p, g in pairs for a, b in zip(scorer.token_log_probs(p + g.token_ids, len(p)), g.log_probs)
        ]
        return [max(diffs), common.percentile(diffs, 99), sum(diffs) / len(diffs), len(diffs)]

    async def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        sp = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i) for i in range(len(prompts))]
        one = [await engine.generate(p, s) for p, s in zip(prompts, sp)]
        out["1 stream"] = worst(zip(prompts, one))
        eight = await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, sp)])
        out["8 streams"] = worst(zip(prompts, eight))
        # Turn 2: the turn-1 prompt + generation + a new user turn, prefilled from the cached KV.
        follow = [p + g.token_ids + prompts[0][-8:] for p, g in zip(prompts, eight)]
        reused = engine.stats["reused"]
        second = await asyncio.gather(*[engine.generate(p, s) for p, s in zip(follow, sp)])
        out["8 streams, turn 2 from cached KV"] = worst(zip(follow, second))
        out["reused_tokens_turn2"] = engine.stats["reused"] - reused
        await engine.close()
        return out

    try:
        return asyncio.run(run())
    finally:
        scorer.close()
