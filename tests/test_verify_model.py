"""``fsdp-shim verify --model module:attr``: the user's own LightningModule, run unchanged, shim off
and on. The user code is ``tests/verify_models/user_models.py``; verify runs in that
folder, as a user runs it next to their code."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from conftest import ROOT, TRAINER, Layout, an_affected_namespace, clean_env, trainer_versions, verify

from fsdp_shim.backport import is_affected_release

MODELS = ROOT / "tests" / "verify_models"
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


def verify_model(namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return verify(*args, env=clean_env(FSDP_SHIM_TEST_LIGHTNING=namespace), cwd=MODELS)


def only_section(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    document = json.loads(proc.stdout)
    assert len(document["sections"]) == 1, document["sections"]
    return document["sections"][0]


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


# `verify` itself runs on every release (tests/test_verify.py); with a user's model it is the same
# probe with another module, so once is enough.
@pytest.mark.release_independent
@pytest.mark.parametrize("devices", [1, 2])
def test_layers_from_init_configure_model_and_a_float32_state_dict_are_exactly_halved(
    devices: int, layouts: dict[str, Layout]
) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, "--model", "user_models:ThreeWays", "--devices", str(devices), "--json")
    assert proc.returncode == 0, proc.stderr
    section = only_section(proc)
    assert section["namespace"] == namespace
    assert_exactly_half(section, devices)


@pytest.mark.release_independent
def test_a_factory_and_init_args(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    factory = only_section(verify_model(namespace, "--model", "user_models:make_model", "--json"))
    wide = only_section(
        verify_model(namespace, "--model", "user_models:ThreeWays", "--init-args", '{"hidden": 64}', "--json")
    )
    for section in (factory, wide):
        assert_exactly_half(section, 1)
    # The arguments reached the constructors: the factory builds 48 hidden units, --init-args asks for 64.
    assert factory["shim_off"][0]["param_bytes"] < wide["shim_off"][0]["param_bytes"]


@pytest.mark.release_independent
def test_a_module_without_data(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, "--model", "user_models:NoData")
    assert proc.returncode == 2
    assert "user_models:NoData has no train_dataloader; pass --datamodule" in proc.stderr
    assert "training with the shim" not in proc.stderr  # refused before any training
    with_data = verify_model(namespace, "--model", "user_models:NoData", "--datamodule", "user_models:Data", "--json")
    assert with_data.returncode == 0, with_data.stderr
    assert_exactly_half(only_section(with_data), 1)


@pytest.mark.release_independent
def test_an_error_in_the_users_code_is_theirs(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, "--model", "user_models:RaisesInTrainingStep")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert str(MODELS / "user_models.py") in proc.stderr
    assert "ValueError: a bug in the user's training_step" in proc.stderr
    assert "your code raised while training (shim off)" in proc.stderr
    assert "FAILED" not in proc.stdout + proc.stderr


@pytest.mark.release_independent
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("user_models:NOT_A_MODULE", "is 'int', not a LightningModule class"),
        ("user_models:Data", "is a class, but not a subclass of Lightning's LightningModule"),
        ("user_models:Missing", "user_models has no attribute 'Missing'"),
        ("not_a_module_here:Model", "cannot import 'not_a_module_here'"),
    ],
)
def test_a_model_option_that_names_no_model(spec: str, message: str, layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    proc = verify_model(namespace, "--model", spec)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_a_fixed_release_is_not_needed_without_training(layouts: dict[str, Layout]) -> None:
    fixed = [ns for ns, v in trainer_versions(layouts).items() if not is_affected_release(v)]
    if "pytorch_lightning" not in fixed:
        pytest.skip("needs the fixed standalone pytorch_lightning")
    section = only_section(verify_model("pytorch_lightning", "--model", "user_models:ThreeWays", "--json"))
    assert section["namespace"] == "pytorch_lightning"
    assert section["verdict"] == "not needed" and "nothing was trained" in section["reason"]
    assert section["shim_off"] is None


@pytest.mark.release_independent
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


@pytest.mark.release_independent
def test_lightning_2_6_itself_gives_nan_with_the_default_eps(layouts: dict[str, Layout]) -> None:
    """The same NaN on the fixed release, measured: it is 2.5+'s behaviour, not the shim's."""
    if "standalone" not in layouts or is_affected_release(layouts["standalone"].trainer_version):
        pytest.skip("needs the fixed standalone pytorch_lightning")
    proc = verify_model(
        TRAINER["standalone"], "--model", "user_models:ThreeWays", "--precision", "16-true", "--measure", "--json"
    )
    section = only_section(proc)
    assert section["verdict"] == "not needed" and "measured" in section["reason"]
    for run in ("shim_off", "shim_on"):
        assert any(v != v for v in section[run][0]["losses"][1:])


@pytest.mark.release_independent
def test_the_docs_worked_example_runs_as_written(layouts: dict[str, Layout]) -> None:
    namespace = an_affected_namespace(layouts, "trainer")[0]
    if namespace != "lightning.pytorch":
        pytest.skip("the docs example imports `lightning`")
    example = ROOT / "docs" / "examples"
    proc = verify("--model", "my_model:MyModel", cwd=example, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fixed: sharded parameters, gradients and optimizer state are 50% smaller on rank 0" in proc.stdout


@pytest.mark.release_independent
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
