"""The compatibility matrix: the whole test suite against every Lightning release line.

torch is installed once (``torch==2.13.0``, see ``.ci/run``) in the environment that runs nox, and
most sessions run in that environment (``venv_backend="none"``): Lightning's wheels are pure
Python, so each session installs its releases with ``pip install --no-deps --target .matrix/<name>``
and puts that folder first on ``PYTHONPATH``. The environment itself holds no Lightning, so a
session sees exactly the layout it installed.

The sessions in :data:`OTHER_TORCH` test the torch users of that Lightning actually run, from 2.3.1 to
the newest: each gets its own virtual environment with that torch installed first, pinned (PyPI's
builds are CUDA builds: about 3 GB with their nvidia-* wheels; they run FSDP on CPU with gloo). torch
2.2 runs CPU FSDP too and was measured once by hand; torch 2.1 cannot (its CPU device handle has no
streams), and CI has no GPU: see the footer of docs/compatibility.md.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
MATRIX_DIR = ROOT / ".matrix"
RESULTS_DIR = MATRIX_DIR / "results"
TIMES_FILE = MATRIX_DIR / "session-times.tsv"
"""One line per session run: name, seconds, outcome. ``.ci/run`` prints it at the end."""
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""In every test session: torch's intra-op threads, one per core by default, only contend for the two cores the
suite's processes share (the models are tiny). torchrun sets the same for its workers. About 7% less CPU and wall
time (tests/test_cast.py on 2.4.0: 74 -> 68 CPU s)."""
SESSION_LIMIT_SECONDS = 2700
"""A whole test session is killed after this (with everything it started): a hang that the per-test
timeout cannot end (in collection, in a fixture) still fails in minutes, not at CI's limit."""


def timed(function: Callable[..., None]) -> Callable[..., None]:
    """Record the session's wall time in ``TIMES_FILE``, whether it passes or fails."""

    @functools.wraps(function)
    def wrapper(session: nox.Session, *args: object, **kwargs: object) -> None:
        start = time.monotonic()
        outcome = "failed"
        try:
            function(session, *args, **kwargs)
            outcome = "passed"
        finally:
            MATRIX_DIR.mkdir(exist_ok=True)
            with TIMES_FILE.open("a") as times:
                times.write(f"{session.name}\t{time.monotonic() - start:.0f}\t{outcome}\n")

    return wrapper


# lightning 2.0.x imports lightning.app at import time, which needs these.
APP_DEPS_2_0 = [
    "fastapi",
    "websockets<13",
    "deepdiff<8",
    "click",
    "lightning-cloud",
    "backoff",
    "beautifulsoup4",
    "croniter<1.5",
    "requests",
]

# A session that installs both layouts of one release (`lightning` and the standalone
# `pytorch_lightning` + `lightning_fabric`) tests both in one run: they are separate class objects,
# gated and patched on their own, and the suite is parametrized by layout, so nothing is lost against
# one session per layout, while each session's fixed cost (collection, probing the environment, the
# release-wide checks) is paid once.
# Two releases that need nothing else of each other share a session, one per layout: 2.1.4 with 2.5.0 (the
# last patch of the first affected line, the first fixed release), 2.2.5 with 2.3.3, 2.6.6 with 2.4.0 (each
# release is tested in one layout at least; 2.4.0 and 2.6.6 in both). 2.1.0, whose Trainer alone names its
# precision class FSDPPrecisionPlugin, runs the wrapt-1 session: the gates, every wrapper and the training
# through them.
MATRIX: dict[str, list[str]] = {
    "lightning-2.0.9": ["lightning==2.0.9"],
    "lightning-2.1.4-standalone-2.5.0": ["lightning==2.1.4", "pytorch-lightning==2.5.0", "lightning-fabric==2.5.0"],
    # 2.2.5 and 2.3.3 on torch 2.3.1, 2.6.6 on torch 2.15.0: OTHER_TORCH below.
    # What `pip install lightning==2.4.0` creates: an affected lightning.* next to the newest,
    # fixed pytorch_lightning/lightning_fabric. The default development environment.
    "mixed-2.4.0": ["lightning==2.4.0", "pytorch-lightning==2.6.6"],
    # wrapt's newest 1.x, on the first release, which needs all three wrappers (2.1.x): WRAPT_DEPENDENT_TESTS.
    "lightning-2.1.0-wrapt1": ["lightning==2.1.0", "wrapt==1.17.3"],
    # No Lightning at all: the shim must import and do nothing.
    "no-lightning": [],
}
# Every session but the wrapt-1 one runs on the environment's wrapt, the newest 2.x.


@dataclass(frozen=True)
class OtherTorch:
    """A session on another torch than the environment's, in a uv virtual environment of its own."""

    torch: str
    python: str | None = None
    """``X.Y`` (see :func:`find_python`), or None for nox's own interpreter."""
    pins: tuple[str, ...] = ()
    """Installed with torch and pinned like it, in every install."""


# Sessions on another torch than the environment's (session name, also in MATRIX -> its torch). The
# recompute fix lives on torch's private checkpoint internals, and FSDP's bytes differ between torch
# releases: the fixes are tested on the torch releases users install next to each Lightning line, from
# the oldest that runs FSDP on CPU to the newest. Where a release line's users run a torch of their
# own (2.2 and 2.3: torch 2.3; the newest Lightning: the newest torch), that line's session runs there,
# all of its per_release tests, instead of on the environment's torch as well.
OTHER_TORCH: dict[str, OtherTorch] = {
    # The oldest torch that runs FSDP on CPU (2.1 and 2.2 cannot: see the footer of docs/compatibility.md),
    # with the Lightning of its time. Built against NumPy 1.
    "lightning-2.2.5-standalone-2.3.3-torch-2.3.1": OtherTorch("2.3.1", pins=("numpy<2",)),
    # The newest torch, on the Python its users run, with the newest Lightning (the recompute's whole
    # matrix: tests/test_recompute.py's PROOF_RELEASES) next to the last release the cast fixes: the
    # per_release tests of the default session's two releases run here (DEFAULT_SESSION).
    "lightning-2.6.6-standalone-2.4.0-torch-2.15.0": OtherTorch("2.15.0", python="3.12"),
}
MATRIX["lightning-2.2.5-standalone-2.3.3-torch-2.3.1"] = [
    "lightning==2.2.5",
    "pytorch-lightning==2.3.3",
    "lightning-fabric==2.3.3",
]
MATRIX["lightning-2.6.6-standalone-2.4.0-torch-2.15.0"] = [
    "lightning==2.6.6",
    "pytorch-lightning==2.4.0",
    "lightning-fabric==2.4.0",
]

WRAPT_DEPENDENT_TESTS = [
    "tests/test_activation.py",
    "tests/test_coexistence.py",
    "tests/test_recompute.py",
    "tests/test_cast.py::test_single_process_behaves_like_2_5",
    "tests/test_cast.py::test_the_2_1_trainer_gets_the_setup_path",
]
"""What the wrapt-1 session runs (its per_release tests): the wrappers, their identity and composition,
and training through each fix's wrappers (2.1.x's conversion moved to setup included). What the cast and
verify measure beyond that does not depend on wrapt's version (the 2.1.4 session runs it)."""
SEED_VERIFY = "tests/test_verify.py::test_the_seed_model_gets_a_verdict_per_fix"
"""``fsdp-shim verify`` on the seed model: four training runs in two processes. Its outcome is one of three, by the
first Trainer's release: nothing trained (2.0.x: lightning-2.0.9), the cast and the recompute measured (2.1-2.4) or
the recompute alone (2.5+: the torch-2.15.0 session, 2.6.6). 2.1-2.4's runs on the oldest torch in the torch-2.3.1
session (2.2.5); on this environment's torch 2.13, the default session's verify tests train the same path on 2.4.0
(exactly half, every phase counted). So the 2.1.4 session, the same outcome on the same torch, does not run it."""
SESSION_TESTS = {
    "lightning-2.1.0-wrapt1": WRAPT_DEPENDENT_TESTS,
    "lightning-2.1.4-standalone-2.5.0": ["--deselect", SEED_VERIFY],
    # The project's own checks (import graph, matrix scripts, the benchmark, which brings its own Lightning
    # folders) do not depend on the session's Lightning: they run in the default session. The start-up, command
    # and install tests run without torch and Lightning in the Python sessions (3.9, sdist) and with both in the
    # default session; what depends on torch alone (per_torch), in the sessions of another torch.
    "no-lightning": [
        *(f"--ignore=tests/test_{name}.py" for name in ("project", "startup", "run", "status", "packaging")),
        "-m",
        "not per_torch",
    ],
}

DEFAULT_SESSION = "mixed-2.4.0"
"""Runs every test but those marked per_release (tests/conftest.py: ``FSDP_SHIM_TEST_SCOPE=common``), whose
outcome differs between Lightning releases: the other sessions run those, and its own releases' (2.4.0 and
2.6.6, in the other layouts) run on the newest torch, so that CI runs each once. ``pytest`` run by hand on its
folder runs them too (CONTRIBUTING.md)."""


COMPILE = "--compile-bytecode"
"""Every install writes its ``.pyc`` files: uv writes none by default, and where ``PYTHONDONTWRITEBYTECODE=1``
(CI) no interpreter does, so each of the suite's interpreters compiled what it imported again (torch
2.4.1's own import: 2.8 s without them, 1.3 s with; numpy, Lightning: about 0.5 s more)."""


def uv_install(session: nox.Session, python: str, *arguments: str) -> None:
    """``uv pip install`` for ``python``: seconds where pip takes minutes. torch is never resolved
    here (it is installed first, from a pinned file), so uv's lack of pip's torch cap does not matter."""
    session.run("uv", "pip", "install", "-q", COMPILE, "--python", python, *arguments, external=True)


TRANSFORMERS = ["transformers>=5,<6"]
"""The Hugging Face Llama of tests/test_recompute.py (default session), in a folder of its own that only
that test's runs put on their path (``FSDP_SHIM_TEST_TRANSFORMERS``, appended): installed next to
Lightning, torchmetrics imports it with every ``import lightning``, about 0.9 s of each of the suite's
interpreters (a quarter of a release session's time). None of its dependencies is torch."""


def install_target(
    session: nox.Session,
    name: str,
    python: str = sys.executable,
    specs: list[str] | None = None,
    with_dependencies: bool = False,
) -> Path:
    """``specs`` (default: the release(s) of MATRIX[name]) in .matrix/<name>, compiled. The stamp records how,
    so that a folder installed another way (before COMPILE, say) is installed again."""
    target = MATRIX_DIR / name
    stamp = target / ".installed"
    specs = MATRIX[name] if specs is None else specs
    options = [] if with_dependencies else ["--no-deps"]
    how = json.dumps([COMPILE, *options, *specs])
    if stamp.exists() and stamp.read_text() == how:
        return target
    if target.exists():
        session.run("rm", "-rf", str(target), external=True)
    target.mkdir(parents=True)
    if specs:
        uv_install(session, python, *options, "--target", str(target), *specs)
    if name == "lightning-2.0.9":
        # Their own dependencies come along, but never torch: none of them asks for it.
        uv_install(session, python, "--target", str(target), *APP_DEPS_2_0)
    stamp.write_text(how)
    return target


def xdist_options(name: str) -> list[str]:
    """Worksteal: each worker gets a contiguous share, and one that finishes early takes tests from the end of
    another's. The default session's rank checks and time limits mostly wait (tests/conftest.py: ``WAITERS``, put
    first in two workers' shares): four workers, two of them waiting from the start while the other two keep the two
    cores busy. The other sessions train more than they wait: two workers."""
    return ["-n", "4" if name == DEFAULT_SESSION else "2", "--dist", "worksteal"]


def run_matrix_session(
    session: nox.Session, name: str, python: str = sys.executable, tests: tuple[str, ...] = ()
) -> None:
    target = install_target(session, name, python)
    env = {
        **ONE_THREAD,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH", "")])),
        "FSDP_SHIM_TEST_SCOPE": {DEFAULT_SESSION: "common", "no-lightning": "all"}.get(
            name, "torch" if name in OTHER_TORCH else "release"
        ),
    }
    if name == DEFAULT_SESSION:
        env["FSDP_SHIM_TEST_TRANSFORMERS"] = str(install_target(session, "transformers", python, TRANSFORMERS, True))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    junit = RESULTS_DIR / f"{name}.xml"
    try:
        session.run(
            "timeout",
            "--kill-after=30",
            str(SESSION_LIMIT_SECONDS),
            python,
            "-m",
            "pytest",
            *xdist_options(name),
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *(session.posargs or tests),
            env=env,
            external=True,
        )
    finally:
        session.run(
            python,
            str(ROOT / "scripts" / "matrix_status.py"),
            name,
            str(RESULTS_DIR / f"{name}.json"),
            str(junit),
            env=env,
            external=True,
        )


for _name in MATRIX:
    if _name in OTHER_TORCH:
        continue

    @nox.session(name=f"tests-{_name}")
    @timed
    def _matrix_session(session: nox.Session, _name: str = _name) -> None:
        run_matrix_session(session, _name, tests=tuple(SESSION_TESTS.get(_name, ())))


def find_python(version: str) -> str:
    """``version`` (``X.Y``) as a session's ``python=``, found here rather than downloaded.

    nox finds ``pythonX.Y`` on ``PATH``, where on a machine with pyenv it is pyenv's shim, which runs only
    the versions pyenv has active (``PYENV_VERSION``, a ``.python-version``, the global one): a shim for
    an installed but inactive version fails, and nox would download that Python (``uv python install``).
    So where pyenv has ``X.Y`` installed, its newest patch release is made active for this nox process
    and what it starts, after those already active (``python3`` and the rest answer as before). Where
    neither has it, nox's uv backend downloads it."""
    import shutil
    import subprocess

    def runs(command: list[str]) -> str | None:
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        return proc.stdout if proc.returncode == 0 else None

    on_path = shutil.which(f"python{version}")
    pyenv = shutil.which("pyenv")
    if (on_path and runs([on_path, "-c", ""]) is not None) or pyenv is None:
        return version
    installed = (runs([pyenv, "versions", "--bare", "--skip-aliases"]) or "").split()
    patches = [v for v in installed if v.startswith(f"{version}.") and v[len(version) + 1 :].isdigit()]
    if patches:
        newest = max(patches, key=lambda v: int(v.rsplit(".", 1)[1]))
        active = (runs([pyenv, "version-name"]) or "").strip().split(":")
        os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys([*filter(None, active), newest]))
    return version


for _name, _other in OTHER_TORCH.items():

    @nox.session(
        name=f"tests-{_name}",
        venv_backend="uv",
        python=find_python(_other.python) if _other.python else None,
    )
    @timed
    def _other_torch_session(session: nox.Session, _name: str = _name, _other: OtherTorch = _other) -> None:
        # torch first, and pinned (with the session's pins) in every install: nothing may resolve another torch.
        pins = [f"torch=={_other.torch}", *_other.pins]
        runtime = nox.project.load_toml(ROOT / "pyproject.toml")["project"]["dependencies"]
        session.install(COMPILE, *pins, *runtime, "-r", str(ROOT / ".ci" / "requirements-test.txt"))
        session.install(COMPILE, *pins, "--no-deps", "-e", str(ROOT))
        check = "import sys, torch; print('torch', torch.__version__, 'python', sys.version.split()[0]); "
        check += f"assert torch.__version__.split('+')[0] == {_other.torch!r}, torch.__version__"
        if _other.python:
            check += f"; assert sys.version.startswith({_other.python + '.'!r}), sys.version"
        session.run("python", "-c", check)
        run_matrix_session(session, _name, python=str(Path(session.virtualenv.bin) / "python"))


DIST_DIR = ROOT / "build" / "dist"
"""Where the lint session builds the sdist and wheel, once per nox run: the sessions after it use those."""
_distributions: list[Path] = []


def distributions(session: nox.Session) -> tuple[Path, Path]:
    """The sdist and wheel of this checkout, built once per nox run (``uv build``: the wheel from the sdist, as
    ``python -m build`` does) and checked as the index checks an upload: ``twine check --strict`` renders
    the README, ``check-wheel-contents`` reads the wheel's files (its list of top-level names: pyproject.toml)."""
    if not _distributions:
        session.run("rm", "-rf", str(DIST_DIR), external=True)
        session.run(
            "uv", "build", "-q", "--python", sys.executable, "--out-dir", str(DIST_DIR), str(ROOT), external=True
        )
        sdist, wheel = next(DIST_DIR.glob("*.tar.gz")), next(DIST_DIR.glob("*.whl"))
        session.run("twine", "check", "--strict", str(sdist), str(wheel), external=True)
        session.run("check-wheel-contents", str(wheel), external=True)
        _distributions.extend([sdist, wheel])
    return _distributions[0], _distributions[1]


@nox.session
@timed
def lint(session: nox.Session) -> None:
    """The linter, the type checker on the package (pyproject.toml's [tool.mypy]), the metadata and the
    workflows against their schemas, and the sdist and wheel built and checked as the index checks them."""
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("validate-pyproject", "pyproject.toml")
    github = ROOT / ".github"
    workflows = sorted(str(path) for path in (github / "workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    forms = sorted(str(path) for path in (github / "ISSUE_TEMPLATE").glob("*.yml") if path.name != "config.yml")
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-issue-forms", *forms)
    distributions(session)


def runtime_floors() -> dict[str, str]:
    """Each runtime dependency's lowest allowed release, from pyproject.toml (``wrapt>=1.14,...`` -> ``1.14``)."""
    from packaging.requirements import Requirement

    floors = {}
    for spec in nox.project.load_toml(ROOT / "pyproject.toml")["project"]["dependencies"]:
        requirement = Requirement(spec)
        floors[requirement.name] = next(s.version for s in requirement.specifier if s.operator == ">=")
    return floors


def test_tools() -> list[str]:
    """``.ci/requirements-test.txt`` less Lightning's dependencies (torchmetrics would resolve a torch)."""
    lines = (ROOT / ".ci" / "requirements-test.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith(("#", "-r"))]


NO_TORCH_TESTS = ["tests/test_startup.py", "tests/test_run.py", "tests/test_status.py", "tests/test_packaging.py"]
"""What the sessions of another Python run, with no torch and no Lightning: every way the shim is armed at
start-up, the command, and what pip, uv and ``fsdp-shim install`` put into an environment and take out."""


def run_no_torch_tests(session: nox.Session) -> None:
    """``pytest``, not ``python -m pytest``: the current folder is not on ``sys.path``, so the tests import the
    package as installed in the session's environment."""
    tests = session.posargs or NO_TORCH_TESTS
    session.run("pytest", "-n", "2", "-q", "-p", "no:cacheprovider", *tests, env={"FSDP_SHIM_TEST_SCOPE": "all"})


@nox.session(name="tests-python-3.9", venv_backend="uv", python=find_python("3.9"))
@timed
def tests_python_3_9(session: nox.Session) -> None:
    """The oldest Python of ``requires-python``, with the runtime dependencies at their floors (uv's
    lowest-direct resolution of the wheel): the floors in pyproject.toml are the ones this session ran."""
    _, wheel = distributions(session)
    runtime = nox.project.load_toml(ROOT / "pyproject.toml")["project"]["dependencies"]
    session.install(COMPILE, "--resolution", "lowest-direct", str(wheel), *runtime)  # direct: at their floors
    session.install(COMPILE, "pip", *test_tools())  # keeps the floors: the tools accept them (pip: the tests')
    check = (
        "import sys\nfrom importlib.metadata import version\nfrom packaging.version import Version\n"
        f"floors = {runtime_floors()!r}\n"
        "found = {name: version(name) for name in floors}\nprint('runtime dependencies:', found)\n"
        "assert all(Version(found[name]) == Version(floor) for name, floor in floors.items()), (found, floors)\n"
        "assert sys.version_info[:2] == (3, 9), sys.version\n"
    )
    session.run("python", "-I", "-c", check)
    run_no_torch_tests(session)


@nox.session(name="sdist", venv_backend="uv", python=find_python("3.13"))
@timed
def sdist(session: nox.Session) -> None:
    """What a packager does with the sdist, on the newest Python here: unpack it, ``pip install`` the folder
    into a fresh environment, collect every test from the folder and run those that need neither torch nor
    Lightning (the release workflow runs this before it publishes)."""
    import tarfile

    archive, _ = distributions(session)
    unpacked = ROOT / "build" / "sdist"
    session.run("rm", "-rf", str(unpacked), external=True)
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    folder = unpacked / archive.name.removesuffix(".tar.gz")
    session.install(COMPILE, str(folder), "pip", *test_tools())  # pip: the tests run it
    version = archive.name.removesuffix(".tar.gz").split("-", 1)[1]
    check = f"from _fsdp_shim._version import __version__ as v; print('installed:', v); assert v == {version!r}, v"
    session.run("python", "-I", "-c", check)
    session.chdir(folder)
    session.run("pytest", "--collect-only", "-qq", "-p", "no:cacheprovider")
    run_no_torch_tests(session)


@nox.session(name="compat-table")
@timed
def compat_table(session: nox.Session) -> None:
    """Write docs/compatibility.md from the results of the matrix sessions run before it."""
    session.run(
        sys.executable,
        str(ROOT / "scripts" / "compat_table.py"),
        str(RESULTS_DIR),
        str(ROOT / "docs" / "compatibility.md"),
        *MATRIX,
    )


@nox.session
@timed
def docs(session: nox.Session) -> None:
    """Build the docs with the locked toolchain (.ci/run installs it) and warnings as errors: broken links too."""
    site = ROOT / "build" / "site"
    env = {"NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, printed on every build
    session.run(sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site), env=env, external=True)


nox.options.sessions = [
    "lint",
    *(f"tests-{name}" for name in MATRIX),
    "tests-python-3.9",
    "sdist",
    "compat-table",
    "docs",
]


# ----------------------------------------------------------------------------- real cluster launchers
CLUSTER_LIGHTNING = DEFAULT_SESSION
"""The Lightning the cluster tests train with (2.4.0, affected): the same .matrix folder as its session."""


CLUSTER_LIMIT_SECONDS = 900
"""The cluster tests are killed after this (about 5-10 minutes here; each job has its own 240 s bound)."""


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: nox stops the running command (and ``timeout`` everything it started), and the
    session's ``finally`` runs, where Python's default would end nox at once, its daemons left running."""
    raise KeyboardInterrupt


@nox.session
@timed
def cluster(session: nox.Session) -> None:
    """A real SLURM (two slurmd "nodes" on 127.0.0.1) and two torchrun nodes on loopback, running real
    FSDP in every activation mode (tests/test_launchers.py). Installs Debian's slurm and munge with
    apt-get if missing (about 30-60 s; needs root), starts its own daemons in a temporary folder and
    stops exactly those afterwards, also when the tests fail."""
    import shutil
    import signal
    import tempfile

    started = time.monotonic()
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        session.skip("needs root and apt-get (Debian) to install and run SLURM")
    target = install_target(session, CLUSTER_LIGHTNING)  # compiled, as every install here (COMPILE)
    slurm = [sys.executable, str(ROOT / "tests" / "cluster" / "slurm.py")]
    session.run(*slurm, "install", external=True)
    state = Path(tempfile.mkdtemp(prefix="fsdp-shim-slurm-")) / "cluster"
    state.parent.chmod(0o755)  # munged runs as user munge and must reach its folder inside
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    tables = RESULTS_DIR / "cluster-tables.txt"
    tables.unlink(missing_ok=True)
    env = {
        **ONE_THREAD,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH", "")])),
        "FSDP_SHIM_TEST_SCOPE": "all",
        "FSDP_SHIM_TEST_CLUSTER": "1",
        "FSDP_SHIM_TEST_CLUSTER_TABLES": str(tables),
        "SLURM_CONF": str(state / "slurm.conf"),
    }
    session.log(
        f"starting munged, slurmctld and slurmd n1 and n2 in {state}: stopped when this session ends, fails "
        "or is interrupted (Ctrl-C, SIGTERM)"
    )
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        session.run(*slurm, "start", str(state), external=True)
        session.run(
            "timeout",
            "--kill-after=30",
            str(CLUSTER_LIMIT_SECONDS),
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-s",  # the per-rank tables go to the log as each job ends
            "-p",
            "no:cacheprovider",
            f"--junitxml={RESULTS_DIR / 'cluster.xml'}",
            "-m",
            "launchers",  # the rank-check tests in that file ran in the default session
            str(ROOT / "tests" / "test_launchers.py"),
            *session.posargs,
            env=env,
            external=True,
        )
    finally:
        session.run(*slurm, "stop", str(state), external=True)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(state.parent, ignore_errors=True)
        session.log(f"cluster session: {time.monotonic() - started:.0f} s wall; per-rank tables in {tables}")


# After the matrix sessions (it reuses the default session's Lightning folder), before the table and docs.
nox.options.sessions.insert(nox.options.sessions.index("compat-table"), "cluster")
