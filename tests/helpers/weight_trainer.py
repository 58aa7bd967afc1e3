"""A trainer in its own process for the weight-sync tests: it imports only torch, safetensors and
``gymserve.trainer`` (what a trainer beside a gymserve has), broadcasts the tensors of a
safetensors file to the server and prints the server's answer (or error) as one JSON line.

``python weight_trainer.py BASE_URL STATE.safetensors OPTIONS_JSON``; options: ``weight_version``,
``bucket_bytes``, ``pause_mode`` (or ``pause_modes``, one per send), ``api`` (``vllm``/``sglang``), ``sends`` (how many times to send,
default 1), ``die_after`` (exit abruptly, as a killed trainer, after that many broadcasts of the
send: the server sees the connection drop mid-transfer), ``timeout``.
"""

from __future__ import annotations

import json
import os
import sys

from safetensors.torch import load_file

from gymserve.trainer import WeightSender, WeightSyncError


def main() -> None:
    base_url, state_path, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    state = load_file(state_path)
    sender = WeightSender(base_url, timeout=opts.get("timeout", 60), api=opts.get("api", "vllm"))
    out: dict = {"open": sender.open()}
    die_after = opts.get("die_after")
    if die_after is not None:
        group = sender.group
        assert group is not None
        sent = {"n": 0}
        real = group.broadcast

        def broadcast(tensor, src=0):
            if sent["n"] >= die_after:
                print(json.dumps({"dying_after": sent["n"]}), flush=True)
                os._exit(17)  # no goodbye: the sockets close as a killed process's do
            sent["n"] += 1
            real(tensor, src)

        group.broadcast = broadcast  # type: ignore[method-assign]
    answers = []
    sends = opts.get("sends", 1)
    modes = opts.get("pause_modes") or [opts.get("pause_mode")] * sends
    for i in range(sends):
        try:
            answers.append(
                sender.send(
                    state,
                    weight_version=opts.get("weight_version"),
                    bucket_bytes=opts.get("bucket_bytes"),
                    pause_mode=modes[i],
                )
            )
        except WeightSyncError as exc:
            answers.append(
                {"error": {"status": exc.status, "code": exc.code, "param": exc.param, "message": exc.message}}
            )
    out["answers"] = answers
    sender.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
