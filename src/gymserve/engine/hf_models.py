"""Loading Hugging Face causal LMs: one load at a time per process.

transformers' ``from_pretrained`` (5.x) changes process-wide state for the length of a load and puts
it back at the end: ``torch.set_default_dtype``, ``PreTrainedModel.tie_weights`` (a no-op while the
weights are on the meta device) and ``torch.linspace`` (``PreTrainedModel.get_init_context`` and
``transformers.initialization``). Each patch keeps the value it found and restores it on exit, so two
loads that overlap in different threads can restore each other's patch: the second saves the first's
no-op ``tie_weights`` as "the original" and reinstates it after the first has put the real one back.
From then on every model the process loads has an untied, uninitialised ``lm_head``: garbage logits,
NaN probabilities, greedy tokens that change from run to run. PEFT's ``PeftModel.from_pretrained``
patches ``nn.Module.register_parameter`` the same way (accelerate's ``init_empty_weights``).

gymserve loads models from several threads of one process (each server's start-up thread, teacher
forcing in ``verify-rollouts``, a LoRA adapter's base model, the model cache's conversion), so every
load goes through :func:`load_causal_lm` or holds :data:`MODEL_LOAD_LOCK`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

#: Held for the whole of any model load in this process (re-entrant: a load may build another).
MODEL_LOAD_LOCK = threading.RLock()


def load_causal_lm(path: str | os.PathLike, *, dtype: Any = None, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)`` under
    :data:`MODEL_LOAD_LOCK`; ``dtype`` a ``torch.dtype`` (default float32). Raises what
    ``from_pretrained`` raises (``OSError`` for a missing or unreadable model)."""
    import torch
    from transformers import AutoModelForCausalLM

    with MODEL_LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, **kwargs)
