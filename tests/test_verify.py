"""``fsdp-shim verify`` on the seed's model, end to end in fresh processes, on whatever Lightning this
session holds: a verdict for every installed Trainer namespace, never one for the wrong package."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Layout, clean_env, trainer_versions, verify

from fsdp_shim.backport import FIRST_AFFECTED, base_release, is_affected_release
from fsdp_shim.verify import seed

DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
LAST_WITH_PKG_RESOURCES = (2, 4, 0)  # a fact about Lightning: 2.4.0 no longer imports pkg_resources


def sections(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {section["namespace"]: section for section in json.loads(proc.stdout)["sections"]}


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


def assert_fixed(section: dict[str, Any], precision: str) -> None:
    assert section["verdict"] == "fixed", section["reason"]
    want = DTYPES[precision]
    for off, on in zip(section["shim_off"], section["shim_on"]):
        assert (off["module_dtype"], on["module_dtype"]) == ("torch.float32", want)
        assert off["flat_param_dtypes"] == sorted([want, "torch.float32"]) and on["flat_param_dtypes"] == [want]
        units_off, units_on = off["unit_param_bytes"], on["unit_param_bytes"]
        assert units_on["pretrained"] * 2 == units_off["pretrained"]  # loaded in float32: exactly half
        assert units_on["model"] == units_off["model"]  # built in configure_model: already half precision
        # Two equal models, one already half precision, one loaded in float32 (twice the bytes):
        # unpatched 1 + 2 = 3 units, patched 1 + 1 = 2.
        for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
            assert on[key] * 3 == off[key] * 2, key


@pytest.mark.parametrize("precision", ["bf16-true", pytest.param("16-true", marks=pytest.mark.release_independent)])
def test_every_installed_trainer_namespace_gets_its_own_verdict(precision: str, layouts: dict[str, Layout]) -> None:
    versions = trainer_versions(layouts)
    if not versions:
        pytest.skip("no Lightning installed")
    proc = verify("--precision", precision, "--json")
    assert proc.returncode == 0, proc.stderr
    found = sections(proc)
    assert sorted(found) == sorted(versions)
    for namespace, version in versions.items():
        section = found[namespace]
        assert section["version"] == version
        if is_affected_release(version):
            assert_fixed(section, precision)
        else:
            assert section["verdict"] == "not needed"
            assert section["shim_off"] is None and section["shim_on"] is None  # decided by the gates alone
            if base_release(version) >= FIRST_AFFECTED:
                assert "already contains the fix" in section["reason"] and "nothing was trained" in section["reason"]


@pytest.mark.release_independent
def test_the_table_two_processes_and_the_phases(layouts: dict[str, Layout]) -> None:
    affected = [ns for ns, v in trainer_versions(layouts).items() if is_affected_release(v)]
    if not affected:
        pytest.skip("the table's 'fixed' rows need an affected release")
    proc = verify("--devices", "2")
    assert proc.returncode == 0, proc.stderr
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
    pretrained_row = next(line for line in proc.stdout.splitlines() if seed.UNITS["pretrained"] in line)
    assert pretrained_row.rstrip().endswith("-50%")
    # The counter counts the runs once (the gate, before their number is known, is not
    # numbered), everything fits 100 columns, and each term is explained once.
    phases = [line for line in proc.stderr.splitlines() if line.startswith("fsdp-shim verify: ")]
    assert phases[0] == "fsdp-shim verify: reading the installed Lightning ..."
    label = f"{affected[0]} {trainer_versions(layouts)[affected[0]]}"
    assert phases[1:] == [
        f"fsdp-shim verify: [1/2] {label}: training with the shim off ...",
        f"fsdp-shim verify: [2/2] {label}: training with the shim on ...",
    ]
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100, proc.stdout
    for term in ("GPU guards lifted:", "flat parameter:", "seed model:"):
        assert sum(line.startswith(f"  {term}") for line in proc.stdout.splitlines()) == 1, term


@pytest.mark.release_independent
def test_a_broken_lightning_next_to_a_working_one_is_failed_not_not_needed(
    layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """`lightning` 2.1–2.3 without pkg_resources (setuptools >= 81) next to the standalone
    2.6.x. Here a stand-in `lightning` fails the same way; the real one is checked on 2.1–2.3 below."""
    if "standalone" not in layouts:
        pytest.skip("needs the standalone packages beside it")
    env = with_missing_pkg_resources(tmp_path, "lightning")
    proc = verify("--json", env=env)
    assert proc.returncode == 1
    found = sections(proc)
    assert found["lightning.pytorch"]["verdict"] == "FAILED"
    reason = found["lightning.pytorch"]["reason"]
    assert "lightning.pytorch" in reason and "fails to import" in reason and "No module named 'pkg_resources'" in reason
    assert "Lightning 2.1-2.3 needs setuptools<81" in reason
    assert found["pytorch_lightning"]["verdict"] == "not needed"
    assert json.loads(proc.stdout)["verdict"] == "FAILED"
    status = subprocess.run(
        [sys.executable, "-m", "fsdp_shim", "status", "--python-check"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert status.returncode == 1
    assert "PROBLEM: lightning" in status.stdout and "needs setuptools<81" in status.stdout


def test_real_lightning_2_1_to_2_3_without_pkg_resources(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """What setuptools 81 does to Lightning 2.1–2.3: pkg_resources is gone, and `import lightning` fails."""
    version = layouts.get("lightning", Layout("lightning", "0", "0")).trainer_version
    if base_release(version) is None or not FIRST_AFFECTED <= base_release(version) < LAST_WITH_PKG_RESOURCES:
        pytest.skip("needs Lightning 2.1–2.3")
    proc = verify("--json", env=with_missing_pkg_resources(tmp_path, "pkg_resources"))
    assert proc.returncode == 1
    reason = sections(proc)["lightning.pytorch"]["reason"]
    assert f"(lightning {version}) is installed but fails to import" in reason
    assert "Lightning 2.1-2.3 needs setuptools<81" in reason


@pytest.mark.release_independent
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --steps: 0 is not a positive number"),
        (["--devices", "0"], "argument --devices: 0 is not a positive number"),
        (["--devices", "-1"], "argument --devices: -1 is not a positive number"),
        (["--steps", "two"], "'two' is not a whole number"),
        (["--init-args", "[1]"], "must be a JSON object"),
        (["--model", "no_colon"], "is not MODULE:ATTR"),
        (["--datamodule", "m:D"], "--init-args and --datamodule need --model"),
    ],
)
def test_bad_numbers_and_options_are_usage_errors_before_anything_starts(args: list[str], message: str) -> None:
    proc = verify(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "[1/" not in proc.stderr  # no child process was started


@pytest.mark.release_independent
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
    assert proc.returncode == 2
    assert "torch is not installed in this interpreter" in proc.stderr
    assert "FAILED" not in proc.stdout + proc.stderr


@pytest.mark.release_independent
def test_without_lightning_it_says_so(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (without it, verify says that first)")
    proc = verify(env=clean_env(PYTHONPATH=None), cwd=tmp_path)
    assert proc.returncode == 2
    assert "neither lightning nor pytorch_lightning is installed" in proc.stderr
