"""A distributed job is patched on every rank, or every rank with the shim stops before training.

Real FSDP through Lightning's Trainer and Fabric, ranks started by torchrun (each rank its own
process, as on a cluster), one rank switched off the way a node exported with ``FSDP_SHIM=0`` is.
The expected dtypes and bytes come from the same runs: the agreeing ranks must hold exactly half the
bytes of the rank without the shim.
"""

from __future__ import annotations

import pytest
from conftest import BYTE_KEYS, affected_layout, run_scenario, scenario_results

CASE = "init+pretrained:bf16-true"

pytestmark = pytest.mark.release_independent


def torchrun(tmp_path, package, api, ranks, *, env=None, extra=(), expect_ok=True):
    out = tmp_path / f"{api}-{ranks}"
    proc = run_scenario(
        api,
        package,
        "before",
        [CASE],
        ranks,
        out,
        env=env,
        extra=extra,
        launcher=("torchrun", ranks),
        expect_ok=expect_ok,
        timeout=300,
    )
    return proc, out


@pytest.mark.parametrize(("api", "ranks"), [("trainer", 2), ("fabric", 4)])
def test_agreeing_ranks_train_and_rank_zero_says_so_once(tmp_path, layouts, api, ranks):
    """Every rank converted; the check waited for a rank that reached its setup 6 s late."""
    package = affected_layout(layouts).package
    proc, out = torchrun(tmp_path, package, api, ranks, extra=("--delay-rank", f"{ranks - 1}:6"))
    results = scenario_results(out, ranks)
    for rank in range(ranks):
        assert results[rank][CASE]["flat_param_dtypes"] == ["torch.bfloat16"], (rank, results[rank][CASE])
    line = f"fsdp-shim: patched on all {ranks} ranks (bfloat16), confirmed in "
    lines = [text for text in (proc.stdout + proc.stderr).splitlines() if line in text]
    assert len(lines) == 1, proc.stderr[-3000:]
    waited = float(lines[0].rpartition(" in ")[2].removesuffix(" s"))
    assert 4 <= waited < 60, lines  # it waited for the late rank (6 s), and no longer than it had to


@pytest.mark.parametrize(("api", "ranks", "off", "strict"), [("trainer", 2, 1, "0"), ("fabric", 4, 3, "1")])
def test_a_rank_without_the_shim_stops_the_job_and_is_named(tmp_path, layouts, api, ranks, off, strict):
    """Strict mode or not, the ranks with the shim raise FSDPShimError naming the rank without it."""
    package = affected_layout(layouts).package
    proc, out = torchrun(
        tmp_path,
        package,
        api,
        ranks,
        env={"FSDP_SHIM_RANK_CHECK_TIMEOUT": "5", "FSDP_SHIM_STRICT": strict},
        extra=("--shim-off-rank", str(off)),
        expect_ok=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert f"FSDPShimError: fsdp-shim: rank {off} of {ranks} did not confirm the FSDP precision fix within 5 s" in (
        output
    ), output[-4000:]
    assert "FSDP_SHIM=0 in their environment" in output
    for rank in range(ranks):  # nobody trained: no report was written
        assert not (tmp_path / f"{out.name}.rank{rank}.json").exists()


def test_ranks_that_converted_to_different_dtypes_stop_the_job(tmp_path, layouts):
    """Every rank has the shim, but one node was configured for 16-true: the disagreement is named."""
    package = affected_layout(layouts).package
    proc, _ = torchrun(tmp_path, package, "trainer", 2, extra=("--precision-on-rank", "1:16-true"), expect_ok=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "FSDPShimError: fsdp-shim: the 2 ranks of this job converted their models to different dtypes" in output
    assert "rank 0: bfloat16 (lightning.pytorch" in output and "rank 1: float16 (lightning.pytorch" in output


def test_timeout_zero_switches_the_check_off(tmp_path, layouts):
    """With the check off, the half-patched job trains as it would without it: mixed dtypes, exit 0."""
    package = affected_layout(layouts).package
    proc, out = torchrun(
        tmp_path,
        package,
        "trainer",
        2,
        env={"FSDP_SHIM_RANK_CHECK_TIMEOUT": "0"},
        extra=("--shim-off-rank", "1"),
    )
    results = scenario_results(out, 2)
    on, off = results[0][CASE], results[1][CASE]
    assert on["flat_param_dtypes"] == ["torch.bfloat16"]
    assert off["flat_param_dtypes"] == ["torch.float32"]
    for key in BYTE_KEYS:
        assert off[key] == 2 * on[key], key
    assert "patched on all" not in proc.stdout + proc.stderr


def test_the_timeout_variable_is_read_as_seconds(monkeypatch):
    from fsdp_shim import rank_check

    assert rank_check.timeout_seconds({}) == rank_check.DEFAULT_TIMEOUT_SECONDS
    assert rank_check.timeout_seconds({"FSDP_SHIM_RANK_CHECK_TIMEOUT": " 12.5 "}) == 12.5
    assert rank_check.timeout_seconds({"FSDP_SHIM_RANK_CHECK_TIMEOUT": "0"}) == 0
    with pytest.warns(Warning, match="is not a number of seconds"):
        assert rank_check.timeout_seconds({"FSDP_SHIM_RANK_CHECK_TIMEOUT": "soon"}) == 300
