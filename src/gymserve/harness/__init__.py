"""The RL harness: an agent loop, rollout collection, rollout checks and example environments.

It is a client of the serving core: it talks to a gymserve server (or any Responses endpoint)
through the official ``openai`` SDK and imports core modules (``protocol``, ``config``, ``server.run``,
``engine.model_store``), while nothing in the core imports it; only the ``gymserve`` CLI dispatches to
it (``gymserve demo|rollout|verify-rollouts|train-demo``).

- ``agent``: ``run_agent``, a tool-calling loop over the Responses API that keeps turns token-contiguous;
- ``rollout``: ``gymserve rollout``, the agent over a JSON Lines tasks file, one finished rollout a line;
- ``verify``: token contiguity across turns and log-probs by teacher forcing;
- ``demo``: ``gymserve demo``, the weather agent end to end on the embedded model, then the checks;
- ``envs``: the ``Environment`` shape and the example weather environment;
- ``rl_loop`` and ``rl_policy``: ``gymserve train-demo``, a minimal on-policy RL loop (GRPO on a LoRA)
  that pushes every update into the server and proves it with the next rollouts.
"""
