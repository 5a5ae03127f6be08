"""The switches: ``FSDP_SHIM`` (on, off, unreadable fails closed), ``FSDP_SHIM_STRICT`` (off by default) and
``FSDP_SHIM_DISABLED_FIXES``: the parsers in this process, then what each does to real Lightning's classes in a
fresh interpreter, read by identity against the literal table of each release."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from children.classes import STATES, expected_wrappers
from conftest import Layout
from test_activation import BF16, FP32, needing_a_fix, run

from _fsdp_shim import FSDPShimWarning, activation, failures, switch_state
from _fsdp_shim.config import disabled_fixes


# ============================================================================= the parsers
@pytest.mark.parametrize(
    ("values", "state"),
    [
        ([None, "", "  "], "unset"),
        (["1", "true", "TRUE", " on ", "\ttrue\n", "yes", "Y", "enable", "ENABLED"], "on"),
        (["0", "false", " off ", "Off", "no", "N", "disable", "Disabled"], "off"),
        (["2", "tru", "maybe", "-1"], "invalid"),
    ],
)
def test_the_switch_parser(values: list[str | None], state: str) -> None:
    assert {switch_state(value) for value in values} == {state}


def test_unreadable_switches_fail_closed_and_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unreadable, the kill switch switches the shim OFF and strict mode turns ON, each said once per value;
    strict mode is off by default and readable values say nothing."""
    monkeypatch.delenv("FSDP_SHIM", raising=False)
    monkeypatch.delenv("FSDP_SHIM_STRICT", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (activation.enabled(), failures.strict_mode()) == (True, False)
        monkeypatch.setenv("FSDP_SHIM", "no")
        monkeypatch.setenv("FSDP_SHIM_STRICT", "yes")
        assert (activation.enabled(), failures.strict_mode()) == (False, True)
        assert caught == []
        monkeypatch.setenv("FSDP_SHIM", "maybe-in-process")
        monkeypatch.setenv("FSDP_SHIM_STRICT", "tru-in-process")
        for _ in range(2):
            assert (activation.enabled(), failures.strict_mode()) == (False, True)
    valid = "Valid values (case-insensitive): 1, true, on, yes, y, enable, enabled, 0, false, off, no, n, disable, "
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            FSDPShimWarning,
            "fsdp-shim: FSDP_SHIM='maybe-in-process' is not a valid value and switched the shim OFF (an unreadable "
            f"kill switch fails closed). {valid}disabled.",
        ),
        (
            FSDPShimWarning,
            "fsdp-shim: FSDP_SHIM_STRICT='tru-in-process' is not a valid value and turned strict mode ON (failures "
            f"raise). {valid}disabled.",
        ),
    ]


@pytest.mark.parametrize(
    ("value", "off", "unknown"),
    [
        (None, set(), []),
        (" Recompute ", {"recompute"}, []),
        ("CAST,recompute", {"cast", "recompute"}, []),
        ("*", {"cast", "recompute"}, []),
        (" All ", {"cast", "recompute"}, []),
        ("cast, , bogus", {"cast"}, ["bogus"]),
    ],
)
def test_the_disabled_fixes_parser(value: str | None, off: set[str], unknown: list[str]) -> None:
    environ = {} if value is None else {"FSDP_SHIM_DISABLED_FIXES": value}
    assert disabled_fixes(environ) == (frozenset(off), unknown)


# ============================================================================= FSDP_SHIM in a process
def test_fsdp_shim_off_unreadable_then_on(layouts: dict[str, Layout]) -> None:
    """``FSDP_SHIM= OFF `` at ``import fsdp_shim``: Lightning stays as shipped and status says the fixes are
    switched off; an unreadable value keeps it off (``activate()`` says False) and warns once, at the user's line;
    ``yes`` and ``activate()`` patch what each release lacks."""
    needing_a_fix(layouts)
    result = run(
        """
        import json, os, sys, warnings
        from children.classes import *

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fsdp_shim
            import_all()
            out = [wrappers(), statuses()]
            os.environ["FSDP_SHIM"] = "maybe"
            out.append([fsdp_shim.activate() for _ in range(2)])  # ACTIVATE-LINE
            out.append(wrappers())
            os.environ["FSDP_SHIM"] = "yes"
            out.append([fsdp_shim.activate(), versions(), wrappers()])
        line = next(n for n, text in enumerate(open(__file__), 1) if "# ACTIVATE" + "-LINE" in text)
        out.append([[str(w.message), w.filename == __file__, w.lineno == line] for w in caught])
        print(json.dumps(out))
        """,
        FSDP_SHIM=" OFF ",
    )
    off, statuses, activated, still_off, (on, versions, patched), said = result
    assert off == still_off == [] and activated == [False, False]
    for namespace in versions:  # nothing was checked: every fix names the switch
        assert statuses[namespace]["cast"] == statuses[namespace]["recompute"] == ["switched off", "FSDP_SHIM=' OFF '"]
    assert on is True and patched == expected_wrappers(versions)
    [(message, at_file, at_line)] = said
    assert message.startswith("fsdp-shim: FSDP_SHIM='maybe' is not a valid value and switched the shim OFF")
    assert (at_file, at_line) == (True, True)


@pytest.fixture(scope="module")
def armed_at_startup(layouts: dict[str, Layout]) -> tuple[tuple[str, str], dict[str, Any]]:
    """``FSDP_SHIM=1`` (the installed start-up file arms the finder): the first layout's Trainer patched at its
    import; the second imported with ``FSDP_SHIM=0`` set in the script, not handed over; ``FSDP_SHIM=1`` again
    and ``import fsdp_shim``; then ``FSDP_SHIM=0`` after patching, and ``deactivate()``."""
    if len(layouts) < 2:
        pytest.skip("needs both Lightning layouts")
    first, second = ("lightning.pytorch", "pytorch_lightning")
    code = f"""
        import importlib, json, os
        from children.classes import *
        import _fsdp_shim

        out = {{"armed_by": list(_fsdp_shim.ARMED_BY)}}
        importlib.import_module({first!r})
        out["at_import"] = wrappers()
        os.environ["FSDP_SHIM"] = "0"
        importlib.import_module({second!r})
        out["while_off"] = wrappers()
        os.environ["FSDP_SHIM"] = "1"
        import fsdp_shim

        out["on"] = [statuses(), wrappers(), list(fsdp_shim.status().sources), versions()]
        os.environ["FSDP_SHIM"] = "0"
        out["off"] = [str(fsdp_shim.status()).splitlines()[0], statuses(), wrappers()]
        fsdp_shim.deactivate()
        out["deactivated"] = [wrappers(), as_shipped(snapshot())]
        print(json.dumps(out))
    """
    return (first, second), run(code, FSDP_SHIM="1")


def test_a_namespace_imported_while_switched_off_is_patched_at_activation_and_called_late(
    armed_at_startup: tuple[tuple[str, str], dict[str, Any]],
) -> None:
    """Set to ``0`` in the script, ``FSDP_SHIM`` keeps the next namespace from being handed over; a later
    ``import fsdp_shim`` patches it and calls it activated after its import, the one patched at import not."""
    (_, second), result = armed_at_startup
    startup = "FSDP_SHIM=1 (start-up file installed with the package)"
    assert result["armed_by"] == [startup]
    statuses, wrapped, sources, versions = result["on"]
    assert sources == [startup, "import fsdp_shim"]
    assert [key for key in result["at_import"] if key.startswith(second)] == []
    assert [key for key in result["while_off"] if key.startswith(second)] == []
    assert [key for key in result["at_import"] if not key.startswith(second)] == expected_wrappers(
        {ns: v for ns, v in versions.items() if ns.startswith("lightning.")}
    )
    assert wrapped == expected_wrappers(versions)
    assert {ns: status["late"] for ns, status in statuses.items()} == {
        "lightning.fabric": False,
        "lightning.pytorch": False,
        "lightning_fabric": True,
        "pytorch_lightning": True,
    }
    assert all(status["patched"] for status in statuses.values()), statuses


def test_fsdp_shim_0_after_patching_says_what_stays(armed_at_startup: tuple[tuple[str, str], dict[str, Any]]) -> None:
    """``FSDP_SHIM=0`` after Lightning was patched: status says what it patched stays patched until
    ``deactivate()`` (naming no arming: it is not armed any more); the wrappers stay; ``deactivate()`` removes
    everything."""
    _, result = armed_at_startup
    line, statuses, wrapped = result["off"]
    assert line.endswith(
        ": switched off by FSDP_SHIM (what it patched before stays patched; fsdp_shim.deactivate() removes it)"
    )
    assert wrapped == result["on"][1]
    assert statuses == result["on"][0]
    assert result["deactivated"] == [[], True]


# ============================================================================= FSDP_SHIM_DISABLED_FIXES
@pytest.fixture(scope="module")
def disabled(layouts: dict[str, Layout]) -> tuple[dict[str, str], dict[str, Any]]:
    """One interpreter: Lightning, ``import fsdp_shim`` with ``FSDP_SHIM_DISABLED_FIXES=cast``; then between
    ``deactivate()`` and ``activate()`` ``recompute, bogus`` twice; the variable deleted and ``activate()``
    without a ``deactivate()``; torch's shared wrappers let go namespace by namespace; the pin counted."""
    versions = needing_a_fix(layouts)
    code = """
        import json, os, warnings
        import torch
        from children.classes import *

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import_all()
            pristine = snapshot()
            import fsdp_shim
            from _fsdp_shim import wrappers
            from _fsdp_shim.config import RECOMPUTE

            def step():
                return [changed(pristine, snapshot()), statuses(), recompute_dtypes(), shim_warnings(caught)]

            out = {"cast off": step()}
            os.environ["FSDP_SHIM_DISABLED_FIXES"] = "recompute, bogus"
            for name in ("recompute off", "recompute off again"):
                fsdp_shim.deactivate()
                fsdp_shim.activate()
                out[name] = step()
            del os.environ["FSDP_SHIM_DISABLED_FIXES"]
            fsdp_shim.activate()
            out["on again"] = step()
            shared = {key: snapshot()[key] for key in TORCH_KEYS}
            out["let go"] = []
            for namespace in versions():
                wrappers.unpatch(namespace, RECOMPUTE)
                out["let go"].append([snapshot()[key] is shared[key] for key in TORCH_KEYS] + [recompute_dtypes()])
            fsdp_shim.activate()
            calls, real = [], torch.set_default_dtype
            torch.set_default_dtype = lambda dtype: (calls.append(dtype), real(dtype))
            out["pins"] = [[recompute_dtypes("torch.float32"), len(calls)]]
            out["pins"].append([recompute_dtypes(), len(calls)])
            fsdp_shim.deactivate()
            out["pins"].append([recompute_dtypes(), len(calls)])
            out["final"] = [changed(pristine, snapshot()), as_shipped(snapshot())]
        print(json.dumps(out))
    """
    return versions, run(code, FSDP_SHIM_DISABLED_FIXES="cast")


def test_a_fix_switched_off_is_left_as_shipped_and_the_other_stays_patched(
    disabled: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """A fix the variable names keeps Lightning's (or torch's) very objects and says why; the other stays
    patched; a name that is no fix is said once and ignored; deleted, the fix is patched again on ``activate()``
    and status says so."""
    versions, result = disabled
    unknown = (
        "fsdp-shim: FSDP_SHIM_DISABLED_FIXES names 'bogus', which is no fix of fsdp-shim (its fixes: cast, "
        "recompute); that name is ignored"
    )
    for name, off, recompute, said in (
        ("cast off", "cast", BF16, []),
        ("recompute off", "recompute", FP32, [unknown]),
        ("recompute off again", "recompute", FP32, [unknown]),
        ("on again", None, BF16, [unknown]),
    ):
        changed, statuses, dtypes, warned = result[name]
        assert changed == expected_wrappers(versions, without=(off,) if off else ()), name
        assert (dtypes, warned) == (recompute, said), name
        for namespace, version in versions.items():
            for fix, state in zip(("cast", "recompute"), STATES[version]):
                expected = "disabled" if fix == off and state == "patched" else state
                assert statuses[namespace][fix][0] == expected, (name, namespace, fix)


def test_every_namespace_shares_torchs_wrappers_and_the_last_one_lets_them_go(
    disabled: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """Every namespace's recompute fix holds the same wrappers on torch: they stay, and act, while another
    namespace holds them, and the last one puts back what torch shipped."""
    versions, result = disabled
    needing = [ns for ns, v in versions.items() if STATES[v][1] == "patched"]
    expected = [[True] * 3 + [BF16]] * (len(needing) - 1) + [[False] * 3 + [FP32]]
    assert [step for ns, step in zip(versions, result["let go"]) if ns in needing] == expected
    assert result["final"] == [[], True]


def test_the_pin_does_nothing_where_the_dtype_did_not_change(
    disabled: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """A checkpoint whose forward and backward run in float32 calls ``torch.set_default_dtype`` never; one whose
    forward ran in bfloat16 is pinned (more calls than the same checkpoint makes without the shim)."""
    _, result = disabled
    (same, none), (pinned, with_pin), (unpinned, all_calls) = result["pins"]
    assert (same, none) == (FP32, 0)
    assert (pinned, unpinned) == (BF16, FP32)
    assert with_pin > all_calls - with_pin > 0
