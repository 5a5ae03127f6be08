"""``fsdp-shim verify``, by behaviour: the seed model's verdict per fix, the user's own
model (``--model``, written in ``tests/verify_models`` as a team writes it), ``--activation-checkpointing``, and
the command itself (exit codes, time limits, Ctrl-C, usage errors). Every verify run trains in fresh processes,
so each serves several assertions; verdicts on states no real run gives here are judged in-process."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FSDP_SHIM,
    ROOT,
    TRAINER,
    Layout,
    alive,
    an_affected_namespace,
    clean_env,
    layout_or_skip,
    trainer_versions,
    verify,
)

from _fsdp_shim.config import State, base_release
from _fsdp_shim.status import FixStatus
from _fsdp_shim.verify.command import Options, RankResult, Section, fix_entries, judge_raised, judge_recompute, render

MODELS = ROOT / "tests" / "verify_models"
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
BF16 = "torch.bfloat16"


def verify_model(namespace: str, *args: str, cwd: Path = MODELS) -> subprocess.CompletedProcess[str]:
    """verify with ``tests/verify_models`` written against ``namespace``, run where they are."""
    return verify(*args, env=clean_env(FSDP_SHIM_TEST_LIGHTNING=namespace), cwd=cwd)


def document(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return json.loads(proc.stdout)


def only_section(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    (section,) = document(proc)["sections"]
    return section


def fixes(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["fix"]: entry for entry in section["fixes"]}


def as_section(data: dict[str, Any]) -> Section:
    """A ``--json`` section as verify's own record, for its renderer and verdicts."""
    runs = ("shim_off", "shim_on", "checkpointed_shim_off", "checkpointed_shim_on")
    return Section(**{**data, **{k: data[k] and [RankResult(**r) for r in data[k]] for k in runs}})


def same_bits(plain: list[dict[str, Any]], checkpointed: list[dict[str, Any]]) -> bool:
    """Every rank's losses and parameter-shard hashes the same (``float.hex``: NaN equals NaN)."""
    return len(plain) == len(checkpointed) and all(
        [float(v).hex() for v in a["losses"]] == [float(v).hex() for v in b["losses"]]
        and a["param_hashes"] == b["param_hashes"]
        for a, b in zip(plain, checkpointed)
    )


def assert_exactly_half(section: dict[str, Any], devices: int) -> None:
    """A model that is all float32 at the FSDP wrap without the shim: every byte count exactly half with it."""
    assert section["verdict"] == "fixed", section["reason"]
    assert [r["rank"] for r in section["shim_on"]] == list(range(devices))
    for off, on in zip(section["shim_off"], section["shim_on"]):
        assert (off["module_dtype"], on["module_dtype"]) == ("torch.float32", BF16)
        assert (off["flat_param_dtypes"], on["flat_param_dtypes"]) == (["torch.float32"], [BF16])
        assert [on[key] * 2 for key in BYTE_KEYS] == [off[key] for key in BYTE_KEYS]


# ----------------------------------------------------------------------------- the seed model
@pytest.mark.per_release
def test_the_seed_model_gets_a_verdict_per_fix(layouts: dict[str, Layout], planted: Path) -> None:
    """The first installed Trainer namespace (``lightning`` next to the standalone, which pip brings along, is said
    not checked): the seed's causal block, built in ``__init__``, is exactly half with the shim where the release
    lacks the cast; checkpointed, it raises without the shim and gives the same bits with it; the runs are counted
    once. Run from a folder holding a ``yaml.py`` and a ``packaging.py``: the probes run none of it."""
    versions = trainer_versions(layouts)
    if not versions:
        pytest.skip("no Lightning installed")
    proc = verify("--json", cwd=planted)
    assert proc.returncode == 0, proc.stderr
    assert list(planted.glob("RAN-*")) == []
    (namespace, version), *others = versions.items()
    section, release = only_section(proc), base_release(version)
    assert release is not None and (section["namespace"], section["version"]) == (namespace, version)
    assert document(proc)["not_checked"] == dict(others)
    lacks_cast, lacks_recompute = (2, 1, 0) <= release < (2, 5, 0), release >= (2, 1, 0)  # 2.5+: recompute only
    assert document(proc)["verdict"] == ("fixed" if lacks_recompute else "not needed")
    cast, recompute = fixes(section)["cast"], fixes(section)["recompute"]
    assert cast["shim"]["state"] == ("patched" if lacks_cast else "built in" if lacks_recompute else "not affected")
    assert (cast["verdict"], cast["reason"]) == (section["verdict"], section["reason"])
    if lacks_recompute:
        assert recompute["shim"]["state"] == "patched" and recompute["verdict"] == "fixed", recompute["reason"]
        assert same_bits(section["shim_on"], section["checkpointed_shim_on"])
        error = section["checkpointed_shim_off"][0]["error"]
        assert error and f"with the shim off, the checkpointed run raised {error}" in recompute["reason"]
    if lacks_cast:
        assert_exactly_half(section, 1)
    else:
        assert section["shim_off"] is None
    assert proc.stderr.splitlines() == [  # one line per probe, as it starts
        "fsdp-shim verify: reading the installed Lightning, then training with the shim on ...",
        *[f"fsdp-shim verify: training {namespace} {version} with the shim off ..."] * lacks_recompute,
    ]
    text = render(as_section(section), Options(), dict(others))
    assert ("    param_bytes: " in text) is lacks_cast and text.endswith(f"verdict: {document(proc)['verdict']}")
    for other, other_version in others:
        assert f"not checked: {other} {other_version} (--package pytorch_lightning checks it)" in text


# ----------------------------------------------------------------------------- activation checkpointing
def test_a_block_that_makes_a_tensor_without_a_dtype_is_fixed(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """``user_models.Block`` multiplies by a tensor made without a dtype: the precision's in the forward, float32
    in the recompute. With the shim the checkpointed run equals the plain one bit for bit; without it, with
    ``cast=True`` (the factory ``casting_checkpointed``: the same dtype, other values) it trains on other values,
    and verify names the first difference. Run from elsewhere, the models found on ``PYTHONPATH``, with two ranks:
    each rank's figures, and on unpatched 2.1-2.4 (float32 weights) exactly half on each."""
    layout = layout_or_skip(layouts, "lightning")
    if base_release(layout.trainer_version) < (2, 1, 0):
        pytest.skip("needs a release that lacks the recompute fix")
    args = ("--model", "user_models:casting_checkpointed")
    checkpointed = ("--activation-checkpointing", "user_models:Block", "--devices", "2")
    env = clean_env(FSDP_SHIM_TEST_LIGHTNING="lightning.pytorch")
    env["PYTHONPATH"] = f"{MODELS}:{env.get('PYTHONPATH', '')}"
    proc = verify(*args, *checkpointed, "--json", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = only_section(proc)
    assert [[r["rank"] for r in section[run]] for run in ("shim_on", "checkpointed_shim_on")] == [[0, 1]] * 2
    recompute = fixes(section)["recompute"]
    assert recompute["verdict"] == "fixed", recompute["reason"]
    assert recompute["reason"].startswith("with the shim, checkpointing Block (2 modules) changes nothing")
    assert same_bits(section["shim_on"], section["checkpointed_shim_on"])
    off = section["shim_off"] or section["shim_on"]  # 2.5+ (it casts): no run without the shim unchecked
    off_checkpointed = section["checkpointed_shim_off"]
    assert off_checkpointed[0]["error"] is None and not same_bits(off, off_checkpointed)
    assert "with the shim off, the checkpointed run differs first in the loss of step " in recompute["reason"]
    if base_release(layout.trainer_version) < (2, 5, 0):  # unpatched, the weights stay float32
        assert_exactly_half(section, 2)
    # As if the shim had done nothing: its runs replaced by the shim-off ones, whose state is "switched off".
    record = as_section(section)
    plain, checkpointed_off = record.shim_off or record.shim_on, record.checkpointed_shim_off
    assert plain and checkpointed_off
    verdict, reason = judge_recompute(plain, plain, checkpointed_off, checkpointed_off, "Block")
    assert verdict == "FAILED" and reason.startswith("the shim did not apply it to lightning.pytorch: switched off")
    assert "with the shim, the checkpointed run " in reason


@pytest.mark.parametrize("state", [State.DISABLED, State.NOT_IN_EFFECT])
def test_a_recompute_the_shim_did_not_apply_is_failed_checked_or_not(state: State) -> None:
    """The verdict follows the fix's ``state`` in the shim-on run: disabled (FSDP_SHIM_DISABLED_FIXES) or not in
    effect on this torch, the recompute is FAILED and never said to be applied; not in effect, even unchecked."""
    on = [RankResult(0, lightning="2.4.0", namespace="lightning.pytorch", losses=[1.0], param_hashes={"w": "a"})]
    raised = [RankResult(0, checkpointed=2, error="CheckpointError: recomputed values differ")]
    status = FixStatus("recompute", state, True, "the detail").as_dict()
    on, raised = (
        [replace(r, fixes={"recompute": status}) for r in on],
        [replace(r, fixes={"recompute": status}) for r in raised],
    )
    verdict, reason = judge_recompute(on, on, raised, raised, "Block")
    assert verdict == "FAILED" and "with the shim, the checkpointed run raised CheckpointError" in reason
    for verdicts in ({"recompute": (verdict, reason)}, {}):
        entries = fix_entries({"recompute": status}, verdicts)
        section = Section("lightning.pytorch", "2.4.0", "fixed", "", entries)
        text = render(section, Options(model="m:M"), {})
        assert f"  recompute [shim: {status['reason']}]: " in text and "patched" not in text
        failed = bool(verdicts) or state is State.NOT_IN_EFFECT
        assert (f"recompute [shim: {status['reason']}]: FAILED" in text) is failed, text
        assert ("verdict: FAILED" in text) is failed


def test_checkpointing_blocks_that_give_every_tensor_a_dtype_is_not_needed(layouts: dict[str, Layout]) -> None:
    """``nn.Linear`` makes no tensor of its own: checkpointing it changes nothing with the shim or without, bit for
    bit. ``--activation-checkpointing`` trains a release that has the cast too, for the recompute only."""
    standalone = layouts.get("standalone")
    fixed = standalone is not None and base_release(standalone.trainer_version) >= (2, 5, 0)
    namespace = TRAINER["standalone"] if fixed else an_affected_namespace(layouts, "trainer")[0]
    blocks = "torch.nn:Linear"
    proc = verify_model(
        namespace, "--model", "user_models:Checkpointed", "--activation-checkpointing", blocks, "--json"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = only_section(proc)
    recompute = fixes(section)["recompute"]
    assert section["namespace"] == namespace and document(proc)["activation_checkpointing"] == [blocks]
    assert recompute["verdict"] == "not needed" and "explicit dtype" in recompute["reason"], recompute["reason"]
    for shim in ("shim_off", "shim_on"):
        assert same_bits(section[shim] or section["shim_on"], section[f"checkpointed_{shim}"]), shim
        assert [r["checkpointed"] for r in section[f"checkpointed_{shim}"]] == [3]  # the blocks' two and the head
    if fixed:
        assert section["shim_off"] is None and section["reason"].endswith("; trained for the recompute only")


def test_activation_checkpointing_of_a_class_the_model_lacks_is_a_usage_error(layouts: dict[str, Layout]) -> None:
    """Checkpointing nothing would compare a run with itself: refused after the first run, exit 2."""
    namespace = an_affected_namespace(layouts, "trainer", fix="recompute")[0]
    proc = verify_model(
        namespace, "--model", "user_models:ThreeWays", "--activation-checkpointing", "user_models:Block"
    )
    assert proc.returncode == 2, proc.stderr
    message = "--activation-checkpointing: this model has no module of user_models:Block to checkpoint"
    assert proc.stderr.strip().splitlines()[-1] == f"fsdp-shim verify: {message}"
    assert "with the shim off" not in proc.stderr


# ----------------------------------------------------------------------------- the user's own model
def test_the_docs_worked_example_runs_as_written(layouts: dict[str, Layout]) -> None:
    """docs/verify-your-model.md's example, from its folder: every layer float32 at the wrap, so exactly half."""
    if an_affected_namespace(layouts, "trainer")[0] != "lightning.pytorch":
        pytest.skip("the docs example imports `lightning`")
    proc = verify("--model", "my_model:MyModel", cwd=ROOT / "docs" / "examples", env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "  cast [shim: patched]: fixed: sharded parameters, gradients and optimizer state are 50% smaller\n" in (
        proc.stdout
    )
    assert (
        "  recompute [shim: patched]: not checked: --activation-checkpointing MODULE:CLASS[,...] trains" in proc.stdout
    )
    assert "    param_bytes: 395520 -> 197760\n" in proc.stdout and "\nverdict: fixed\n" in proc.stdout


def test_a_module_without_data_takes_a_datamodule_and_16_true_numerics_show(layouts: dict[str, Layout]) -> None:
    """A module without ``train_dataloader`` is refused before anything trains; with ``--datamodule`` it trains.
    In ``16-true`` AdamW's default eps (0 in float16) gives NaN with the shim, where unpatched 2.1-2.4 trained in
    float32: FAILED, though the memory itself is exactly half."""
    namespace = an_affected_namespace(layouts, "trainer")[0]
    refused = verify_model(namespace, "--model", "user_models:NoData")
    assert refused.returncode == 2
    assert "user_models:NoData has no train_dataloader; pass --datamodule" in refused.stderr
    assert "with the shim off" not in refused.stderr
    args = ("--model", "user_models:NoData", "--datamodule", "user_models:Data", "--precision", "16-true", "--json")
    proc = verify_model(namespace, *args)
    assert proc.returncode == 1, proc.stderr
    section = only_section(proc)
    assert section["verdict"] == "FAILED"
    assert "the losses are not finite with the shim, while they are without it" in section["reason"]
    off, on = section["shim_off"][0], section["shim_on"][0]
    assert all(v is not None and v == v for v in off["losses"]) and any(v != v for v in on["losses"][1:])
    assert [on[key] * 2 for key in BYTE_KEYS] == [off[key] for key in BYTE_KEYS]


def test_a_release_that_has_the_cast_is_not_trained_without_a_recompute_to_check(layouts: dict[str, Layout]) -> None:
    """2.5+ already casts: "not needed" from the gate alone, the recompute not checked without
    ``--activation-checkpointing``. The model is a factory's: its namespace is the one its module imported."""
    standalone = layout_or_skip(layouts, "standalone")
    if base_release(standalone.trainer_version) < (2, 5, 0):
        pytest.skip("needs a standalone pytorch_lightning that has the cast")
    untrained = verify_model(TRAINER["standalone"], "--model", "user_models:make_model", "--json")
    plain = only_section(untrained)
    assert plain["verdict"] == "not needed" and "nothing was trained" in plain["reason"]
    assert "with the shim off" not in untrained.stderr  # the probe that read Lightning ended there
    assert plain["shim_off"] is plain["shim_on"] is None and fixes(plain)["recompute"]["verdict"] is None


def test_a_model_that_casts_itself_is_told_the_shim_changes_nothing(layouts: dict[str, Layout]) -> None:
    """Right without the shim, so "fixed" would claim what the shim did not do."""
    proc = verify_model(an_affected_namespace(layouts, "trainer")[0], "--model", "user_models:CastsItself", "--json")
    assert proc.returncode == 0, proc.stderr
    section = only_section(proc)
    assert (
        section["verdict"] == "not needed" and "already in the precision's dtype without the shim" in section["reason"]
    )
    off, on = section["shim_off"][0], section["shim_on"][0]
    assert off["module_dtype"] == on["module_dtype"] == BF16
    assert [off[key] for key in BYTE_KEYS] == [on[key] for key in BYTE_KEYS]


def test_a_model_that_raises_only_without_the_shim_is_judged(layouts: dict[str, Layout]) -> None:
    """``ChecksItsOwnForward`` calls ``torch.utils.checkpoint`` in its forward: without the shim the recompute
    raises, so there is no run to compare with; with the shim it trains: the recompute is "fixed", by what it
    raised, and the cast is "not checked"."""
    namespace, _ = an_affected_namespace(layouts, "trainer")
    proc = verify_model(namespace, "--model", "user_models:ChecksItsOwnForward", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "your code raised" not in proc.stderr
    section = only_section(proc)
    assert section["shim_off"] is None and "CheckpointError" in section["shim_off_error"]
    recompute, cast = fixes(section)["recompute"], fixes(section)["cast"]
    assert recompute["verdict"] == "fixed", recompute["reason"]
    assert recompute["reason"].startswith("without the shim, a recompute of torch's checkpoint raised CheckpointError")
    assert recompute["reason"].endswith("; with the shim it trains")
    assert (cast["verdict"], section["verdict"]) == (None, "not checked")
    assert cast["reason"].endswith("so there is no run without the shim to compare with")
    text = render(as_section(section), Options(model="user_models:ChecksItsOwnForward"), {})
    assert "\n  recompute [shim: patched]: fixed: without the shim, a recompute of torch's checkpoint raised" in text
    assert text.endswith("\nverdict: fixed")


def test_a_run_that_ends_its_process_is_named_and_the_run_before_keeps_its_figures(layouts: dict[str, Layout]) -> None:
    """``BuiltOncePerProcess`` ends its process at its second build there: the checkpointed run with the shim on,
    the second run of its probe. verify names that run, not the first, and keeps the first run's figures."""
    namespace = an_affected_namespace(layouts, "trainer")[0]
    options = ("--activation-checkpointing", "torch.nn:Sequential", "--steps", "1", "--json")
    proc = verify_model(namespace, "--model", "user_models:BuiltOncePerProcess", *options)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = only_section(proc)
    assert section["verdict"] == "FAILED"
    assert section["reason"].startswith("the checkpointed run with FSDP_SHIM=1 failed (exit 3)"), section["reason"]
    assert [(run["module_dtype"], len(run["losses"])) for run in section["shim_on"]] == [(BF16, 1)]  # --steps 1
    assert [section[key] for key in ("checkpointed_shim_on", "shim_off", "checkpointed_shim_off")] == [None] * 3


def test_an_error_in_the_users_code_is_theirs(layouts: dict[str, Layout]) -> None:
    """Raised with the shim off and on: the user's traceback, exit 1, no verdict."""
    proc = verify_model(an_affected_namespace(layouts, "trainer")[0], "--model", "user_models:RaisesInTrainingStep")
    assert proc.returncode == 1
    assert f'File "{MODELS / "user_models.py"}"' in proc.stderr
    assert "ValueError: a bug in the user's training_step" in proc.stderr
    assert "your code raised while training (shim off), and with the shim on too (ValueError: a bug" in proc.stderr
    assert "FAILED" not in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- the command
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "user_models:Data"], "user_models:Data is not a Lightning LightningModule class or a factory"),
        (["--model", "user_models:NoData", "--datamodule", "user_models"], "'user_models' is not MODULE:ATTR (e.g."),
        (["--activation-checkpointing", "torch.nn:Linear, a:"], "'a:' is not MODULE:ATTR (e.g. my_project.model:"),
    ],
)
def test_an_option_that_names_nothing_usable_is_refused_before_training(
    layouts: dict[str, Layout], args: list[str], message: str
) -> None:
    """Read while verify reads Lightning: exit 2 with the reason in one line, no traceback, nothing trained (the
    reasons: in-process below)."""
    proc = verify_model(an_affected_namespace(layouts, "trainer")[0], *args)
    assert proc.returncode == 2, proc.stderr
    reading, said = proc.stderr.splitlines()  # one line per step, and the reason: no traceback
    assert reading == "fsdp-shim verify: reading the installed Lightning, then training with the shim on ..."
    assert said.startswith(f"fsdp-shim verify: {message}"), said


def test_what_the_probe_refuses_and_why() -> None:
    """The probe's reading of ``MODULE:ATTR`` (dotted attributes step by step) and of what it names."""
    pytest.importorskip("torch")
    from _fsdp_shim.verify import probe

    assert probe.resolve("json:JSONDecoder.decode", "", callable) is json.JSONDecoder.decode
    for options, message in [
        (Options(model="json:JSONDecoder.no"), "json:JSONDecoder.no is not a Lightning LightningModule class or a"),
        (Options(model="json:__name__"), "json:__name__ is not a Lightning LightningModule class or a factory"),
        (
            Options(model="not_a_module_here:Model"),
            f"cannot import 'not_a_module_here' (not_a_module_here:Model) from the current folder ({Path.cwd()}) or",
        ),
        (Options(activation_checkpointing=["json:loads"]), "json:loads is not a torch.nn.Module class"),
        (Options(model="no_colon"), "'no_colon' is not MODULE:ATTR (e.g. my_project.model:MyModel)"),
        (Options(model="json:"), "'json:' is not MODULE:ATTR"),
        (Options(model=":JSONDecoder"), "':JSONDecoder' is not MODULE:ATTR"),
        (Options(activation_checkpointing=["torch.nn:Linear", "torch..nn:Linear"]), "'torch..nn:Linear' is not MOD"),
    ]:
        with pytest.raises(probe.ProbeStop) as stop:
            probe.user_modules(options, build=False)
        assert (stop.value.code, stop.value.record["kind"]) == (2, "usage") and message in str(stop.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --steps: '0' is not a positive whole number"),
        (["--devices", "-1"], "argument --devices: '-1' is not a positive whole number"),
        (["--timeout", "soon"], "argument --timeout: 'soon' is not a positive number"),
        (["--datamodule", "m:D"], "--datamodule needs --model"),
        (["--model", "m:M", "--package", "lightning"], "--package is for the seed model; with --model"),
        (["--package", "all"], "argument --package: invalid choice: 'all'"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from _fsdp_shim.cli import main

    try:
        code = main(["verify", *args])
    except SystemExit as stop:
        code = stop.code
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.usefixtures("lightning_installed")
def test_a_package_that_is_not_installed_is_refused_before_anything_trains() -> None:
    """``--package`` names one this interpreter cannot find (found without importing it): exit 2, nothing trained."""
    from _fsdp_shim.status import installed_packages
    from _fsdp_shim.verify import PACKAGES

    missing = [package for package in PACKAGES if package not in installed_packages()]
    if not missing:
        pytest.skip("both Lightning packages are installed")
    proc = verify("--package", missing[0], env=clean_env())
    assert proc.returncode == 2 and "with the shim off" not in proc.stderr
    assert f"fsdp-shim verify: {PACKAGES[missing[0]]} is not installed in this interpreter (" in proc.stderr


def test_the_help_says_each_default(capsys: pytest.CaptureFixture[str]) -> None:
    from _fsdp_shim.cli import main

    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: bf16-true)", "(default: 1)", "(default: 3)", "(default: 1800)"):
        assert default in text, default
    assert "(default: the seed model's own causal block; with --model, not checked)" in text
    assert "example: fsdp-shim verify --model my_project.model:MyModel --devices 2" in text


def test_a_broken_lightning_next_to_a_working_one_is_failed(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """``lightning`` 2.1-2.3 without pkg_resources (setuptools >= 81) next to the standalone: a stand-in
    ``lightning`` fails the same way. FAILED, exit 1, nothing trained; the standalone is not checked, said so."""
    standalone = layout_or_skip(layouts, "standalone")
    proc = verify("--json", env=without_pkg_resources(tmp_path, "lightning"))
    assert proc.returncode == 1, proc.stderr
    (section,) = document(proc)["sections"]
    assert (section["namespace"], section["verdict"], document(proc)["verdict"]) == (
        "lightning.pytorch",
        "FAILED",
        "FAILED",
    )
    assert "fails to import" in section["reason"] and "Lightning 2.1-2.3 needs setuptools<81" in section["reason"]
    assert document(proc)["not_checked"] == {"pytorch_lightning": standalone.trainer_version}
    assert "with the shim off" not in proc.stderr


@pytest.mark.per_release  # only 2.1-2.3 import pkg_resources
def test_real_lightning_2_1_to_2_3_without_pkg_resources(layouts: dict[str, Layout], tmp_path: Path) -> None:
    version = layouts.get("lightning", Layout("lightning", "0", "0")).trainer_version
    if not (2, 1, 0) <= (base_release(version) or (0, 0, 0)) < (2, 4, 0):
        pytest.skip("needs Lightning 2.1-2.3")
    proc = verify("--json", env=without_pkg_resources(tmp_path, "pkg_resources"))
    assert proc.returncode == 1
    reason = only_section(proc)["reason"]
    assert f"(lightning {version}) is installed but fails to import" in reason and "needs setuptools<81" in reason


def without_pkg_resources(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment where importing ``package`` fails as setuptools 81 makes Lightning 2.1-2.3 fail."""
    folder = tmp_path / "shadow" / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pkg_resources'\", name='pkg_resources')\n"
    )
    env = clean_env()
    env["PYTHONPATH"] = f"{folder.parent}:{env.get('PYTHONPATH', '')}"
    return env


def test_without_torch_or_lightning_it_says_so_exit_2(tmp_path: Path) -> None:
    """An interpreter with fsdp-shim and its dependencies but no torch; then this one without Lightning, also with a
    ``--model`` whose module imports Lightning: refused before that module runs, not blamed on it."""
    import packaging

    environment, dependencies = tmp_path / "venv", tmp_path / "dependencies"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True)
    shutil.copytree(Path(packaging.__file__).parent, dependencies / "packaging")
    python = str(environment / "bin" / "python")
    purelib = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    )
    Path(purelib.strip(), "aa_paths.pth").write_text(f"{ROOT}\n{dependencies}\n")
    command = [python, "-m", "fsdp_shim", "verify"]
    no_torch = subprocess.run(command, capture_output=True, text=True, env=clean_env(PYTHONPATH=None), cwd=tmp_path)
    assert no_torch.returncode == 2 and "torch is not installed in this interpreter" in no_torch.stderr
    no_lightning = verify(env=clean_env(PYTHONPATH=str(ROOT)), cwd=tmp_path)  # this checkout, not the installed one
    assert no_lightning.returncode == 2, no_lightning.stderr
    assert "fsdp-shim verify: Lightning is not installed in this interpreter (" in no_lightning.stderr
    with_model = verify("--model", "user_models:make_model", env=clean_env(PYTHONPATH=str(ROOT)), cwd=MODELS)
    assert with_model.returncode == 2 and "Lightning is not installed in this interpreter (" in with_model.stderr


def test_a_model_that_raises_only_without_the_shim_where_the_release_casts_is_fixed_by_the_recompute() -> None:
    """On 2.5+ the cast is Lightning's own: a model that trained only with the shim was made to by the recompute
    (its run checkpointed the same as its plain run), and the cast has no run without the shim to compare with."""
    from _fsdp_shim.verify.command import RankResult, judge_raised

    fixes = {"cast": {"state": "built in", "reason": "left untouched"}, "recompute": {"state": "patched", "reason": ""}}
    run = RankResult(0, BF16, [BF16], losses=[1.5], param_hashes={"w": "1"}, lightning="2.5.0", fixes=fixes)
    raised = {"in_recompute": False, "message": "RuntimeError: expected mat1 and mat2 to have the same dtype"}
    verdicts = judge_raised(raised, [run], [run], "bf16-true")
    assert (verdicts["recompute"][0], verdicts["cast"][0]) == ("fixed", None), verdicts
    affected = replace(run, lightning="2.4.0", fixes={**fixes, "cast": {"state": "patched", "reason": ""}})
    verdicts = judge_raised(raised, [affected], [affected], "bf16-true")
    assert (verdicts["cast"][0], verdicts["recompute"][0]) == ("fixed", None), verdicts


def wait_for_pids(folder: Path, count: int, seconds: float = 120) -> list[int]:
    deadline = time.monotonic() + seconds
    while len(pids := [int(p.stem) for p in folder.glob("*.pid")]) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"the hanging probe did not start within {seconds} s")
        time.sleep(0.2)
    return pids


@pytest.mark.usefixtures("lightning_installed")
def test_a_probe_that_runs_past_timeout_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = verify(
        "--model",
        "hanging_models:Model",
        "--timeout",
        "20",
        cwd=MODELS,
        env=clean_env(FSDP_SHIM_TEST_PIDS=str(tmp_path)),
    )
    assert time.monotonic() - start < 120
    pids = wait_for_pids(tmp_path, 2, seconds=0)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "fsdp-shim verify: reading the installed Lightning, then training with the shim on ran past --timeout 20 s; "
        "every process it started was stopped"
    )
    time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.usefixtures("lightning_installed")
def test_ctrl_c_stops_every_process_the_probe_started(tmp_path: Path) -> None:
    command = subprocess.Popen(
        [FSDP_SHIM, "verify", "--model", "hanging_models:Model"],
        cwd=MODELS,
        env=clean_env(FSDP_SHIM_TEST_PIDS=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = wait_for_pids(tmp_path, 2)
    command.send_signal(signal.SIGINT)
    _, stderr = command.communicate(timeout=60)
    assert command.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == (
        "fsdp-shim verify: interrupted while reading the installed Lightning, then training with the shim on; every "
        "process it started was stopped"
    )
    time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []


def test_a_model_that_raised_without_the_shim_outside_a_recompute_credits_the_cast() -> None:
    """The cast made it train (FSDP's "uniform dtype" error without the shim): the cast is fixed; the recompute, with
    no run without the shim to compare with, has no verdict; a dtype still wrong with the shim is FAILED."""
    states = {fix: FixStatus(fix, State.PATCHED, True).as_dict() for fix in ("cast", "recompute")}
    run = RankResult(rank=0, module_dtype=BF16, flat_param_dtypes=[BF16], losses=[2.5, 2.25], param_hashes={"w": "a"})
    on = [replace(run, lightning="2.4.0", namespace="lightning.pytorch", fixes=states)]
    raised = {"message": "ValueError: Must flatten tensors with uniform dtype", "in_recompute": False}
    verdicts = judge_raised(raised, on, on, "bf16-true")
    without = "without the shim, training raised ValueError: Must flatten tensors with uniform dtype; "
    assert verdicts["cast"] == ("fixed", without + "with the shim it trains")
    assert verdicts["recompute"] == (None, without + "so there is no run without the shim to compare with")
    wrong = judge_raised(raised, [replace(on[0], module_dtype="torch.float32")], None, "bf16-true")["cast"]
    assert wrong[0] == "FAILED" and "LightningModule.dtype is torch.float32 on rank 0" in wrong[1]
