"""Shared helpers. The pytest process itself never imports Lightning or torch: every Lightning
interaction happens in a fresh interpreter, so import order, start-up files and the shim's
activation are exercised exactly as users meet them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from _fsdp_shim.config import NAMESPACES as NAMESPACE_KINDS

pytest_plugins = ["process_cleanup"]

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "scenarios" / "fsdp_train.py"
DTYPES = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16", "32-true": "torch.float32"}
BYTE_KEYS = ("flat_param_bytes", "grad_bytes", "optimizer_state_bytes")
NAMESPACES = {
    layout: tuple(
        name
        for kind in ("trainer", "fabric")
        for name, k in NAMESPACE_KINDS.items()
        if k == kind and (name.startswith("lightning.") == (layout == "lightning"))
    )
    for layout in ("lightning", "standalone")
}
"""Per layout, its (Trainer, Fabric) namespaces, from the package's one table."""


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
EXIT_ABORT = "terminate called without an active exception"
"""What a gloo rank sometimes prints as its interpreter exits, after it trained, with or without the shim (on a loaded
2-core machine, 2026-12-07: 2 of 24 two-rank DDP jobs with ``FSDP_SHIM=0``, 2 of 24 with it, interleaved): torch's,
not the behaviour a test checks, so such a run is repeated too."""


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
    it failed because another process took its rendezvous port (``PORT_TAKEN``) or a rank aborted as torch
    exits (``EXIT_ABORT``); ``attempt`` draws a new port for a retry. Returns the last run and its command."""
    for retry in (False, True, True):
        command, env = attempt(retry)
        proc = run_command(command, env=env, timeout=timeout)
        if proc.returncode == 0 or not any(sign in proc.stderr for sign in (PORT_TAKEN, EXIT_ABORT)):
            break
    return proc, command


PATCHED_CHECKPOINT = ROOT / "tests" / "patched_checkpoint"
"""First on a child's ``PYTHONPATH``, its ``sitecustomize`` serves ``torch.utils.checkpoint`` as
docs/upstream/checkpoint-default-dtype.patch makes it (a copy; the installed torch is never written)."""


def patched_checkpoint_env(**overrides: str | None) -> dict[str, str]:
    """``clean_env(**overrides)`` for a child whose torch has the upstream patch (``PATCHED_CHECKPOINT``
    first on ``PYTHONPATH``): ``run_child(..., env=patched_checkpoint_env(FSDP_SHIM="1"))``. Where the patch
    does not apply, the child's ``import torch`` fails naming the release: mark such tests
    ``needs_patched_checkpoint``."""
    env = clean_env(**overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PATCHED_CHECKPOINT), env.get("PYTHONPATH")]))
    return env


def patched_checkpoint_tools() -> ModuleType:
    """``PATCHED_CHECKPOINT``'s ``sitecustomize`` loaded under another name, so that it installs nothing
    here: its ``patch_problem()`` asks whether the patch applies to the installed torch without importing it."""
    spec = importlib.util.spec_from_file_location("patched_checkpoint_tools", PATCHED_CHECKPOINT / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UPSTREAM_PATCH_PROBLEM: str | None = patched_checkpoint_tools().patch_problem()
"""Why docs/upstream/checkpoint-default-dtype.patch does not apply to the torch installed here, or None."""
needs_patched_checkpoint = pytest.mark.skipif(
    UPSTREAM_PATCH_PROBLEM is not None, reason=f"the upstream patch: {UPSTREAM_PATCH_PROBLEM}"
)
"""Skips a test that needs ``patched_checkpoint_env`` where the patch does not apply (it applies to torch 2.15.0)."""


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


def run_code(
    code: str,
    *,
    env: dict[str, str] | None = None,
    expect_ok: bool = True,
    python: str = sys.executable,
    python_args: tuple[str, ...] = (),
    launcher: tuple[str, ...] = (),
    cwd: Path | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (a test's own source, dedented) as a script in a fresh interpreter: the test holds the child's
    code next to its assertions. The script's folder is a temporary one, and ``tests/`` is importable from it."""
    import tempfile
    import textwrap

    folder = Path(tempfile.mkdtemp(prefix="fsdp-shim-test-"))
    script = folder / "child.py"
    script.write_text(f"import sys; sys.path.insert(1, {str(ROOT / 'tests')!r})\n" + textwrap.dedent(code))
    command = [*launcher, python, *python_args, str(script)]
    first_env = env if env is not None else clean_env()

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:
        return command, {**first_env, "MASTER_PORT": str(free_port())} if retry else first_env

    try:
        for retry in (False, True, True):
            cmd, run_env = attempt(retry)
            proc = run_command(cmd, env=run_env, cwd=cwd or folder, timeout=timeout)
            if proc.returncode == 0 or PORT_TAKEN not in proc.stderr:
                break
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def code_json(code: str, **options: Any) -> Any:
    """``run_code(code)``'s last line of JSON: the child prints its result with ``print(json.dumps(...))``."""
    return last_json(run_code(code, **options))


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(("{", "[", "null", "true", "false")):
            return json.loads(line)
    raise AssertionError(f"no JSON in child output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


MATRIX_SCOPE = os.environ.get("FSDP_SHIM_TEST_SCOPE", "all")
"""``all`` (every test), ``release`` (the ``per_release`` tests only), ``torch`` (the ``per_release`` and
``per_torch`` ones: a session on another torch than the matrix's) or ``common`` (every other test: the matrix's
default session, whose releases' ``per_release`` tests run in other sessions, as the ``per_torch`` and
``per_python`` ones do in the sessions of another torch or Python; noxfile.py)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "launchers: a real cluster launcher (SLURM, torchrun nodes): nox -s cluster")
    config.addinivalue_line(
        "markers",
        "per_release: what it checks differs between Lightning releases; the matrix runs it in every "
        "release session (every other test runs once, in the default session)",
    )
    config.addinivalue_line(
        "markers",
        "per_torch: what it checks differs between torch releases, not Lightning's; the matrix runs it in the "
        "sessions of another torch (on its own torch, the default session's end-to-end tests show the same)",
    )
    config.addinivalue_line(
        "markers",
        "per_python: needs neither torch nor Lightning (start-up files, the command, installs); the sessions of "
        "another Python run it without either (3.9, the sdist's 3.13), the matrix's sessions do not",
    )


WAITERS: tuple[tuple[str, ...], ...] = (
    (
        "test_rank_check.py::test_a_rank_stopped_right_after_joining_is_waited_for",
        "test_rank_check.py::test_a_rank_that_switched_its_check_off_is_named_as_one_without_the_shim",
        "test_verify.py::test_a_probe_that_runs_past_timeout_is_stopped_with_everything_it_started",
        "test_rank_check.py::test_fabric_ranks_agree_with_an_extra_model_and_unbounded_waits",
        "test_activation.py::test_the_import_finder_never_deadlocks",
    ),
    (
        "test_rank_check.py::test_trainer_ranks_agree_once_per_process_group_waiting_for_a_late_rank",
        "test_rank_check.py::test_a_rank_without_the_shim_stops_the_job_within_a_minute_by_default",
        "test_rank_check.py::test_without_the_variable_the_wait_is_the_process_groups_timeout",
        "test_rank_check.py::test_an_elastic_restart_without_the_shim_stops_the_job",
    ),
)
"""The tests that mostly wait (``tests/<file>::<test>``, every parameter): a documented grace, a late or stopped
rank, a timeout; 20-50 s of wall each, a few of CPU. Under xdist each group is put first in a worker's share (see
``waiters_first``): two workers wait through them from the start while the others keep the cores busy (the
default session runs four, noxfile.py). In file order they ran last, when nothing was left to overlap them."""


def waiters_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` reordered so that the ``--dist worksteal`` share of worker k starts with ``WAITERS[k]``: worksteal
    splits the collection in ``workers`` contiguous shares (each the remaining items // the remaining workers) and
    steals from a share's end, never its start. A worker of the same share size without waiters gets the next items
    in file order. Every worker collects the same order, as xdist requires."""
    groups: list[list[pytest.Item]] = [[] for _ in WAITERS]
    others = []
    for item in items:
        name = item.nodeid.split("[")[0].removeprefix("tests/")
        index = next((k for k, group in enumerate(WAITERS) if name in group), None)
        (others if index is None else groups[index]).append(item)
    ordered: list[pytest.Item] = []
    for k in range(workers):
        share = (len(items) - len(ordered)) // (workers - k)
        waiting = groups[k] if k < len(groups) else []
        ordered += waiting + others[: max(0, share - len(waiting))]
        del others[: max(0, share - len(waiting))]
    return ordered + others + [item for group in groups[workers:] for item in group]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules = {item.nodeid.split("::")[0]: getattr(item, "module", None) for item in items}
    for name in (name for group in WAITERS for name in group):
        file, function = name.split("::")
        module = modules.get(f"tests/{file}")
        if module is not None and not hasattr(module, function):  # renamed: it would silently wait last again
            raise pytest.UsageError(f"tests/conftest.py WAITERS: tests/{file} has no {function}")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        items[:] = waiters_first(items, workers)
    if MATRIX_SCOPE not in ("release", "torch", "common"):
        return
    skip_common = pytest.mark.skip(reason="the same on every release; runs in the matrix's default session")
    skip_release = pytest.mark.skip(
        reason="differs between releases; runs in the matrix session of this release (noxfile.py: DEFAULT_SESSION)"
    )
    skip_torch = pytest.mark.skip(reason="differs between torch releases; runs in the sessions of another torch")
    skip_python = pytest.mark.skip(reason="needs neither torch nor Lightning; runs in the sessions of another Python")
    for item in items:
        per_release = bool(item.get_closest_marker("per_release"))
        per_torch = bool(item.get_closest_marker("per_torch"))
        if MATRIX_SCOPE == "common" and item.get_closest_marker("per_python"):
            item.add_marker(skip_python)
        elif MATRIX_SCOPE == "common" and (per_release or per_torch):
            item.add_marker(skip_release if per_release else skip_torch)
        elif MATRIX_SCOPE == "release" and not per_release:
            item.add_marker(skip_torch if per_torch else skip_common)
        elif MATRIX_SCOPE == "torch" and not (per_release or per_torch):
            item.add_marker(skip_common)


@dataclass(frozen=True)
class Layout:
    """One installed Lightning layout: ``lightning`` (unified) or ``standalone``."""

    package: str
    trainer_version: str
    fabric_version: str

    def version(self, api: str) -> str:
        return self.fabric_version if api == "fabric" else self.trainer_version


@pytest.fixture(scope="session")
def layouts(once_per_run: OncePerRun) -> dict[str, Layout]:
    """The Lightning layouts importable here, probed in a child without the shim, once per test run (not once per
    xdist worker: each probe is an interpreter importing torch and Lightning, about 4 s of CPU). Without torch (the
    Python sessions: no filelock either) the probe imports nothing heavy and runs in each worker."""

    def probe() -> Any:
        return child_json("environment:layouts", {"namespaces": NAMESPACES}, python_args=("-W", "ignore"))

    found = once_per_run.get("layouts", probe) if importlib.util.find_spec("filelock") else probe()
    return {package: Layout(package, *versions) for package, versions in found.items()}


def is_fixed_release(version: str) -> bool:
    """Whether a Lightning release already contains the cast (2.5.0rc0 on)."""
    from _fsdp_shim.config import CAST

    return CAST.built_in(version)


@pytest.fixture
def lightning_installed(layouts: dict[str, Layout]) -> None:
    """Skips where no Lightning is importable (the no-Lightning session): the test needs one to read."""
    if not layouts:
        pytest.skip("needs an installed Lightning")


def layout_or_skip(layouts: dict[str, Layout], package: str) -> Layout:
    if package not in layouts:
        pytest.skip(f"the {package} layout of Lightning is not installed in this environment")
    return layouts[package]


class OncePerRun:
    """``get(key, compute)``: ``compute()``'s result (JSON), computed once in the whole test run. Under
    xdist the workers share the run's folder (the parent of each worker's basetemp: xdist's recipe for a
    session fixture that runs once) and take a lock per key, so a run two workers' tests need is made
    by whichever asks first and read by the other; alone, the folder is this process's own."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._memory: dict[str, Any] = {}

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self._memory:
            from filelock import FileLock  # torch's own dependency: in every environment with torch

            path = self._folder / f"once-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
            with FileLock(f"{path}.lock"):
                if not path.exists():
                    path.write_text(json.dumps(compute()))
                self._memory[key] = json.loads(path.read_text())
        return self._memory[key]


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory: pytest.TempPathFactory) -> OncePerRun:
    basetemp = tmp_path_factory.getbasetemp()
    shared = os.environ.get("PYTEST_XDIST_WORKER") is not None  # basetemp is <run>/popen-gwN
    return OncePerRun(basetemp.parent if shared else tmp_path_factory.mktemp("once"))


class Scenarios:
    """Runs ``tests/scenarios/fsdp_train.py``; each argument set once per test run (``OncePerRun``)."""

    def __init__(self, workdir: Path, once: OncePerRun) -> None:
        self._workdir = workdir
        self._once = once
        self._runs = 0

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
        key = json.dumps(["scenario", api, package, shim, cases, devices, sorted((env or {}).items()), extra])
        by_rank = self._once.get(
            key, lambda: list(self._execute(api, package, shim, cases, devices, env or {}, extra).items())
        )
        return {rank: results for rank, results in by_rank}  # JSON keeps no int keys: pairs

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
        self._runs += 1
        out = self._workdir / f"run{self._runs}"
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
            command = [*torchrun(launcher[1]), *command[1:]]
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
def scenarios(tmp_path_factory: pytest.TempPathFactory, once_per_run: OncePerRun) -> Scenarios:
    return Scenarios(tmp_path_factory.mktemp("scenarios"), once_per_run)


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


def an_affected_namespace(layouts: dict[str, Layout], kind: str = "any", fix: str = "cast") -> tuple[str, str]:
    """An installed namespace (of ``kind``: "trainer", "fabric" or "any") that lacks ``fix``, and its
    release; the test is skipped where there is none."""
    from _fsdp_shim.config import FIXES

    affects = next(f for f in FIXES if f.name == fix).affects
    for namespace, version in installed_versions(layouts).items():
        trainer = namespace in TRAINER.values()
        if affects(version) and (kind == "any" or trainer == (kind == "trainer")):
            return namespace, version
    pytest.skip(f"no Lightning ({kind}) that lacks the {fix} fix is installed in this environment")


def affected_layout(layouts: dict[str, Layout], package: str | None = None, fix: str = "cast") -> Layout:
    """An installed layout (``package``: "lightning" or "standalone", or either) whose Trainer and
    Fabric lack ``fix``; the test is skipped where there is none."""
    from _fsdp_shim.config import FIXES

    affects = next(f for f in FIXES if f.name == fix).affects
    for layout in layouts.values():
        if package in (None, layout.package) and affects(layout.trainer_version):
            return layout
    pytest.skip(f"needs a {package or 'Lightning'} release that lacks the {fix} fix")


FSDP_SHIM = str(Path(sys.executable).with_name("fsdp-shim"))
"""The console script next to this interpreter, as users run it."""


def fsdp_shim(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    python: str | None = None,
    prefix: tuple[str, ...] = (),
    timeout: float = 900,
) -> subprocess.CompletedProcess[str]:
    """``fsdp-shim ARGS`` in a fresh process: the console script, or ``PYTHON -m fsdp_shim`` for another
    interpreter; ``prefix`` goes in front (``setpriv ...``)."""
    command = [FSDP_SHIM] if python is None else [python, "-m", "fsdp_shim"]
    return run_command([*prefix, *command, *args], env=env or clean_env(), cwd=cwd, timeout=timeout)


def verify(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``fsdp-shim verify ARGS`` in a fresh interpreter."""
    return fsdp_shim("verify", *args, env=env, cwd=cwd)


def torchrun(ranks: int, *, nodes: int = 1, node_rank: int = 0, port: int | None = None) -> list[str]:
    """torchrun's command line for ``ranks`` ranks per node on 127.0.0.1, up to the program to run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    command += ["--monitor-interval", "0.5"]  # how often it looks at its ranks: an ended job ends in 0.5 s, not 5
    if nodes > 1:
        command += ["--nnodes", str(nodes), "--node-rank", str(node_rank)]
    return [*command, "--master-addr", "127.0.0.1", "--master-port", str(port or free_port())]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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


def site_packages_of(python: str) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.check_output([python, "-c", code], text=True).strip())


def make_venv(root: Path, paths: list[str] | None = None) -> Venv:
    """A venv without pip that sees ``paths`` (default: this checkout and this environment's packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = site_packages_of(str(root / "bin" / "python"))
    paths = [str(ROOT), sysconfig.get_paths()["purelib"]] if paths is None else paths
    paths_file = purelib / "aa_outer_environment.pth"
    paths_file.write_text("".join(f"{path}\n" for path in paths))
    return Venv(root, purelib, paths_file)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout, built from a copy of its files (a build writes where it runs); in an unpacked sdist
    (the sdist session), from a copy of the whole folder, as a packager builds it."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    if (ROOT / "PKG-INFO").is_file():
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"]
        files = subprocess.run(listing, cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
        for name in filter(None, files):
            path = ROOT / os.fsdecode(name)
            if path.is_file():
                target = source / os.fsdecode(name)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    build = [uv, "build", "-q", "--wheel", "--python", sys.executable, "--out-dir", str(work), str(source)]
    if uv is None:  # pip builds it too, in an isolated environment of its own (the build backend from the index)
        build = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps", "-w"]
        build += [str(work), str(source)]
    subprocess.run(build, check=True)
    return next(work.glob("fsdp_shim-*.whl"))


# ----------------------------------------------------------------------------- code planted in the current folder
PLANTED = """\
import importlib, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "RAN-" + __name__), "a") as marker:
    marker.write(f"{os.getpid()} {sys.argv}\\n")
# Then step aside for the real module, so whatever imported it still works.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
del sys.modules[__name__]
sys.modules[__name__] = importlib.import_module(__name__)
"""


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A folder holding a ``yaml.py`` and a ``packaging.py`` that record every process importing them."""
    folder = tmp_path / "project"
    folder.mkdir()
    for name in ("yaml", "packaging"):
        (folder / f"{name}.py").write_text(PLANTED)
    control = subprocess.run([sys.executable, "-c", "import yaml"], cwd=folder, env=clean_env(), timeout=60)
    assert control.returncode == 0 and (folder / "RAN-yaml").exists(), "the planted module must work"
    (folder / "RAN-yaml").unlink()
    return folder
