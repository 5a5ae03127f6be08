"""The three ways to activate the shim without editing code, each in fresh interpreters: the
environment-wide start-up file, ``fsdp-shim run``, and their combinations with ``import fsdp_shim``,
a user's own ``sitecustomize``, ``FSDP_SHIM=0`` and ``python -I``/``-S``."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIO, Layout, clean_env, free_port

from fsdp_shim.startup_files import PTH_TEXT, START_TEXT
from fsdp_shim.versions import is_affected_release

pytestmark = pytest.mark.release_independent

PROBE = """
import importlib, json, sys
for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
shim = sys.modules.get("fsdp_shim")
out = {"loaded": shim is not None}
if shim is not None:
    from fsdp_shim.patching import is_shim_wrapper
    status = shim.status()
    out.update(active=status.active, sources=list(status.sources),
               patched={s.namespace: s.patched for s in status.namespaces if s.imported})
    fsdp = sys.modules.get("lightning.pytorch.plugins.precision.fsdp")
    wrapper = fsdp.FSDPPrecision.__dict__.get("convert_module") if fsdp else None
    out["nested_wrapper"] = bool(wrapper is not None and is_shim_wrapper(getattr(wrapper, "__wrapped__", None)))
print(json.dumps(out))
"""


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
        self, *args: str, env: dict[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.python, *args], capture_output=True, text=True, env=env or clean_env(), cwd=ROOT, timeout=600
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return proc


@pytest.fixture
def venv(tmp_path: Path) -> Venv:
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = Path(
        subprocess.check_output(
            [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    paths_file = purelib / "aa_outer_environment.pth"
    paths_file.write_text(f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    return Venv(root, purelib, paths_file)


def probe(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def shim_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fsdp_shim", *args]


def run(command: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command, capture_output=True, text=True, env=env or clean_env(), cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{command} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def affected_lightning(layouts: dict[str, Layout]) -> None:
    if "lightning" not in layouts or not is_affected_release(layouts["lightning"].trainer_version):
        pytest.skip("needs an affected `lightning` release")


# ----------------------------------------------------------------------------- start-up file
def test_install_is_idempotent_and_uninstall_leaves_a_clean_interpreter(venv: Venv, layouts: dict[str, Layout]) -> None:
    affected_lightning(layouts)
    first = venv.run("-m", "fsdp_shim", "install")
    assert (venv.site_packages / "fsdp_shim.pth").read_text() == PTH_TEXT
    assert (venv.site_packages / "fsdp_shim.start").read_text() == START_TEXT
    assert first.stdout.count("wrote ") == 2
    second = venv.run("-m", "fsdp_shim", "install")
    assert second.stdout.count("already installed") == 2

    quiet = venv.run("-c", "pass")
    assert quiet.stderr == "" and quiet.stdout == ""
    active = probe(venv.run("-c", PROBE))
    assert active["loaded"] and active["sources"] == ["startup file"]
    assert active["patched"]["lightning.pytorch"] is True

    venv.run("-m", "fsdp_shim", "uninstall")
    assert not (venv.site_packages / "fsdp_shim.pth").exists()
    assert not (venv.site_packages / "fsdp_shim.start").exists()
    clean = venv.run("-c", "pass")
    assert clean.stderr == "" and clean.stdout == ""
    assert probe(venv.run("-c", PROBE)) == {"loaded": False}
    assert "nothing to remove" in venv.run("-m", "fsdp_shim", "uninstall").stdout


def test_a_startup_file_left_behind_by_a_removed_package_is_silent(venv: Venv) -> None:
    venv.run("-m", "fsdp_shim", "install")
    # What `pip uninstall fsdp-shim` leaves: the start-up file, and no importable package.
    venv.paths_file.write_text(f"{sysconfig.get_paths()['purelib']}\n")
    env = clean_env(PYTHONPATH=None)
    proc = venv.run("-c", "import sys; print('fsdp_shim' in sys.modules)", env=env)
    assert proc.stdout.strip() == "False"
    assert proc.stderr == ""


def test_the_startup_file_imports_nothing(venv: Venv) -> None:
    """The reason the start-up cost stays in the noise: no module is imported at all, only a watcher
    is put on sys.meta_path."""
    listing = "import sys, json; print(json.dumps([sorted(sys.modules), [getattr(f, '__name__', '') for f in sys.meta_path]]))"
    without, finders_without = json.loads(venv.run("-c", listing).stdout)
    venv.run("-m", "fsdp_shim", "install")
    with_file, finders_with = json.loads(venv.run("-c", listing).stdout)
    assert set(with_file) == set(without)
    # One watcher per time site reads the file (twice where lib64 links to lib), nothing else.
    watchers = [f for f in finders_with if f == "fsdp_shim_watcher"]
    assert watchers and finders_with == [*watchers, *finders_without]


def test_install_target_and_user(tmp_path: Path) -> None:
    target = tmp_path / "site"
    assert "wrote" in run(shim_cli("install", "--target", str(target))).stdout
    assert sorted(p.name for p in target.iterdir()) == ["fsdp_shim.pth", "fsdp_shim.start"]
    run(shim_cli("uninstall", "--target", str(target)))
    assert list(target.iterdir()) == []
    env = clean_env(PYTHONUSERBASE=str(tmp_path / "userbase"))
    run(shim_cli("install", "--user"), env=env)
    user_site = Path(
        run([sys.executable, "-c", "import site; print(site.getusersitepackages())"], env=env).stdout.strip()
    )
    assert (user_site / "fsdp_shim.pth").read_text() == PTH_TEXT
    run(shim_cli("uninstall", "--user"), env=env)
    assert not (user_site / "fsdp_shim.pth").exists()


# ----------------------------------------------------------------------------- fsdp-shim run
@pytest.fixture
def user_sitecustomize(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """A user's own sitecustomize (module or package form) that counts its runs in a file."""
    folder = tmp_path / "user_site"
    counter = tmp_path / "count.txt"
    # One line per run: (pid, command line). `fsdp-shim run` execs, so the launcher and the command
    # share a pid and differ in their command line; a process that ran it twice repeats a line.
    body = f"import os, sys\nwith open({str(counter)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}} {{sys.orig_argv!r}}\\n')\n"
    if getattr(request, "param", "module") == "package":
        (folder / "sitecustomize").mkdir(parents=True)
        (folder / "sitecustomize" / "__init__.py").write_text(body)
    else:
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(body)
    return folder, counter


def with_pythonpath(env: dict[str, str], first: Path) -> dict[str, str]:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(first), env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.parametrize("user_sitecustomize", ["module", "package"], indirect=True)
@pytest.mark.parametrize("nested", [False, True], ids=["run", "run-run"])
def test_run_activates_and_chains_the_users_sitecustomize_once(
    user_sitecustomize: tuple[Path, Path], nested: bool, layouts: dict[str, Layout]
) -> None:
    affected_lightning(layouts)
    folder, counter = user_sitecustomize
    prefix = shim_cli("run") + (shim_cli("run") if nested else [])
    result = probe(run([*prefix, sys.executable, "-c", PROBE], env=with_pythonpath(clean_env(), folder)))
    assert result["loaded"] and result["sources"] == ["fsdp-shim run"]
    assert result["patched"]["lightning.pytorch"] is True
    assert result["nested_wrapper"] is False
    assert_each_process_ran_it_once(counter, expected_processes=3 if nested else 2)


def assert_each_process_ran_it_once(counter: Path, expected_processes: int) -> None:
    """Every interpreter involved (each `fsdp-shim run` launcher, then the command) ran it once."""
    lines = counter.read_text().splitlines()
    assert len(lines) == len(set(lines)) == expected_processes, lines
    argvs = [ast.literal_eval(line.partition(" ")[2]) for line in lines]
    assert sum(argv[1:3] == ["-m", "fsdp_shim"] for argv in argvs) == expected_processes - 1
    assert sum(argv[1] == "-c" for argv in argvs) == 1


def test_run_with_import_and_startup_file_arms_once(
    venv: Venv, user_sitecustomize: tuple[Path, Path], layouts: dict[str, Layout]
) -> None:
    affected_lightning(layouts)
    folder, counter = user_sitecustomize
    venv.run("-m", "fsdp_shim", "install")
    code = "import fsdp_shim\n" + PROBE
    result = probe(
        venv.run("-m", "fsdp_shim", "run", venv.python, "-c", code, env=with_pythonpath(clean_env(), folder))
    )
    assert sorted(result["sources"]) == ["fsdp-shim run", "startup file"]
    assert result["patched"]["lightning.pytorch"] is True
    assert result["nested_wrapper"] is False
    assert_each_process_ran_it_once(counter, expected_processes=2)


@pytest.mark.parametrize("mode", ["startup-file", "run", "run+startup-file", "run-then-set-in-script"])
def test_fsdp_shim_0_switches_every_mode_off(mode: str, venv: Venv, layouts: dict[str, Layout]) -> None:
    affected_lightning(layouts)
    if "startup-file" in mode:
        venv.run("-m", "fsdp_shim", "install")
    if mode == "run-then-set-in-script":
        env, code = clean_env(), "import os; os.environ['FSDP_SHIM'] = '0'\n" + PROBE
    else:
        env, code = clean_env(FSDP_SHIM="0"), PROBE
    args = ("-m", "fsdp_shim", "run", venv.python, "-c", code) if "run" in mode else ("-c", code)
    result = probe(venv.run(*args, env=env))
    assert result.get("patched", {}).get("lightning.pytorch", False) is False


def test_isolated_and_no_site_modes(venv: Venv, layouts: dict[str, Layout]) -> None:
    """Documented: -S skips every start-up activation; -I (and -E) ignore PYTHONPATH, so `run` cannot
    reach them, while the start-up file in site-packages still does."""
    affected_lightning(layouts)
    assert (
        probe(
            run(
                [
                    *shim_cli("run"),
                    sys.executable,
                    "-I",
                    "-c",
                    "import sys; sys.path.insert(0, %r)\n" % os.environ.get("PYTHONPATH", "") + PROBE,
                ]
            )
        )["loaded"]
        is False
    )
    venv.run("-m", "fsdp_shim", "install")
    isolated = "import sys; sys.path[:0] = %r\n" % [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    assert probe(venv.run("-I", "-c", isolated + PROBE))["loaded"] is True
    no_site = "import sys; sys.path[:0] = %r\n" % [
        str(ROOT),
        sysconfig.get_paths()["purelib"],
        *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p],
    ]
    assert probe(venv.run("-S", "-c", no_site + PROBE))["loaded"] is False


def test_run_passes_exit_codes_and_signals_through() -> None:
    assert run([*shim_cli("run"), sys.executable, "-c", "import sys; sys.exit(7)"], check=False).returncode == 7
    killed = run(
        [*shim_cli("run"), sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], check=False
    )
    assert killed.returncode == -signal.SIGTERM
    missing = run([*shim_cli("run"), "no-such-command-fsdp-shim"], check=False)
    assert missing.returncode == 127 and "command not found" in missing.stderr


# ----------------------------------------------------------------------------- status
def test_status_reports_and_exit_code(venv: Venv, layouts: dict[str, Layout]) -> None:
    affected_lightning(layouts)
    venv.run("-m", "fsdp_shim", "install")
    report = json.loads(venv.run("-m", "fsdp_shim", "status", "--json", "--python-check").stdout)
    assert report["consistent"] is True
    assert [Path(f["path"]).name for f in report["startup_files"]] == ["fsdp_shim.pth", "fsdp_shim.start"]
    assert report["child"]["shim_loaded"] is True
    by_namespace = {n["namespace"]: n for n in report["child"]["status"]["namespaces"]}
    assert by_namespace["lightning.pytorch"]["patched"] is True
    assert any(row["namespace"] == "lightning.pytorch" and row["affected"] for row in report["lightning"])

    bad_toggle = venv.run("-m", "fsdp_shim", "status", env=clean_env(FSDP_SHIM="perhaps"), check=False)
    assert bad_toggle.returncode == 1 and "FSDP_SHIM='perhaps'" in bad_toggle.stdout

    (venv.site_packages / "fsdp_shim.pth").write_text(PTH_TEXT + "# edited\n")
    outdated = venv.run("-m", "fsdp_shim", "status", check=False)
    assert outdated.returncode == 1 and "another fsdp-shim version" in outdated.stdout

    in_run = json.loads(run([*shim_cli("run"), *shim_cli("status", "--json")]).stdout)
    assert in_run["bootstrap_on_pythonpath"] and in_run["consistent"] is True

    stale_env = clean_env()
    stale_env["PYTHONPATH"] = os.pathsep.join(
        ["/nonexistent/site-packages/fsdp_shim/bootstrap", stale_env.get("PYTHONPATH", "")]
    )
    stale = run(shim_cli("status"), env=stale_env, check=False)
    assert stale.returncode == 1 and "bootstrap folder that does not exist" in stale.stdout


# ----------------------------------------------------------------------------- multi-process FSDP
def flat_dtypes(out: Path, ranks: int) -> list[list[str]]:
    results = []
    for rank in range(ranks):
        rows = {row["case"]: row for row in json.loads(Path(f"{out}.rank{rank}.json").read_text())}
        results.append(rows["init+pretrained:bf16-true"]["flat_param_dtypes"])
    return results


SCENARIO_ARGS = ["--api", "trainer", "--shim", "off", "--cases", "init+pretrained:bf16-true"]


def test_lightning_launcher_ranks_get_the_fix_from_the_startup_file_alone(
    venv: Venv, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    affected_lightning(layouts)
    venv.run("-m", "fsdp_shim", "install")
    out = tmp_path / "launcher"
    venv.run(str(SCENARIO), *SCENARIO_ARGS, "--devices", "2", "--out", str(out), env=clean_env(PYTHONWARNINGS="ignore"))
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def torchrun() -> str:
    return shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"


def test_fsdp_shim_run_torchrun_two_ranks(tmp_path: Path, layouts: dict[str, Layout]) -> None:
    affected_lightning(layouts)
    out = tmp_path / "torchrun"
    command = [
        *shim_cli("run"),
        torchrun(),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCENARIO),
        *SCENARIO_ARGS,
        "--devices",
        "2",
        "--out",
        str(out),
    ]
    run(command, env=clean_env(PYTHONWARNINGS="ignore"))
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def test_two_nodes_on_loopback_each_wrapped_with_run(tmp_path: Path, layouts: dict[str, Layout]) -> None:
    affected_lightning(layouts)
    out = tmp_path / "nodes"
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        command = [
            *shim_cli("run"),
            torchrun(),
            "--nnodes",
            "2",
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "fsdp-shim-test",
            str(SCENARIO),
            *SCENARIO_ARGS,
            "--devices",
            "1",
            "--num-nodes",
            "2",
            "--out",
            str(out),
        ]
        nodes.append(
            subprocess.Popen(
                command,
                env=clean_env(PYTHONWARNINGS="ignore"),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for node in nodes:
        _, stderr = node.communicate(timeout=600)
        assert node.returncode == 0, stderr[-4000:]
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def test_arming_after_lightning_was_imported_patches_at_once(layouts: dict[str, Layout]) -> None:
    """A start-up hook that runs after something already imported Lightning patches it at once."""
    affected_lightning(layouts)
    code = "import lightning, _fsdp_shim_startup\n_fsdp_shim_startup.arm('fsdp-shim run')\n" + PROBE
    result = probe(run([sys.executable, "-c", code]))
    assert result["sources"] == ["fsdp-shim run"]
    assert result["patched"]["lightning.pytorch"] is True
