"""The shim on and off in a process: ``import fsdp_shim``, ``activate`` / ``deactivate`` / ``status``,
the gates of both fixes, the switches (``FSDP_SHIM``, ``FSDP_SHIM_STRICT``, ``FSDP_SHIM_DISABLED_FIXES``),
the failure policy, import order, Lightning imported again, a reloaded shim, and imports from threads.

The unit tests at the top run in this process (importing ``_fsdp_shim`` activates nothing); every
Lightning interaction runs in a fresh interpreter (``tests/children/activation.py`` and its siblings),
and reads Lightning's classes directly: object identity says what is patched and what is not.
Expectations come from ``_fsdp_shim.config`` (which releases each fix applies to) and from the table
of what each fix wraps per release (``expected_targets``, the table in ``_fsdp_shim/fixes.py``).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from children.classes import shared_targets
from conftest import NAMESPACES as LAYOUT_NAMESPACES
from conftest import (
    ROOT,
    Layout,
    an_affected_namespace,
    child_json,
    clean_env,
    installed_versions,
    run_child,
    run_command,
)

from _fsdp_shim import NAMESPACES as NAMESPACE_KINDS
from _fsdp_shim import FSDPShimWarning, activation, config, failures, switch_state
from _fsdp_shim._version import __version__
from _fsdp_shim.config import CAST, DISABLED_FIXES_VARIABLE, FIX_NAMES, FIXES, RANK_CHECK, RECOMPUTE, base_release
from _fsdp_shim.failures import FSDPShimError
from _fsdp_shim.fixes import converts_only_in_connect, has_new_class_names, plan_of

pytest.importorskip("torch", reason="its targets are named after the torch in hand, read at import")
QUIET = ("-W", "ignore::DeprecationWarning")


def child(target: str, arguments: dict | None = None, **env: str | None) -> Any:
    return child_json(f"activation:{target}", arguments, env=clean_env(**env), python_args=QUIET)


# ----------------------------------------------------------------------------- what each fix wraps
SHARED = tuple(
    sorted(
        f"{module}:{'.'.join(filter(None, (owner, name)))}"
        for module, owner, names in shared_targets()
        for name in names
        if name != "backward"  # in the snapshot to prove it stays untouched
    )
)
"""torch's checkpoint entry points, as ``children.classes.snapshot`` keys them: one key (and one wrapper)
for every namespace that needs the recompute fix (the generator's name is the torch in hand's)."""


BF16_RECOMPUTE = {"reentrant": "torch.bfloat16", "non_reentrant": "torch.bfloat16"}
FLOAT32_RECOMPUTE = {"reentrant": "torch.float32", "non_reentrant": "torch.float32"}
"""What ``children.classes.recompute_dtypes`` measures with the recompute fix and without it."""


def expected_targets(namespace: str, version: str) -> dict[str, list[str]]:
    """Per fix (and the rank check, patched like one), the class attributes (``namespace:Class.attribute``,
    as ``children.classes.snapshot`` keys them) the shim must wrap in one namespace of one release: the
    table in ``_fsdp_shim/fixes.py``. The recompute fix's torch targets (``SHARED``) are the same keys
    for every namespace."""
    trainer = NAMESPACE_KINDS[namespace] == "trainer"
    suffix = "" if not trainer or has_new_class_names(version) else "Plugin"  # 2.1.0's Trainer names
    fsdp = f"{namespace}:FSDPPrecision{suffix}"
    out: dict[str, list[str]] = {fix.name: [] for fix in (*FIXES, RANK_CHECK)}
    if CAST.affects(version):
        wrap = "_setup_model" if trainer else "setup_module"
        out["cast"] = [f"{fsdp}.convert_module", f"{namespace}:FSDPStrategy.{wrap}"]
        if trainer and converts_only_in_connect(version):
            out["cast"] += [f"{namespace}:FSDPStrategy.connect", f"{namespace}:FSDPStrategy.setup"]
    if RECOMPUTE.affects(version):
        out["recompute"] = list(SHARED)
    if RANK_CHECK.affects(version):  # wherever the shim is active: FSDP_SHIM_DISABLED_FIXES cannot name it
        out["rank-check"] = [f"{namespace}:FSDPStrategy.setup_environment"]
    return {fix: sorted(keys) for fix, keys in out.items()}


def expected_wrappers(namespace: str, version: str) -> list[str]:
    return sorted(key for keys in expected_targets(namespace, version).values() for key in keys)


def expected_for(versions: dict[str, str]) -> list[str]:
    """The keys wrapped in a process that imported these namespaces: each namespace's own, and the
    shared torch keys once (a set: every namespace holds the same wrapper there)."""
    return sorted({key for namespace, version in versions.items() for key in expected_wrappers(namespace, version)})


def all_expected_wrappers(layouts: dict[str, Layout]) -> list[str]:
    return expected_for(installed_versions(layouts))


def own_keys(keys: list[str], namespace: str) -> list[str]:
    """The keys of ``namespace``'s own classes (not the shared torch keys, nor another namespace's)."""
    return [key for key in keys if key.partition(":")[0] == namespace]


def shared(keys: list[str]) -> list[str]:
    return [key for key in keys if key in SHARED]


def seen_by(keys: list[str], namespace: str) -> list[str]:
    """The keys a namespace's fixes may wrap: its own and the shared torch keys."""
    return sorted(own_keys(keys, namespace) + shared(keys))


def key_of(label: str) -> str:
    """A status target as a snapshot key: ``lightning.pytorch.plugins.precision.fsdp.FSDPPrecision.backward``
    as ``lightning.pytorch:FSDPPrecision.backward``, ``torch.utils.checkpoint.CheckpointFunction.forward``
    as ``torch.utils.checkpoint:CheckpointFunction.forward``."""
    for key in SHARED:
        if label == key.replace(":", "."):
            return key
    namespace = max((ns for ns in NAMESPACE_KINDS if label.startswith(ns + ".")), key=len)
    return namespace + ":" + ".".join(label.rsplit(".", 2)[1:])


def fix_status(namespace_status: dict, fix: str) -> dict:
    [found] = [entry for entry in namespace_status["fixes"] if entry["fix"] == fix]
    return found


def lightest_patched_namespace(layouts: dict[str, Layout]) -> tuple[str, str]:
    """An installed namespace that lacks some fix, the quickest to import first (the standalone Fabric
    imports neither the Trainer nor the unified package)."""
    versions = installed_versions(layouts)
    for namespace in ("lightning_fabric", "pytorch_lightning", "lightning.fabric", "lightning.pytorch"):
        if namespace in versions and any(fix.affects(versions[namespace]) for fix in FIXES):
            return namespace, versions[namespace]
    pytest.skip("no installed Lightning lacks a fix")


# ============================================================================= unit: gates
@pytest.mark.parametrize(
    ("version", "cast", "recompute"),
    [
        ("2.0.9", False, False),
        ("2.0.9.post0", False, False),
        ("2.1.0", True, True),
        ("2.1.0rc1", True, True),  # base 2.1.0: the "true" precisions are there
        ("2.1.4", True, True),
        ("2.2.0.post0", True, True),
        ("2.3.3", True, True),
        ("2.4.0", True, True),
        ("2.4.0+cu121", True, True),
        ("2.4.1.dev3", True, True),
        ("2.5.0rc0", False, True),  # the cast shipped in 2.5.0rc0; a plain PEP 440 compare says < 2.5.0
        ("2.5.0.dev20241101", False, True),
        ("2.5.0", False, True),
        ("2.5.0.post0", False, True),
        ("2.6.6", False, True),
        ("3.0.0", False, True),  # no release has the recompute fix
        ("not-a-version", False, False),
        ("", False, False),
    ],
)
def test_each_fix_gates_on_the_base_version(version: str, cast: bool, recompute: bool) -> None:
    assert CAST.affects(version) is cast
    assert RECOMPUTE.affects(version) is recompute
    assert RECOMPUTE.built_in(version) is False
    assert CAST.built_in(version) is (base_release(version) is not None and base_release(version) >= (2, 5, 0))


def test_why_a_release_needs_no_fix() -> None:
    assert CAST.unaffected_reason("2.5.0rc0") == (
        "Lightning 2.5.0rc0 already contains it (Lightning #20323, 2.5.0); left untouched"
    )
    for fix in FIXES:
        assert fix.unaffected_reason("2.0.9") == "Lightning 2.0.9 has no 'true' precisions for FSDP; nothing to fix"


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.1.0", True),
        ("2.1.4", True),
        ("2.1.0rc1", True),
        ("2.2.0", False),
        ("2.2.0rc0", False),
        ("2.0.9", False),
        ("2.4.0", False),
    ],
)
def test_only_2_1_converts_in_connect(version: str, expected: bool) -> None:
    assert converts_only_in_connect(version) is expected


@pytest.mark.parametrize(
    ("version", "expected"), [("2.1.0", False), ("2.1.0rc1", False), ("2.1.1", True), ("2.4.0", True), ("junk", True)]
)
def test_only_2_1_0_has_the_old_trainer_class_names(version: str, expected: bool) -> None:
    assert has_new_class_names(version) is expected


@pytest.mark.parametrize("version", ["2.0.9", "2.1.0", "2.1.4", "2.2.0", "2.4.0", "2.5.0rc0", "2.6.6"])
def test_each_plan_wraps_what_the_table_says(version: str) -> None:
    """The plans in ``_fsdp_shim.fixes`` name, per namespace and release, exactly the targets of the
    table this file checks Lightning's classes against; only torch's are shared by every namespace,
    and only ``convert_module`` and 2.1.x's ``connect`` are wrapped where the class inherits them."""
    for namespace in NAMESPACE_KINDS:
        expected = expected_targets(namespace, version)
        for fix in (*FIXES, RANK_CHECK):
            planned = plan_of(fix)(namespace, version) if fix.affects(version) else ()
            assert sorted(key_of(target.label(namespace)) for target in planned) == expected[fix.name], (namespace, fix)
            assert sorted(key_of(t.label(namespace)) for t in planned if t.shared) == shared(expected[fix.name])
            assert {t.attribute for t in planned if t.inherited} <= {"convert_module", "connect"}
            assert all(t.class_name == "" for t in planned if t.attribute.startswith("_checkpoint"))


def test_base_release_pads_short_versions() -> None:
    assert base_release("2") == (2, 0, 0)
    assert base_release("2.4") == (2, 4, 0)
    assert base_release("2.4.0.1") == (2, 4, 0)
    assert base_release("junk") is None


# ============================================================================= unit: switches
@pytest.fixture
def _fresh_warning_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failures, "_said", set())
    monkeypatch.delenv("FSDP_SHIM_STRICT", raising=False)


ON = [None, "", "  ", "1", "true", "TRUE", " on ", "On", "\ttrue\n", "yes", "Y", "enable", "ENABLED"]
OFF = ["0", "false", "FALSE", " off ", "Off", "no", "N", "disable", "Disabled"]
INVALID = ["2", "tru", "maybe", "nope", "-1"]


@pytest.mark.usefixtures("_fresh_warning_memory")
@pytest.mark.parametrize("value", ON)
def test_on_values(value: str | None) -> None:
    env = {} if value is None else {"FSDP_SHIM": value}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation.enabled(env) is True
        assert switch_state(env.get("FSDP_SHIM")) in ("on", "unset")  # the start-up module agrees
        assert failures.strict_mode({"FSDP_SHIM_STRICT": value} if value is not None else {}) is (
            switch_state(value) == "on"
        )


@pytest.mark.usefixtures("_fresh_warning_memory")
@pytest.mark.parametrize("value", OFF)
def test_off_values(value: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation.enabled({"FSDP_SHIM": value}) is False
        assert switch_state(value) == "off"  # the start-up finder skips the hand-over
        assert failures.strict_mode({"FSDP_SHIM_STRICT": value}) is False


@pytest.mark.usefixtures("_fresh_warning_memory")
@pytest.mark.parametrize("value", INVALID)
def test_an_unreadable_value_fails_closed_and_warns_once(value: str) -> None:
    """The kill switch switches the shim OFF; strict mode turns ON."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert activation.enabled({"FSDP_SHIM": value}) is False
        assert activation.enabled({"FSDP_SHIM": value}) is False
        assert failures.strict_mode({"FSDP_SHIM_STRICT": value}) is True
        assert failures.strict_mode({"FSDP_SHIM_STRICT": value}) is True
    assert switch_state(value) == "invalid"
    # the start-up module's own strict check (a shim that cannot load) reads "invalid" as on too
    assert config.shim_state({"FSDP_SHIM": value}) == config.strict_state({"FSDP_SHIM_STRICT": value}) == "invalid"
    messages = [str(w.message) for w in caught if issubclass(w.category, FSDPShimWarning)]
    assert len(messages) == 2  # once per variable and value, not once per read
    assert f"FSDP_SHIM={value!r} is not a valid value and switched the shim OFF" in messages[0]
    assert f"FSDP_SHIM_STRICT={value!r} is not a valid value and turned strict mode ON" in messages[1]
    for valid in ("0", "1", "false", "off", "on", "true", "no", "yes", "disable", "disabled"):
        assert valid in messages[0]


def test_strict_defaults_off(_fresh_warning_memory: None) -> None:
    assert failures.strict_mode({}) is False
    assert failures.strict_mode({"FSDP_SHIM_STRICT": "1"}) is True


@pytest.mark.parametrize(
    ("value", "disabled", "unknown"),
    [
        (None, set(), []),
        ("", set(), []),
        ("cast", {"cast"}, []),
        (" Recompute ", {"recompute"}, []),
        ("CAST,recompute", {"cast", "recompute"}, []),
        ("*", set(FIX_NAMES), []),
        (" All ", set(FIX_NAMES), []),
        ("cast, , bogus", {"cast"}, ["bogus"]),
        ("all,bogus", set(FIX_NAMES), ["bogus"]),
    ],
)
def test_the_disabled_fixes_parser(value: str | None, disabled: set[str], unknown: list[str]) -> None:
    environ = {} if value is None else {DISABLED_FIXES_VARIABLE: value}
    assert config.disabled_fixes(environ) == (frozenset(disabled), unknown)


# ============================================================================= unit: failure policy
@pytest.mark.usefixtures("_fresh_warning_memory")
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


@pytest.mark.usefixtures("_fresh_warning_memory")
def test_strict_mode_raises_the_problem_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_SHIM_STRICT", "1")
    cause = KeyError("precision")
    with pytest.raises(FSDPShimError) as raised:
        failures.report("fsdp-shim: the problem", "what happened instead", cause=cause)
    assert str(raised.value) == "fsdp-shim: the problem (FSDP_SHIM_STRICT is on)"
    assert raised.value.__cause__ is cause


@pytest.mark.usefixtures("_fresh_warning_memory")
def test_a_warning_at_a_line_without_source_is_still_a_warning() -> None:
    """``python -c`` and the interactive prompt run ``__main__`` with ``BuiltinImporter`` as its
    loader, which has no source to show: a warning attributed to such a line must still be a warning,
    not an ImportError from the user's ``import`` (Python's own ``warnings.warn`` copes with it)."""
    code = compile("failures.report('fsdp-shim: the problem', 'what happened instead')", "<string>", "exec")
    namespace = {"__name__": "__main__", "__loader__": importlib.machinery.BuiltinImporter, "failures": failures}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(code, namespace)
    assert [(str(w.message), w.filename, w.lineno) for w in caught] == [
        ("fsdp-shim: the problem; what happened instead", "<string>", 1)
    ]


@pytest.mark.usefixtures("_fresh_warning_memory")
def test_warnings_turned_into_errors_escape() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FSDPShimWarning)
        with pytest.raises(FSDPShimWarning):
            failures.report("fsdp-shim: the problem", "what happened instead")


# ============================================================================= what importing does
def test_import_needs_neither_torch_nor_lightning_nor_the_patching_code() -> None:
    """``import fsdp_shim`` runs in every process a start-up file arms: it must not pull in torch,
    Lightning, wrapt, packaging or the patching code (they load at Lightning's import), yet arm the
    finder first on ``sys.meta_path`` and answer ``status()``. The public names are the
    implementation's classes, not copies."""
    result = child("import_cost")
    assert result["before"] == []
    assert result["after_import"] == [] and result["after_status"] == []
    assert result["active"] is True and result["sources"] == ["import fsdp_shim"]
    assert result["first_finder"] == "fsdp_shim_finder"
    assert result["version"] and result["status_text"].startswith(f"fsdp-shim {result['version']}: active")
    assert result["one_warning_class"] is True and result["one_error_class"] is True
    assert result["warning_category"][:2] == ["FSDPShimWarning", "RuntimeWarning"]


def test_python_m_fsdp_shim_does_not_activate_and_import_fsdp_shim_does(tmp_path: Path) -> None:
    """``python -m fsdp_shim`` imports the package before it runs the command, which inspects the
    environment: that import must arm nothing and load no patching code. The same start-up hook, in
    a process that runs ``import fsdp_shim``, sees the finder armed (so the hook can tell)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("from children.activation import report_at_exit\n\nreport_at_exit()\n")
    base = clean_env()
    paths = [str(hook), str(ROOT / "tests"), *filter(None, [base.get("PYTHONPATH")])]
    reports = {}
    for name, command in {
        "-m fsdp_shim --version": ["-m", "fsdp_shim", "--version"],
        "import fsdp_shim": ["-c", "import fsdp_shim"],
    }.items():
        report = tmp_path / f"{len(reports)}.json"
        env = {**base, "PYTHONPATH": os.pathsep.join(paths), "CHILD_REPORT_FILE": str(report)}
        proc = run_command([sys.executable, *command], env=env, check=True)
        reports[name] = (proc, json.loads(report.read_text()))
    proc, command = reports["-m fsdp_shim --version"]
    assert proc.stdout.strip() == f"fsdp-shim {__version__}"
    assert command["fsdp_shim_imported"] is True
    assert "fsdp_shim_finder" not in command["finders"] and command["armed_by"] == []
    assert command["active"] is None and command["patching_code_loaded"] == []
    _, imported = reports["import fsdp_shim"]
    assert imported["finders"][0] == "fsdp_shim_finder" and imported["armed_by"] == ["import fsdp_shim"]
    assert imported["active"] is True


# ============================================================================= one process, whole lifecycle
@pytest.fixture(scope="module")
def lifecycle(layouts: dict[str, Layout]) -> dict[str, Any]:
    """One interpreter: every module of ``_fsdp_shim`` imported, Lightning imported, ``import
    fsdp_shim``, five more activations, deactivate, activate, a reload of the patching code and an
    activation, deactivate. Each test below reads one step of it."""
    return child("lifecycle")


def test_importing_the_implementation_arms_nothing_and_patches_nothing(lifecycle: dict[str, Any]) -> None:
    """Every module of ``_fsdp_shim`` (``cli``, ``activation``, ``wrappers``, ``fixes``, ``verify`` ...)
    imported before Lightning: no finder armed, and every class attribute is what Lightning ships."""
    inert = lifecycle["inert"]
    assert {"_fsdp_shim.cli", "_fsdp_shim.activation", "_fsdp_shim.wrappers", "_fsdp_shim.fixes"} <= set(
        inert["modules"]
    )
    assert "fsdp_shim_finder" not in inert["finders"] and inert["armed_by"] == []
    assert inert["wrappers"] == [] and inert["active"] is False
    assert inert["as_shipped"] and all(inert["as_shipped"].values()), inert["as_shipped"]


@pytest.mark.per_release
def test_import_patches_what_each_release_lacks_and_leaves_the_rest_alone(
    lifecycle: dict[str, Any], layouts: dict[str, Layout]
) -> None:
    """Lightning first, then the shim: exactly the methods of the fixes each namespace lacks are
    replaced; on a release that ships the cast (2.5+) its methods are the very same objects, and the
    recompute's wrappers are there (on torch's checkpoint, once for every namespace) with the rank
    check's; no ``backward`` (Lightning's precision plugins', torch's ``CheckpointFunction``'s) is
    touched; on 2.0.x nothing changes."""
    assert lifecycle["patched"] == all_expected_wrappers(layouts)
    backward = [key for key in lifecycle["pristine_keys"] if key.endswith(".backward")]
    assert "torch.utils.checkpoint:CheckpointFunction.backward" in backward
    assert len(backward) > 1 or not layouts  # and Lightning's precision plugins' where it is installed
    assert not set(backward) & set(lifecycle["patched"])  # no wrapper of the shim's on any backward
    for namespace, version in installed_versions(layouts).items():
        touched = set(own_keys(lifecycle["patched"], namespace))
        assert touched == set(own_keys(expected_wrappers(namespace, version), namespace))
        if CAST.built_in(version):  # 2.5+ ships the cast: its convert_module and FSDP wrap are the same objects
            trainer = NAMESPACE_KINDS[namespace] == "trainer"
            own = [f"{namespace}:FSDPPrecision.convert_module"]
            own.append(f"{namespace}:FSDPStrategy.{'_setup_model' if trainer else 'setup_module'}")
            assert set(own) <= set(lifecycle["pristine_keys"]) and not set(own) & touched


@pytest.mark.per_release
def test_status_per_fix(lifecycle: dict[str, Any], layouts: dict[str, Layout]) -> None:
    """``status()`` per namespace and per fix: affected and patched where the release lacks the fix
    (with the methods it wrapped), "already contains it ... left untouched" where it ships it, "nothing
    to fix" before 2.1; ``str(status())`` lists each fix of each imported namespace."""
    text = lifecycle["status_text"].splitlines()
    for namespace, version in installed_versions(layouts).items():
        status = lifecycle["statuses_on"][namespace]
        assert status["version"] == version and status["activated_after_import"] is True
        assert [entry["fix"] for entry in status["fixes"]] == list(FIX_NAMES)
        lacks = [fix for fix in FIXES if fix.affects(version)]
        assert status["affected"] is bool(lacks) and status["patched"] is bool(lacks)
        expected = expected_targets(namespace, version)
        for fix in FIXES:
            entry = fix_status(status, fix.name)
            assert entry["affected"] is fix.affects(version) and entry["patched"] is fix.affects(version), entry
            assert sorted(map(key_of, entry["targets"])) == expected[fix.name]
            if fix.affects(version):
                assert entry["reason"] == "patched"
            else:
                assert entry["reason"] == fix.unaffected_reason(version)
                assert ("left untouched" if fix.built_in(version) else "nothing to fix") in entry["reason"]
        assert status["reason"] == ("patched" if lacks else fix_status(status, "cast")["reason"])
        header = next(i for i, line in enumerate(text) if line.split()[:1] == [namespace])
        assert version in text[header] and status["reason"] in text[header]
        for offset, fix in enumerate(FIXES, 1):
            assert text[header + offset].split(None, 1) == [fix.name, fix_status(status, fix.name)["reason"]]


def test_activate_many_times_installs_one_layer(lifecycle: dict[str, Any], layouts: dict[str, Layout]) -> None:
    assert lifecycle["patched"] == all_expected_wrappers(layouts)
    assert lifecycle["changed_by_activations"] == []
    assert all(count <= 1 for count in lifecycle["layers_after_activations"].values())
    assert sum(lifecycle["layers_after_activations"].values()) == len(lifecycle["patched"])


@pytest.mark.per_release
def test_deactivate_puts_back_the_identical_objects(lifecycle: dict[str, Any], layouts: dict[str, Layout]) -> None:
    """After ``deactivate()`` every class attribute is the very object it was before the shim (an
    inherited method is inherited again, torch's ``CheckpointFunction.forward`` is its staticmethod
    object itself); ``activate()`` patches the same methods again."""
    expected = all_expected_wrappers(layouts)
    assert lifecycle["restored"] == []
    assert lifecycle["repatched"] == expected
    assert lifecycle["final"] == []
    assert all(lifecycle["final_as_shipped"].values()), lifecycle["final_as_shipped"]
    for namespace, version in installed_versions(layouts).items():
        status = lifecycle["statuses_off"][namespace]
        assert status["patched"] is False
        for fix in FIXES:
            entry = fix_status(status, fix.name)
            assert entry["patched"] is False
            assert entry["reason"] == ("deactivated" if fix.affects(version) else fix.unaffected_reason(version))
        if any(fix.affects(version) for fix in FIXES):
            assert status["reason"] == "deactivated"


def test_a_reloaded_shim_takes_over_its_wrappers(lifecycle: dict[str, Any], layouts: dict[str, Layout]) -> None:
    """``importlib.reload`` of ``_fsdp_shim.wrappers`` and ``.fixes`` (Jupyter's autoreload) forgets the
    records: the next activation finds the wrappers on the classes and switches them on instead of
    stacking new ones, and status reads them as patched."""
    assert lifecycle["patched_before_reload"] == all_expected_wrappers(layouts)
    assert lifecycle["changed_by_reload"] == []
    assert all(count <= 1 for count in lifecycle["layers_after_reload"].values())
    for namespace, version in installed_versions(layouts).items():
        status = lifecycle["statuses_after_reload"][namespace]
        for fix in FIXES:
            assert fix_status(status, fix.name)["patched"] is fix.affects(version)


def test_a_reloaded_shim_still_restores_exactly(lifecycle: dict[str, Any]) -> None:
    """After the reload, ``deactivate()`` puts back every original object, and an inherited method is
    inherited again (the wrappers' state outlives the module that made them: a sentinel of the old
    module must still read as "nothing was there")."""
    assert lifecycle["final_after_reload"] == []
    assert all(lifecycle["final_after_reload_as_shipped"].values())


# ============================================================================= import order
@pytest.mark.parametrize(
    "modules",
    [
        ["fsdp_shim", "lightning"],
        ["lightning", "fsdp_shim"],
        ["fsdp_shim", "lightning.fabric.plugins.precision.fsdp"],
        ["lightning.pytorch.strategies.fsdp", "fsdp_shim", "lightning.fabric"],
        ["fsdp_shim", "pytorch_lightning", "lightning_fabric"],
        ["fsdp_shim", "lightning_fabric", "lightning.pytorch"],
        ["lightning_fabric", "fsdp_shim", "pytorch_lightning.plugins.precision.fsdp"],
    ],
    ids=[
        "shim-lightning",
        "lightning-shim",
        "shim-submodule",
        "submodule-shim",
        "shim-standalone",
        "shim-fabric-then-trainer",
        "fabric-shim-trainer-submodule",
    ],
)
def test_import_order_does_not_matter(modules: list[str], layouts: dict[str, Layout]) -> None:
    versions = installed_versions(layouts)
    needed = {name.partition(".")[0] for name in modules if name != "fsdp_shim"}
    available = {ns.partition(".")[0] for ns in versions}
    if not needed <= available:
        pytest.skip(f"needs {sorted(needed - available)}")
    result = child("import_order", {"imports": modules})
    expected = expected_for({ns: versions[ns] for ns in result["imported"]})
    assert expected and result["wrappers"] == expected
    assert result["warnings"] == []  # nothing went wrong, so nothing is said


# ============================================================================= gates that fail
@pytest.fixture(scope="module")
def without_class(layouts: dict[str, Layout]) -> tuple[str, str, dict[str, Any]]:
    namespace, version = an_affected_namespace(layouts, "trainer", fix="cast")  # the cast needs the class
    if not has_new_class_names(version):
        pytest.skip("2.1.0 has no FSDPPrecision; its FSDPPrecisionPlugin is the real class")
    return namespace, version, child("without_class", {"namespace": namespace, "class_name": "FSDPPrecision"})


def test_a_class_lightning_renamed_warns_once_per_fix_and_the_deprecated_subclass_stays_untouched(
    without_class: tuple[str, str, dict[str, Any]],
) -> None:
    """From 2.2 on, FSDPPrecisionPlugin is a deprecated *subclass* of FSDPPrecision. When
    FSDPPrecision is missing, patching the subclass would leave the Trainer's class unfixed: every
    fix that needs the class (the cast) says so once, patches nothing of its own in that namespace,
    and status says why; the recompute fix and the rank check, which do not need it, are applied."""
    namespace, version, result = without_class
    own_warnings = [w for w in result["warnings"] if namespace in w]
    lacks = [fix for fix in FIXES if fix.affects(version)]
    needs_the_class = [fix for fix in lacks if fix is CAST]
    assert len(own_warnings) == len(needs_the_class), result["warnings"]
    for fix, warning in zip(needs_the_class, own_warnings):
        assert warning == (
            f"fsdp-shim: cannot patch {namespace} {version} ({fix.name} fix): {namespace}.plugins.precision.fsdp "
            f"has no class FSDPPrecision; Lightning was left unchanged, so {fix.unfixed}"
        )
    assert f"{namespace}:FSDPPrecisionPlugin.convert_module" in result["keys"]  # the subclass was watched...
    targets = expected_targets(namespace, version)
    applied = sorted(key for fix, keys in targets.items() if fix != CAST.name for key in keys)
    assert seen_by(result["changed"], namespace) == applied  # ...and untouched
    assert result["status"]["patched"] is False
    assert result["status"]["reason"].startswith("not patched: ")
    for fix in lacks:
        entry = fix_status(result["status"], fix.name)
        if fix in needs_the_class:
            assert entry["reason"].startswith("not patched: ") and entry["patched"] is False, entry
        else:
            assert entry["reason"] == "patched" and entry["patched"] is True, entry


def test_strict_error_from_a_later_activation_is_not_wrapped_twice(
    without_class: tuple[str, str, dict[str, Any]],
) -> None:
    """The strict error surfaces as itself, not as "internal error ... FSDPShimError"."""
    namespace, version, result = without_class
    assert result["error_type"] == "fsdp_shim.errors.FSDPShimError"
    assert result["error"] == (
        f"fsdp-shim: cannot patch {namespace} {version} ({CAST.name} fix): {namespace}.plugins.precision.fsdp "
        "has no class FSDPPrecision (FSDP_SHIM_STRICT is on)"
    )


def test_a_renamed_target_warns_once_at_the_users_import_line(layouts: dict[str, Layout]) -> None:
    """The cast's table names a class Lightning lacks: one warning, at the user's ``import`` line (not
    in fsdp-shim's files), the cast left out in that namespace, the recompute fix and the rank check
    still applied."""
    namespace, version = an_affected_namespace(layouts, fix="cast")
    result = child("with_renamed_target", {"namespace": namespace})
    own = [w for w in result["warnings"] if namespace in w]
    assert len(own) == 1, result["warnings"]
    assert "RenamedPrecision" in own[0] and version in own[0] and "(cast fix)" in own[0]
    assert own[0].endswith(f"Lightning was left unchanged, so {CAST.unfixed}")
    mine = seen_by(result["wrappers"], namespace)
    targets = expected_targets(namespace, version)
    assert mine == sorted(targets["recompute"] + targets["rank-check"])
    assert result["status"]["patched"] is False
    assert result["status"]["reason"].startswith("not patched")
    assert fix_status(result["status"], "cast")["reason"].startswith("not patched: ")
    assert fix_status(result["status"], "recompute")["patched"] is True
    assert result["locations"] and all(location == result["expected_location"] for location in result["locations"])


def test_strict_mode_turns_a_renamed_target_into_an_error(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts, fix="cast")
    proc = run_child(
        "activation:import_with_renamed_target",
        {"namespace": namespace},
        env=clean_env(FSDP_SHIM_STRICT="1"),
        expect_ok=False,
    )
    assert proc.returncode != 0
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("fsdp_shim.errors.FSDPShimError: fsdp-shim: cannot patch ")
    assert ".plugins.precision.fsdp has no class RenamedPrecision" in error
    assert error.endswith("(FSDP_SHIM_STRICT is on)")
    assert "internal error" not in proc.stderr and "left unchanged" not in error


def test_minus_w_error_with_the_message_prefix_turns_warnings_into_errors(layouts: dict[str, Layout]) -> None:
    """What the docs recommend works from the command line; the category form cannot (Python resolves
    ``-W`` categories before ``sys.path`` is set up, so it ignores it and says so)."""
    namespace, _ = an_affected_namespace(layouts, fix="cast")
    proc = run_child(
        "activation:import_with_renamed_target",
        {"namespace": namespace},
        python_args=("-W", "error::fsdp_shim.FSDPShimWarning", "-W", "error:fsdp-shim"),
        expect_ok=False,
    )
    assert "Invalid -W option ignored: invalid module name: 'fsdp_shim'" in proc.stderr
    assert proc.returncode != 0
    assert "FSDPShimWarning: fsdp-shim: cannot patch" in proc.stderr.strip().splitlines()[-1]


def test_an_internal_error_never_reaches_the_users_import(layouts: dict[str, Layout]) -> None:
    """A bug in the patching code is a warning, and Lightning imports; in strict mode the user's
    next Lightning import fails with an error that says it is the shim's own."""
    namespace, _ = lightest_patched_namespace(layouts)
    versions = installed_versions(layouts)
    then = next((ns for ns in ("pytorch_lightning", "lightning.pytorch") if ns in versions and ns != namespace), None)
    result = child("with_broken_patch", {"namespace": namespace, "then": then})
    assert result["wrappers"] == []
    assert result["warnings"] and all("simulated bug" in w for w in result["warnings"])
    assert any(f"internal error while patching {namespace}" in w for w in result["warnings"])
    assert result["strict_error"] is not None
    assert result["strict_error"].startswith(f"fsdp-shim: internal error while patching {then or namespace} ")
    assert result["strict_error"].endswith("(RuntimeError: simulated bug in the shim) (FSDP_SHIM_STRICT is on)")


# ============================================================================= switches, in a process
@pytest.mark.parametrize(
    ("env", "set_in_script", "expect_patched"),
    [
        ({"FSDP_SHIM": " OFF "}, None, False),
        # the shim's own switch outranks the per-fix one: naming one fix leaves the other off too
        ({"FSDP_SHIM": "disabled", DISABLED_FIXES_VARIABLE: "cast"}, None, False),
        ({}, "no", False),  # set in the script after `import fsdp_shim`, before Lightning
        ({"FSDP_SHIM": "maybe"}, None, False),  # unreadable kill switch: fails closed
        ({"FSDP_SHIM": "yes"}, None, True),
    ],
    ids=["env-OFF", "env-disabled-and-one-fix", "script-no", "env-invalid", "env-yes"],
)
def test_the_environment_toggle(
    env: dict, set_in_script: str | None, expect_patched: bool, layouts: dict[str, Layout]
) -> None:
    namespace, version = lightest_patched_namespace(layouts)
    result = child("toggle", {"namespace": namespace, "set_in_script": set_in_script}, **env)
    mine = seen_by(result["wrappers"], namespace)
    assert mine == (expected_wrappers(namespace, version) if expect_patched else [])
    if env.get("FSDP_SHIM") == "maybe":
        assert len(result["warnings"]) == 1
        assert "FSDP_SHIM='maybe' is not a valid value and switched the shim OFF" in result["warnings"][0]
        assert result["locations"] == [result["expected_location"]]  # the `import fsdp_shim` line
    else:
        assert result["warnings"] == []
    if not expect_patched:
        assert "switched off by FSDP_SHIM=" in result["status"]["reason"]
        for fix in FIXES:
            if fix.affects(version):
                assert fix_status(result["status"], fix.name)["reason"].startswith("switched off by FSDP_SHIM=")


DISABLED_SETTINGS = [
    (" Cast ", {"cast"}),
    ("RECOMPUTE", {"recompute"}),
    ("*", set(FIX_NAMES)),
    ("all", set(FIX_NAMES)),
    ("recompute, bogus", {"recompute"}),
    ("recompute, bogus", {"recompute"}),  # again: the unknown name is not warned about twice
    ("", set()),
]


@pytest.fixture(scope="module")
def disabled_fixes(layouts: dict[str, Layout]) -> list[dict[str, Any]]:
    """One interpreter: Lightning, then ``import fsdp_shim`` under the first setting; each further
    setting between ``deactivate()`` and ``activate()``."""
    settings = [setting for setting, _ in DISABLED_SETTINGS]
    if not any(fix.affects(v) for v in installed_versions(layouts).values() for fix in FIXES):
        pytest.skip("no installed Lightning lacks a fix")
    return child("disabled_fixes", {"settings": settings}, FSDP_SHIM_DISABLED_FIXES=settings[0])


def test_a_fix_switched_off_is_left_as_lightning_ships_it_and_the_other_stays_patched(
    disabled_fixes: list[dict[str, Any]], layouts: dict[str, Layout]
) -> None:
    """``FSDP_SHIM_DISABLED_FIXES`` (names, ``*`` or ``all``; case and spaces ignored): a fix it names
    is not installed (its methods are Lightning's own objects) and its status says why; every other
    fix stays patched; ``status().disabled_fixes`` lists what is off."""
    versions = installed_versions(layouts)
    for result, (setting, disabled) in zip(disabled_fixes, DISABLED_SETTINGS):
        assert result["setting"] == setting
        assert set(result["disabled_fixes"]) == disabled and list(result["disabled_fixes"]) == [
            name for name in FIX_NAMES if name in disabled
        ]
        expected = sorted(  # a set: the shared torch keys once; the rank check is never switched off
            {
                key
                for namespace, version in versions.items()
                for fix, keys in expected_targets(namespace, version).items()
                if fix not in disabled
                for key in keys
            }
        )
        assert result["changed"] == expected, setting  # what is not wrapped is the very object it was
        assert result["wrappers"] == expected, setting
        for namespace, version in versions.items():
            status = result["statuses"][namespace]
            for fix in FIXES:
                entry = fix_status(status, fix.name)
                if not fix.affects(version):
                    assert entry["reason"] == fix.unaffected_reason(version)
                elif fix.name in disabled:
                    assert entry["patched"] is False, (setting, entry)
                    assert entry["reason"] == f"switched off by {DISABLED_FIXES_VARIABLE}"
                else:
                    assert entry["patched"] is True and entry["reason"] == "patched", (setting, entry)
            left = [fix for fix in FIXES if fix.affects(version) and fix.name not in disabled]
            assert status["patched"] is bool(left), (setting, status)
        if disabled:
            assert f"fixes switched off: {', '.join(n for n in FIX_NAMES if n in disabled)}" in result["status_text"]
            assert f"switched off by {DISABLED_FIXES_VARIABLE}" in result["status_text"]
        else:
            assert "fixes switched off" not in result["status_text"]


def test_an_unknown_fix_name_warns_once_and_is_ignored(disabled_fixes: list[dict[str, Any]]) -> None:
    """A name that is no fix is ignored (the previous test: ``recompute, bogus`` switches off the
    recompute fix alone) and said once, naming the valid fixes, however often it is read."""
    about = f"fsdp-shim: {DISABLED_FIXES_VARIABLE} names "
    warnings_by_step = [[w for w in result["warnings"] if w.startswith(about)] for result in disabled_fixes]
    first_unknown = next(i for i, (setting, _) in enumerate(DISABLED_SETTINGS) if "bogus" in setting)
    assert all(step == [] for step in warnings_by_step[:first_unknown]), warnings_by_step
    [warning] = warnings_by_step[-1]
    assert warning == (
        f"fsdp-shim: {DISABLED_FIXES_VARIABLE} names 'bogus', which is no fix of fsdp-shim "
        f"(its fixes: {', '.join(FIX_NAMES)}); that name is ignored"
    )


# ============================================================================= the recompute's shared wrappers
TORCH_KEYS = ("forward", "generator", "composable")
THE_SHIMS = dict.fromkeys(TORCH_KEYS, "shim")
AS_SHIPPED = dict.fromkeys(TORCH_KEYS, "as shipped")
"""``children.activation.shared_wrappers``: torch's two targets hold wrappers of the shim's."""


@pytest.fixture(scope="module")
def shared_wrappers(layouts: dict[str, Layout]) -> tuple[dict[str, str], dict[str, Any]]:
    """One interpreter (see ``children.activation.shared_wrappers``): the recompute fix switched off,
    then on again; its torch wrappers held by every namespace and unpatched one namespace at a time;
    ``torch.set_default_dtype`` counted around checkpoints."""
    versions = installed_versions(layouts)
    if not any(RECOMPUTE.affects(version) for version in versions.values()):
        pytest.skip("no installed Lightning lacks the recompute fix")
    return versions, child("shared_wrappers")


def test_a_fix_switched_off_and_then_on_again_is_patched_and_status_says_so(
    shared_wrappers: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """Review C1: ``FSDP_SHIM_DISABLED_FIXES=recompute``, ``deactivate()``, ``activate()``, then the
    variable deleted and ``activate()``: the recompute fix must be installed (torch's functions are the
    shim's wrappers, checkpoints recompute in the forward's dtype) and status must say so. It used to
    stay unpatched while status said "patched". While it is switched off, a namespace counts as patched
    when every other fix it lacks is (``NamespaceStatus.patched``): the switched-off fix is not counted."""
    versions, result = shared_wrappers
    namespaces = result["namespaces"]
    assert set(namespaces) == set(versions)
    for step in ("switched_off", "switched_off_again"):
        off = result[step]
        assert off["torch"] == AS_SHIPPED, step
        assert off["recompute_dtypes"] == FLOAT32_RECOMPUTE
        expected = expected_for(versions)
        assert off["changed"] == [key for key in expected if key not in SHARED], step
        for namespace in namespaces:
            assert off["recompute"][namespace]["reason"] == f"switched off by {DISABLED_FIXES_VARIABLE}"
            assert off["recompute"][namespace]["patched"] is False
            others = [fix for fix in FIXES if fix is not RECOMPUTE and fix.affects(versions[namespace])]
            assert off["patched"][namespace] is bool(others), (step, namespace)
    on = result["switched_on"]
    assert on["torch"] == THE_SHIMS
    assert on["recompute_dtypes"] == BF16_RECOMPUTE
    assert on["changed"] == expected_for(versions)
    for namespace in namespaces:
        entry = on["recompute"][namespace]
        assert (entry["patched"], entry["reason"]) == (True, "patched"), (namespace, entry)
        assert sorted(map(key_of, entry["targets"])) == list(SHARED)
        assert on["patched"][namespace] is True


def test_every_namespace_shares_torchs_wrappers_and_the_last_one_removes_them(
    shared_wrappers: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """With lightning 2.4.0 and pytorch_lightning 2.6.6 both imported, every namespace reports the
    recompute fix patched with the very same wrapper objects on torch (one layer). ``unpatch`` (what
    ``deactivate()`` runs, namespace by namespace) leaves them in place, still pinning the recompute,
    while another namespace's live record holds them, and the last one puts back exactly what torch
    shipped: ``CheckpointFunction``'s staticmethod object itself and the generator function."""
    _, result = shared_wrappers
    namespaces = result["namespaces"]
    assert result["layers"] == {**dict.fromkeys(SHARED, 1), "torch.utils.checkpoint:CheckpointFunction.backward": 0}
    assert result["held"] == {namespace: list(TORCH_KEYS) for namespace in namespaces}
    steps = result["unpatched"]
    assert [step["namespace"] for step in steps] == namespaces and len(steps) > 1
    for number, step in enumerate(steps, 1):
        last = number == len(steps)
        done = set(namespaces[:number])
        assert sorted(step["returned"]) == (sorted(TORCH_KEYS) if last else []), step["namespace"]
        assert step["still_the_shims"] == dict.fromkeys(TORCH_KEYS, not last)
        assert step["torch"] == (AS_SHIPPED if last else THE_SHIMS)
        assert step["recompute_dtypes"] == (FLOAT32_RECOMPUTE if last else BF16_RECOMPUTE)
        for namespace, entry in step["recompute"].items():
            expected = ("deactivated", False) if namespace in done else ("patched", True)
            assert (entry["reason"], entry["patched"]) == expected, (step["namespace"], namespace, entry)
    assert result["restored"] == dict.fromkeys(TORCH_KEYS, True)
    final = result["final"]  # after activate() and the public deactivate()
    assert final == {"restored": dict.fromkeys(TORCH_KEYS, True), "changed": [], "as_shipped": True}


def test_the_pin_does_nothing_where_the_dtype_did_not_change(
    shared_wrappers: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """A checkpoint whose forward and backward both run in float32 (``32-true``, ``*-mixed``, no
    Lightning) recomputes in float32 and the shim never calls ``torch.set_default_dtype``; the count
    sees the pin where the dtype did change (a bfloat16 forward: more calls than the same checkpoint
    makes without the shim)."""
    _, result = shared_wrappers
    counted = result["set_default_dtype"]
    assert counted["same"] == {
        "recompute_dtypes": FLOAT32_RECOMPUTE,
        "calls": 0,
    }
    assert counted["changed"]["recompute_dtypes"] == BF16_RECOMPUTE
    assert counted["changed_unpatched"]["recompute_dtypes"] == {
        "reentrant": "torch.float32",
        "non_reentrant": "torch.float32",
    }
    assert counted["changed"]["calls"] > counted["changed_unpatched"]["calls"] > 0, counted


# ============================================================================= armed at start-up, then switched off
@pytest.fixture(scope="module")
def armed_at_startup(layouts: dict[str, Layout]) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]]:
    """Both layouts: the first one's namespaces patched at their import, the second one's imported while
    the shim is off (``children.activation.armed_at_startup``)."""
    if len(layouts) < 2:
        pytest.skip("needs both Lightning layouts")
    first, second = (LAYOUT_NAMESPACES[package] for package in layouts)
    arguments = {"patched_at_import": first[0], "imported_while_off": second[0]}
    return first, second, child("armed_at_startup", arguments, FSDP_SHIM="1")


def test_a_namespace_patched_at_its_import_is_not_late(
    armed_at_startup: tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]],
) -> None:
    """Review C2: ``FSDP_SHIM=1`` arms the shim at start-up, so ``import lightning.pytorch`` (and the Fabric
    it imports) is patched at its import; a later ``import fsdp_shim`` must not call it activated after
    its import (no model can have been set up unpatched). A namespace imported while ``FSDP_SHIM=0`` and
    activated afterwards is."""
    first, second, result = armed_at_startup
    assert result["armed_by_at_start"] and result["on"]["sources"][0] == result["armed_by_at_start"][0]
    for namespace in first:
        assert own_keys(result["at_import"], namespace), namespace  # patched at its import
    for namespace in second:
        assert own_keys(result["while_off"], namespace) == [], namespace  # not handed over while off
        assert own_keys(result["on"]["wrappers"], namespace), namespace  # patched at the activation
    statuses = result["on"]["statuses"]
    assert {ns for ns, status in statuses.items() if status["imported"]} == {*first, *second}
    for namespace in (*first, *second):
        status = statuses[namespace]
        assert status["activated_after_import"] is (namespace in second), (namespace, status)
        assert status["patched"] is True, status


def test_fsdp_shim_0_after_patching_says_what_stays(
    armed_at_startup: tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]],
) -> None:
    """Review C3: ``FSDP_SHIM=0`` set after Lightning was patched: the first line of ``status()`` says the
    shim is switched off and that what it patched stays patched until ``deactivate()``, naming no way it
    was armed (it is not armed any more); the wrappers stay (identity); a fix a release already contains
    keeps saying so; ``deactivate()`` then removes everything."""
    _, _, result = armed_at_startup
    off = result["off"]
    lines = off["text"].splitlines()
    assert lines[0] == (
        f"fsdp-shim {__version__}: switched off by FSDP_SHIM (what it patched before stays patched; "
        "fsdp_shim.deactivate() removes it)"
    )
    assert " via " not in lines[0] and off["enabled"] is False
    assert off["wrappers"] == result["on"]["wrappers"]
    for namespace, status in off["statuses"].items():
        if not status["imported"]:
            continue
        version = status["version"]
        for fix in FIXES:
            entry = fix_status(status, fix.name)
            if fix.affects(version):
                assert (entry["patched"], entry["reason"]) == (True, "patched"), (namespace, entry)
            else:
                assert entry["reason"] == fix.unaffected_reason(version), (namespace, entry)
                assert "already contains it" in entry["reason"] or "nothing to fix" in entry["reason"]
    assert result["deactivated"] == {"wrappers": [], "as_shipped": True}


# ============================================================================= logging
@pytest.mark.parametrize("rank", ["0", "1"])
def test_one_debug_line_per_patched_namespace_and_the_float16_notice_on_rank_zero_only(
    rank: str, layouts: dict[str, Layout]
) -> None:
    """Rank zero logs one DEBUG line per namespace the shim patched, naming each fix it applied and the
    methods it wrapped, and one DEBUG line per namespace and fix; nothing at INFO, which a logging setup at
    INFO shows next to the confirmation line. Then, with logging unconfigured: 16-true now keeps float16
    weights and optimizer state, which can turn a job that trained in float32 unpatched into NaN, so one
    WARNING per process goes to stderr pointing at the docs; no other precision triggers it. Other ranks
    say nothing at INFO or WARNING, and log no patched line."""
    namespace, _ = an_affected_namespace(layouts, fix="cast")
    proc = run_child(
        "activation:logs", {"namespace": namespace}, env=clean_env(RANK=rank), python_args=("-W", "ignore")
    )
    info = [line for line in proc.stdout.splitlines() if line.startswith("fsdp_shim INFO")]
    debug = [line for line in proc.stdout.splitlines() if line.startswith("fsdp_shim DEBUG")]
    patched_lines = [line for line in debug if line.startswith("fsdp_shim DEBUG fsdp-shim: patched ")]
    before, _, after = proc.stderr.partition("MARKER: 16-true from here")
    notices = [line for line in after.splitlines() if "precision='16-true' now keeps" in line]
    versions = installed_versions(layouts)
    patched = {ns: v for ns, v in versions.items() if any(fix.affects(v) for fix in FIXES)}
    assert "precision='16-true' now keeps" not in before
    assert info == [], info
    if rank == "1":
        assert patched_lines == [] and notices == []
    else:
        assert len(patched_lines) == len(patched), patched_lines
        for ns, version in patched.items():
            [line] = [line for line in patched_lines if f"patched {ns} {version}: " in line]
            targets = expected_targets(ns, version)
            for fix in FIXES:
                assert (f"{fix.name} (" in line) is fix.affects(version), line
                for key in targets[fix.name]:
                    assert key.partition(":")[2] in line
        assert len(notices) == 1, proc.stderr
        assert "AdamW's default eps=1e-8 is 0 in float16" in notices[0] and "docs/numerics.md" in notices[0]
    for ns, version in versions.items():
        for fix in FIXES:
            assert sum(line.startswith(f"fsdp_shim DEBUG {ns} {version}, {fix.name} fix: ") for line in debug) == 1
    assert len(debug) - len(patched_lines) == len(versions) * len(FIXES)


# ============================================================================= glue that fails at call time
@pytest.fixture(scope="module")
def glue(layouts: dict[str, Layout]) -> tuple[str, dict[str, Any]]:
    namespace, _ = an_affected_namespace(layouts, "fabric", fix="cast")
    return namespace, child("glue_fallback", {"namespace": namespace})


FELL_BACK = "was used for this call, so it runs without {}"


def test_a_call_that_falls_back_is_reported_and_status_stops_saying_patched(
    glue: tuple[str, dict[str, Any]],
) -> None:
    """What a wrapper reads went missing at call time: ``_desired_input_dtype`` for the cast (a Lightning
    rename), the checkpointed function as the first positional argument of torch's generator for the
    recompute (torch changing its calling convention: the function by keyword), ``precision`` for the
    rank check at ``setup_environment``. Each call runs the function the shim wrapped (no cast; the
    recompute in the backward's float32; Lightning's ``setup_environment`` without the rank check),
    each wrapper warns once, status stops saying patched for that fix, and healthy calls keep every
    fix: a plain checkpoint afterwards still recomputes in its forward's dtype."""
    namespace, result = glue
    assert result["results"] == {
        "cast": ["torch.float32", "torch.float32"],  # Lightning's own (identity) convert_module
        "checkpoint": ["torch.float32", "torch.float32"],  # torch's own generator, unpinned
        "setup_environment": ["rank checks: 0", "rank checks: 0"],  # Lightning's own: the group is up, no check
    }
    assert len(result["warnings"]) == 3, result["warnings"]  # one per wrapper, not per call
    cast, checkpoint, setup = result["warnings"]
    assert cast.startswith(
        f"fsdp-shim: {namespace}.plugins.precision.fsdp.FSDPPrecision.convert_module could not read what it needs "
        "(AttributeError: "
    )
    assert cast.endswith("Lightning's own method " + FELL_BACK.format("the cast fix"))
    assert checkpoint.startswith(
        "fsdp-shim: torch.utils.checkpoint._checkpoint_without_reentrant_generator could not read what it needs "
        "(TypeError: expected the checkpointed function as the first positional argument)"
    )
    assert checkpoint.endswith("torch's own function " + FELL_BACK.format("the recompute fix"))
    assert setup.startswith(
        f"fsdp-shim: {namespace}.strategies.fsdp.FSDPStrategy.setup_environment could not read what it needs "
        "(AttributeError: 'precision' is gone"
    )
    assert setup.endswith("Lightning's own method " + FELL_BACK.format("the rank check"))
    status = result["status"]
    assert status["patched"] is False
    for fix in ("cast", "recompute"):
        entry = fix_status(status, fix)
        assert entry["patched"] is False
        assert "fell back to" in entry["reason"] and "at call time" in entry["reason"], entry
    assert "_checkpoint_without_reentrant_generator fell back" in fix_status(status, "recompute")["reason"]
    assert result["healthy"] == {
        "cast": "torch.bfloat16",
        "reentrant": "torch.bfloat16",
        "non_reentrant": "torch.bfloat16",
        "setup_environment": [[namespace, "torch.bfloat16"]],  # the rank check ran, for this namespace
    }


def test_strict_glue_error_does_not_claim_to_fall_back(glue: tuple[str, dict[str, Any]]) -> None:
    _, result = glue
    assert result["strict_warnings"] == []
    assert set(result["strict_errors"]) == {"cast", "checkpoint", "setup_environment"}
    for name, errors in result["strict_errors"].items():
        assert len(errors) == 2, (name, errors)
        for error in errors:
            assert "could not read what it needs" in error and error.endswith("(FSDP_SHIM_STRICT is on)")
            assert "fall" not in error and "was used" not in error


# ============================================================================= late activation, real FSDP
def test_late_activation_warns_about_models_fsdp_already_wrapped(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts, "trainer", fix="cast")
    result = child("late_activation", {"namespace": namespace}, PYTHONWARNINGS="ignore")
    assert result["late"] is True and result["patched"] is True
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "already set up 1 FSDP model" in result["warnings"][0] and "next setup" in result["warnings"][0]
    assert (result["before"], result["after"]) == ("torch.float32", "torch.bfloat16")


# ============================================================================= Lightning imported again
@pytest.fixture(scope="module")
def reimport(layouts: dict[str, Layout]) -> tuple[str, str, dict[str, Any]]:
    namespace, version = an_affected_namespace(layouts, "trainer", fix="recompute")
    result = child_json("reimport:import_again", {"namespace": namespace}, python_args=("-W", "ignore"))
    return namespace, version, result


@pytest.mark.per_release
def test_a_namespace_imported_again_gets_its_new_classes_patched(reimport: tuple[str, str, dict[str, Any]]) -> None:
    """Lightning removed from ``sys.modules`` and imported again (test frameworks, reloaders): the new
    classes get every fix the release lacks, torch's checkpoint keeps the very same wrappers (one layer),
    and status describes the new classes."""
    namespace, version, result = reimport
    expected = expected_wrappers(namespace, version)
    assert result["new_class"] is True
    assert seen_by(result["first_wrappers"], namespace) == expected
    assert seen_by(result["wrappers"], namespace) == expected
    assert result["same_torch_wrappers"] is True
    assert result["convert_dtype"] == "torch.bfloat16"  # the shim's cast, or the release's own
    assert result["recompute_dtypes"] == BF16_RECOMPUTE
    assert result["status"]["patched"] is True and result["status"]["reason"].startswith("patched"), result["status"]


def test_status_reads_the_classes_in_sys_modules_now(reimport: tuple[str, str, dict[str, Any]]) -> None:
    """Only the module that holds the FSDP precision class is imported again: until ``activate()`` its
    new class runs unpatched (no cast), and status says so for the cast instead of reading the shim's
    records. Then the strategy's module too: its new ``FSDPStrategy`` has no wrapper of the shim's (no
    FSDP wrap of the cast's, no rank check) until ``activate()``. The recompute fix, whose targets are
    torch's and were never imported again, stays patched and says so: checkpoints recompute in the
    forward's dtype throughout."""
    namespace, version, result = reimport
    expected = expected_targets(namespace, version)
    stale = result["one_module"]
    assert stale["new_class"] is True
    assert stale["convert_dtype"] == ("torch.float32" if CAST.affects(version) else "torch.bfloat16")
    strategy = [key for key in own_keys(expected_wrappers(namespace, version), namespace) if ":FSDPStrategy." in key]
    assert own_keys(stale["wrappers"], namespace) == strategy  # the strategy's wrappers: its class is the same
    assert stale["status"]["patched"] is not CAST.affects(version), stale["status"]
    if CAST.affects(version):
        assert "was imported again after fsdp-shim patched it" in stale["status"]["reason"], stale
        assert "fsdp_shim.activate()" in stale["status"]["reason"]
        assert "was imported again" in fix_status(stale["status"], CAST.name)["reason"]
    both = result["two_modules"]
    assert both["new_class"] is True
    assert own_keys(both["wrappers"], namespace) == []
    assert both["status"]["patched"] is not CAST.affects(version), both["status"]
    for step in (stale, both):
        assert shared(step["wrappers"]) == shared(expected["recompute"]) and step["same_torch_wrappers"] is True
        assert step["recompute_dtypes"] == BF16_RECOMPUTE
        assert fix_status(step["status"], RECOMPUTE.name)["reason"] == "patched"
    after = result["after_activate"]
    assert seen_by(after["wrappers"], namespace) == expected_wrappers(namespace, version)
    assert after["same_torch_wrappers"] is True  # switched on again, not stacked
    assert (after["convert_dtype"], after["recompute_dtypes"]) == ("torch.bfloat16", BF16_RECOMPUTE)
    assert after["status"]["patched"] is True, after


# ============================================================================= threads
HANG_TIMEOUT = 8.0


def test_the_shims_import_finder_does_not_deadlock(tmp_path: Path) -> None:
    """CPython asks every ``sys.meta_path`` finder while holding its global import lock; a finder that
    imports there (wrapt's post-import finder imports the parent package) deadlocks against a thread
    that is executing that parent. The shim's real finder, told to watch a package's child as a
    namespace, imports nothing there: both threads finish and the child is handed over once."""
    result = child_json(
        "threads:parent_and_child_at_once", {"folder": str(tmp_path), "hook": "fsdp-shim", "timeout": 60.0}
    )
    assert result == {"finished": True, "errors": [], "hook_calls": [["slowparent.child", None, 1]]}


@pytest.mark.xfail(
    reason="control: wrapt's post-import finder imports the parent under the global import lock (upstream bug)",
    strict=False,
)
def test_control_wrapts_post_import_hook_deadlocks_in_the_same_program(tmp_path: Path) -> None:
    """Shows the program above does reach the deadlock: the same hook through wrapt hangs."""
    result = child_json(
        "threads:parent_and_child_at_once", {"folder": str(tmp_path), "hook": "wrapt", "timeout": HANG_TIMEOUT}
    )
    assert result["finished"] is True


@pytest.mark.parametrize("shim", ["none", "import", "arm"])
def test_ten_threads_importing_lightning_finish(shim: str, layouts: dict[str, Layout]) -> None:
    """Lightning's own imports are not thread-safe (partially initialised modules, with or without
    the shim), so which threads fail varies; what must hold is that all of them finish, that a
    namespace that did finish executing reached the shim (armed or imported), and that the shim says,
    per fix, what it did for it."""
    lightest_patched_namespace(layouts)
    result = child_json(
        "threads:lightning_in_threads", {"shim": shim, "timeout": 240.0}, env=clean_env(PYTHONWARNINGS="ignore")
    )
    assert result["finished"] is True, result
    if shim == "none":
        assert result["shim_loaded"] is False
        return
    assert result["shim_loaded"] is (shim == "import" or bool(result["executed"])), result
    for namespace, status in result.get("status", {}).items():
        version = status["version"]
        if not (status["imported"] and version):
            continue
        for fix in FIXES:
            entry = fix_status(status, fix.name)
            if fix.affects(version):
                assert entry["patched"] or entry["reason"].startswith(("not patched", "imported; not checked")), (
                    namespace,
                    entry,
                )
            else:
                assert entry["patched"] is False
