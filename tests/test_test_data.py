"""The suite stands alone: every file it reads is inside the repository, and every public case cited by
id anywhere in the code, tests, docs or benchmarks is in ``tests/data/cases/public.jsonl``."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.spec import CASES_PATH, SPEC_PATH, load_cases

ROOT = Path(__file__).resolve().parents[1]
CASE_ID = re.compile(r"\b(?:RC|CR|RP|TP|TE|CL|AZ|ST)-\d{2}\b")
# A path outside the checkout: the sibling folder named shared (beside a CI clone only), an absolute path to one, or /work/.
OUTSIDE = re.compile(r"\.\./shared|[\"']/[A-Za-z0-9_.-]+/shared|/work/")


def _sources(*folders: str, suffixes=(".py", ".md")) -> list[Path]:
    return [p for folder in folders for p in (ROOT / folder).rglob("*") if p.suffix in suffixes and p.is_file()]


def test_data_files_are_in_the_repository():
    assert CASES_PATH.is_relative_to(ROOT) and SPEC_PATH.is_relative_to(ROOT)
    cases = load_cases()
    assert len(cases) == 15 and all({"id", "category", "input", "expected"} <= set(c) for c in cases.values())


def test_every_cited_case_id_resolves_in_the_repository():
    known = set(load_cases())
    cited: dict[str, list[str]] = {}
    for path in _sources("src", "tests", "docs", "bench", "scripts"):
        if path.is_relative_to(ROOT / "tests" / "data"):
            continue
        for case_id in CASE_ID.findall(path.read_text(errors="replace")):
            cited.setdefault(case_id, []).append(str(path.relative_to(ROOT)))
    assert cited, "no case cited anywhere: the pattern is wrong"
    missing = {case_id: where for case_id, where in cited.items() if case_id not in known}
    assert not missing, f"case ids cited but not in {CASES_PATH.relative_to(ROOT)}: {missing}"


def test_no_test_reads_a_path_outside_the_repository():
    offenders = [
        str(p.relative_to(ROOT))
        for p in _sources("tests", suffixes=(".py",))
        if p != Path(__file__).resolve() and OUTSIDE.search(p.read_text())
    ]
    assert not offenders, f"these tests name a path outside the checkout: {offenders}"
