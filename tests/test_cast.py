"""The cast fix, with real FSDP (gloo, CPU) through Lightning's own Trainer and Fabric, 1 and 2 processes.

Numbers are compared with other runs of the same program: the shim off, plain PyTorch FSDP on the layers cast
to the precision's dtype, or a Lightning that has the fix; which release gets what is the literal table of
``children/classes.py``. Then Lightning 2.5.0's own ``convert_module`` cases, and two model shapes: #20239
(bfloat16 and float32 layers in one model), which the cast fixes, and BatchNorm, which it must not break.
"""

from __future__ import annotations

import json

import pytest
from children.classes import STATES
from conftest import BYTE_KEYS, DTYPES, NAMESPACES, Layout, OncePerRun, Scenarios, code_json, layout_or_skip

pytestmark = pytest.mark.per_release


def cast(version: str) -> str:
    """``patched`` (2.1-2.4), ``built in`` (2.5+) or ``not affected`` (2.0.x): the literal table."""
    return STATES[version][0]


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
TWO_PROCESS_RELEASES = {"2.1.4", "2.4.0"}
"""Where two processes run: the last release of each affected line whose cast wraps other methods (2.1.x,
which also wraps ``connect`` and ``setup``; 2.2-2.4). The others between share their code and targets."""


def cases_for(api: str, version: str) -> list[str]:
    if cast(version) == "not affected":
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
    if cast(version) != "patched":
        for rank in on:
            assert_untouched(off[rank], on[rank])
    if cast(version) == "not affected":
        return
    reference = scenarios.run("torch", layout.package, "off", reference_cases(cases), devices=devices)
    for rank in on:
        if cast(version) == "patched":
            assert on[rank]["_shim"][f"{api}_convert_module"] is True
        for case in cases:
            if cast(version) == "patched":
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
    if cast(version) != "patched":
        pytest.skip("the shim changes nothing on this release: test_single_process_behaves_like_2_5 shows it")
    if version not in TWO_PROCESS_RELEASES:
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


def test_the_2_1_trainer_gets_the_setup_path(layouts: dict[str, Layout], scenarios: Scenarios) -> None:
    """On 2.1.x the method alone is not enough (DESIGN-FACTS): connect and setup are wrapped too,
    and only there."""
    for layout in layouts.values():
        cases = cases_for("trainer", layout.trainer_version)
        on = scenarios.run("trainer", layout.package, "before", cases)[0]["_shim"]
        expected = layout.trainer_version in ("2.1.0", "2.1.4")
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
    affected = [p for p, v in versions.items() if cast(v) == "patched"]
    fixed = [p for p, v in versions.items() if cast(v) == "built in"]
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


def since_2_1(layouts: dict[str, Layout]) -> dict[str, str]:
    """Every installed namespace with the "true" precisions (2.1 and later), and its release."""
    return {
        namespace: version
        for package, layout in layouts.items()
        for namespace, version in zip(NAMESPACES[package], (layout.trainer_version, layout.fabric_version))
        if cast(version) != "not affected"
    }


@pytest.fixture(scope="session")
def converted(layouts: dict[str, Layout], once_per_run: OncePerRun) -> dict[str, dict[str, list]]:
    code = f"""
        import json, torch
        import fsdp_shim
        from children.classes import precision_class

        out = {{}}
        for namespace in {sorted(since_2_1(layouts))!r}:
            out[namespace] = {{}}
            for precision, _ in {CONVERT_CASES!r}:
                layer = torch.nn.Linear(2, 2)
                before = [str(layer.weight.dtype), str(layer.bias.dtype)]
                result = precision_class(namespace)(precision=precision).convert_module(layer)
                out[namespace][precision] = [*before, str(result.weight.dtype), str(result.bias.dtype), result is layer]
        print(json.dumps(out))
    """
    return once_per_run.get(json.dumps(["convert_all", code]), lambda: code_json(code, python_args=("-W", "ignore")))


@pytest.mark.parametrize(("precision", "expected_dtype"), CONVERT_CASES)
@pytest.mark.parametrize(
    "namespace", ["lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"]
)
def test_lightning_2_5_convert_module(namespace: str, precision: str, expected_dtype: str, converted: dict) -> None:
    """Lightning 2.5.0's own ``test_convert_module`` cases: with the shim they hold on every release from 2.1."""
    if namespace not in converted:
        pytest.skip(f"{namespace} (2.1 or later) is not installed")
    assert converted[namespace][precision] == ["torch.float32"] * 2 + [expected_dtype] * 2 + [True]


# ----------------------------------------------------------------------------- model shapes
SHAPES = [("mixed", False), ("batchnorm", True), ("batchnorm", False)]
FIT = """
    import importlib, json, sys
    import torch
    from torch import nn
    from _fsdp_shim.verify import cpu_guards

    def fit(namespace, shape, auto_wrap):
        \"\"\"Two steps of bf16-true FSDP through the Trainer or Fabric: the parameters' dtypes, or the error.\"\"\"
        importlib.import_module(namespace)
        cpu_guards.lift(namespace)

        def model():
            torch.manual_seed(0)
            if shape == "batchnorm":
                return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
            return nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))  # #20239

        policy = {"auto_wrap_policy": {nn.Linear, nn.BatchNorm1d}} if auto_wrap else {}
        strategy = importlib.import_module(namespace + ".strategies").FSDPStrategy(**policy)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        try:
            if namespace in ("lightning.fabric", "lightning_fabric"):
                fabric = sys.modules[namespace].Fabric(
                    accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true"
                )
                fabric.launch()
                wrapped = fabric.setup_module(model())
                optimizer = fabric.setup_optimizers(torch.optim.SGD(wrapped.parameters(), lr=0.1))
                for batch in x.split(8):
                    fabric.backward(wrapped(batch).float().pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                pl = sys.modules[namespace]

                class Model(pl.LightningModule):
                    def __init__(self):
                        super().__init__()
                        self.net = model()

                    def training_step(self, batch, batch_idx):
                        return self.net(batch[0]).float().pow(2).mean()

                    def configure_optimizers(self):
                        return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)

                trainer = pl.Trainer(
                    accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true", max_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                )
                trainer.fit(Model(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8))
                wrapped = trainer.strategy.model
        except Exception as error:
            return {"error": f"{type(error).__name__}: {error}"}
        dtypes = {name: str(p.dtype) for name, p in wrapped.named_parameters()}
        norm = {name: dtype for name, dtype in dtypes.items() if ".1." in f".{name}."}  # the layer at index 1
        return {"error": None, "dtypes": sorted(set(dtypes.values())), "batchnorm": sorted(set(norm.values()))}

    IMPORT_SHIM
    print(json.dumps([fit(*run) for run in RUNS]))
"""


@pytest.fixture(scope="session")  # a module fixture is set up again when xdist runs another file in between
def shape_runs(layouts: dict[str, Layout], once_per_run: OncePerRun) -> dict[tuple[str, str, bool], dict[str, dict]]:
    """Per namespace from 2.1 on and per shape, the run without the shim and with it: one interpreter per layout
    and shim state trains them all, once in the test run."""
    runs: dict[tuple[str, str, bool], dict[str, dict]] = {}
    for package in layouts:
        namespaces = [ns for ns in NAMESPACES[package] if ns in since_2_1(layouts)]
        requested = [(namespace, shape, auto_wrap) for namespace in namespaces for shape, auto_wrap in SHAPES]
        for shim in ("off", "on"):
            code = FIT.replace("RUNS", repr(requested)).replace(
                "IMPORT_SHIM", "import fsdp_shim" if shim == "on" else ""
            )
            results = once_per_run.get(
                json.dumps(["fit_all", code]), lambda code=code: code_json(code, python_args=("-W", "ignore"))
            )
            for run, result in zip(requested, results, strict=True):
                runs.setdefault(run, {})[shim] = result
    return runs


def runs_of(shape_runs: dict, shape: str, auto_wrap: bool) -> dict[str, dict[str, dict]]:
    """Namespace -> {"off": run, "on": run} for one shape; the test is skipped before Lightning 2.1."""
    found = {ns: runs for (ns, s, a), runs in shape_runs.items() if (s, a) == (shape, auto_wrap)}
    if not found:
        pytest.skip("needs Lightning 2.1 or later")
    return found


def test_a_model_holding_bfloat16_and_float32_layers_trains(layouts: dict[str, Layout], shape_runs: dict) -> None:
    """Lightning #20239: FSDP refuses a flat parameter of mixed dtypes; the cast gives every layer the precision's
    dtype first, as 2.5.0 does, so such a model trains with the shim on every release it casts."""
    versions = since_2_1(layouts)
    for namespace, runs in runs_of(shape_runs, "mixed", auto_wrap=False).items():
        if cast(versions[namespace]) == "patched":
            assert "Must flatten tensors with uniform dtype" in (runs["off"]["error"] or ""), (namespace, runs["off"])
        assert runs["on"] == {"error": None, "dtypes": ["torch.bfloat16"], "batchnorm": ["torch.bfloat16"]}, namespace


@pytest.mark.parametrize("auto_wrap", [True, False], ids=["auto-wrap-policy", "one-unit"])
def test_batchnorm_trains_where_it_trained_before(
    auto_wrap: bool, layouts: dict[str, Layout], shape_runs: dict
) -> None:
    """Under an auto-wrap policy FSDP runs BatchNorm in a unit of its own in float32: the shim leaves its weights
    float32 there (unpatched 2.1-2.4 trained so; 2.5+ casts them and fails, as shipped). Without a policy it
    shares the root's flat parameter: bfloat16, as on 2.5+."""
    versions = since_2_1(layouts)
    for namespace, runs in runs_of(shape_runs, "batchnorm", auto_wrap).items():
        if cast(versions[namespace]) == "patched":
            assert runs["off"]["error"] is None, (namespace, runs["off"])
            norm = ["torch.float32"] if auto_wrap else ["torch.bfloat16"]
            dtypes = sorted({"torch.bfloat16", *norm})
            assert runs["on"] == {"error": None, "dtypes": dtypes, "batchnorm": norm}, namespace
        elif auto_wrap:  # Lightning 2.5+ as shipped, shim or not (the shim does not cast there)
            for shim in ("off", "on"):
                assert "expect parameter to have scalar type of Float" in (runs[shim]["error"] or ""), runs[shim]
