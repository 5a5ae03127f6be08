"""activate / deactivate / status, gates, toggles, failure isolation, messages and import order, each
in a fresh interpreter with real Lightning (the code they run is in ``tests/children/activation.py``)."""

from __future__ import annotations

import pytest
from conftest import Layout, an_affected_namespace, child_json, clean_env, installed_versions, run_child

from fsdp_shim.backport import converts_only_in_connect, has_fsdp_precision_class, is_affected_release

QUIET = ("-W", "ignore::DeprecationWarning")


def child(target: str, arguments: dict | None = None, **env: str | None) -> dict:
    return child_json(f"activation:{target}", arguments, env=clean_env(**env), python_args=QUIET)


def expected_wrappers(namespace: str, version: str) -> list[str]:
    if not is_affected_release(version):
        return []
    trainer = namespace in ("lightning.pytorch", "pytorch_lightning")
    precision = "FSDPPrecision" if not trainer or has_fsdp_precision_class(version) else "FSDPPrecisionPlugin"
    keys = [f"{namespace}:{precision}.convert_module"]
    if trainer and converts_only_in_connect(version):
        keys += [f"{namespace}:FSDPStrategy.connect", f"{namespace}:FSDPStrategy.setup"]
    return sorted(keys)


def all_expected_wrappers(layouts: dict[str, Layout]) -> list[str]:
    return sorted(k for ns, v in installed_versions(layouts).items() for k in expected_wrappers(ns, v))


@pytest.mark.release_independent
def test_import_needs_neither_torch_nor_lightning() -> None:
    result = child("import_needs_neither_torch_nor_lightning")
    assert result["loaded"] == []
    assert result["after_status"] == []
    assert result["active"] is True
    assert result["version"]


def test_activate_many_times_installs_one_layer(layouts: dict[str, Layout]) -> None:
    result = child("activate_many_times")
    assert result["changed"] == []
    assert all(count <= 1 for count in result["layers"].values()), result["layers"]
    assert result["wrappers"] == all_expected_wrappers(layouts)


def test_deactivate_puts_back_the_identical_objects(layouts: dict[str, Layout]) -> None:
    result = child("deactivate_restores_identity")
    expected = all_expected_wrappers(layouts)
    assert result["patched"] == expected
    assert result["restored"] == []
    assert result["repatched"] == expected
    assert result["final"] == []
    assert all(result["inherits"].values())
    for namespace, version in installed_versions(layouts).items():
        status = result["status"][namespace]
        assert status["patched"] is False
        if is_affected_release(version):
            assert status["reason"] == "deactivated"


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
    result = child("import_in_order", {"modules": modules})
    expected = sorted(k for ns in result["imported"] for k in expected_wrappers(ns, versions[ns]))
    assert result["wrappers"] == expected


def test_fixed_and_unsupported_releases_are_left_alone(layouts: dict[str, Layout]) -> None:
    """Imported first, then the shim: every object on an unaffected namespace is the very same."""
    result = child("shim_after_lightning")
    for namespace, version in installed_versions(layouts).items():
        mine = [k for k in result["changed"] if k.startswith(namespace + ":")]
        assert mine == expected_wrappers(namespace, version)
        status = result["status"][namespace]
        assert status["version"] == version
        assert status["affected"] is is_affected_release(version)
        assert status["patched"] is is_affected_release(version)
        assert status["activated_after_import"] is True
        if not is_affected_release(version):
            assert "left untouched" in status["reason"] or "nothing to fix" in status["reason"]


def test_a_class_lightning_renamed_warns_once_and_the_deprecated_subclass_stays_untouched(
    layouts: dict[str, Layout],
) -> None:
    """From 2.2 on, FSDPPrecisionPlugin is a deprecated *subclass* of FSDPPrecision. When
    FSDPPrecision is missing, patching the subclass would leave the Trainer's class unfixed."""
    namespace, version = an_affected_namespace(layouts, "trainer")
    if not has_fsdp_precision_class(version):
        pytest.skip("2.1.0 has no FSDPPrecision; its FSDPPrecisionPlugin is the real class")
    result = child("without_class", {"namespace": namespace, "class_name": "FSDPPrecision"})
    own = [w for w in result["warnings"] if namespace in w]
    assert len(own) == 1, result["warnings"]
    assert (
        f"cannot patch {namespace} {version}: {namespace}.plugins.precision.fsdp has no class FSDPPrecision" in own[0]
    )
    assert [k for k in result["changed"] if k.startswith(namespace + ":")] == []
    assert result["status"][namespace]["patched"] is False
    assert result["status"][namespace]["reason"].startswith("not patched: ")


@pytest.mark.release_independent
def test_strict_error_from_a_later_activation_is_not_wrapped_twice(layouts: dict[str, Layout]) -> None:
    """The strict error surfaces as itself, not as "internal error ... FSDPShimError"."""
    namespace, version = an_affected_namespace(layouts, "trainer")
    class_name = "FSDPPrecision" if has_fsdp_precision_class(version) else "FSDPPrecisionPlugin"
    result = child("without_class", {"namespace": namespace, "class_name": class_name}, FSDP_SHIM_STRICT="1")
    assert result["error"] == (
        f"fsdp-shim: cannot patch {namespace} {version}: {namespace}.plugins.precision.fsdp has no class "
        f"{class_name} (FSDP_SHIM_STRICT is on)"
    )


def test_a_renamed_target_warns_once_at_the_users_import_line(layouts: dict[str, Layout]) -> None:
    namespace, version = an_affected_namespace(layouts)
    result = child("with_renamed_target", {"namespace": namespace})
    own = [w for w in result["warnings"] if namespace in w]
    assert len(own) == 1
    assert "RenamedPrecision" in own[0] and version in own[0]
    assert own[0].endswith("Lightning was left unchanged, so FSDP 'true' precisions keep the memory bug")
    assert [k for k in result["wrappers"] if k.startswith(namespace + ":")] == []
    assert result["status"][namespace]["patched"] is False
    assert result["status"][namespace]["reason"].startswith("not patched")
    # The warning points at the user's `import`, not at fsdp_shim's own files.
    assert result["locations"] and all(location == result["expected_location"] for location in result["locations"])


@pytest.mark.release_independent
def test_strict_mode_turns_a_renamed_target_into_an_error(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts)
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


@pytest.mark.release_independent
def test_minus_w_error_with_the_message_prefix_turns_warnings_into_errors(layouts: dict[str, Layout]) -> None:
    """What the docs recommend works from the command line; the category form cannot."""
    namespace, _ = an_affected_namespace(layouts)
    proc = run_child(
        "activation:import_with_renamed_target",
        {"namespace": namespace},
        python_args=("-W", "error:fsdp-shim"),
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert "FSDPShimWarning: fsdp-shim: cannot patch" in proc.stderr
    category = run_child(
        "activation:import_with_renamed_target",
        {"namespace": namespace},
        python_args=("-W", "error::fsdp_shim.FSDPShimWarning"),
    )
    assert "Invalid -W option ignored: invalid module name: 'fsdp_shim'" in category.stderr


@pytest.mark.release_independent
def test_an_internal_error_never_reaches_the_users_import(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts)
    result = child("with_broken_patch", {"namespace": namespace})
    assert result["wrappers"] == []
    assert result["warnings"] and all("simulated bug" in w for w in result["warnings"])
    strict = run_child(
        "activation:with_broken_patch",
        {"namespace": namespace},
        env=clean_env(FSDP_SHIM_STRICT="true"),
        expect_ok=False,
    )
    assert strict.returncode != 0 and "FSDPShimError: fsdp-shim: internal error while patching" in strict.stderr


@pytest.mark.release_independent
@pytest.mark.parametrize(
    ("env", "set_in_script", "expect_patched"),
    [
        ({"FSDP_SHIM": " OFF "}, None, False),  # the parsing itself is unit-tested in test_toggles
        ({"FSDP_SHIM": "disabled"}, None, False),
        ({}, "no", False),  # set in the script after `import fsdp_shim`, before Lightning
        ({"FSDP_SHIM": "maybe"}, None, False),  # unreadable kill switch: fails closed
        ({"FSDP_SHIM": "yes"}, None, True),
    ],
    ids=["env-OFF", "env-disabled", "script-no", "env-invalid", "env-yes"],
)
def test_the_environment_toggle(
    env: dict, set_in_script: str | None, expect_patched: bool, layouts: dict[str, Layout]
) -> None:
    namespace, _ = an_affected_namespace(layouts)
    result = child("toggle", {"namespace": namespace, "set_in_script": set_in_script}, **env)
    assert bool(result["wrappers"]) is expect_patched
    if env.get("FSDP_SHIM") == "maybe":
        assert len(result["warnings"]) == 1
        assert "FSDP_SHIM='maybe' is not a valid value and switched the shim OFF" in result["warnings"][0]
        assert result["locations"] == [result["expected_location"]]  # the `import fsdp_shim` line
    else:
        assert result["warnings"] == []
    if not expect_patched:
        assert "switched off by FSDP_SHIM" in result["status"][namespace]["reason"]


@pytest.mark.release_independent
@pytest.mark.parametrize("rank", ["0", "1"])
def test_one_info_line_per_patched_namespace_on_rank_zero_only(rank: str, layouts: dict[str, Layout]) -> None:
    proc = run_child("activation:log_lines", env=clean_env(RANK=rank), python_args=("-W", "ignore"))
    info = [line for line in proc.stdout.splitlines() if line.startswith("fsdp_shim INFO")]
    debug = [line for line in proc.stdout.splitlines() if line.startswith("fsdp_shim DEBUG")]
    versions = installed_versions(layouts)
    affected = [ns for ns, v in versions.items() if is_affected_release(v)]
    if rank == "1":
        assert info == []
    else:
        assert len(info) == len(affected)
        for ns in affected:
            assert sum(f"patched {ns} {versions[ns]}" in line for line in info) == 1
    assert len(debug) == len(versions) - len(affected)


@pytest.mark.release_independent
def test_a_call_that_falls_back_is_reported_and_status_stops_saying_patched(layouts: dict[str, Layout]) -> None:
    """A Lightning attribute the wrapper reads went missing at call time."""
    namespace, _ = an_affected_namespace(layouts)
    result = child("glue_fallback", {"namespace": namespace})
    assert result["dtypes"] == ["torch.float32", "torch.float32"]  # Lightning's own (identity) behaviour
    assert len(result["warnings"]) == 1
    assert "could not read what it needs" in result["warnings"][0]
    assert result["warnings"][0].endswith(
        "Lightning's own method was used for this call, so this model was not converted"
    )
    assert result["status"]["patched"] is False
    assert "fell back to Lightning's own method at call time" in result["status"]["reason"]
    assert result["healthy_plugin_dtype"] == "torch.bfloat16"  # other plugins still convert


@pytest.mark.release_independent
def test_strict_glue_error_does_not_claim_to_fall_back(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts)
    result = child("glue_fallback", {"namespace": namespace}, FSDP_SHIM_STRICT="1")
    assert result["dtypes"] == [] and len(result["errors"]) == 2
    assert result["errors"][0].endswith("(FSDP_SHIM_STRICT is on)")
    assert "fall" not in result["errors"][0] and "was used" not in result["errors"][0]


@pytest.mark.release_independent
def test_late_activation_warns_about_models_fsdp_already_wrapped(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts, "trainer")
    result = child("late_activation", {"namespace": namespace}, PYTHONWARNINGS="ignore")
    assert result["late"] is True and result["patched"] is True
    assert len(result["warnings"]) == 1
    assert "already set up 1 FSDP model" in result["warnings"][0] and "next setup" in result["warnings"][0]
    assert (result["before"], result["after"]) == ("torch.float32", "torch.bfloat16")


def test_a_reloaded_shim_takes_over_its_wrappers_and_still_restores_exactly(layouts: dict[str, Layout]) -> None:
    result = child("reload_and_deactivate")
    assert result["patched_keys"] == all_expected_wrappers(layouts)
    assert result["changed_by_reload"] == []
    assert all(count <= 1 for count in result["layers"].values())
    for namespace, version in installed_versions(layouts).items():
        assert result["status_after_reload"][namespace]["patched"] is is_affected_release(version)
    assert result["final"] == []


@pytest.mark.release_independent
@pytest.mark.parametrize(
    ("precisions", "rank", "expected"),
    [(["16-true"], "0", 1), (["16-true"], "1", 0), (["bf16-true", "32-true"], "0", 0)],
    ids=["16-true-rank0", "16-true-rank1", "bf16-true"],
)
def test_casting_to_float16_warns_once_per_process_on_rank_zero(
    precisions: list[str], rank: str, expected: int, layouts: dict[str, Layout]
) -> None:
    """16-true now keeps float16 weights and optimizer state; a job that trained in
    float32 unpatched can produce NaN. One WARNING per process, where Lightning logs, pointing at the docs."""
    namespace, _ = an_affected_namespace(layouts)
    proc = run_child(
        "activation:convert_with",
        {"namespace": namespace, "precisions": precisions},
        env=clean_env(RANK=rank),
        python_args=QUIET,
    )
    notices = [line for line in proc.stderr.splitlines() if "precision='16-true' now keeps" in line]
    assert len(notices) == expected, proc.stderr
    if notices:
        assert "AdamW's default eps=1e-8 is 0 in float16" in notices[0] and "docs/numerics.md" in notices[0]
