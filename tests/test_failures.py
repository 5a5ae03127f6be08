"""The one failure policy: strict raises, otherwise one warning per problem, at the
caller's line, never at fsdp-shim's own."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from fsdp_shim import failures
from fsdp_shim.errors import FSDPShimError, FSDPShimWarning

pytestmark = pytest.mark.release_independent


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failures, "_said", set())
    monkeypatch.delenv("FSDP_SHIM_STRICT", raising=False)


def test_outside_strict_mode_one_warning_per_problem_at_the_callers_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            failures.report("fsdp-shim: the problem", "what happened instead", key="k")  # CALLER
        failures.report("fsdp-shim: another problem", "what happened instead")
    found = [w for w in caught if w.category is FSDPShimWarning]
    assert [str(w.message) for w in found] == [
        "fsdp-shim: the problem; what happened instead",
        "fsdp-shim: another problem; what happened instead",
    ]
    lines = Path(__file__).read_text().splitlines()
    caller = next(n for n, line in enumerate(lines, 1) if "# CALLER" in line and "report(" in line)
    assert (found[0].filename, found[0].lineno) == (__file__, caller)


def test_strict_mode_raises_the_problem_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_SHIM_STRICT", "1")
    cause = KeyError("precision")
    with pytest.raises(FSDPShimError) as raised:
        failures.report("fsdp-shim: the problem", "what happened instead", cause=cause)
    assert str(raised.value) == "fsdp-shim: the problem (FSDP_SHIM_STRICT is on)"
    assert raised.value.__cause__ is cause


def test_warnings_turned_into_errors_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FSDPShimWarning)
        with pytest.raises(FSDPShimWarning):
            failures.report("fsdp-shim: the problem", "what happened instead")
