"""Failure isolation: what the shim cannot do is said once at the user's line (strict mode raises instead), an
internal error never breaks the user's import, a call whose glue fails runs Lightning's own, and a late
activation says which models keep their dtype. The policy in this process; real Lightning in fresh ones."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
from children.classes import CAST_WRAPS, STATES, expected_wrappers
from conftest import NAMESPACES, Layout, clean_env, code_json, run_code

from _fsdp_shim import FSDPShimWarning, failures
from _fsdp_shim.failures import FSDPShimError

QUIET = ("-W", "ignore::DeprecationWarning")
UNCHANGED = "Lightning was left unchanged, so it runs without the cast fix"
NO_CLASS = "fsdp-shim: cannot patch {0} {1} (cast fix): {0}.plugins.precision.fsdp has no class {2}"


def affected_package(layouts: dict[str, Layout], trainer_release_not: str = "") -> tuple[str, tuple[str, str]]:
    """An installed layout whose Trainer and Fabric lack the cast: its package and (Trainer, Fabric) namespaces."""
    for package, layout in layouts.items():
        if STATES[layout.trainer_version][0] == "patched" and layout.trainer_version != trainer_release_not:
            return package, NAMESPACES[package]
    pytest.skip("needs a Lightning release that lacks the cast")


# ============================================================================= the policy, in this process
def test_one_warning_per_problem_at_the_callers_line_and_strict_mode_raises_the_problem_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FSDP_SHIM_STRICT", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            failures.report("fsdp-shim: the problem", "what happened instead", key="policy-test")  # CALLER
    lines = Path(__file__).read_text().splitlines()
    caller = next(n for n, line in enumerate(lines, 1) if "# CALLER" in line and "report(" in line)
    assert [(w.category, str(w.message), w.filename, w.lineno) for w in caught] == [
        (FSDPShimWarning, "fsdp-shim: the problem; what happened instead", __file__, caller)
    ]
    monkeypatch.setenv("FSDP_SHIM_STRICT", "1")
    cause = KeyError("precision")
    with pytest.raises(FSDPShimError) as raised:
        failures.report("fsdp-shim: the problem", "what happened instead", key="policy-test-strict", cause=cause)
    assert str(raised.value) == "fsdp-shim: the problem (FSDP_SHIM_STRICT is on)" and raised.value.__cause__ is cause


def test_a_warning_at_a_line_without_source_is_still_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -c`` and the prompt run ``__main__`` with a loader that has no source: still a warning, not an
    error from the user's ``import``."""
    monkeypatch.delenv("FSDP_SHIM_STRICT", raising=False)
    code = compile("failures.report('fsdp-shim: no source', 'instead', key='no-source')", "<string>", "exec")
    namespace = {"__name__": "__main__", "__loader__": importlib.machinery.BuiltinImporter, "failures": failures}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(code, namespace)
    assert [(str(w.message), w.filename, w.lineno) for w in caught] == [
        ("fsdp-shim: no source; instead", "<string>", 1)
    ]


# ============================================================================= a target Lightning renamed
RENAMED = """
    import dataclasses, importlib, json, sys, warnings
    from children.classes import *
    import fsdp_shim
    from _fsdp_shim import fixes

    shipped = fixes.PLANS["cast"]
    fixes.PLANS["cast"] = lambda namespace, version: tuple(  # the table names a class Lightning does not have
        dataclasses.replace(t, class_name="RenamedPrecision") if (t.attribute, namespace) == ("convert_module", FABRIC)
        else t
        for t in shipped(namespace, version)
    )
    if not CATCH:  # strict mode or -W error decide what escapes the user's import
        try:
            importlib.import_module(PACKAGE)
        except Exception as error:
            print(json.dumps([f"{type(error).__module__}.{type(error).__name__}", str(error)]))
        sys.exit(0)
    line = lambda marker: next(n for n, text in enumerate(open(__file__), 1) if marker + "-LINE" in text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(PACKAGE)  # IMPORT-LINE
    out = {"renamed": [[str(w.message), w.filename == __file__ and w.lineno == line("# IMPORT")] for w in caught]}
    out["renamed"] += [versions(), wrappers(), statuses()]

    fixes.PLANS["cast"] = shipped
    fsdp_shim.deactivate()
    module = importlib.import_module(TRAINER + ".plugins.precision.fsdp")
    del module.FSDPPrecision  # a Lightning release that renamed the class: its deprecated subclass stays
    before = snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            fsdp_shim.activate()  # ACTIVATE-LINE
    out["without_class"] = [
        [[str(w.message), w.lineno == line("# ACTIVATE")] for w in caught], changed(before, snapshot()), statuses()
    ]
    print(json.dumps(out))
"""


def renamed(layouts: dict[str, Layout], catch: bool) -> tuple[tuple[str, str], str]:
    """``RENAMED`` for an installed layout that lacks the cast: its (Trainer, Fabric) namespaces and the code."""
    package, namespaces = affected_package(layouts, trainer_release_not="2.1.0")  # 2.1.0 has no FSDPPrecision
    code = RENAMED.replace("PACKAGE", repr(package)).replace("TRAINER", repr(namespaces[0]))
    return namespaces, code.replace("FABRIC", repr(namespaces[1])).replace("CATCH", str(catch))


def test_a_renamed_target_warns_once_at_the_users_import_line(layouts: dict[str, Layout]) -> None:
    """The cast's table names a class Fabric lacks: one warning, at the user's ``import`` line,
    the cast left out there, the recompute fix and the rank check applied. A Trainer whose ``FSDPPrecision`` is gone
    (2.2+ keeps ``FSDPPrecisionPlugin`` as its deprecated subclass): the subclass is left untouched, said once
    however often ``activate()`` runs."""
    (trainer, fabric), code = renamed(layouts, True)
    result = code_json(code, python_args=QUIET, env=clean_env())
    *said, versions, wrapped, statuses = result["renamed"]
    version = versions[trainer]
    assert said == [[NO_CLASS.format(fabric, version, "RenamedPrecision") + f"; {UNCHANGED}", True]]
    fabric_cast = {f"{fabric}:{key}" for key in CAST_WRAPS[version]["fabric"]}
    assert wrapped == sorted(set(expected_wrappers(versions)) - fabric_cast)
    assert [statuses[fabric]["patched"], statuses[fabric]["cast"][0], statuses[fabric]["recompute"][0]] == [
        False,
        "failed",
        "patched",
    ]
    assert statuses[trainer]["cast"][0] == "patched"

    said, touched, statuses = result["without_class"]
    assert said == [[NO_CLASS.format(trainer, version, "FSDPPrecision") + f"; {UNCHANGED}", True]]
    assert f"{trainer}:FSDPPrecisionPlugin.convert_module" not in touched
    rank_check = [key for key in expected_wrappers({trainer: version}, ("cast",)) if key.startswith(f"{trainer}:")]
    assert [key for key in touched if key.startswith(f"{trainer}:")] == rank_check
    assert statuses[trainer]["cast"] == ["failed", f"{trainer}.plugins.precision.fsdp has no class FSDPPrecision"]
    assert statuses[trainer]["recompute"] == ["patched", ""]


@pytest.mark.parametrize(
    ("flags", "env", "kind", "tail"),
    [
        ((), {"FSDP_SHIM_STRICT": "1"}, "fsdp_shim.FSDPShimError", " (FSDP_SHIM_STRICT is on)"),
        (("-W", "error::fsdp_shim.FSDPShimWarning", "-W", "error:fsdp-shim"), {}, "fsdp_shim.FSDPShimWarning", ""),
    ],
    ids=["strict", "minus-W-error"],
)
def test_strict_mode_or_minus_w_error_turns_a_renamed_target_into_an_error_from_the_users_import(
    flags: tuple[str, ...], env: dict[str, str], kind: str, tail: str, layouts: dict[str, Layout]
) -> None:
    """``FSDP_SHIM_STRICT=1``, or the ``-W error:fsdp-shim`` the docs recommend; the ``-W`` category form cannot
    work (Python resolves ``-W`` categories before ``sys.path`` is set up, and says so)."""
    (_, fabric), code = renamed(layouts, False)
    proc = run_code(code, python_args=flags, env=clean_env(**env))
    assert ("Invalid -W option ignored: invalid module name: 'fsdp_shim'" in proc.stderr) == bool(flags)
    raised, message = json.loads(proc.stdout.splitlines()[-1])
    assert raised == kind and message.startswith(f"fsdp-shim: cannot patch {fabric} ")
    no_class = f"(cast fix): {fabric}.plugins.precision.fsdp has no class RenamedPrecision"
    assert message.endswith(no_class + (tail or f"; {UNCHANGED}"))


# ============================================================================= a bug of the shim's
def test_an_internal_error_never_reaches_the_users_import(layouts: dict[str, Layout]) -> None:
    """A bug in the patching code is a warning and Lightning imports unpatched; in strict mode the user's next
    import of Lightning fails with an error that says it is the shim's."""
    if "standalone" not in layouts or STATES[layouts["standalone"].trainer_version][1] != "patched":
        pytest.skip("needs a standalone Lightning that lacks a fix")
    said, wrapped, error = code_json(
        """
        import json, os, warnings
        from children.classes import shim_warnings, wrappers
        import fsdp_shim
        from _fsdp_shim import wrappers as patching

        def broken(*args, **kwargs):
            raise RuntimeError("simulated bug in the shim")

        patching.patch = broken
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lightning_fabric
        out = [shim_warnings(caught), wrappers()]
        os.environ["FSDP_SHIM_STRICT"] = "true"
        try:
            import pytorch_lightning
        except fsdp_shim.FSDPShimError as error:
            out.append(str(error))
        print(json.dumps(out))
        """,
        env=clean_env(),
        python_args=QUIET,
    )
    internal = "fsdp-shim: internal error while patching {} (RuntimeError: simulated bug in the shim)"
    assert said == [internal.format("lightning_fabric") + "; see fsdp_shim.status() for what is in effect"]
    assert wrapped == []
    assert error == internal.format("pytorch_lightning") + " (FSDP_SHIM_STRICT is on)"


# ============================================================================= glue that fails at call time
@pytest.fixture(scope="module")
def glue(layouts: dict[str, Layout]) -> tuple[str, dict[str, Any]]:
    """What the wrappers read went missing at call time: a plugin without ``_desired_input_dtype`` (a Lightning
    rename) for the cast, a non-reentrant checkpoint handing torch's generator its function by keyword (a torch
    that changed its calling convention) for the recompute, a precision plugin without ``precision`` at Fabric's
    ``setup_environment`` for the rank check; each called twice, then a healthy call, then strict mode."""
    _, (_, namespace) = affected_package(layouts)
    code = f"""
        import contextlib, importlib, json, os, warnings
        import torch
        import fsdp_shim
        from _fsdp_shim import rank_check
        from children.classes import *

        importlib.import_module({namespace!r})
        plugin_class = precision_class({namespace!r})
        confirmed, confirm = [], rank_check.confirm_every_rank
        rank_check.confirm_every_rank = lambda where, dtype, joined_here=False: (
            confirmed.append([where, str(dtype)]), confirm(where, dtype, joined_here)
        )

        class WithoutPrecision(plugin_class):
            @property
            def precision(self):
                raise AttributeError("'precision' is gone")

        environments = importlib.import_module({namespace!r} + ".plugins.environments")

        def strategy(plugin):
            return importlib.import_module({namespace!r} + ".strategies.fsdp").FSDPStrategy(
                accelerator=importlib.import_module({namespace!r} + ".accelerators").CPUAccelerator(),
                parallel_devices=[torch.device("cpu")],
                cluster_environment=environments.LightningEnvironment(),
                precision=plugin,
            )

        def cast():
            plugin = plugin_class(precision="bf16-true")
            del plugin._desired_input_dtype
            return str(plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype)

        def checkpoint():
            seen = []

            def block(x):
                seen.append(str(torch.get_default_dtype()))
                return torch.sin(x)

            x = torch.ones(2, requires_grad=True)
            from torch.utils import checkpoint as module

            with default_dtype("torch.bfloat16"):
                generator = getattr(module, checkpoint_generator())(fn=block, preserve_rng_state=True, x=x)
                next(generator)
                out = block(x=x)
                with contextlib.suppress(StopIteration):
                    next(generator)
            out.sum().backward()
            return seen[-1]

        def setup_environment():
            plugin = plugin_class(precision="bf16-true")
            plugin.__class__ = WithoutPrecision
            before = len(confirmed)
            strategy(plugin).setup_environment()
            return len(confirmed) - before

        calls = (cast, checkpoint, setup_environment)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = {{"results": [[call() for _ in range(2)] for call in calls], "said": shim_warnings(caught)}}
        out["status"] = statuses()[{namespace!r}]
        out["generator"] = "torch.utils.checkpoint." + checkpoint_generator()
        strategy(plugin_class(precision="bf16-true")).setup_environment()
        out["healthy"] = [converted_dtype(plugin_class), recompute_dtypes(), confirmed]
        os.environ["FSDP_SHIM_STRICT"] = "1"
        out["strict"] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for call in calls:
                try:
                    call()
                except fsdp_shim.FSDPShimError as error:
                    out["strict"].append(str(error))
        out["strict_said"] = shim_warnings(caught)
        print(json.dumps(out))
    """
    return namespace, code_json(code, env=clean_env(), python_args=QUIET)


def test_a_call_whose_glue_fails_falls_back_to_lightnings_own_and_status_stops_saying_patched(
    glue: tuple[str, dict[str, Any]],
) -> None:
    """Each call runs the function the shim wrapped (no cast; the recompute in the backward's float32; no rank
    check), each wrapper says so once, status stops saying patched, and healthy calls keep every fix."""
    namespace, result = glue
    assert result["results"] == [["torch.float32"] * 2, ["torch.float32"] * 2, [0, 0]]
    generator = result["generator"]
    cast, checkpoint, setup = result["said"]
    assert cast.startswith(
        f"fsdp-shim: {namespace}.plugins.precision.fsdp.FSDPPrecision.convert_module could not read what it needs "
        "(AttributeError: "
    ) and cast.endswith("Lightning's own method was used for this call, so it runs without the cast fix")
    assert checkpoint == (
        f"fsdp-shim: {generator} could not read what it needs (TypeError: expected the checkpointed function as the "
        "first positional argument); torch's own function was used for this call, so it runs without the "
        "recompute fix"
    )
    assert setup == (
        f"fsdp-shim: {namespace}.strategies.fsdp.FSDPStrategy.setup_environment could not read what it needs "
        "(AttributeError: 'precision' is gone); Lightning's own method was used for this call, so it runs without "
        "the rank check"
    )
    status = result["status"]
    assert status["patched"] is False
    assert status["cast"][0] == status["recompute"][0] == "failed"
    assert status["recompute"][1] == (
        f"{generator} fell back to torch's own function at call time (TypeError: expected the checkpointed function "
        "as the first positional argument)"
    )
    assert result["healthy"] == ["torch.bfloat16", ["torch.bfloat16"] * 2, [[namespace, "torch.bfloat16"]]]


def test_strict_glue_error_does_not_claim_to_fall_back(glue: tuple[str, dict[str, Any]]) -> None:
    _, result = glue
    assert result["strict_said"] == [] and len(result["strict"]) == 3
    for error in result["strict"]:
        assert "could not read what it needs" in error and error.endswith("(FSDP_SHIM_STRICT is on)")
        assert "was used" not in error


# ============================================================================= late activation, real FSDP
def test_a_pin_that_cannot_be_loaded_at_a_checkpoint_call_is_a_glue_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pins load at the first checkpoint call: where they cannot (an upgrade under a running job), the call falls
    back to torch's own function, as any glue failure, instead of breaking the user's backward."""
    pytest.importorskip("torch")
    from _fsdp_shim.fixes import non_reentrant_in_forward_dtype, reentrant_in_forward_dtype
    from _fsdp_shim.wrappers import GlueError

    monkeypatch.setitem(sys.modules, "_fsdp_shim.pins", None)
    monkeypatch.delattr(sys.modules["_fsdp_shim"], "pins", raising=False)  # where a test imported it before
    for body, args in ((reentrant_in_forward_dtype, (None, print)), (non_reentrant_in_forward_dtype, (print,))):
        with pytest.raises(GlueError, match=r"import of _fsdp_shim\.pins halted"):
            body(print, None, args, {})


FIT = """
import torch


def fit(pl):
    \"\"\"One bf16-true FSDP step of a one-layer model on the CPU: the model and the trainer.\"\"\"
    from _fsdp_shim.verify import cpu_guards

    cpu_guards.lift(pl.__name__)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0].to(self.layer.weight.dtype)).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)

    model, data = Tiny(), torch.utils.data.TensorDataset(torch.randn(4, 8))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=pl.strategies.FSDPStrategy(), precision="bf16-true", max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    return model, trainer
"""


def test_late_activation_warns_about_models_fsdp_already_wrapped(layouts: dict[str, Layout]) -> None:
    """``import fsdp_shim`` after a Trainer set up an FSDP model: that model keeps its float32 (said once), the
    next setup is cast."""
    _, (namespace, _) = affected_package(layouts)
    script = f"""
        import importlib, json, warnings
        from children.classes import shim_warnings, statuses

        pl = importlib.import_module({namespace!r})
        before, kept_alive = fit(pl)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fsdp_shim
        after, _ = fit(pl)
        late = statuses()[{namespace!r}]["late"]
        print(json.dumps([shim_warnings(caught), str(before.dtype), str(after.dtype), late]))
        """
    said, before, after, late = code_json(FIT + textwrap.dedent(script), env=clean_env(PYTHONWARNINGS="ignore"))
    assert (before, after, late) == ("torch.float32", "torch.bfloat16", True)
    assert said == [
        "fsdp-shim was activated after FSDP had already wrapped a model: its parameters keep the dtype they were "
        "wrapped with. The fix applies from the next setup on. Import fsdp_shim before Lightning, or use "
        "`fsdp-shim run` or the start-up file."
    ]
