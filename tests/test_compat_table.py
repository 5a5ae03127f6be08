"""docs/compatibility.md: one row per release and layout, torch and wrapt once below the table.

The generator runs as the nox session does (a subprocess on a results folder); its input is what
``scripts/matrix_status.py`` writes, so one test feeds it a record that script made in this environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.release_independent

SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import compat_table  # noqa: E402  (scripts/ is not a package)


def namespace(name: str, version: str, targets: tuple[str, ...] = (), affected: bool | None = None) -> dict:
    """One entry of a matrix record, as `fsdp_shim.status().namespaces[i].as_dict()` gives it."""
    return {
        "namespace": name,
        "imported": True,
        "version": version,
        "affected": bool(targets) if affected is None else affected,
        "patched": bool(targets),
        "reason": "",
        "targets": [f"{name}.plugins.precision.fsdp.{t}" for t in targets],
        "activated_after_import": False,
    }


def record(
    session: str, namespaces: list[dict], torch: str = "2.13.0+cpu", wrapt: str = "2.5.2", **counts: int
) -> dict:
    tally = {"tests": 10, "failures": 0, "errors": 0, "skipped": 2, **counts}
    tally["passed"] = tally["tests"] - tally["failures"] - tally["errors"] - tally["skipped"]
    return {"session": session, "wrapt": wrapt, "torch": torch, "namespaces": namespaces, "counts": tally}


def generate(tmp_path: Path, records: list[dict]) -> str:
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    for rec in records:
        (results / f"{rec['session']}.json").write_text(json.dumps(rec))
    out = tmp_path / "compatibility.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "compat_table.py"), str(results), str(out), *(r["session"] for r in records)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return out.read_text()


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of the main table's rows (the first table after the header line)."""
    lines = markdown.split("| Session |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


MIXED = record(
    "mixed-2.4.0",
    [
        namespace("lightning.fabric", "2.4.0", ("FSDPPrecision.convert_module",)),
        namespace("lightning.pytorch", "2.4.0", ("FSDPPrecision.convert_module",)),
        namespace("lightning_fabric", "2.6.6"),
        namespace("pytorch_lightning", "2.6.6"),
    ],
    tests=228,
    skipped=2,
)


def test_one_row_per_release_and_layout_with_torch_and_wrapt_below(tmp_path: Path) -> None:
    records = [
        MIXED,
        record(
            "lightning-2.1.0",
            [
                namespace("lightning.fabric", "2.1.0", ("FSDPPrecision.convert_module",)),
                namespace(
                    "lightning.pytorch",
                    "2.1.0",
                    ("FSDPPrecisionPlugin.convert_module", "FSDPStrategy.connect", "FSDPStrategy.setup"),
                ),
            ],
            wrapt="1.17.3",
        ),
        record(
            "lightning-2.4.0-torch-2.4.1",
            [namespace("pytorch_lightning", "2.4.0", ("FSDPPrecision.convert_module",))],
            torch="2.4.1",
        ),
        record("no-lightning", []),
    ]
    markdown = generate(tmp_path, records)
    assert table_rows(markdown) == [
        [
            "mixed-2.4.0",
            "`lightning` 2.4.0",
            "`FSDPPrecision.convert_module`",
            "`FSDPPrecision.convert_module`",
            "226 / 2 / 0: pass",
        ],
        ["mixed-2.4.0", "`pytorch_lightning`, `lightning_fabric` 2.6.6", "untouched", "untouched", "226 / 2 / 0: pass"],
        [
            "lightning-2.1.0",
            "`lightning` 2.1.0",
            "`FSDPPrecisionPlugin.convert_module`, `FSDPStrategy.connect`, `FSDPStrategy.setup`",
            "`FSDPPrecision.convert_module`",
            "8 / 2 / 0: pass",
        ],
        # Only the Trainer namespace of that layout imported: the Fabric cell says so.
        [
            "lightning-2.4.0-torch-2.4.1",
            "`pytorch_lightning`, `lightning_fabric` 2.4.0",
            "`FSDPPrecision.convert_module`",
            "not installed",
            "8 / 2 / 0: pass",
        ],
        ["no-lightning", "(no Lightning)", "-", "-", "8 / 2 / 0: pass"],
    ]
    header = markdown.split("| Session |", 1)[1].splitlines()[0]
    assert "torch" not in header and "wrapt" not in header
    assert (
        "**Versions.** Every session ran on torch 2.13.0+cpu and wrapt 2.5.2, except `lightning-2.1.0`: wrapt 1.17.3; "
        "`lightning-2.4.0-torch-2.4.1`: torch 2.4.1." in markdown
    )


def test_failures_are_loud(tmp_path: Path) -> None:
    records = [
        record("lightning-2.2.5", [namespace("lightning.pytorch", "2.2.5", affected=True)], failures=1),
        {"session": "broken", "error": "Traceback ...", "counts": record("x", [])["counts"]},
    ]
    rows = table_rows(generate(tmp_path, records))
    assert rows == [
        ["lightning-2.2.5", "`lightning` 2.2.5", "**affected, not patched**", "not installed", "7 / 2 / 1: **FAIL**"],
        ["broken", "probe failed", "-", "-", "8 / 2 / 0: **FAIL**"],
    ]


def test_the_committed_table_has_the_generators_format() -> None:
    """docs/compatibility.md is written by the generator: its prose and footer are the generator's, and
    every row has the generator's five cells, so the next matrix run changes figures, not the layout."""
    committed = (ROOT / "docs" / "compatibility.md").read_text()
    assert committed.startswith(compat_table.HEADER)
    assert committed.endswith(compat_table.FOOTER)
    rows = table_rows(committed)
    assert rows and all(len(row) == 5 for row in rows)
    sessions = {row[0] for row in rows}
    assert {"mixed-2.4.0", "no-lightning"} <= sessions
    assert "**Versions.** Every session ran on torch " in committed


def test_a_record_that_matrix_status_writes_here(tmp_path: Path) -> None:
    """The real probe of this environment, through the generator: one row per installed layout, with the
    versions and targets the shim reports."""
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuite tests="3" failures="0" errors="0" skipped="1"></testsuite>')
    results = tmp_path / "results"
    results.mkdir()
    subprocess.run(
        [sys.executable, str(SCRIPTS / "matrix_status.py"), "here", str(results / "here.json"), str(junit)], check=True
    )
    rec = json.loads((results / "here.json").read_text())
    assert "error" not in rec, rec.get("error")
    rows = table_rows(generate(tmp_path, [rec]))
    imported = [n for n in rec["namespaces"] if n["imported"]]
    if not imported:
        assert rows == [["here", "(no Lightning)", "-", "-", "2 / 1 / 0: pass"]]
        return
    cells = " ".join(" ".join(row) for row in rows)
    for status in imported:
        assert status["version"] in cells
        for target in status["targets"]:
            assert ".".join(target.rsplit(".", 2)[-2:]) in cells
