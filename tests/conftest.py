"""Shared helpers. The pytest process itself never imports Lightning or torch: every Lightning
interaction happens in a fresh interpreter, so import order, start-up files and the shim's
activation are exercised exactly as users meet them."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["process_cleanup"]

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "scenarios" / "fsdp_train.py"
DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16", "32-true": "torch.float32"}
BYTE_KEYS = ("flat_param_bytes", "grad_bytes", "optimizer_state_bytes")
NAMESPACES = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "standalone": ("pytorch_lightning", "lightning_fabric"),
}


PORT_RANGE = range(20000, 32000)
"""Where rendezvous ports are drawn from: below Linux's ephemeral range (32768-60999), which the
outgoing connections of every other test take their source ports from. A port the kernel handed out
for ``bind(0)`` was seen taken again by such a connection before the child listened on it."""


def free_port() -> int:
    for _ in range(100):
        port = random.choice(PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT_TAKEN = "EADDRINUSE"
"""What torch prints when another process took the rendezvous port between the draw and the listen:
a run that failed with it is repeated on a new port (twice at most); a run that succeeded, or failed
otherwise, counts as it is."""


def clean_env(**overrides: str | None) -> dict[str, str]:
    """The test environment minus the shim's own variables, plus ``overrides`` (None removes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_SHIM")}
    if env.get("PYTHONPATH"):  # children may run elsewhere than the checkout: absolute entries only
        env["PYTHONPATH"] = os.pathsep.join(
            str(ROOT / entry) if entry else entry for entry in env["PYTHONPATH"].split(os.pathsep)
        )
    env["PYTHONWARNINGS"] = env.get("PYTHONWARNINGS", "")
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_command(
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    check: bool = False,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (``clean_env()`` unless ``env``), output captured as text. With ``check``, a
    non-zero exit fails the test and shows the end of both streams."""
    proc = subprocess.run(
        command, capture_output=True, text=True, env=env if env is not None else clean_env(), cwd=cwd, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{command} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_on_a_free_port(
    attempt: Callable[[bool], tuple[list[str], dict[str, str]]], timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the command ``attempt(retry)`` gives, and once more (twice at most) with ``retry=True`` when
    it failed because another process took its rendezvous port (``PORT_TAKEN``); ``attempt`` draws a
    new port for a retry. Returns the last run and its command."""
    for retry in (False, True, True):
        command, env = attempt(retry)
        proc = run_command(command, env=env, timeout=timeout)
        if proc.returncode == 0 or PORT_TAKEN not in proc.stderr:
            break
    return proc, command


CHILD = ROOT / "tests" / "child.py"


def run_child(
    target: str,
    arguments: dict[str, Any] | None = None,
    *,
    env: dict[str, str] | None = None,
    expect_ok: bool = True,
    python: str = sys.executable,
    python_args: tuple[str, ...] = (),
    sys_path: tuple[str, ...] = (),
    launcher: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/children`` function ``target`` ("module:function") in a fresh interpreter.

    ``launcher`` goes before the interpreter (``fsdp-shim run``); ``python_args`` after it (``-I``).
    """
    prefix = [item for path in sys_path for item in ("--sys-path", path)]
    command = [*launcher, python, *python_args, str(CHILD), *prefix, f"children.{target}", json.dumps(arguments or {})]
    first_env = env if env is not None else clean_env()

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:
        return command, {**first_env, "MASTER_PORT": str(free_port())} if retry else first_env

    proc, _ = run_on_a_free_port(attempt)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def child_json(target: str, arguments: dict[str, Any] | None = None, **options: Any) -> Any:
    return last_json(run_child(target, arguments, **options))


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(("{", "[", "null", "true", "false")):
            return json.loads(line)
    raise AssertionError(f"no JSON in child output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


MATRIX_SCOPE = os.environ.get("FSDP_SHIM_TEST_SCOPE", "all")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "release_independent: checks the shim's own logic (toggles, logging, error isolation), not a "
        "Lightning release; the matrix runs it once, in the default session",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MATRIX_SCOPE != "release":
        return
    skip = pytest.mark.skip(reason="release-independent; runs in the matrix's default session")
    for item in items:
        if item.get_closest_marker("release_independent"):
            item.add_marker(skip)


@dataclass(frozen=True)
class Layout:
    """One installed Lightning layout: ``lightning`` (unified) or ``standalone``."""

    package: str
    trainer_version: str
    fabric_version: str

    def version(self, api: str) -> str:
        return self.fabric_version if api == "fabric" else self.trainer_version


@pytest.fixture(scope="session")
def layouts() -> dict[str, Layout]:
    """The Lightning layouts importable here, probed in a child without the shim."""
    found = child_json("environment:layouts", {"namespaces": NAMESPACES}, python_args=("-W", "ignore"))
    return {package: Layout(package, *versions) for package, versions in found.items()}


def is_fixed_release(version: str) -> bool:
    """Whether a Lightning release already contains the fix (2.5.0rc0 on)."""
    from fsdp_shim.backport import FIRST_FIXED, base_release

    release = base_release(version)
    return release is not None and release >= FIRST_FIXED


@pytest.fixture
def lightning_installed(layouts: dict[str, Layout]) -> None:
    """Skips where no Lightning is importable (the no-Lightning session): the test needs one to read."""
    if not layouts:
        pytest.skip("needs an installed Lightning")


def layout_or_skip(layouts: dict[str, Layout], package: str) -> Layout:
    if package not in layouts:
        pytest.skip(f"the {package} layout of Lightning is not installed in this environment")
    return layouts[package]


class Scenarios:
    """Runs ``tests/scenarios/fsdp_train.py`` and caches results per argument set."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._cache: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}

    def run(
        self,
        api: str,
        package: str,
        shim: str,
        cases: list[str],
        *,
        devices: int = 1,
        env: dict[str, str] | None = None,
        extra: tuple[str, ...] = (),
    ) -> dict[int, dict[str, Any]]:
        key = (api, package, shim, tuple(cases), devices, tuple(sorted((env or {}).items())), extra)
        if key not in self._cache:
            self._cache[key] = self._execute(api, package, shim, cases, devices, env or {}, extra)
        return self._cache[key]

    def _execute(
        self,
        api: str,
        package: str,
        shim: str,
        cases: list[str],
        devices: int,
        env: dict[str, str],
        extra: tuple[str, ...],
    ) -> dict[int, dict[str, Any]]:
        out = self._workdir / f"run{len(self._cache)}"
        launcher = ("torchrun", devices) if api == "torch" else None
        run_scenario(api, package, shim, cases, devices, out, env=env, extra=extra, launcher=launcher)
        return scenario_results(out, devices)


def run_scenario(
    api: str,
    package: str,
    shim: str,
    cases: list[str],
    devices: int,
    out: Path,
    *,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
    launcher: tuple[str, int] | None = None,
    expect_ok: bool = True,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/scenarios/fsdp_train.py`` once; ``launcher=("torchrun", N)`` starts N ranks with
    torchrun instead of Lightning's own launcher (``devices`` is then the ranks per node)."""
    arguments = ["--api", api, "--package", package, "--shim", shim, "--devices", str(devices)]
    arguments += ["--cases", ",".join(cases), "--out", str(out), *extra]

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:  # every attempt draws its ports anew
        command = [sys.executable, str(SCENARIO), *arguments]
        if launcher is not None:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(launcher[1])]
            command = [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *command[1:]]
        return command, clean_env(PYTHONWARNINGS="ignore", **(env or {}))

    proc, command = run_on_a_free_port(attempt, timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"scenario failed (exit {proc.returncode}): {' '.join(command)}\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def scenario_results(out: Path, ranks: int) -> dict[int, dict[str, Any]]:
    """Each rank's report of a scenario run, by rank, each keyed by case."""
    results = {}
    for rank in range(ranks):
        rows = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        results[rank] = {row.pop("case"): row for row in rows}
    return results


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    return Scenarios(tmp_path_factory.mktemp("scenarios"))


# ----------------------------------------------------------------------------- the installed Lightning
TRAINER = {package: namespaces[0] for package, namespaces in NAMESPACES.items()}


def installed_versions(layouts: dict[str, Layout]) -> dict[str, str]:
    """Every importable namespace (``lightning.pytorch``, ``lightning_fabric``, ...) and its release."""
    versions = {}
    for package, layout in layouts.items():
        trainer, fabric = NAMESPACES[package]
        versions[trainer] = layout.trainer_version
        versions[fabric] = layout.fabric_version
    return versions


def trainer_versions(layouts: dict[str, Layout]) -> dict[str, str]:
    return {TRAINER[package]: layout.trainer_version for package, layout in layouts.items()}


def an_affected_namespace(layouts: dict[str, Layout], kind: str = "any") -> tuple[str, str]:
    """An installed namespace (of ``kind``: "trainer", "fabric" or "any") that needs the fix, and its
    release; the test is skipped where there is none."""
    from fsdp_shim.backport import is_affected_release

    for namespace, version in installed_versions(layouts).items():
        trainer = namespace in TRAINER.values()
        if is_affected_release(version) and (kind == "any" or trainer == (kind == "trainer")):
            return namespace, version
    pytest.skip(f"no affected Lightning ({kind}) is installed in this environment")


def affected_layout(layouts: dict[str, Layout], package: str | None = None) -> Layout:
    """An installed layout (``package``: "lightning" or "standalone", or either) whose Trainer and
    Fabric need the fix; the test is skipped where there is none."""
    from fsdp_shim.backport import is_affected_release

    for layout in layouts.values():
        if package in (None, layout.package) and is_affected_release(layout.trainer_version):
            return layout
    pytest.skip(f"needs an affected {package or 'Lightning'} release")


def verify(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``fsdp-shim verify ARGS`` in a fresh interpreter."""
    return run_command(
        [sys.executable, "-m", "fsdp_shim", "verify", *args], env=env or clean_env(), cwd=cwd, timeout=900
    )


# ----------------------------------------------------------------------------- a virtual environment of its own
@dataclass
class Venv:
    """A new virtual environment that sees this one's packages (torch, wrapt, fsdp_shim) through a
    plain path file, so start-up files written into it affect nothing but its own interpreters."""

    root: Path
    site_packages: Path
    paths_file: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def run(
        self, *args: str, env: dict[str, str] | None = None, check: bool = True, cwd: Path = ROOT
    ) -> subprocess.CompletedProcess[str]:
        return run_command([self.python, *args], env=env or clean_env(), cwd=cwd, check=check)


def make_venv(root: Path, paths: list[str]) -> Venv:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = Path(
        subprocess.check_output(
            [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    paths_file = purelib / "aa_outer_environment.pth"
    paths_file.write_text("".join(f"{path}\n" for path in paths))
    return Venv(root, purelib, paths_file)
