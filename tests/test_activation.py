"""activate / deactivate / status, gates, toggles, failure isolation and import order, each in a
fresh interpreter with real Lightning."""

from __future__ import annotations

import pytest
from conftest import NAMESPACES, Layout, clean_env, last_json, run_python

from fsdp_shim.versions import base_release, converts_only_in_connect, is_affected_release

ALL_NAMESPACES = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")

# Helpers pasted into each child: they read the classes directly, never the shim's bookkeeping.
PRELUDE = '''
import importlib, json, os, sys, warnings
MISSING = "<missing>"
# 2.0.x's Trainer class is FSDPMixedPrecisionPlugin; it is snapshotted too, to prove it is untouched.
TARGETS = (("plugins.precision.fsdp", ("FSDPPrecision", "FSDPPrecisionPlugin", "FSDPMixedPrecisionPlugin"), ("convert_module",)),
           ("strategies.fsdp", ("FSDPStrategy",), ("setup", "connect")))

def snapshot():
    """Every class attribute the shim could touch, as the objects themselves."""
    out = {}
    for ns in %r:
        if ns not in sys.modules:
            continue
        for module, classes, attributes in TARGETS:
            mod = importlib.import_module(ns + "." + module)
            cls = next((c for c in (getattr(mod, name, None) for name in classes) if isinstance(c, type)), None)
            for attribute in attributes if cls is not None else ():
                out[ns + ":" + cls.__name__ + "." + attribute] = cls.__dict__.get(attribute, MISSING)
    return out

def changed(before, after):
    return sorted(key for key in set(before) | set(after) if before.get(key) is not after.get(key))

def wrappers():
    from fsdp_shim.patching import is_shim_wrapper
    return sorted(key for key, obj in snapshot().items() if is_shim_wrapper(obj))

def statuses():
    import fsdp_shim
    return {s.namespace: s.as_dict() for s in fsdp_shim.status().namespaces}
''' % (ALL_NAMESPACES,)


def child(body: str, **env: str | None) -> dict:
    return last_json(run_python(PRELUDE + body, env=clean_env(**env), args=("-W", "ignore::DeprecationWarning")))


def installed_versions(layouts: dict[str, Layout]) -> dict[str, str]:
    versions = {}
    for package, layout in layouts.items():
        trainer, fabric = NAMESPACES[package]
        versions[trainer] = layout.trainer_version
        versions[fabric] = layout.fabric_version
    return versions


def expected_wrappers(namespace: str, version: str) -> list[str]:
    if not is_affected_release(version):
        return []
    trainer = namespace in ("lightning.pytorch", "pytorch_lightning")
    # 2.1.0 names the Trainer's class FSDPPrecisionPlugin; 2.1.1 renamed it.
    precision = "FSDPPrecisionPlugin" if trainer and base_release(version) == (2, 1, 0) else "FSDPPrecision"
    keys = [f"{namespace}:{precision}.convert_module"]
    if trainer and converts_only_in_connect(version):
        keys += [f"{namespace}:FSDPStrategy.connect", f"{namespace}:FSDPStrategy.setup"]
    return sorted(keys)


def all_expected_wrappers(layouts: dict[str, Layout]) -> list[str]:
    return sorted(k for ns, v in installed_versions(layouts).items() for k in expected_wrappers(ns, v))


def an_affected_namespace(layouts: dict[str, Layout]) -> tuple[str, str]:
    for namespace, version in installed_versions(layouts).items():
        if is_affected_release(version):
            return namespace, version
    pytest.skip("no affected Lightning release is installed in this environment")


IMPORT_ALL = "\nfor name in ('lightning', 'pytorch_lightning', 'lightning_fabric'):\n    try:\n        importlib.import_module(name)\n    except ImportError:\n        pass\n"


def test_import_needs_neither_torch_nor_lightning() -> None:
    result = child(
        """
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "lightning", "pytorch_lightning", "lightning_fabric"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import fsdp_shim
# The patching code (packaging, logging, the wrappers) waits for Lightning's import.
loaded = sorted(m for m in ("torch", "lightning", "packaging", "fsdp_shim.integration") if m in sys.modules)
status = fsdp_shim.status()
print(json.dumps({"loaded": loaded, "active": status.active, "version": fsdp_shim.__version__,
                  "after_status": sorted(m for m in ("torch", "lightning") if m in sys.modules)}))
"""
    )
    assert result["loaded"] == []
    assert result["after_status"] == []
    assert result["active"] is True
    assert result["version"]


def test_activate_many_times_installs_one_layer(layouts: dict[str, Layout]) -> None:
    result = child(
        "import fsdp_shim"
        + IMPORT_ALL
        + """
from fsdp_shim.patching import is_shim_wrapper
first = snapshot()
for _ in range(5):
    fsdp_shim.activate()
after = snapshot()
nested = [k for k, obj in after.items() if is_shim_wrapper(obj) and is_shim_wrapper(obj.__wrapped__)]
print(json.dumps({"changed": changed(first, after), "nested": nested, "wrappers": wrappers()}))
"""
    )
    assert result["changed"] == []
    assert result["nested"] == []
    expected = all_expected_wrappers(layouts)
    assert result["wrappers"] == expected


def test_deactivate_puts_back_the_identical_objects(layouts: dict[str, Layout]) -> None:
    result = child(
        IMPORT_ALL
        + """
pristine = snapshot()
import fsdp_shim
patched = changed(pristine, snapshot())
fsdp_shim.deactivate()
restored = changed(pristine, snapshot())
fsdp_shim.activate()
repatched = changed(pristine, snapshot())
fsdp_shim.deactivate()
inherits = {}
for ns in ("lightning.pytorch", "pytorch_lightning"):
    if ns in sys.modules:
        fsdp = importlib.import_module(ns + ".plugins.precision.fsdp")
        cls = getattr(fsdp, "FSDPPrecision", None) or getattr(fsdp, "FSDPPrecisionPlugin", None)
        if cls is None:  # 2.0.x: no true-precision FSDP plugin at all
            continue
        if "convert_module" in cls.__dict__:  # fixed upstream: its own method, never ours
            from fsdp_shim.patching import is_shim_wrapper
            inherits[ns] = not is_shim_wrapper(cls.__dict__["convert_module"])
            continue
        base = next(b for b in cls.__mro__[1:] if "convert_module" in b.__dict__)
        inherits[ns] = cls.convert_module is base.__dict__["convert_module"]
print(json.dumps({"patched": patched, "restored": restored, "repatched": repatched,
                  "final": changed(pristine, snapshot()), "inherits": inherits,
                  "status": statuses()}))
"""
    )
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
    "imports",
    [
        "import fsdp_shim\nimport lightning",
        "import lightning\nimport fsdp_shim",
        "import fsdp_shim\nfrom lightning.fabric.plugins.precision.fsdp import FSDPPrecision",
        "from lightning.pytorch.strategies.fsdp import FSDPStrategy\nimport fsdp_shim\nimport lightning.fabric",
        "import fsdp_shim\nimport pytorch_lightning\nimport lightning_fabric",
        "import fsdp_shim\nimport lightning_fabric\nimport lightning.pytorch",
        "import lightning_fabric\nimport fsdp_shim\nfrom pytorch_lightning.plugins.precision.fsdp import FSDPPrecision",
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
def test_import_order_does_not_matter(imports: str, layouts: dict[str, Layout]) -> None:
    versions = installed_versions(layouts)
    needed = {line.split()[1].partition(".")[0] for line in imports.splitlines() if "fsdp_shim" not in line}
    available = {ns.partition(".")[0] for ns in versions}
    if not needed <= available:
        pytest.skip(f"needs {sorted(needed - available)}")
    result = child(
        imports
        + '\nprint(json.dumps({"wrappers": wrappers(), "imported": [n for n in %r if n in sys.modules]}))'
        % (ALL_NAMESPACES,)
    )
    expected = sorted(k for ns in result["imported"] for k in expected_wrappers(ns, versions[ns]))
    assert result["wrappers"] == expected


def test_fixed_and_unsupported_releases_are_left_alone(layouts: dict[str, Layout]) -> None:
    """Imported first, then the shim: every object on an unaffected namespace is the very same."""
    result = child(
        IMPORT_ALL
        + """
pristine = snapshot()
import fsdp_shim
print(json.dumps({"changed": changed(pristine, snapshot()), "status": statuses()}))
"""
    )
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


def test_a_renamed_target_warns_once_and_leaves_lightning_untouched(layouts: dict[str, Layout]) -> None:
    namespace, version = an_affected_namespace(layouts)
    result = child(
        """
import fsdp_shim, fsdp_shim.targets as targets
object.__setattr__(targets.PRECISION_CONVERT_MODULE, "class_names", ("RenamedPrecision",))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    importlib.import_module(%r)
    fsdp_shim.activate()  # activating again neither retries nor warns again
    fsdp_shim.activate()
shim_warnings = [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"]
print(json.dumps({"warnings": shim_warnings, "wrappers": wrappers(), "status": statuses()}))
"""
        % (namespace,)
    )
    own = [w for w in result["warnings"] if namespace in w]
    assert len(own) == 1
    assert "RenamedPrecision" in own[0] and version in own[0]
    assert [k for k in result["wrappers"] if k.startswith(namespace + ":")] == []
    assert result["status"][namespace]["patched"] is False
    assert result["status"][namespace]["reason"].startswith("not patched")


@pytest.mark.release_independent
def test_strict_mode_turns_a_renamed_target_into_an_error(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts)
    proc = run_python(
        """
import importlib, fsdp_shim, fsdp_shim.targets as targets
object.__setattr__(targets.PRECISION_CONVERT_MODULE, "class_names", ("RenamedPrecision",))
importlib.import_module(%r)
"""
        % (namespace,),
        env=clean_env(FSDP_SHIM_STRICT="1"),
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert "FSDPShimError" in proc.stderr
    # The first affected namespace imported fails (``lightning.fabric`` before ``lightning.pytorch``).
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("fsdp_shim.errors.FSDPShimError: fsdp-shim: cannot patch ")
    assert ".plugins.precision.fsdp has no class RenamedPrecision" in error
    assert any(f"{ns} {v}:" in error for ns, v in installed_versions(layouts).items() if is_affected_release(v))


@pytest.mark.release_independent
def test_an_internal_error_never_reaches_the_users_import(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts)
    body = """
import fsdp_shim, fsdp_shim.integration as integration
def broken(*args, **kwargs):
    raise RuntimeError("simulated bug in the shim")
integration.patch = broken
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    importlib.import_module(%r)
print(json.dumps({"warnings": [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"], "wrappers": wrappers()}))
""" % (namespace,)
    result = child(body)
    assert result["wrappers"] == []
    assert result["warnings"] and all("simulated bug" in w for w in result["warnings"])
    strict = run_python(PRELUDE + body, env=clean_env(FSDP_SHIM_STRICT="true"), expect_ok=False)
    assert strict.returncode != 0 and "FSDPShimError" in strict.stderr


@pytest.mark.release_independent
@pytest.mark.parametrize(
    ("env", "script_sets", "expect_patched"),
    [
        ({"FSDP_SHIM": " OFF "}, None, False),  # the parsing itself is unit-tested in test_toggles
        ({}, "false", False),  # set in the script after `import fsdp_shim`, before Lightning
        ({"FSDP_SHIM": "maybe"}, None, True),
    ],
    ids=["env-OFF", "script-false", "env-invalid"],
)
def test_the_environment_toggle(
    env: dict, script_sets: str | None, expect_patched: bool, layouts: dict[str, Layout]
) -> None:
    namespace, _ = an_affected_namespace(layouts)
    result = child(
        """
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fsdp_shim
    if %r is not None:
        os.environ["FSDP_SHIM"] = %r
    importlib.import_module(%r)
shim_warnings = [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"]
print(json.dumps({"wrappers": wrappers(), "warnings": shim_warnings, "status": statuses()}))
"""
        % (script_sets, script_sets, namespace),
        **env,
    )
    assert bool(result["wrappers"]) is expect_patched
    if env.get("FSDP_SHIM") == "maybe":
        assert len(result["warnings"]) == 1 and "FSDP_SHIM='maybe'" in result["warnings"][0]
    else:
        assert result["warnings"] == []
    if not expect_patched:
        assert "switched off by FSDP_SHIM" in result["status"][namespace]["reason"]


@pytest.mark.release_independent
@pytest.mark.parametrize("rank", ["0", "1"])
def test_one_info_line_per_patched_namespace_on_rank_zero_only(rank: str | None, layouts: dict[str, Layout]) -> None:
    proc = run_python(
        """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
import fsdp_shim, importlib
for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
""",
        env=clean_env(RANK=rank),
        args=("-W", "ignore"),
    )
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
def test_late_activation_warns_about_models_fsdp_already_wrapped(layouts: dict[str, Layout]) -> None:
    """Activation after Lightning's import patches at once and says so; a model FSDP wrapped before
    keeps its dtype, and the user is told once."""
    namespace, _ = an_affected_namespace(layouts)
    if namespace not in ("lightning.pytorch", "pytorch_lightning"):
        pytest.skip("needs an affected Trainer namespace")
    result = child(
        """
import torch
pl = importlib.import_module(%r)
fabric_ns = "lightning.fabric" if %r == "lightning.pytorch" else "lightning_fabric"
sys.path.insert(0, "tests/scenarios")
from cpu_fsdp_harness import lift_gpu_guards
lift_gpu_guards(%r, fabric_ns)

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).float().pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.Adam(self.trainer.model.parameters())

def fit():
    model = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=importlib.import_module(%r + ".strategies").FSDPStrategy(),
                         precision="bf16-true", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 8)), batch_size=4))
    return model, trainer

before, before_trainer = fit()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fsdp_shim
after, _ = fit()
status = fsdp_shim.status().namespace(%r)
print(json.dumps({
    "warnings": [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"],
    "late": status.activated_after_import, "patched": status.patched,
    "before": str(before.dtype), "after": str(after.dtype),
}))
"""
        % (namespace, namespace, namespace, namespace, namespace),
        PYTHONWARNINGS="ignore",
    )
    assert result["late"] is True and result["patched"] is True
    assert len(result["warnings"]) == 1
    assert "already set up 1 FSDP model" in result["warnings"][0] and "next setup" in result["warnings"][0]
    assert (result["before"], result["after"]) == ("torch.float32", "torch.bfloat16")
