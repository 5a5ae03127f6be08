"""The shim's lines: one confirmation, on rank zero, through the user's logging where it is configured;
``FSDP_SHIM_LOG`` switches it off. The runs are one-device ``bf16-true`` trainings with
activation checkpointing (tests/scenarios/recompute.py)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NAMESPACES, ROOT, Layout, affected_layout, clean_env, free_port
from test_recompute import assert_like_the_run_without_checkpointing, run_with_output, trainer_layout

from _fsdp_shim import log

RECOMPUTE_ACTED = "; recompute acted (a checkpointed block recomputed in bfloat16, its forward's dtype, not float32)"


@pytest.mark.parametrize(
    ("setting", "logging_setup"),
    [(None, "none"), (" On ", "info"), ("false", "none"), ("debug", "none")],
)
def test_what_the_shim_prints_in_a_run(
    setting: str | None, logging_setup: str, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """Unset or on, one line, the confirmation, unconfigured or through ``basicConfig(level=INFO)`` (Ray Train's
    workers, many scripts) in the user's format; off, none; a value it cannot read (``debug``, which 0.3.0 removed)
    keeps the confirmation and warns once, naming the value."""
    layout = trainer_layout(layouts)
    cases = ["ones:none", "ones:nonreentrant"]
    env = {"PYTHONWARNINGS": "default", **({"FSDP_SHIM_LOG": setting} if setting else {})}
    results, output = run_with_output(
        tmp_path, "trainer", cases, strategy="single", package=layout.package, env=env, logging_setup=logging_setup
    )
    assert_like_the_run_without_checkpointing(results, cases)
    lines = [line for line in output.splitlines() if re.search("^fsdp-shim|:fsdp_shim:|FSDPShimWarning", line)]
    if setting == "false":
        assert lines == [], output[-3000:]
        return
    (line,) = [line for line in lines if ": active; " in line]
    assert line.endswith(RECOMPUTE_ACTED), output[-3000:]
    if setting in (None, " On "):
        assert lines == [line], output[-3000:]
        assert line.startswith("INFO:fsdp_shim:fsdp-shim " if logging_setup == "info" else "fsdp-shim "), line
    else:
        (warning,) = [line for line in lines if "FSDPShimWarning" in line]
        assert "FSDP_SHIM_LOG='debug' is not a valid value" in warning and "the confirmation lines stay" in warning
        assert len(lines) == 2, lines


def test_the_lines_go_through_the_users_logging_configuration_and_change_none_of_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A confirmation line the configuration shows goes through it, once; one it would drop goes to stderr instead,
    and ``FSDP_SHIM_LOG=0`` drops it. No handler or level of the user's is added or changed."""
    logger = logging.getLogger("fsdp_shim")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    monkeypatch.setattr(logger, "handlers", [])
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)
        for setting, expected in [("0", []), ("1", ["confirmed 0"])]:
            monkeypatch.setenv("FSDP_SHIM_LOG", setting)
            log.announce("confirmed %d", 0)
            assert capsys.readouterr().err.splitlines() == expected, setting
            assert (logger.handlers, logger.level) == ([], logging.WARNING)
        logger.addHandler(handler)
        log.announce("confirmed %d", 1)  # below the level the user chose (WARNING): on stderr
        assert (records, capsys.readouterr().err.splitlines()) == ([], ["confirmed 1"])
        logger.setLevel(logging.INFO)
        monkeypatch.delenv("FSDP_SHIM_LOG")  # a setup at INFO: through it, once
        log.announce("confirmed %d", 2)
        assert (records, capsys.readouterr().err) == (["confirmed 2"], "")
        assert (logger.handlers, logger.level) == ([handler], logging.INFO)
    finally:
        logger.setLevel(level)


RANK_OF_THE_GROUP = """
import sys, datetime
import torch.distributed as dist
from _fsdp_shim import log
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2,
                        timeout=datetime.timedelta(seconds=60))
log.confirm("cast", f"said by rank {dist.get_rank()}")
dist.barrier()
dist.destroy_process_group()
"""


def test_rank_zero_is_the_process_groups_where_no_variable_says_it() -> None:
    """Two ranks of one process group, each with ``LOCAL_RANK=0`` and no ``RANK`` (the main process of each node
    under Lightning's own launcher; under mpirun no variable is set at all): the line is said once, by rank 0."""
    env = clean_env(LOCAL_RANK="0", RANK=None, SLURM_PROCID=None, PYTHONWARNINGS="ignore")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    command = [sys.executable, "-c", RANK_OF_THE_GROUP, f"tcp://127.0.0.1:{free_port()}"]
    procs = [subprocess.Popen([*command, str(rank)], env=env, cwd=ROOT, **pipes) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    said = [[line.partition("active; ")[2] for line in err.splitlines()] for _, err in outputs]
    assert said == [["said by rank 0"], []], outputs


def test_each_fix_that_acts_is_named_once(layouts: dict[str, Layout], tmp_path: Path) -> None:
    """FSDP on a release that lacks both fixes, with checkpointing: the cast acts first (before the first forward),
    in the confirmation line; the recompute acts at the first checkpointed backward, in a line of its own. Each
    is named once, however many steps and recomputes follow."""
    layout = affected_layout(layouts)
    cases = ["ones:none", "ones:nonreentrant"]
    results, output = run_with_output(tmp_path, "trainer", cases, package=layout.package)
    assert_like_the_run_without_checkpointing(results, cases)
    lines = [line for line in output.splitlines() if line.startswith("fsdp-shim")]
    cast = f"cast acted ({NAMESPACES[layout.package][0]} {layout.trainer_version}: the model cast to bfloat16 before"
    assert len(lines) == 2 and lines[0].endswith(f": active; {cast} FSDP wraps it)"), output[-3000:]
    assert lines[1] == lines[0].split(":")[0] + RECOMPUTE_ACTED.replace(";", ":", 1), lines
