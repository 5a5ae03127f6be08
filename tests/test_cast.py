"""The cast fix, with real FSDP (gloo, CPU) through Lightning's own Trainer and Fabric, 1 and 2 processes.

Every expectation is derived from another run of the same program: the shim switched off, plain
PyTorch FSDP on the same layers cast to the precision's dtype, or a Lightning that has the fix. On
an affected release the shim must match plain PyTorch (which is what 2.5.0+ gives, checked on the
fixed layouts by the same assertions) and halve the unpatched run's bytes for "bf16-true" and
"16-true"; on any other release the cast must change nothing at all. Then Lightning 2.5.0's own
``convert_module`` tests, and two model shapes: #20239 (bfloat16 and float32 layers in one model),
which the cast fixes, and BatchNorm under an auto-wrap policy, which it must not break.
"""

from __future__ import annotations

import json

import pytest
from conftest import (
    BYTE_KEYS,
    DTYPES,
    NAMESPACES,
    Layout,
    OncePerRun,
    Scenarios,
    child_json,
    installed_versions,
    is_fixed_release,
    layout_or_skip,
)

from _fsdp_shim.config import CAST, base_release
from _fsdp_shim.fixes import converts_only_in_connect

FIRST_AFFECTED = CAST.first_affected
is_affected_release = CAST.affects
pytestmark = pytest.mark.per_release

TRAINER_CASES = [
    "init:bf16-true",
    "pretrained:bf16-true",
    "init+pretrained:bf16-true",
    "setup_hook:bf16-true",
    "seed:bf16-true",
    "init+pretrained:16-true",
    "init:32-true",
    "float64:32-true",
]
FABRIC_CASES = [
    "init:bf16-true",
    "pretrained:bf16-true",
    "init+pretrained:bf16-true",
    "init+pretrained:16-true",
    "float64:32-true",
]
# Lightning 2.0.x rejects "true" half precisions and fails on float64 layers without the conversion.
CASES_2_0 = ["init:32-true"]
TWO_PROCESS_CASE = "init+pretrained:bf16-true"
TWO_PROCESS_RELEASES = {(2, 1, 4), (2, 4, 0)}
"""Where two processes run: the last release of each affected line whose cast wraps other methods (2.1.x,
which also wraps ``connect`` and ``setup``; 2.2-2.4). The others between share their code and targets."""


def cases_for(api: str, version: str) -> list[str]:
    release = base_release(version)
    if release is not None and release < FIRST_AFFECTED:
        return CASES_2_0
    return TRAINER_CASES if api == "trainer" else FABRIC_CASES


def reference_cases(cases: list[str]) -> list[str]:
    """The cases of the one-process plain-PyTorch reference: every case from 2.1.0 on, whatever the API
    asked for (the reference has no API), so one run serves all tests of a layout in a worker's cache."""
    return cases if cases == CASES_2_0 else TRAINER_CASES


def measurements(result: dict) -> dict:
    return {key: result[key] for key in ("flat_param_dtypes", "flat_param_numel", *BYTE_KEYS)}


def assert_untouched(off: dict, on: dict) -> None:
    """Shim on and shim off gave identical results, and no class carries a shim wrapper."""
    assert not any(on["_shim"].values()), on["_shim"]
    for case in off:
        if not case.startswith("_"):
            assert on[case] == off[case], case


def assert_like_2_5(case: str, off: dict, on: dict, reference: dict) -> None:
    kind, precision = case.split(":")
    assert on["flat_param_dtypes"] == [DTYPES[precision]], case
    assert measurements(on) == measurements(reference), case
    if "module_dtype" in on:  # LightningModule.dtype (Trainer)
        assert on["module_dtype"] == DTYPES[precision], case
        assert off["module_dtype"] == "torch.float32", case
    if kind == "seed":
        # Built under the precision's init context: already half on the affected release; only
        # LightningModule.dtype was wrong. Bytes must be unchanged.
        assert measurements(off) == measurements(on), case
    elif precision in ("bf16-true", "16-true"):
        assert off["flat_param_dtypes"] == ["torch.float32"], case
        for key in BYTE_KEYS:
            assert off[key] == 2 * on[key], (case, key)
    elif kind == "float64":
        assert off["flat_param_dtypes"] == ["torch.float64"], case
        for key in BYTE_KEYS:
            assert off[key] == 2 * on[key], (case, key)
    else:  # fp32 layers under "32-true": nothing to convert
        assert measurements(off) == measurements(on), case


def check_layout(api: str, layout: Layout, scenarios: Scenarios, devices: int, cases: list[str]) -> None:
    version = layout.version(api)
    off = scenarios.run(api, layout.package, "off", cases, devices=devices)
    on = scenarios.run(api, layout.package, "before", cases, devices=devices)
    if not is_affected_release(version):
        for rank in on:
            assert_untouched(off[rank], on[rank])
    if base_release(version) < FIRST_AFFECTED:
        return
    reference = scenarios.run("torch", layout.package, "off", reference_cases(cases), devices=devices)
    for rank in on:
        if is_affected_release(version):
            assert on[rank]["_shim"][f"{api}_convert_module"] is True
        for case in cases:
            if is_affected_release(version):
                assert_like_2_5(case, off[rank][case], on[rank][case], reference[rank][case])
            else:  # a fixed release, untouched, already equals plain PyTorch
                assert measurements(on[rank][case]) == measurements(reference[rank][case]), case


@pytest.mark.parametrize("api", ["trainer", "fabric"])
@pytest.mark.parametrize("package", ["lightning", "standalone"])
def test_single_process_behaves_like_2_5(
    api: str, package: str, layouts: dict[str, Layout], scenarios: Scenarios
) -> None:
    layout = layout_or_skip(layouts, package)
    check_layout(api, layout, scenarios, 1, cases_for(api, layout.version(api)))


@pytest.mark.parametrize("api", ["trainer", "fabric"])
@pytest.mark.parametrize("package", ["lightning", "standalone"])
def test_two_processes_behave_like_2_5(
    api: str, package: str, layouts: dict[str, Layout], scenarios: Scenarios
) -> None:
    """Lightning's own launcher re-runs the script per rank; each rank holds half the flat params.

    On affected releases only (``TWO_PROCESS_RELEASES``): on the others the ranks run Lightning's own code,
    and the single-process test already shows, per API, that the shim changes nothing there. The unpatched
    comparison runs for the Trainer.
    """
    layout = layout_or_skip(layouts, package)
    version = layout.version(api)
    if not is_affected_release(version):
        pytest.skip("the shim changes nothing on this release: test_single_process_behaves_like_2_5 shows it")
    if base_release(version) not in TWO_PROCESS_RELEASES:
        pytest.skip(f"runs on {sorted(TWO_PROCESS_RELEASES)}, whose code and targets this release shares")
    case = TWO_PROCESS_CASE
    on = scenarios.run(api, package, "before", [case], devices=2)
    reference = scenarios.run("torch", package, "off", [case], devices=2)  # the same for Trainer and Fabric
    single = scenarios.run("torch", package, "off", reference_cases([case]))[0][case]
    assert sum(on[rank][case]["flat_param_numel"] for rank in on) == single["flat_param_numel"]
    assert on[0][case]["flat_param_numel"] == on[1][case]["flat_param_numel"] == single["flat_param_numel"] // 2
    off = scenarios.run(api, package, "off", [case], devices=2) if api == "trainer" else None
    for rank in (0, 1):
        assert on[rank]["_shim"][f"{api}_convert_module"] is True
        assert measurements(on[rank][case]) == measurements(reference[rank][case])
        assert on[rank][case]["flat_param_dtypes"] == ["torch.bfloat16"]
        if off is not None:
            assert_like_2_5(case, off[rank][case], on[rank][case], reference[rank][case])


@pytest.mark.parametrize("package", ["lightning", "standalone"])
def test_import_after_lightning_gives_the_same_result(
    package: str, layouts: dict[str, Layout], scenarios: Scenarios
) -> None:
    layout = layout_or_skip(layouts, package)
    cases = cases_for("trainer", layout.trainer_version)
    before = scenarios.run("trainer", package, "before", cases)[0]
    after = scenarios.run("trainer", package, "after", cases)[0]
    assert after == before


@pytest.mark.parametrize("package", ["lightning", "standalone"])
def test_checkpoint_resume_keeps_dtypes_and_step(
    package: str, layouts: dict[str, Layout], scenarios: Scenarios, tmp_path
) -> None:
    layout = layout_or_skip(layouts, package)
    if base_release(layout.trainer_version) < FIRST_AFFECTED:
        pytest.skip("no 'true' precisions for FSDP before Lightning 2.1")
    case = TWO_PROCESS_CASE
    run = scenarios.run("trainer", package, "before", [case], extra=("--checkpoint-dir", str(tmp_path)))[0][case]
    resumed = run["resumed"]
    assert run["global_step"] == 2
    assert resumed["global_step"] == 4
    assert resumed["module_dtype"] == run["module_dtype"] == "torch.bfloat16"
    assert measurements(resumed) == measurements(run)


def test_the_2_1_trainer_gets_the_setup_path(layouts: dict[str, Layout], scenarios: Scenarios) -> None:
    """On 2.1.x the method alone is not enough (DESIGN-FACTS): connect and setup are wrapped too,
    and only there."""
    for layout in layouts.values():
        cases = cases_for("trainer", layout.trainer_version)
        on = scenarios.run("trainer", layout.package, "before", cases)[0]["_shim"]
        expected = is_affected_release(layout.trainer_version) and converts_only_in_connect(layout.trainer_version)
        assert on["trainer_setup"] is expected
        assert on["trainer_connect"] is expected


@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_patched_release_equals_the_fixed_release_next_to_it(
    api: str, layouts: dict[str, Layout], scenarios: Scenarios
) -> None:
    """Where an affected layout sits next to a fixed one (what `pip install lightning==2.4.0` creates,
    and the 2.1.0/2.5.0 session), the same program through the patched `lightning` and through the fixed
    `pytorch_lightning` gives the same dtypes and bytes."""
    if not {"lightning", "standalone"} <= set(layouts):
        pytest.skip("needs both layouts")
    versions = {package: layouts[package].version(api) for package in ("lightning", "standalone")}
    affected = [p for p, v in versions.items() if is_affected_release(v)]
    fixed = [p for p, v in versions.items() if is_fixed_release(v)]
    if not (affected and fixed):
        pytest.skip(f"needs one affected and one fixed layout, have {versions}")
    # "seed" builds each release's own demo Transformer, whose size changed between 2.1 and 2.4.
    cases = [case for case in cases_for(api, versions[affected[0]]) if not case.startswith("seed:")]
    patched = scenarios.run(api, affected[0], "before", cases)[0]
    upstream = scenarios.run(api, fixed[0], "off", cases)[0]
    for case in cases:
        assert measurements(patched[case]) == measurements(upstream[case]), case
        assert patched[case].get("module_dtype") == upstream[case].get("module_dtype"), case


# ----------------------------------------------------------------------------- Lightning's own tests
CONVERT_CASES = [
    ("32-true", "torch.float32"),
    ("bf16-mixed", "torch.float32"),
    ("16-mixed", "torch.float32"),
    ("bf16-true", "torch.bfloat16"),
    ("16-true", "torch.float16"),
]


@pytest.fixture(scope="session")
def converted(layouts: dict[str, Layout], once_per_run: OncePerRun) -> dict[str, dict[str, list[str]]]:
    namespaces = [
        ns
        for package, layout in layouts.items()
        for ns, version in zip(NAMESPACES[package], (layout.trainer_version, layout.fabric_version))
        if base_release(version) >= FIRST_AFFECTED
    ]
    arguments = {"namespaces": namespaces, "precisions": [p for p, _ in CONVERT_CASES]}
    return once_per_run.get(
        json.dumps(["convert_all", arguments]),
        lambda: child_json("convert_module:convert_all", arguments, python_args=("-W", "ignore")),
    )


@pytest.mark.parametrize(("precision", "expected_dtype"), CONVERT_CASES)
@pytest.mark.parametrize(
    "namespace", ["lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"]
)
def test_lightning_2_5_convert_module(namespace: str, precision: str, expected_dtype: str, converted: dict) -> None:
    """Lightning 2.5.0's own ``test_convert_module`` cases, rewritten as ours: with the shim active they
    hold on every release from 2.1.0 on, affected ones included (2.1.0's Trainer class is
    ``FSDPPrecisionPlugin``)."""
    if namespace not in converted:
        pytest.skip(f"{namespace} (2.1 or later) is not installed")
    weight_before, bias_before, weight_after, bias_after, same_object = converted[namespace][precision]
    assert weight_before == bias_before == "torch.float32"
    assert weight_after == bias_after == expected_dtype
    assert same_object is True  # Module.to converts in place, as in 2.5.0


# ----------------------------------------------------------------------------- model shapes
SHAPES = [("mixed", False), ("batchnorm", True), ("batchnorm", False)]


@pytest.fixture(scope="session")  # a module fixture is set up again when xdist runs another file in between
def shape_runs(layouts: dict[str, Layout], once_per_run: OncePerRun) -> dict[tuple[str, str, bool], dict[str, dict]]:
    """Per installed namespace from 2.1.0 on and per shape: the run without the shim and the run with
    it. One interpreter per layout and shim state trains them all (``children.cast:fit_all``), once in
    the test run."""
    runs: dict[tuple[str, str, bool], dict[str, dict]] = {}
    for package, layout in layouts.items():
        namespaces = [
            namespace
            for namespace, version in zip(NAMESPACES[package], (layout.trainer_version, layout.fabric_version))
            if base_release(version) >= FIRST_AFFECTED
        ]
        requested = [(namespace, shape, auto_wrap) for namespace in namespaces for shape, auto_wrap in SHAPES]
        for shim in ("off", "on"):
            arguments = {"runs": requested, "import_shim": shim == "on"}
            results = once_per_run.get(
                json.dumps(["fit_all", arguments]),
                lambda arguments=arguments: child_json("cast:fit_all", arguments, python_args=("-W", "ignore")),
            )
            for run, result in zip(requested, results, strict=True):
                runs.setdefault(run, {})[shim] = result
    return runs


def runs_of(shape_runs: dict, layouts: dict[str, Layout], shape: str, auto_wrap: bool) -> dict[str, dict[str, dict]]:
    """Namespace -> {"off": run, "on": run} for one shape; the test is skipped before Lightning 2.1."""
    found = {ns: runs for (ns, s, a), runs in shape_runs.items() if (s, a) == (shape, auto_wrap)}
    if not found:
        pytest.skip("needs Lightning 2.1 or later")
    return found


def test_a_model_holding_bfloat16_and_float32_layers_trains(layouts: dict[str, Layout], shape_runs: dict) -> None:
    """Lightning #20239: FSDP refuses a flat parameter of mixed dtypes ("Must flatten tensors with
    uniform dtype"). The cast gives every layer the precision's dtype first, as 2.5.0 does, so such a
    model trains with the shim on every release it casts, and on a fixed release as it is."""
    for namespace, runs in runs_of(shape_runs, layouts, "mixed", auto_wrap=False).items():
        version = installed_versions(layouts)[namespace]
        if is_affected_release(version):
            assert "Must flatten tensors with uniform dtype" in (runs["off"]["error"] or ""), (namespace, runs["off"])
        assert runs["on"]["error"] is None, (namespace, runs["on"])
        assert runs["on"]["dtypes"] == ["torch.bfloat16"], namespace


@pytest.mark.parametrize("auto_wrap", [True, False], ids=["auto-wrap-policy", "one-unit"])
def test_batchnorm_trains_where_it_trained_before(
    auto_wrap: bool, layouts: dict[str, Layout], shape_runs: dict
) -> None:
    """Under an auto-wrap policy FSDP runs BatchNorm in a unit of its own in float32: the shim leaves
    its weights float32 there (unpatched 2.1-2.4 trained so; 2.5+ casts them and fails, which the
    fixed releases show as they are). Without a policy it shares the root's flat parameter: bfloat16,
    as on 2.5+."""
    for namespace, runs in runs_of(shape_runs, layouts, "batchnorm", auto_wrap).items():
        version = installed_versions(layouts)[namespace]
        if is_affected_release(version):
            assert runs["off"]["error"] is None, (namespace, runs["off"])
            assert runs["on"]["error"] is None, (namespace, runs["on"])
            expected = ["torch.float32"] if auto_wrap else ["torch.bfloat16"]
            assert runs["on"]["batchnorm"] == expected, (namespace, runs["on"])
            assert runs["on"]["dtypes"] == sorted({"torch.bfloat16", *expected}), (namespace, runs["on"])
        elif auto_wrap:  # Lightning 2.5+ as shipped, shim or not (the shim does not cast there)
            for shim in ("off", "on"):
                assert "expect parameter to have scalar type of Float" in (runs[shim]["error"] or ""), runs[shim]
