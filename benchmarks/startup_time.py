"""Start-up cost of the shim, as ratios measured in one invocation.

1. ``python -c pass`` with fsdp-shim installed (its ``fsdp_shim_env.pth``, ``FSDP_SHIM`` unset) vs a
   fresh virtual environment without fsdp-shim: what every interpreter of an environment pays for
   having the package installed. The figure is the median of the per-pair ratios of interleaved
   runs (robust to drift in machine load).
2. The same environment with ``FSDP_SHIM=1`` vs unset: what arming at start-up costs.
3. ``python -c "import fsdp_shim"`` and ``python -c "import wrapt"`` against ``python -c pass``, the
   same way, in the environment with fsdp-shim installed.
4. The floors: a fresh environment whose only addition is a ``.pth`` file holding ``import os``, which is
   what any start-up file that runs code costs before its code does anything (the floor of row 1); and
   one whose ``.pth`` imports an empty module from site-packages, what any start-up file that imports a
   module pays before that module runs (the floor of row 2).
5. The anchor for row 1: setuptools' ``distutils-precedence.pth`` (its exact text) made dormant with
   ``SETUPTOOLS_USE_DISTUTILS=stdlib``, the same kind of line (read a variable, arm nothing), against none.

Both environments get the shim the way users do, from a wheel installed into site-packages (pip
writes the .pyc files), and see this environment's wrapt through a plain path entry.

Usage: python benchmarks/startup_time.py [--pairs N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(folder: Path) -> Path:
    """The shim as users get it: a wheel, installed into site-packages with its .pyc files."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), str(ROOT)], check=True)
    return next(folder.glob("fsdp_shim-*.whl"))


def make_venv(folder: Path, wheel: Path | None) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = str(folder / "bin" / "python")
    purelib = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    if wheel is not None:
        subprocess.run([*pip, "install", "--no-deps", "--target", purelib, str(wheel)], check=True)
    # wrapt and the rest of this environment as a plain path entry: no start-up code of theirs runs.
    (Path(purelib) / "zz_outer_environment.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
    return python


UNSET = {key: value for key, value in os.environ.items() if not key.startswith("FSDP_SHIM")}
SETUPTOOLS_LINE = (
    "import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, 'local') == 'local'; "
    "enabled and __import__('_distutils_hack').add_shim(); \n"
)
"""setuptools' ``distutils-precedence.pth``, as setuptools 65-80 install it (``install_with_pth._pth_contents``)."""
SET = {**UNSET, "FSDP_SHIM": "1"}


def elapsed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def paired(
    baseline: list[str], candidate: list[str], pairs: int, candidate_env: dict[str, str] = UNSET
) -> dict[str, float]:
    for _ in range(3):  # warm the page cache for both
        elapsed(baseline, UNSET)
        elapsed(candidate, candidate_env)
    base_times, cand_times, ratios = [], [], []
    for index in range(pairs):
        if index % 2 == 0:
            base = elapsed(baseline, UNSET)
            cand = elapsed(candidate, candidate_env)
        else:
            cand = elapsed(candidate, candidate_env)
            base = elapsed(baseline, UNSET)
        base_times.append(base)
        cand_times.append(cand)
        ratios.append(cand / base)
    return {
        "baseline_median_ms": round(statistics.median(base_times) * 1000, 2),
        "candidate_median_ms": round(statistics.median(cand_times) * 1000, 2),
        "median_ratio": round(statistics.median(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp) / "wheel")
        bare = make_venv(Path(tmp) / "bare", None)
        plain = make_venv(Path(tmp) / "plain", wheel)
        floor = make_venv(Path(tmp) / "floor", None)
        floor_site = subprocess.check_output(
            [floor, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
        (Path(floor_site) / "floor.pth").write_text("import os\n")
        import_floor = make_venv(Path(tmp) / "import-floor", None)
        import_floor_site = subprocess.check_output(
            [import_floor, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
        (Path(import_floor_site) / "empty_module.py").write_text("")
        subprocess.run([import_floor, "-m", "compileall", "-q", import_floor_site], check=True)
        (Path(import_floor_site) / "floor.pth").write_text("import empty_module\n")
        anchor = make_venv(Path(tmp) / "setuptools-anchor", None)
        anchor_site = subprocess.check_output(
            [anchor, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
        (Path(anchor_site) / "distutils-precedence.pth").write_text(SETUPTOOLS_LINE)
        results = {
            "pass: installed, FSDP_SHIM unset / none": paired([bare, "-c", "pass"], [plain, "-c", "pass"], args.pairs),
            "pass: FSDP_SHIM=1 / unset": paired([plain, "-c", "pass"], [plain, "-c", "pass"], args.pairs, SET),
            "import fsdp_shim / python -c pass": paired(
                [plain, "-c", "pass"], [plain, "-c", "import fsdp_shim"], args.pairs
            ),
            "import wrapt / python -c pass": paired([plain, "-c", "pass"], [plain, "-c", "import wrapt"], args.pairs),
            "pass: a .pth holding `import os` / none": paired([bare, "-c", "pass"], [floor, "-c", "pass"], args.pairs),
            "pass: a .pth importing an empty module / none": paired(
                [bare, "-c", "pass"], [import_floor, "-c", "pass"], args.pairs
            ),
            "pass: setuptools' .pth, dormant / none": paired(
                [bare, "-c", "pass"],
                [anchor, "-c", "pass"],
                args.pairs,
                {**UNSET, "SETUPTOOLS_USE_DISTUTILS": "stdlib"},
            ),
        }
    import wrapt

    results["_environment"] = {"python": sys.version.split()[0], "wrapt": wrapt.__version__, "pairs": args.pairs}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'comparison':<48} {'baseline ms':>12} {'candidate ms':>13} {'median ratio':>13}")
    for name, row in results.items():
        if not name.startswith("_"):
            print(
                f"{name:<48} {row['baseline_median_ms']:>12} {row['candidate_median_ms']:>13} {row['median_ratio']:>13}"
            )
    environment = results["_environment"]
    print(f"python {environment['python']}, wrapt {environment['wrapt']}, {args.pairs} interleaved pairs each")


if __name__ == "__main__":
    main()
