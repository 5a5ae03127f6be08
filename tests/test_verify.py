"""``fsdp-shim verify`` end to end, in fresh processes, on whatever Lightning this session holds: a
verdict per fix for every installed Trainer namespace, never one for the wrong package; the user's own
model (``--model``, run in ``tests/verify_models`` as a user runs it next to their code); the
recompute fix under activation checkpointing (``--activation-checkpointing``); and the command's
reliability (no code from the current folder, time limits, Ctrl-C, usage errors).

verify's runs are slow (every run is fresh processes importing torch and Lightning), so each
invocation serves several assertions, and the runs two tests share are made once (``runs``)."""

from __future__ import annotations

import itertools
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
    DTYPES,
    FSDP_SHIM,
    NAMESPACES,
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

from _fsdp_shim.config import CAST, FIXES, RECOMPUTE, base_release
from _fsdp_shim.verify import seed
from _fsdp_shim.verify.output import render
from _fsdp_shim.verify.records import Options, RankResult
from _fsdp_shim.verify.selection import select
from _fsdp_shim.verify.verdict import Section, fix_entries, judge_recompute

MODELS = ROOT / "tests" / "verify_models"
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
"""verify's own byte keys (conftest's ``BYTE_KEYS`` are the training scenario's)."""
LAST_WITH_PKG_RESOURCES = (2, 4, 0)  # a fact about Lightning: 2.4.0 no longer imports pkg_resources


# ----------------------------------------------------------------------------- helpers
def document(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return json.loads(proc.stdout)


def sections(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {section["namespace"]: section for section in document(proc)["sections"]}


def only_section(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    found = document(proc)["sections"]
    assert len(found) == 1, found
    return found[0]


def fix_entry(section: dict[str, Any], name: str) -> dict[str, Any]:
    return next(entry for entry in section["fixes"] if entry["fix"] == name)


def verify_model(namespace: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """verify run in ``tests/verify_models``, whose modules are written against ``namespace``."""
    return verify(*args, env=clean_env(FSDP_SHIM_TEST_LIGHTNING=namespace, **(env or {})), cwd=MODELS)


class Runs:
    """verify runs that more than one test reads, made once per session."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = {}

    def model(self, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
        key = (namespace, *args)
        if key not in self._cache:
            self._cache[key] = verify_model(namespace, *args)
        return self._cache[key]


@pytest.fixture(scope="session")
def runs() -> Runs:
    return Runs()


def with_missing_pkg_resources(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment where importing ``package`` fails the way setuptools 81 makes Lightning 2.1–2.3
    fail: ``ModuleNotFoundError: No module named 'pkg_resources'``."""
    folder = tmp_path / "shadow" / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pkg_resources'\", name='pkg_resources')\n"
    )
    env = clean_env()
    env["PYTHONPATH"] = f"{folder.parent}:{env.get('PYTHONPATH', '')}"
    return env


def assert_seed_fixed(section: dict[str, Any]) -> None:
    """The cast's verdict on the seed model in ``bf16-true`` (verify's default precision)."""
    assert section["verdict"] == "fixed", section["reason"]
    want = DTYPES["bf16-true"]
    for off, on in zip(section["shim_off"], section["shim_on"]):
        assert (off["module_dtype"], on["module_dtype"]) == ("torch.float32", want)
        assert off["flat_param_dtypes"] == sorted([want, "torch.float32"]) and on["flat_param_dtypes"] == [want]
        units_off, units_on = off["unit_param_bytes"], on["unit_param_bytes"]
        assert units_on["pretrained"] * 2 == units_off["pretrained"]  # loaded in float32: exactly half
        assert units_on["model"] == units_off["model"]  # built in configure_model: already half precision
        assert units_on["block"] == units_off["block"] > 0  # the causal block: built in configure_model too
        # Two equal models, one already half precision, one loaded in float32 (twice the bytes):
        # unpatched 1 + 2 = 3 units, patched 1 + 1 = 2; the causal block's bytes (Adam: two moments) aside.
        for key, blocks in zip(BYTE_KEYS, (1, 1, 2)):
            block = units_on["block"] * blocks
            assert (on[key] - block) * 3 == (off[key] - block) * 2, key


def assert_seed_recompute_fixed(section: dict[str, Any], recompute: dict[str, Any]) -> None:
    """The seed's causal block makes its mask without a dtype: checkpointed, it raises without the shim
    (float32 meets the precision's dtype in the recompute) and equals the unchecked run with it, bit for bit."""
    assert recompute["verdict"] == "fixed", recompute["reason"]
    assert recompute["reason"].startswith("with the shim, checkpointing CausalBlock (")
    assert same_bits(section["shim_on"], section["checkpointed_shim_on"])
    assert all(r["checkpointed"] > 0 for r in section["checkpointed_shim_on"])
    error = section["checkpointed_shim_off"][0]["error"]
    assert error is not None and f"with the shim off, the checkpointed run raised {error}" in recompute["reason"]


def assert_exactly_half(section: dict[str, Any], devices: int, steps: int = 3) -> None:
    assert section["verdict"] == "fixed", section["reason"]
    assert len(section["shim_off"]) == len(section["shim_on"]) == devices
    for rank, (off, on) in enumerate(zip(section["shim_off"], section["shim_on"])):
        assert off["rank"] == on["rank"] == rank
        assert (off["module_dtype"], on["module_dtype"]) == ("torch.float32", "torch.bfloat16")
        assert (off["flat_param_dtypes"], on["flat_param_dtypes"]) == (["torch.float32"], ["torch.bfloat16"])
        for key in BYTE_KEYS:
            assert on[key] * 2 == off[key], (rank, key)
        assert len(off["losses"]) == len(on["losses"]) == steps
        assert off["peak_memory_kind"] == "peak RSS above the import baseline"


def same_bits(plain: list[dict[str, Any]], checkpointed: list[dict[str, Any]]) -> bool:
    """Every rank's losses and parameter-shard hashes the same (``float.hex``: NaN equals NaN)."""
    return len(plain) == len(checkpointed) and all(
        [float(v).hex() for v in a["losses"]] == [float(v).hex() for v in b["losses"]]
        and a["param_hashes"] == b["param_hashes"]
        for a, b in zip(plain, checkpointed)
    )


def as_section(data: dict[str, Any]) -> Section:
    """A ``--json`` section as verify's own record, for its text renderer and its verdicts."""
    runs = ("shim_off", "shim_on", "checkpointed_shim_off", "checkpointed_shim_on")
    return Section(**{**data, **{k: data[k] and [RankResult(**r) for r in data[k]] for k in runs}})


# ----------------------------------------------------------------------------- the seed model, per release
@pytest.mark.per_release
def test_every_installed_trainer_namespace_gets_its_own_verdict_naming_each_fix(
    layouts: dict[str, Layout], planted: Path
) -> None:
    """With ``--package all``, one verdict per installed Trainer namespace, with its own release's figures;
    each section names every fix, whether its release lacks it and whether the shim applied it, as
    ``_fsdp_shim.config`` says for that release. Run from a folder holding a ``yaml.py`` and a
    ``packaging.py``: verify's probes run none of it (they run by path, and only ``--model`` gets the
    current folder)."""
    versions = trainer_versions(layouts)
    if not versions:
        pytest.skip("no Lightning installed")
    proc = verify("--package", "all", "--json", cwd=planted)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in planted.glob("RAN-*")} == set()
    assert (document(proc)["package"], document(proc)["skipped"]) == ("all", [])
    found = sections(proc)
    assert sorted(found) == sorted(versions)
    for namespace, version in versions.items():
        section = found[namespace]
        assert section["version"] == version
        assert [entry["fix"] for entry in section["fixes"]] == [fix.name for fix in FIXES]
        for fix in FIXES:
            shim = fix_entry(section, fix.name)["shim"]
            assert shim["affected"] is fix.affects(version), (namespace, shim)
            assert shim["patched"] is fix.affects(version), (namespace, shim)  # the shim applies what is lacking
            assert bool(shim["targets"]) is shim["patched"]  # and names the methods it wrapped for it
        cast = fix_entry(section, CAST.name)
        assert (cast["verdict"], cast["reason"]) == (section["verdict"], section["reason"])
        recompute = fix_entry(section, RECOMPUTE.name)
        if RECOMPUTE.affects(version):  # the seed's causal block, checkpointed: measured on every such release
            assert_seed_recompute_fixed(section, recompute)
        if CAST.affects(version):
            assert_seed_fixed(section)
        else:
            assert section["verdict"] == "not needed"
            assert section["shim_off"] is None  # the cast is decided by the gates alone
            if base_release(version) >= CAST.first_affected:
                assert CAST.unaffected_reason(version) in section["reason"]
            if RECOMPUTE.affects(version):
                assert "not measured: trained for the recompute only" in section["reason"]
            elif base_release(version) >= CAST.first_affected:
                assert section["shim_on"] is None and "nothing was trained" in section["reason"]


def test_the_table_two_processes_the_fixes_and_the_phases(layouts: dict[str, Layout]) -> None:
    """The text report with 2 processes: the table's rows, the fixes each release lacks and what the
    shim did, one line per fix's verdict (the recompute's measured with the seed's causal block), the
    phases on stderr, 100 columns, each term once. By default the standalone pytorch_lightning next to
    lightning (which pip brings along) is not trained: said after the sections, with how to check it."""
    installed = trainer_versions(layouts)
    both = len(installed) == 2
    versions = {ns: v for ns, v in installed.items() if not (both and ns == TRAINER["standalone"])}
    affected = [ns for ns, v in versions.items() if CAST.affects(v)]
    if not affected:
        pytest.skip("the table's 'fixed' rows need an affected release")
    proc = verify("--devices", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "CPU check with gloo, 2 process(es)" in proc.stdout
    assert "verdict: fixed" in proc.stdout
    for row in (
        "LightningModule.dtype",
        "flat-parameter dtypes",
        "sharded parameter bytes",
        seed.UNITS["pretrained"],
        seed.UNITS["model"],
        "sharded gradient bytes",
        "optimizer-state bytes",
        "peak memory",
        "losses (3 steps)",
    ):
        assert row in proc.stdout
    assert "(peak memory: peak RSS above the import baseline)" in proc.stdout
    pretrained_row = next(line for line in lines if seed.UNITS["pretrained"] in line)
    assert pretrained_row.rstrip().endswith("-50%")
    for namespace, version in versions.items():  # each section: the fixes its release lacks, then a line per fix
        lacking = ", ".join(f"{fix.name} (applied by the shim)" for fix in FIXES if fix.affects(version))
        start = lines.index(f"  fixes this release lacks: {lacking}", lines.index(f"{namespace} {version}"))
        verdicts = [line.split(":")[0] for line in itertools.takewhile(bool, lines[start + 1 :])]
        assert [line for line in verdicts if not line.startswith("    ")] == [f"  {fix.name}" for fix in FIXES]
    assert "  fixes this release lacks: cast (applied by the shim), recompute (applied by the shim)" in lines
    assert any(line.startswith("  cast: fixed: sharded parameters, gradients and optimizer state") for line in lines)
    recompute = [line for line in lines if line.startswith("  recompute: fixed: with the shim, checkpointing Causal")]
    assert len(recompute) == sum(RECOMPUTE.affects(v) for v in versions.values())
    assert not [line for line in lines if line.startswith(tuple(f"  {fix.name}: not checked" for fix in FIXES))]
    # The counter counts the runs once (the gate, before their number is known, is not
    # numbered), everything fits 100 columns, and each term is explained once.
    phases = [line for line in proc.stderr.splitlines() if line.startswith("fsdp-shim verify: ")]
    assert phases[0] == "fsdp-shim verify: reading the installed Lightning ..."
    label = f"{affected[0]} {versions[affected[0]]}"
    total = len(phases) - 1
    assert phases[1:5] == [
        f"fsdp-shim verify: [1/{total}] {label}: training with the shim off ...",
        f"fsdp-shim verify: [2/{total}] {label}: training with the shim on ...",
        f"fsdp-shim verify: [3/{total}] {label}: training with the shim off, with activation checkpointing ...",
        f"fsdp-shim verify: [4/{total}] {label}: training with the shim on, with activation checkpointing ...",
    ]
    # A release that has the cast is trained for the recompute only: 3 runs (the checkpointed one raised).
    assert total == 4 * len(affected) + 3 * sum(RECOMPUTE.affects(v) and not CAST.affects(v) for v in versions.values())
    assert max(len(line) for line in lines) <= 100, proc.stdout
    if both:  # the standalone: no section, no run; one note, after the sections, saying how to check it
        note = lines.index(f"{TRAINER['standalone']} {installed[TRAINER['standalone']]}")
        assert note > max(lines.index(f"{ns} {v}") for ns, v in versions.items())
        assert lines[note + 1].startswith("  not checked: installed next to lightning (pip brings it along")
        assert "--package pytorch_lightning (--package all checks both)" in " ".join(" ".join(lines[note:]).split())
        assert f"{TRAINER['standalone']} {installed[TRAINER['standalone']]}:" not in proc.stdout  # in no verdict
    for term in ("GPU guards lifted:", "flat parameter:", "seed model:"):
        assert sum(line.startswith(f"  {term}") for line in lines) == 1, term


def test_a_broken_lightning_next_to_a_working_one_is_failed_not_not_needed(
    layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """`lightning` 2.1–2.3 without pkg_resources (setuptools >= 81) next to the standalone
    2.6.x. Here a stand-in `lightning` fails the same way; the real one is checked on 2.1–2.3 below.
    The standalone, which pip brought along, is not checked: by default, and with ``--package lightning``,
    each time saying why and how to check it (with ``--package pytorch_lightning`` verify trains it)."""
    standalone = layout_or_skip(layouts, "standalone")
    env = with_missing_pkg_resources(tmp_path, "lightning")
    for package, why in [(None, "installed next to lightning"), ("lightning", "(--package lightning;")]:
        proc = verify(*(["--package", package] if package else []), "--json", env=env)
        assert proc.returncode == 1
        found = sections(proc)
        assert list(found) == ["lightning.pytorch"] and found["lightning.pytorch"]["verdict"] == "FAILED"
        reason = found["lightning.pytorch"]["reason"]
        assert "lightning.pytorch" in reason and "fails to import" in reason
        assert "No module named 'pkg_resources'" in reason and "Lightning 2.1-2.3 needs setuptools<81" in reason
        (skipped,) = document(proc)["skipped"]
        assert (skipped["namespace"], skipped["version"]) == ("pytorch_lightning", standalone.trainer_version)
        assert skipped["reason"].startswith("not checked") and why in skipped["reason"]
        assert document(proc)["verdict"] == "FAILED"
        assert "training with the shim" not in proc.stderr  # nothing was trained
    status = subprocess.run(
        [sys.executable, "-m", "fsdp_shim", "status", "--python-check"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert status.returncode == 1
    assert "PROBLEM: lightning" in status.stdout and "needs setuptools<81" in status.stdout


@pytest.mark.per_release  # only 2.1–2.3 import pkg_resources: it runs (and means something) in their sessions
def test_real_lightning_2_1_to_2_3_without_pkg_resources(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """What setuptools 81 does to Lightning 2.1–2.3: pkg_resources is gone, and `import lightning` fails."""
    version = layouts.get("lightning", Layout("lightning", "0", "0")).trainer_version
    release = base_release(version)
    if release is None or not CAST.first_affected <= release < LAST_WITH_PKG_RESOURCES:
        pytest.skip("needs Lightning 2.1–2.3")
    proc = verify("--json", env=with_missing_pkg_resources(tmp_path, "pkg_resources"))
    assert proc.returncode == 1
    reason = sections(proc)["lightning.pytorch"]["reason"]
    assert f"(lightning {version}) is installed but fails to import" in reason
    assert "Lightning 2.1-2.3 needs setuptools<81" in reason


# ----------------------------------------------------------------------------- activation checkpointing
def test_checkpointing_layers_that_give_every_tensor_a_dtype_is_not_needed(layouts: dict[str, Layout]) -> None:
    """``nn.Linear`` makes no tensor of its own, so checkpointing it changes nothing, with the shim or
    without: "not needed", measured bit for bit (every loss, every rank's parameter shards).
    ``--activation-checkpointing`` trains a release that has the cast too (whose cast is then measured):
    the fixed standalone one where this session has it."""
    standalone = layouts.get("standalone")
    fixed = standalone is not None and not CAST.affects(standalone.trainer_version)
    namespace = TRAINER["standalone"] if fixed else an_affected_namespace(layouts, "trainer")[0]
    blocks = "torch.nn:Linear"
    proc = verify_model(
        namespace, "--model", "user_models:Checkpointed", "--activation-checkpointing", blocks, "--json"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert document(proc)["activation_checkpointing"] == [blocks]
    section = only_section(proc)
    assert section["namespace"] == namespace
    recompute = fix_entry(section, RECOMPUTE.name)
    assert recompute["verdict"] == "not needed", recompute["reason"]
    assert "explicit dtype" in recompute["reason"] and "checkpointing Linear" in recompute["reason"]
    for shim in ("shim_off", "shim_on"):
        plain, checkpointed = section[shim], section[f"checkpointed_{shim}"]
        assert same_bits(plain, checkpointed), shim
        # Lightning's policy wrapped every module of the named classes the run without it counted.
        assert [r["checkpointed"] for r in checkpointed] == [r["checkpointed"] for r in plain]
        assert all(r["checkpointed"] > 0 and r["error"] is None for r in checkpointed)
    if fixed:
        assert section["verdict"] == "not needed" and "measured: the shim changes nothing" in section["reason"]


@pytest.mark.parametrize(
    ("package", "devices", "init_args"), [("lightning", 1, '{"cast": true}'), ("standalone", 2, "{}")]
)
def test_a_block_that_makes_a_tensor_without_a_dtype_is_fixed(
    package: str, devices: int, init_args: str, layouts: dict[str, Layout], runs: Runs
) -> None:
    """``user_models.Block`` multiplies by a tensor it makes without a dtype: bfloat16 in the forward,
    float32 when checkpointing recomputes it. With the shim the checkpointed run equals the run
    without checkpointing bit for bit, on every rank. Without it, 2.6.6 (bfloat16 weights) raises
    torch's CheckpointError; 2.4.0's unpatched float32 weights with ``cast`` (the tensor converted to
    the input's dtype) train silently on other values, and verify names the first difference."""
    layout = layout_or_skip(layouts, package)
    if not RECOMPUTE.affects(layout.trainer_version):
        pytest.skip("needs a release that lacks the recompute fix")
    if package == "lightning" and not CAST.affects(layout.trainer_version):
        pytest.skip("the case of unpatched float32 weights needs Lightning 2.1–2.4")
    namespace = NAMESPACES[package][0]
    args = ("--model", "user_models:Checkpointed", "--init-args", init_args, "--activation-checkpointing")
    proc = runs.model(namespace, *args, "user_models:Block", "--devices", str(devices), "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = only_section(proc)
    assert section["namespace"] == namespace
    recompute = fix_entry(section, RECOMPUTE.name)
    assert recompute["verdict"] == "fixed", recompute["reason"]
    assert same_bits(section["shim_on"], section["checkpointed_shim_on"])
    assert [r["rank"] for r in section["checkpointed_shim_on"]] == list(range(devices))
    off, off_checkpointed = section["shim_off"], section["checkpointed_shim_off"]
    if CAST.affects(layout.trainer_version):  # unpatched 2.1–2.4: float32 weights, the same dtype in the recompute
        assert off_checkpointed[0]["error"] is None and not same_bits(off, off_checkpointed)
        assert "with the shim off, the checkpointed run differs first in" in recompute["reason"]
    else:
        assert off_checkpointed[0]["error"].startswith("CheckpointError: ")
        assert f"with the shim off, the checkpointed run raised {off_checkpointed[0]['error']}" in recompute["reason"]
    text = render([as_section(section)], Options(devices=devices, model="user_models:Checkpointed"))
    assert "  fixes this release lacks: " in text and "recompute (applied by the shim)" in text
    assert "\n  recompute: fixed: with the shim, checkpointing Block (2 modules) changes nothing" in text
    assert "verdict: fixed (" in text and "recompute fixed)" in text


def test_a_recompute_that_differs_is_failed_naming_the_first_difference(layouts: dict[str, Layout], runs: Runs) -> None:
    """verify's recompute verdict on real runs (the 2.4.0 ones above), as if the shim had done nothing:
    its shim-on runs replaced by the shim-off ones. "FAILED" says the shim did not apply the fix, and
    names the first step whose loss differs (or the first parameter, were every loss the same)."""
    layout = layout_or_skip(layouts, "lightning")
    if not CAST.affects(layout.trainer_version):
        pytest.skip("needs an unpatched 2.1–2.4 (its checkpointed run differs without raising)")
    args = ("--model", "user_models:Checkpointed", "--init-args", '{"cast": true}', "--activation-checkpointing")
    proc = runs.model("lightning.pytorch", *args, "user_models:Block", "--devices", "1", "--json")
    section = as_section(only_section(proc))
    off, off_ac = section.shim_off, section.checkpointed_shim_off
    assert off is not None and off_ac is not None
    verdict, reason = judge_recompute(off, off, off_ac, off_ac, "Block")
    assert verdict == "FAILED"
    assert reason.startswith("the shim did not apply it to lightning.pytorch: switched off by FSDP_SHIM")
    steps = [i for i, (a, b) in enumerate(zip(off[0].losses, off_ac[0].losses), 1) if float(a).hex() != float(b).hex()]
    if steps:
        assert f"with the shim, the checkpointed run differs first in the loss of step {steps[0]} (" in reason
    else:
        name = next(n for n, h in off[0].param_hashes.items() if off_ac[0].param_hashes[n] != h)
        assert f"with the shim, the checkpointed run differs first in parameter {name}" in reason


def test_a_shim_that_does_not_apply_the_recompute_is_failed(layouts: dict[str, Layout]) -> None:
    """``FSDP_SHIM_DISABLED_FIXES=recompute``: the shim leaves the recompute as it is, so its checkpointed
    run raises as the shim-off one does. The text report says the fix was not applied and what the
    checkpointed run raised, exit code 1; the cast, still applied, is still "fixed"."""
    namespace, version = an_affected_namespace(layouts, "trainer")
    args = ("--model", "user_models:Checkpointed", "--activation-checkpointing", "user_models:Block")
    proc = verify_model(namespace, *args, env={"FSDP_SHIM_DISABLED_FIXES": RECOMPUTE.name})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())  # the report wraps at 100 columns
    assert "fixes this release lacks: cast (applied by the shim), recompute (NOT applied: switched off by" in text
    assert "cast: fixed: sharded parameters" in text
    failed = f"recompute: FAILED: the shim did not apply it to {namespace}: switched off by FSDP_SHIM_DISABLED_FIXES"
    assert f"{failed}; with the shim, the checkpointed run raised CheckpointError: " in text
    assert "(with the shim off, the checkpointed run raised CheckpointError: " in text
    assert f"verdict: FAILED ({namespace} {version}: cast fixed, recompute FAILED)" in text


def test_activation_checkpointing_of_a_class_the_model_lacks_is_a_usage_error(layouts: dict[str, Layout]) -> None:
    """Checkpointing nothing would compare a run with itself: refused after the first run, exit 2."""
    namespace = an_affected_namespace(layouts, "trainer", fix=RECOMPUTE.name)[0]
    proc = verify_model(
        namespace, "--model", "user_models:ThreeWays", "--activation-checkpointing", "user_models:Block"
    )
    assert proc.returncode == 2, proc.stderr
    message = "--activation-checkpointing: this model has no module of user_models:Block to checkpoint"
    assert proc.stderr.strip().splitlines()[-1] == f"fsdp-shim verify: {message}"
    assert "[1/4]" in proc.stderr and "[2/4]" not in proc.stderr


# ----------------------------------------------------------------------------- the user's own model
@pytest.mark.parametrize("devices", [1, 2])
def test_layers_from_init_configure_model_and_a_float32_state_dict_are_exactly_halved(
    devices: int, layouts: dict[str, Layout], runs: Runs
) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    wide = ("--init-args", '{"hidden": 64}') if devices == 1 else ()  # shared with the test below
    proc = runs.model(namespace, "--model", "user_models:ThreeWays", *wide, "--devices", str(devices), "--json")
    assert proc.returncode == 0, proc.stderr
    section = only_section(proc)
    assert section["namespace"] == namespace
    assert_exactly_half(section, devices)


def test_a_factory_and_init_args(layouts: dict[str, Layout], runs: Runs) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    factory = only_section(runs.model(namespace, "--model", "user_models:make_model", "--json"))
    wide = only_section(
        runs.model(
            namespace, "--model", "user_models:ThreeWays", "--init-args", '{"hidden": 64}', "--devices", "1", "--json"
        )
    )
    for section in (factory, wide):
        assert_exactly_half(section, 1)
    # The arguments reached the constructors: the factory builds 48 hidden units, --init-args asks for 64.
    assert factory["shim_off"][0]["param_bytes"] < wide["shim_off"][0]["param_bytes"]


def test_a_module_without_data(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, "--model", "user_models:NoData")
    assert proc.returncode == 2
    assert "user_models:NoData has no train_dataloader; pass --datamodule" in proc.stderr
    assert "training with the shim" not in proc.stderr  # refused before any training
    with_data = verify_model(namespace, "--model", "user_models:NoData", "--datamodule", "user_models:Data", "--json")
    assert with_data.returncode == 0, with_data.stderr
    assert_exactly_half(only_section(with_data), 1)


def test_an_error_in_the_users_code_is_theirs(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, "--model", "user_models:RaisesInTrainingStep")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert str(MODELS / "user_models.py") in proc.stderr
    assert "ValueError: a bug in the user's training_step" in proc.stderr
    assert "your code raised while training (shim off)" in proc.stderr
    # It was trained with the shim too, which raised the same: the user's code, not what the shim fixes.
    assert "training with the shim on ..." in proc.stderr
    assert "and with the shim on too (ValueError: a bug in the user's training_step)" in proc.stderr
    assert "FAILED" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(("package", "devices", "extra"), [("lightning", 1, ()), ("standalone", 2, ("--measure",))])
def test_a_model_that_checkpoints_in_its_own_forward_and_raises_without_the_shim_is_fixed(
    package: str, devices: int, extra: tuple[str, ...], layouts: dict[str, Layout]
) -> None:
    """``user_models.ChecksItsOwnForward`` calls ``torch.utils.checkpoint`` in its own forward: without the
    shim its backward raises (a recompute in float32 meets bfloat16), so there is no run to compare with;
    verify trains it with the shim anyway, and it trains: the recompute is "fixed", named by what it raised.
    The cast cannot be compared on 2.1-2.4 ("not checked", its dtypes shown); 2.5+ has it."""
    layout = layout_or_skip(layouts, package)
    if not RECOMPUTE.affects(layout.trainer_version):
        pytest.skip("needs a release that lacks the recompute fix")
    namespace = NAMESPACES[package][0]
    args = ("--model", "user_models:ChecksItsOwnForward", "--devices", str(devices), *extra)
    proc = verify_model(namespace, *args, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = only_section(proc)
    assert section["namespace"] == namespace and section["shim_off"] is None
    assert [r["rank"] for r in section["shim_on"]] == list(range(devices))
    assert "CheckpointError" in section["shim_off_error"] and "Traceback" in section["shim_off_error"]
    recompute = fix_entry(section, RECOMPUTE.name)
    assert recompute["verdict"] == "fixed", recompute["reason"]
    assert recompute["reason"].startswith(
        "without the shim, a recompute of torch's checkpoint raised CheckpointError: "
    )
    assert recompute["reason"].endswith("; with the shim it trains")
    cast = fix_entry(section, CAST.name)
    if CAST.affects(layout.trainer_version):
        assert (cast["verdict"], section["verdict"]) == (None, "not checked")
        assert "so there is nothing to compare with; with the shim, LightningModule.dtype and every" in cast["reason"]
    else:
        assert cast["verdict"] == section["verdict"] == "not needed"
    assert document(proc)["verdict"] == "fixed"
    text = render([as_section(section)], Options(devices=devices, model="user_models:ChecksItsOwnForward"))
    assert "\n  recompute: fixed: without the shim, a recompute of torch's checkpoint raised CheckpointError" in text
    assert "your code raised" not in proc.stderr


TORCH_2_1_CPU_STREAM = """
import torch.cpu


class Stream:  # torch 2.1's CPU stream: no __init__, so FSDP's Stream(priority=0) raises TypeError
    pass


torch.cpu.Stream = Stream
"""


@pytest.mark.usefixtures("lightning_installed")
def test_a_torch_that_cannot_run_fsdp_on_cpu_is_named_not_the_model(tmp_path: Path) -> None:
    """torch 2.1's CPU device handle has no streams, so FSDP's lazy init raises ``TypeError: Stream() takes
    no arguments`` inside torch, whatever the model. Here torch 2.1's ``torch.cpu.Stream`` is put in place
    in verify's processes (a ``sitecustomize`` on ``PYTHONPATH``) and the real FSDP raises it: verify names
    torch and where in its FSDP it raised, exit 2, before any model (``--model`` too) is imported."""
    (tmp_path / "sitecustomize.py").write_text(TORCH_2_1_CPU_STREAM)
    env = clean_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    pids = tmp_path / "pids"
    pids.mkdir()
    for args in ([], ["--model", "hanging_models:Model"]):  # that module hangs once imported
        proc = verify(*args, env={**env, "FSDP_SHIM_TEST_PIDS": str(pids)}, cwd=MODELS)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        release = ".".join(torch_version().split(".")[:2])
        assert proc.stderr.strip().splitlines()[-1] == (
            f"fsdp-shim verify: torch {release} cannot run FSDP on this machine's CPU (TypeError: Stream() takes "
            "no arguments, raised in torch/distributed/fsdp/_runtime_utils.py: _init_streams)"
        )
        assert "your model" not in proc.stderr and "Traceback" not in proc.stderr
    assert list(pids.iterdir()) == []


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def test_where_an_error_was_raised_in_torchs_fsdp() -> None:
    """The classifier on real exceptions: FSDP on CPU without ``device_id`` raises in its own set-up: torch's
    FSDP, named by the innermost FSDP frame. An error raised by code FSDP called (a wrap policy of the
    user's) is not torch's, nor is one raised outside torch."""
    torch = pytest.importorskip("torch")
    from torch.distributed.fsdp import FullyShardedDataParallel

    from _fsdp_shim.verify.probe import raised_in_torch_fsdp

    with pytest.raises(RuntimeError, match="FSDP needs a non-CPU accelerator device") as inside:
        FullyShardedDataParallel(torch.nn.Linear(2, 2))  # no device_id on CPU: torch's FSDP refuses
    where = raised_in_torch_fsdp(inside.value)
    assert where is not None and where.startswith("torch/distributed/fsdp/_init_utils.py: "), where

    def policy(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the user's policy")

    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="the user's policy") as called:
            FullyShardedDataParallel(torch.nn.Linear(2, 2), auto_wrap_policy=policy, device_id=torch.device("cpu"))
    finally:
        torch.distributed.destroy_process_group()
    assert raised_in_torch_fsdp(called.value) is None
    with pytest.raises(ValueError) as outside:
        int("x")
    assert raised_in_torch_fsdp(outside.value) is None


def test_a_recompute_the_shim_says_is_not_in_effect_is_failed_never_applied(
    layouts: dict[str, Layout], runs: Runs
) -> None:
    """``fsdp_shim.status()`` says the recompute is ``patched=False``, "not in effect on torch ..." where the
    shim could not show, on that torch, that a checkpoint recomputes in its forward's dtype. verify's verdict
    and text on real runs (2.4.0's, from the test above) with that status in their shim-on results: the
    recompute is FAILED with that reason, checked or not, and nothing says it was applied or fixed."""
    layout = layout_or_skip(layouts, "lightning")
    if not CAST.affects(layout.trainer_version):
        pytest.skip("needs an unpatched 2.1–2.4 (the runs of the test above)")
    args = ("--model", "user_models:Checkpointed", "--init-args", '{"cast": true}', "--activation-checkpointing")
    proc = runs.model("lightning.pytorch", *args, "user_models:Block", "--devices", "1", "--json")
    section = as_section(only_section(proc))
    reason = (
        "not in effect on torch 2.13.0 for the non-reentrant checkpoint (torch recomputed it without the shim's "
        "pinned function (its checkpoint calls other functions)); in effect for the reentrant and composable "
        "checkpoints"
    )
    state = {"fix": RECOMPUTE.name, "affected": True, "patched": False, "reason": reason, "targets": []}

    def with_state(results: list[RankResult] | None) -> list[RankResult]:
        assert results is not None
        return [replace(r, fixes={**r.fixes, RECOMPUTE.name: state}) for r in results]

    on, on_ac = with_state(section.shim_on), with_state(section.checkpointed_shim_on)
    verdict, why = judge_recompute(section.shim_off, on, section.checkpointed_shim_off or [], on_ac, "Block")
    assert (verdict, why) == ("FAILED", f"the shim's fix is {reason}" + why.partition(reason)[2])
    for verdicts in ({RECOMPUTE.name: (verdict, why)}, {}):  # checked, and not checked (--model alone)
        fixes = fix_entries(on[0].fixes, verdicts)
        text = render([replace(section, shim_on=on, fixes=fixes, checkpointed_shim_on=on_ac)], Options(model="m:M"))
        flat = " ".join(text.split())
        assert f"recompute (NOT applied: {reason})" in flat
        assert f"recompute: FAILED: {'the shim' + chr(39) + 's fix is ' if verdicts else ''}{reason}" in flat
        assert "recompute (applied" not in flat and "recompute: fixed" not in flat
        assert "recompute FAILED)" in flat


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "user_models:NOT_A_MODULE"], "is 'int', not a LightningModule class"),
        (["--model", "user_models:Data"], "is a class, but not a subclass of Lightning's LightningModule"),
        (["--model", "user_models:Missing"], "user_models has no attribute 'Missing'"),
        (["--model", "not_a_module_here:Model"], "cannot import 'not_a_module_here'"),
        (
            ["--model", "user_models:ThreeWays", "--activation-checkpointing", "user_models:make_model"],
            "--activation-checkpointing: user_models:make_model is not a torch.nn.Module class",
        ),
        (["--activation-checkpointing", "torch.nn:NoSuchLayer"], "torch.nn has no attribute 'NoSuchLayer'"),
    ],
)
def test_an_option_that_names_no_model_or_no_module_class(
    args: list[str], message: str, layouts: dict[str, Layout]
) -> None:
    """Refused while verify reads Lightning, before anything trains: exit 2 and the reason."""
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "training with the shim" not in proc.stderr


def test_a_fixed_release_is_not_needed_without_training(layouts: dict[str, Layout]) -> None:
    standalone = layout_or_skip(layouts, "standalone")
    if CAST.affects(standalone.trainer_version):
        pytest.skip("needs the fixed standalone pytorch_lightning")
    section = only_section(verify_model("pytorch_lightning", "--model", "user_models:ThreeWays", "--json"))
    assert section["namespace"] == "pytorch_lightning"
    assert section["verdict"] == "not needed" and "nothing was trained" in section["reason"]
    assert section["shim_off"] is None


def test_16_true_numerics_show_before_the_real_job(layouts: dict[str, Layout]) -> None:
    """With float16 weights, AdamW's default eps (1e-8, which is 0 in float16) gives NaN
    losses; unpatched 2.4 trained in float32. verify says so; eps=1e-4 trains."""
    namespace = an_affected_namespace(layouts, "trainer")[0]
    default_eps = verify_model(namespace, "--model", "user_models:ThreeWays", "--precision", "16-true", "--json")
    assert default_eps.returncode == 1
    section = only_section(default_eps)
    assert section["verdict"] == "FAILED"
    assert "the training losses are not finite with the shim while they are without it" in section["reason"]
    off, on = section["shim_off"][0], section["shim_on"][0]
    assert all(v is not None and v == v for v in off["losses"])  # finite without the shim
    assert any(v != v for v in on["losses"][1:])  # NaN from step 2 with it
    assert on["param_bytes"] * 2 == off["param_bytes"]  # the memory itself is fixed
    larger_eps = verify_model(
        namespace,
        "--model",
        "user_models:ThreeWays",
        "--precision",
        "16-true",
        "--init-args",
        '{"eps": 1e-4}',
        "--json",
    )
    assert larger_eps.returncode == 0, larger_eps.stdout
    finite = only_section(larger_eps)
    assert finite["verdict"] == "fixed"
    assert all(v == v for v in finite["shim_on"][0]["losses"])


def test_lightning_2_6_itself_gives_nan_with_the_default_eps(layouts: dict[str, Layout]) -> None:
    """The same NaN on the fixed release, measured: it is 2.5+'s behaviour, not the shim's."""
    standalone = layout_or_skip(layouts, "standalone")
    if CAST.affects(standalone.trainer_version):
        pytest.skip("needs the fixed standalone pytorch_lightning")
    proc = verify_model(
        TRAINER["standalone"], "--model", "user_models:ThreeWays", "--precision", "16-true", "--measure", "--json"
    )
    section = only_section(proc)
    assert section["verdict"] == "not needed" and "measured" in section["reason"]
    for run in ("shim_off", "shim_on"):
        assert any(v != v for v in section[run][0]["losses"][1:])


def test_the_docs_worked_example_runs_as_written(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    if namespace != "lightning.pytorch":
        pytest.skip("the docs example imports `lightning`")
    proc = verify("--model", "my_model:MyModel", cwd=ROOT / "docs" / "examples", env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fixed: sharded parameters, gradients and optimizer state are 50% smaller on rank 0" in proc.stdout


def test_a_model_that_casts_itself_is_told_the_shim_changes_nothing(layouts: dict[str, Layout]) -> None:
    """Right without the shim, so "fixed" would claim what the shim did not do."""
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, "--model", "user_models:CastsItself", "--json")
    assert proc.returncode == 0, proc.stderr
    section = only_section(proc)
    assert section["verdict"] == "not needed", section["reason"]
    assert "the shim changes nothing for this model" in section["reason"]
    off, on = section["shim_off"][0], section["shim_on"][0]
    assert off["module_dtype"] == on["module_dtype"] == "torch.bfloat16"
    for key in BYTE_KEYS:
        assert off[key] == on[key]


# ----------------------------------------------------------------------------- the command itself
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --steps: 0 is not a positive number"),
        (["--devices", "0"], "argument --devices: 0 is not a positive number"),
        (["--devices", "-1"], "argument --devices: -1 is not a positive number"),
        (["--steps", "two"], "'two' is not a whole number"),
        (["--init-args", "[1]"], "must be a JSON object"),
        (["--model", "no_colon"], "is not MODULE:ATTR"),
        (["--activation-checkpointing", "torch.nn:TransformerEncoderLayer,no_colon"], "'no_colon' is not MODULE:CLASS"),
        (["--datamodule", "m:D"], "--init-args and --datamodule need --model"),
        (["--model-path", "."], "--model-path needs --model or --activation-checkpointing"),
        (["--model", "m:M", "--package", "lightning"], "--package is for the seed model; with --model"),
        (["--package", "lightning_fabric"], "argument --package: invalid choice: 'lightning_fabric'"),
    ],
)
def test_bad_numbers_and_options_are_usage_errors_before_anything_starts(args: list[str], message: str) -> None:
    proc = verify(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "reading the installed Lightning" not in proc.stderr  # no child process was started


def test_which_namespaces_the_seed_model_trains() -> None:
    """Every installed one, but not the standalone next to lightning (pip brings it along); ``--package`` names
    one, or all; naming one that is not installed is refused. Each one left out says why and how to check it."""
    both = {"lightning.pytorch": "2.3.3", "pytorch_lightning": "2.6.6"}
    chosen, skipped = select(None, both)
    assert chosen == ["lightning.pytorch"] and [(s.namespace, s.version) for s in skipped] == [
        ("pytorch_lightning", "2.6.6")
    ]
    assert "--package pytorch_lightning" in skipped[0].reason
    assert select("all", both) == (list(both), [])
    chosen, skipped = select("pytorch_lightning", both)
    assert chosen == ["pytorch_lightning"] and [s.namespace for s in skipped] == ["lightning.pytorch"]
    assert "(--package pytorch_lightning; --package all checks every one)" in skipped[0].reason
    for alone in ({"lightning.pytorch": "2.4.0"}, {"pytorch_lightning": "2.4.0"}):
        assert select(None, alone) == (list(alone), [])
    with pytest.raises(ValueError, match="--package lightning: lightning is not installed in this interpreter"):
        select("lightning", {"pytorch_lightning": "2.4.0"})


def test_without_torch_it_says_so(tmp_path: Path) -> None:
    """An interpreter with fsdp-shim and its dependencies, and no torch."""
    import packaging

    environment = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True)
    dependencies = tmp_path / "dependencies"
    shutil.copytree(Path(packaging.__file__).parent, dependencies / "packaging")
    purelib = subprocess.check_output(
        [str(environment / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True,
    ).strip()
    Path(purelib, "aa_paths.pth").write_text(f"{ROOT}\n{dependencies}\n")
    proc = subprocess.run(
        [str(environment / "bin" / "python"), "-m", "fsdp_shim", "verify"],
        capture_output=True,
        text=True,
        env=clean_env(PYTHONPATH=None),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "torch is not installed in this interpreter" in proc.stderr
    assert "FAILED" not in proc.stdout + proc.stderr


def test_without_lightning_it_says_so(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (without it, verify says that first)")
    proc = verify(env=clean_env(PYTHONPATH=None), cwd=tmp_path)
    assert proc.returncode == 2
    assert "neither lightning nor pytorch_lightning is installed" in proc.stderr


def test_a_dotted_model_attribute_is_resolved_step_by_step() -> None:
    """``--model mod:Cls.factory``: the parser accepted it, so the probe resolves it too."""
    from _fsdp_shim.verify import probe

    assert probe.resolve("json:JSONDecoder.decode") is json.JSONDecoder.decode
    with pytest.raises(probe.ProbeStop) as stop:
        probe.resolve("json:JSONDecoder.no_factory")
    assert stop.value.code == probe.USAGE_ERROR
    assert "json.JSONDecoder has no attribute 'no_factory' (from 'json:JSONDecoder.no_factory')" in str(stop.value)


def wait_for_pids(folder: Path, count: int, seconds: float = 120) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        pids = [int(p.stem) for p in folder.glob("*.pid")]
        if len(pids) >= count:
            return pids
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise AssertionError(f"the hanging probe did not start within {seconds} s")


@pytest.mark.usefixtures("lightning_installed")
def test_a_probe_that_hangs_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    env = clean_env(FSDP_SHIM_TEST_PIDS=str(tmp_path))
    start = time.monotonic()
    proc = verify("--model", "hanging_models:Model", "--timeout", "20", cwd=MODELS, env=env)
    assert time.monotonic() - start < 120
    pids = wait_for_pids(tmp_path, 2, seconds=0)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "fsdp-shim verify: reading the installed Lightning did not finish within 20 s, so verify stopped it and "
        "every process it started; --timeout SECONDS allows longer"
    )
    assert "Traceback" not in proc.stderr
    time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.usefixtures("lightning_installed")
def test_ctrl_c_stops_every_process_the_probe_started(tmp_path: Path) -> None:
    env = clean_env(FSDP_SHIM_TEST_PIDS=str(tmp_path))
    command = subprocess.Popen(
        [FSDP_SHIM, "verify", "--model", "hanging_models:Model"],
        cwd=MODELS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = wait_for_pids(tmp_path, 2)
    command.send_signal(signal.SIGINT)
    _, stderr = command.communicate(timeout=60)
    assert command.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == (
        "fsdp-shim verify: interrupted while reading the installed Lightning; every process it started was stopped"
    )
    time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []


def test_the_help_has_a_description_its_defaults_and_an_example() -> None:
    from _fsdp_shim.cli import DESCRIPTIONS

    proc = verify("--help")
    assert proc.returncode == 0, proc.stderr
    description, example = DESCRIPTIONS["verify"]
    assert description.splitlines()[0] in proc.stdout
    assert f"example:\n  {example}\n" in proc.stdout
    text = " ".join(proc.stdout.split())
    for default in (
        "(default: bf16-true)",
        "(default: 1)",
        "(default: 3)",
        "(default: 1800)",
        "(default: the seed model's own causal block; with --model, not checked)",
    ):
        assert default in text, default
    assert "the Lightning precision both runs use" in proc.stdout
    assert "--activation-checkpointing MODULE:CLASS[,...]" in proc.stdout
    assert "each MODULE:CLASS as activation_checkpointing_policy={...} takes them" in text
    assert "CLASSES" not in proc.stdout
