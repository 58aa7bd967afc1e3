"""The one exception tree: drawn truly in errors.py, causes as classes, errors that survive pickling."""

from __future__ import annotations

import ast
import inspect
import pickle
import re
from pathlib import Path

import pytest

from gymserve import errors
from gymserve.errors import (
    ContextLengthExceededError,
    GymserveError,
    OverloadedError,
    UpstreamError,
    UpstreamRateLimitedError,
    UpstreamRejectedError,
    UpstreamServerError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "gymserve"


def _classes() -> dict[str, type[GymserveError]]:
    return {name: cls for name, cls in vars(errors).items() if inspect.isclass(cls) and issubclass(cls, GymserveError)}


def test_the_docstring_draws_every_class_under_its_parent():
    drawn: dict[str, int] = {}  # class name -> depth in the drawing
    parents: dict[str, str] = {}
    stack: list[str] = []
    for line in errors.__doc__.splitlines():
        m = re.match(r"^    ((?:[│ ] {3})*)(?:[├└]── )?(\w+Error)\b", line)
        if not m:
            continue
        depth = len(m.group(1)) // 4 + (1 if "──" in line else 0)
        name = m.group(2)
        stack[depth:] = [name]
        drawn[name] = depth
        if depth:
            parents[name] = stack[depth - 1]
    assert set(drawn) == set(_classes())
    for name, parent in parents.items():
        assert _classes()[name].__mro__[1].__name__ == parent, name


def test_status_and_code_come_from_the_class():
    assert UpstreamTimeoutError("t").to_dict()["error"]["code"] == "upstream_timeout"
    assert UpstreamTimeoutError("t").status_code == 504
    err = ContextLengthExceededError(900, 512)
    assert (err.status_code, err.code, err.param) == (400, "context_length_exceeded", "messages")
    assert "context length" in err.message and "900" in err.message and "512" in err.message
    upstream = ContextLengthExceededError(None, None, message="upstream said so", url="http://h/v1", param=None)
    assert (upstream.message, upstream.url, upstream.prompt_tokens) == ("upstream said so", "http://h/v1", None)
    limited = UpstreamRateLimitedError("slow", upstream_retry_after=None)
    assert (limited.status_code, limited.retry_after, limited.code) == (429, 1.0, "upstream_rate_limited")
    assert isinstance(limited, OverloadedError)
    rejected = UpstreamRejectedError("bad tool", status_code=422, param="tools", code="x")
    assert rejected.to_dict() == {
        "error": {"message": "bad tool", "type": "invalid_request_error", "param": "tools", "code": "x"}
    }
    assert rejected.status_code == 422 and UpstreamError.status_code == 502


def test_only_unreachable_5xx_and_429_are_retryable():
    retryable = {name for name, cls in _classes().items() if cls.retryable}
    assert retryable == {
        UpstreamUnreachableError.__name__,
        UpstreamServerError.__name__,
        UpstreamRateLimitedError.__name__,
    }


@pytest.mark.parametrize(
    "exc",
    [
        ContextLengthExceededError(900, 512),
        ContextLengthExceededError(None, None, message="upstream", url="http://h/v1", param=None),
        OverloadedError("busy", retry_after=3.0),
        UpstreamRateLimitedError("slow", upstream_retry_after=2.5),
        UpstreamError("boom", status_code=504, code="x", url="http://h"),
        UpstreamRejectedError("nope", status_code=422, param="tools"),
        errors.ShuttingDownError(),
        errors.RequestTooLargeError(10, 5),
        errors.SpliceError("ambiguous"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_every_field(exc):
    """How errors cross from a Ray replica to the front end."""
    got = pickle.loads(pickle.dumps(exc))
    assert type(got) is type(exc) and vars(got) == vars(exc) and str(got) == str(exc)
    assert got.to_dict() == exc.to_dict() and got.status_code == exc.status_code


def test_no_code_compares_error_codes_or_mutates_an_error():
    """Causes are classes: nothing outside errors.py compares ``.code`` or sets ``.code``,
    ``.status_code``, ``.error_type`` on an object other than ``self``."""
    bad = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if isinstance(side, ast.Attribute) and side.attr == "code":
                        bad.append(f"{path.relative_to(SRC)}:{node.lineno} compares .code")
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in ("code", "status_code", "error_type")
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")
                ):
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno} sets .{target.attr}")
    assert not bad, bad
