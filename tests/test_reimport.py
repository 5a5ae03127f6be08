"""Lightning imported again after being removed from ``sys.modules``."""

from __future__ import annotations

from conftest import Layout, an_affected_namespace, child_json

from fsdp_shim.backport import namespace_named, precision_convert_module


def test_a_namespace_imported_again_gets_its_new_classes_patched(layouts: dict[str, Layout]) -> None:
    namespace, version = an_affected_namespace(layouts, "trainer")
    precision_class = precision_convert_module(namespace_named(namespace), version).class_name
    result = child_json("reimport:import_again", {"namespace": namespace}, python_args=("-W", "ignore"))
    assert result["new_class"]
    assert result["dtype"] == "torch.bfloat16"
    assert f"{namespace}:{precision_class}.convert_module" in result["wrappers"]
    assert result["status"]["patched"] and result["status"]["reason"].startswith("patched"), result["status"]


def test_status_reads_the_classes_in_sys_modules_now(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts, "trainer")
    result = child_json("reimport:import_one_module_again", {"namespace": namespace}, python_args=("-W", "ignore"))
    assert result["before"]["patched"]
    stale = result["stale"]
    assert stale["dtype"] == "torch.float32"
    assert not stale["status"]["patched"]
    assert "was imported again after fsdp-shim patched it" in stale["status"]["reason"], stale
    assert "fsdp_shim.activate()" in stale["status"]["reason"]
    assert result["after"]["dtype"] == "torch.bfloat16"
    assert result["after"]["status"]["patched"], result["after"]
