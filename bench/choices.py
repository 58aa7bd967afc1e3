"""n > 1: what asking for several choices in one request costs against sending them one by one.

The tiny random-weight model (2 layers, the embedded model's tokenizer and template; the embedded
model decodes a few tokens/s here, so this measures the serving path and the engine's batching,
not the model) on the local backend, through the official openai SDK. For ``--samples`` samples of
one chat prompt, ``--max-tokens`` tokens each, ``--reps`` times per configuration (median wall time):

- ``n=1 × S, concurrent``: S requests of one choice at once — the baseline (what a client without
  ``n`` does best);
- ``n=1 × S, one after another``: S requests in sequence;
- ``n=S, one request``: one request of S choices (each an engine call, batched by the engine);
- ``completions n=S``: the same through ``/v1/completions`` with the prompt as token IDs.

Printed: wall seconds, generated tokens/s, and the ratio to the baseline measured in the same run.
Configurations run in interleaved rounds. Usage: ``python bench/choices.py [--samples 8]
[--max-tokens 32] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import common  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


async def _configurations(client, samples: int, max_tokens: int, prompt_ids: list[int]):
    async def concurrent():
        answers = await asyncio.gather(
            *(
                client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens)
                for _ in range(samples)
            )
        )
        return sum(a.usage.completion_tokens for a in answers)

    async def sequential():
        total = 0
        for _ in range(samples):
            a = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens)
            total += a.usage.completion_tokens
        return total

    async def one_request():
        a = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens, n=samples)
        return a.usage.completion_tokens

    async def completions():
        a = await client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=max_tokens, n=samples)
        return a.usage.completion_tokens

    return {
        f"n=1 × {samples}, concurrent": concurrent,
        f"n=1 × {samples}, one after another": sequential,
        f"n={samples}, one request": one_request,
        f"completions n={samples}": completions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    a = parser.parse_args()

    import openai

    from gymserve.backends.local import LocalBackend
    from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
    from gymserve.engine.model_store import embedded_model_dir
    from gymserve.server.run import start_background_server
    from helpers.tiny_model import build_tiny_model

    print(common.machine_line(), flush=True)
    tiny = build_tiny_model(Path(tempfile.mkdtemp(prefix="Qwen2.5-Coder-tiny-")), embedded_model_dir())
    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(
            model=str(tiny),
            max_batch_size=max(8, a.samples),
            sampling=SamplingConfig(temperature=1.0, seed=1),
            # Every sample runs to max_tokens: no EOS ends one early and skews the comparison.
            context_window=4096,
        ),
    )
    srv = start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))
    try:
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=600)
        prompt_ids = srv.backend.tokenizer("The sea is", add_special_tokens=False)["input_ids"]

        async def run():
            configs = await _configurations(client, a.samples, a.max_tokens, prompt_ids)
            times: dict[str, list[float]] = {name: [] for name in configs}
            tokens: dict[str, list[int]] = {name: [] for name in configs}
            for fn in configs.values():  # warm-up
                await fn()
            for _ in range(a.reps):
                for name, fn in configs.items():
                    t0 = time.perf_counter()
                    tokens[name].append(await fn())
                    times[name].append(time.perf_counter() - t0)
            return times, tokens

        times, tokens = asyncio.run(run())
    finally:
        srv.stop()
    base = statistics.median(next(iter(times.values())))
    rows = []
    for name, ts in times.items():
        wall = statistics.median(ts)
        rows.append([name, wall, statistics.median(tokens[name]) / wall, base / wall])
    print(
        common.table(
            ["configuration", "wall s (median)", "generated tok/s", "speed vs baseline"],
            rows,
            title=f"{a.samples} samples of {a.max_tokens} tokens, tiny model, {a.reps} reps",
        )
    )


if __name__ == "__main__":
    main()
