"""The shim next to other code that patches the same methods or imports Lightning itself, with real
Lightning in fresh interpreters (``tests/children/coexistence.py`` and ``foreign.py``).

Other wrappers: the shim composes with what was there, never takes another library's wrapper for its
own, never removes one, and says so when it cannot simply remove its own. Each check runs on a target
of each fix in one process: the cast's ``convert_module`` (inherited from ``Precision``), and the
recompute's ``backward`` on Fabric's FSDP precision class (which defines it) and on the Trainer's
(which inherits it); the classes are read directly, by identity.

A finder in front of the shim's that loads Lightning itself (instrumenting import hooks): the shim
notices at the next import, patches then, and says so; a real FSDP fit shows the result.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Layout, an_affected_namespace, child_json, clean_env, installed_versions, make_venv

from _fsdp_shim import NAMESPACES as NAMESPACE_KINDS
from _fsdp_shim.config import CAST, RECOMPUTE
from _fsdp_shim.startup_files import write_files

QUIET = ("-W", "ignore::DeprecationWarning")
DTYPE_ON, DTYPE_OFF = "torch.bfloat16", "torch.float32"
"""What each target gives a bf16-true plugin with the fix (the cast dtype, or the backward in the
forward's dtype) and without it (Lightning's own: no cast, backward in float32)."""


def child(target: str, arguments: dict) -> Any:
    return child_json(f"coexistence:{target}", arguments, env=clean_env(), python_args=QUIET)


def targets(layouts: dict[str, Layout]) -> list[dict[str, str]]:
    """One target per method kind, where an installed release lacks its fix: the cast's
    ``convert_module``, the recompute's ``backward`` that Fabric defines and the one the Trainer
    inherits. Skips where there is none (2.0.x)."""
    versions = installed_versions(layouts)
    found = []
    for fix, kind in ((CAST, "any"), (RECOMPUTE, "fabric"), (RECOMPUTE, "trainer")):
        namespace = next(
            (ns for ns, v in versions.items() if fix.affects(v) and kind in ("any", NAMESPACE_KINDS[ns])), None
        )
        if namespace is not None:
            found.append({"fix": fix.name, "namespace": namespace})
    if not found:
        pytest.skip("no installed Lightning lacks a fix")
    return found


def key(target: dict[str, str]) -> str:
    return f"{target['fix']}:{target['namespace']}"


def about(target: dict[str, str], warnings: list[str]) -> list[str]:
    """The warnings about the shim's wrapper on ``target`` (they name it by its label)."""
    attribute = {"cast": "convert_module", "recompute": "backward"}[target["fix"]]
    label = f"{target['namespace']}.plugins.precision.fsdp.FSDPPrecision"  # 2.1.0's Trainer: ...PrecisionPlugin
    return [w for w in warnings if label in w and f".{attribute} " in w]


def defined_by_lightning(target: dict[str, str]) -> bool:
    """Whether Lightning's class defines the method itself (Fabric's ``FSDPPrecision.backward``), so
    whatever the class holds looks like Lightning's own, rather than inheriting it."""
    return target["fix"] == "recompute" and NAMESPACE_KINDS[target["namespace"]] == "fabric"


# ----------------------------------------------------------------------------- other wrappers
# Which class holds the method and whether the cast applies differs per release (2.1.0, 2.1.x,
# 2.2-2.4, 2.5+): the wrapt kind runs on every release; the rest of this file is the shim's own logic
# and runs once, in the default session.
@pytest.mark.parametrize("kind", ["plain", pytest.param("wrapt", marks=pytest.mark.per_release)])
def test_a_wrapper_put_there_first_is_composed_with_not_mistaken_for_the_fix(
    kind: str, layouts: dict[str, Layout]
) -> None:
    found = targets(layouts)
    result = child("foreign_wrapper_first", {"targets": found, "kind": kind})
    for target in found:
        one = result[key(target)]
        assert one["dtype_on"] == DTYPE_ON, target  # the fix applies...
        assert one["their_calls_on"] == 1, target  # ...and their code still runs
        status = one["status_on"]
        assert status["affected"] is True and status["patched"] is True, (target, status)
        if defined_by_lightning(target):  # the class defines it: a hot-fix there looks like Lightning's own
            assert status["reason"] == "patched", (target, status)
        else:
            assert "wraps" in status["reason"] and "which was there before" in status["reason"], (target, status)
        assert one["theirs_restored"] is True, target  # deactivate() puts back their object itself
        assert one["dtype_off"] == DTYPE_OFF, target
        assert one["their_calls_off"] == 1, target


def test_a_wrapper_put_on_top_is_never_taken_for_the_shims_own(layouts: dict[str, Layout]) -> None:
    found = targets(layouts)
    result = child("foreign_wrapper_on_top", {"targets": found})
    # deactivate(): their wrapper stays on each class, the shim's (under it) passes calls through.
    assert len(result["deactivate_warnings"]) == len(found), result["deactivate_warnings"]
    for target in found:
        [warning] = about(target, result["deactivate_warnings"])
        assert "has wrapped it since" in warning and "passes every call through" in warning
        one = result["targets"][key(target)]
        assert one["foreign_counts_as_shim_wrapper"] is False
        assert one["status_on"]["patched"] is True
        assert "is under a " in one["status_on"]["reason"]
        assert one["dtype_on"] == DTYPE_ON
        assert one["foreign_still_on_class"] is True
        assert one["dtype_off"] == DTYPE_OFF
        assert one["status_off"]["patched"] is False
        assert one["status_off"]["reason"].startswith("deactivated; ")
        assert "passes calls through" in one["status_off"]["reason"]
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
        one = result["targets"][key(target)]
        assert one["status"]["patched"] is False
        assert "other code replaced its wrapper" in one["status"]["reason"]
        assert one["replacement_kept"] is True


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
