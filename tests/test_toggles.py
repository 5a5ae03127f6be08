from __future__ import annotations

import warnings

import pytest

from fsdp_shim import toggles
from fsdp_shim.errors import FSDPShimWarning


@pytest.fixture(autouse=True)
def _fresh_warning_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toggles, "_warned", set())


@pytest.mark.parametrize("value", [None, "1", "true", "TRUE", " on ", "On", "\ttrue\n", ""])
def test_enabled_values(value: str | None) -> None:
    env = {} if value is None else {"FSDP_SHIM": value}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert toggles.shim_enabled(env) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", " off ", "Off"])
def test_disabled_values(value: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert toggles.shim_enabled({"FSDP_SHIM": value}) is False


@pytest.mark.parametrize("value", ["yes", "2", "disable", "tru"])
def test_bad_value_warns_once_names_valid_values_and_keeps_the_default(value: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert toggles.shim_enabled({"FSDP_SHIM": value}) is True
        assert toggles.shim_enabled({"FSDP_SHIM": value}) is True
        assert toggles.strict_mode({"FSDP_SHIM_STRICT": value}) is False
    messages = [str(w.message) for w in caught if issubclass(w.category, FSDPShimWarning)]
    assert len(messages) == 2  # once per variable, not once per read
    assert "FSDP_SHIM=" in messages[0]
    for valid in ("0", "1", "false", "off", "on", "true"):
        assert valid in messages[0]


def test_strict_defaults_off() -> None:
    assert toggles.strict_mode({}) is False
    assert toggles.strict_mode({"FSDP_SHIM_STRICT": "1"}) is True
