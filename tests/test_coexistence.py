"""The shim next to other code that patches the same functions or imports Lightning itself, with real
Lightning in fresh interpreters (``tests/children/coexistence.py`` and ``foreign.py``).

Other wrappers: the shim composes with what was there, never takes another library's wrapper for its
own, never removes one, and says so when it cannot simply remove its own. Each check runs in one
process on a target of each kind the shim wraps: the cast's ``convert_module`` (inherited from
``Precision``), and the recompute's ``CheckpointFunction.forward`` (a staticmethod in torch's class dict)
and the non-reentrant generator (a function of the module ``torch.utils.checkpoint``, ``_impl`` from torch 2.14),
which every namespace that needs the fix shares; the classes and the module are read directly, by
identity. And a library that wraps the base class of an inherited target after the shim.

A finder in front of the shim's that loads Lightning itself (instrumenting import hooks): the shim
notices at the next import, patches then, and says so; a real FSDP fit shows the result.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from children.classes import COMPOSABLE_MODULE, checkpoint_generator
from conftest import ROOT, Layout, an_affected_namespace, child_json, clean_env, installed_versions, make_venv

from _fsdp_shim.config import CAST, RECOMPUTE
from _fsdp_shim.fixes import plan_of, precision_class
from _fsdp_shim.startup_files import write_files

pytest.importorskip("torch", reason="its targets are named after the torch in hand, read at import")
QUIET = ("-W", "ignore::DeprecationWarning")
DTYPE_ON, DTYPE_OFF = "torch.bfloat16", "torch.float32"
"""What each target gives with the fix (a bf16-true plugin's cast dtype, or a checkpoint's recompute in
its forward's bfloat16) and without it (Lightning's own: no cast; torch's own: recompute in float32)."""
KINDS = {
    "convert": (CAST, "convert_module"),
    "reentrant": (RECOMPUTE, "forward"),
    "non_reentrant": (RECOMPUTE, checkpoint_generator()),
}
"""Each kind of target: the fix that wraps it and the attribute (see ``children/coexistence.py``)."""


def child(target: str, arguments: dict) -> Any:
    return child_json(f"coexistence:{target}", arguments, env=clean_env(), python_args=QUIET)


def targets(layouts: dict[str, Layout]) -> list[dict[str, Any]]:
    """One target per kind, where an installed release lacks its fix, with the shim's label for it and
    whether the shim wraps it where the class inherits it (from the fix's plan). Skips where there is
    none (2.0.x)."""
    versions = installed_versions(layouts)
    found = []
    for kind, (fix, attribute) in KINDS.items():
        namespace = next((ns for ns, v in versions.items() if fix.affects(v)), None)
        if namespace is not None:
            planned = plan_of(fix)(namespace, versions[namespace])
            [target] = [t for t in planned if t.attribute == attribute and t.module != COMPOSABLE_MODULE]
            found.append(
                {
                    "fix": fix.name,
                    "namespace": namespace,
                    "kind": kind,
                    "label": target.label(namespace),
                    "inherited": target.inherited,
                }
            )
    if not found:
        pytest.skip("no installed Lightning lacks a fix")
    return found


def about(target: dict[str, Any], warnings: list[str]) -> list[str]:
    """The warnings about the shim's wrapper on ``target`` (they name it by its label)."""
    return [w for w in warnings if f" {target['label']} " in w]


# ----------------------------------------------------------------------------- other wrappers
# Which class holds the cast's method and whether the cast applies differs per release (2.1.0, 2.1.x,
# 2.2-2.4, 2.5+): the wrapt kind runs on every release; the rest of this file is the shim's own logic
# and runs once, in the default session.
@pytest.mark.parametrize("kind", ["plain", pytest.param("wrapt", marks=pytest.mark.per_release)])
def test_a_wrapper_put_there_first_is_composed_with_not_mistaken_for_the_fix(
    kind: str, layouts: dict[str, Layout]
) -> None:
    found = targets(layouts)
    result = child("foreign_wrapper_first", {"targets": found, "kind": kind})
    for target in found:
        one = result[target["kind"]]
        assert one["dtype_on"] == DTYPE_ON, target  # the fix applies...
        assert one["their_calls_on"] == 1, target  # ...and their code still runs
        status = one["status_on"]
        assert status["affected"] is True and status["patched"] is True, (target, status)
        if target["inherited"]:  # Lightning ships nothing there: the shim says whose object it wraps
            assert "wraps" in status["reason"] and "which was there before" in status["reason"], (target, status)
        else:  # the class or module defines it: a hot-fix there looks like the shipped function
            assert status["reason"] == "patched", (target, status)
        assert one["theirs_restored"] is True, target  # deactivate() puts back their object itself
        assert one["dtype_off"] == DTYPE_OFF, target
        assert one["their_calls_off"] == 1, target


def test_a_wrapper_put_on_top_is_never_taken_for_the_shims_own(layouts: dict[str, Layout]) -> None:
    """Their wrapt wrapper on top of the shim's: ``deactivate()`` switches the shim's off in place (one
    warning per target; for torch's, shared, when the last namespace lets it go) and every namespace's
    status says it is deactivated, and one at least names the wrapper left in place; ``activate()``
    switches it back on."""
    found = targets(layouts)
    result = child("foreign_wrapper_on_top", {"targets": found})
    assert len(result["deactivate_warnings"]) == len(found), result["deactivate_warnings"]
    for target in found:
        [warning] = about(target, result["deactivate_warnings"])
        assert "has wrapped it since" in warning and "passes every call through" in warning
        one = result["targets"][target["kind"]]
        assert one["foreign_counts_as_shim_wrapper"] is False
        assert one["status_on"]["patched"] is True
        assert "is under a " in one["status_on"]["reason"]
        assert one["dtype_on"] == DTYPE_ON
        assert one["foreign_still_on_class"] is True
        assert one["dtype_off"] == DTYPE_OFF
        assert one["status_off"]["patched"] is False
        assert one["status_off"]["reason"].startswith("deactivated"), one["status_off"]
        assert all(entry["patched"] is False for entry in one["statuses_off"])
        saying = [e for e in one["statuses_off"] if target["label"] in e["reason"]]
        assert saying and all(e["reason"].startswith("deactivated; ") for e in saying), one["statuses_off"]
        assert all("passes calls through" in e["reason"] for e in saying)
        # activate(): the buried wrapper is switched back on, nothing is stacked or adopted.
        assert one["foreign_still_on_class_after_activate"] is True
        assert one["shim_layers"] == 1
        assert one["dtype_reactivated"] == DTYPE_ON
        assert one["status_reactivated"]["patched"] is True
        assert one["foreign_still_on_class_at_the_end"] is True
        assert one["dtype_at_the_end"] == DTYPE_OFF
        assert one["their_calls"] == 4  # each of the four calls above went through their wrapper


def test_a_replaced_wrapper_is_reported_and_the_replacement_kept(layouts: dict[str, Layout]) -> None:
    found = targets(layouts)
    result = child("shim_wrapper_replaced", {"targets": found})
    assert len(result["deactivate_warnings"]) == len(found), result["deactivate_warnings"]
    for target in found:
        [warning] = about(target, result["deactivate_warnings"])
        assert "already been replaced" in warning
        one = result["targets"][target["kind"]]
        assert one["status"]["patched"] is False
        assert "other code replaced its wrapper" in one["status"]["reason"]
        assert one["replacement_kept"] is True


def test_a_library_that_wraps_the_base_class_after_the_shim_still_runs(layouts: dict[str, Layout]) -> None:
    """Review B2: the FSDP precision class inherits ``convert_module`` (2.1-2.4), the shim wrapped it on
    that class, and then another library (a tracer) wraps the base class's ``Precision.convert_module``
    with wrapt. Without the shim their wrapper would run for every FSDP plugin; with it, it still does,
    and the shim's cast too (its wrapper looks the inherited method up at every call, not once).
    ``deactivate()`` restores inheritance and leaves their wrapper alone. Trainer and Fabric: their
    ``Precision`` classes differ (the Trainer's inherits the method from Fabric's)."""
    layout = next((lay for lay in layouts.values() if CAST.affects(lay.trainer_version)), None)
    if layout is None:
        pytest.skip("needs a Lightning release that lacks the cast (its FSDP precision class inherits it)")
    versions = {ns: v for ns, v in installed_versions({layout.package: layout}).items() if CAST.affects(v)}
    result = child("base_class_wrapped_after", {"namespaces": list(versions)})
    for namespace, version in versions.items():
        one = result[namespace]
        fsdp_class = precision_class(namespace, version)
        assert one["inherited_as_shipped"] is True and one["derives_from_base"] is True, one
        assert one["shim_on_the_class"] is True
        assert (one["dtype_on"], one["their_calls_on"]) == (DTYPE_ON, [fsdp_class]), one
        assert one["status_on"]["fix"] == CAST.name and one["status_on"]["patched"] is True
        assert one["inherited_again"] is True and one["theirs_kept"] is True
        assert (one["dtype_off"], one["their_calls_off"]) == (DTYPE_OFF, [fsdp_class]), one


# ----------------------------------------------------------------------------- a finder in front
def check_fit(result: dict, namespace: str, sources: list[str]) -> None:
    """The model trained in the precision's dtype: the shim patched the namespace when it noticed it,
    and said once, naming the finder, that it could only do so then."""
    assert result["loaded"] and result["sources"] == sources
    assert result["param_dtypes"] == ["torch.bfloat16"], result
    assert result["module_dtype"] == "torch.bfloat16"
    assert result["status"]["patched"] is True, result["status"]
    [warning] = [
        w for w in result["warnings"] if f"loaded {namespace} without fsdp-shim's import watcher seeing it" in w
    ]
    assert "<test Instrumenter>" in warning and "so it was patched only then" in warning, warning


@pytest.mark.parametrize("strict", [None, "1"], ids=["default", "strict"])
def test_a_finder_in_front_in_import_mode(strict: str | None, layouts: dict[str, Layout]) -> None:
    """``import fsdp_shim`` first, then an instrumenting finder in front of it. Strict mode does not
    raise: the late patch worked, so there is nothing to fail."""
    namespace = an_affected_namespace(layouts, "trainer")[0]
    result = child_json(
        "foreign:fit",
        {"namespace": namespace, "import_shim": True},
        python_args=("-W", "ignore"),
        env=clean_env(FSDP_SHIM_STRICT=strict),
    )
    check_fit(result, namespace, ["import fsdp_shim"])


def test_a_finder_in_front_in_start_up_file_mode(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """The start-up files ``fsdp-shim install`` writes arm the shim; the script never imports it."""
    namespace = an_affected_namespace(layouts, "trainer")[0]
    venv = make_venv(tmp_path / "venv", [str(ROOT), sysconfig.get_paths()["purelib"]])
    write_files(venv.site_packages)
    proc = venv.run(
        "-W",
        "ignore",
        str(ROOT / "tests" / "child.py"),
        "children.foreign:fit",
        json.dumps({"namespace": namespace, "import_shim": False}),
        env=clean_env(),
    )
    check_fit(json.loads(proc.stdout.strip().splitlines()[-1]), namespace, ["startup file"])
