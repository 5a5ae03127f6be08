"""The switch parser the start-up code and the package share, and the warnings for bad values."""

from __future__ import annotations

import warnings

import pytest

import _fsdp_shim_startup as startup
from fsdp_shim import activation, failures
from fsdp_shim.errors import FSDPShimWarning

pytestmark = pytest.mark.release_independent


@pytest.fixture(autouse=True)
def _fresh_warning_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failures, "_said", set())


ON = [None, "", "  ", "1", "true", "TRUE", " on ", "On", "\ttrue\n", "yes", "Y", "enable", "ENABLED"]
OFF = ["0", "false", "FALSE", " off ", "Off", "no", "N", "disable", "Disabled"]
INVALID = ["2", "tru", "maybe", "nope", "-1"]


@pytest.mark.parametrize("value", ON)
def test_on_values(value: str | None) -> None:
    env = {} if value is None else {"FSDP_SHIM": value}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation.shim_enabled(env) is True
        assert startup.switch_state(env.get("FSDP_SHIM")) in ("on", "unset")  # the start-up code agrees


@pytest.mark.parametrize("value", OFF)
def test_off_values(value: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation.shim_enabled({"FSDP_SHIM": value}) is False
        assert startup.switch_state(value) == "off"  # the start-up code skips loading the shim
        assert failures.strict_mode({"FSDP_SHIM_STRICT": value}) is False


@pytest.mark.parametrize("value", INVALID)
def test_an_unreadable_value_fails_closed_and_warns_once(value: str) -> None:
    """The kill switch switches the shim OFF; strict mode turns ON."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert activation.shim_enabled({"FSDP_SHIM": value}) is False
        assert activation.shim_enabled({"FSDP_SHIM": value}) is False
        assert failures.strict_mode({"FSDP_SHIM_STRICT": value}) is True
    assert startup.switch_state(value) == "invalid"  # the start-up code loads the package, which stays off
    assert startup.strict_switched_on({"FSDP_SHIM_STRICT": value}) is True
    messages = [str(w.message) for w in caught if issubclass(w.category, FSDPShimWarning)]
    assert len(messages) == 2  # once per variable and value, not once per read
    assert f"FSDP_SHIM={value!r} is not a valid value and switched the shim OFF" in messages[0]
    assert f"FSDP_SHIM_STRICT={value!r} is not a valid value and turned strict mode ON" in messages[1]
    for valid in ("0", "1", "false", "off", "on", "true", "no", "yes", "disable", "disabled"):
        assert valid in messages[0]


def test_strict_defaults_off() -> None:
    assert failures.strict_mode({}) is False
    assert failures.strict_mode({"FSDP_SHIM_STRICT": "1"}) is True


def test_the_warning_category_is_one_class() -> None:
    import fsdp_shim

    assert fsdp_shim.FSDPShimWarning is startup.FSDPShimWarning is FSDPShimWarning
    assert issubclass(FSDPShimWarning, RuntimeWarning)
