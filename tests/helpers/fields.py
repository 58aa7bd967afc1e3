"""Comparing the training fields of two model calls."""

from __future__ import annotations

import pytest


def assert_same_call(a, b, tol: float = 1e-4) -> None:
    """``a`` and ``b`` (``(prompt_token_ids, generation_token_ids, generation_log_probs)``) describe
    the same model call: the same IDs exactly, the log-probs equal up to the float rounding by which
    a batched forward pass differs from another batch's (the engine batches concurrent calls)."""
    assert a[0] == b[0] and a[1] == b[1]
    assert a[2] == pytest.approx(b[2], abs=tol)
