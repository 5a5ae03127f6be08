"""A finder in front of the shim's import watcher that loads Lightning itself."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT, Layout, an_affected_namespace, child_json, clean_env, make_venv

from fsdp_shim.startup_files import install


def check(result: dict, namespace: str) -> None:
    assert result["loaded"]
    assert result["param_dtypes"] == ["torch.bfloat16"], result
    assert result["module_dtype"] == "torch.bfloat16"
    assert result["patched"]
    [warning] = [
        w for w in result["warnings"] if f"loaded {namespace} without fsdp-shim's import watcher seeing it" in w
    ]
    assert "<test Instrumenter>" in warning and namespace in warning, warning


def test_import_mode(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    result = child_json("foreign:fit", {"namespace": namespace, "import_shim": True}, python_args=("-W", "ignore"))
    check(result, namespace)


def test_startup_file_mode(layouts: dict[str, Layout], tmp_path: Path) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    venv = make_venv(tmp_path / "venv", [str(ROOT), sysconfig.get_paths()["purelib"]])
    install(venv.site_packages)
    proc = venv.run(
        "-W",
        "ignore",
        str(ROOT / "tests" / "child.py"),
        "children.foreign:fit",
        json.dumps({"namespace": namespace, "import_shim": False}),
        env=clean_env(),
    )
    check(json.loads(proc.stdout.strip().splitlines()[-1]), namespace)


@pytest.mark.parametrize("strict", ["1"])
def test_strict_mode_does_not_raise_when_the_late_patch_worked(strict: str, layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    result = child_json(
        "foreign:fit",
        {"namespace": namespace, "import_shim": True},
        python_args=("-W", "ignore"),
        env=clean_env(FSDP_SHIM_STRICT=strict),
    )
    check(result, namespace)
