"""Activation at interpreter start, in fresh interpreters: ``FSDP_SHIM`` read by the start-up files this environment's
install of fsdp-shim put into site-packages (``fsdp_shim_env.pth``, its PEP 829 companion ``.start``); ``python -m
fsdp_shim``; what a start costs; what the armed finder leaves of Lightning's import; a shim that cannot load.
``fsdp-shim run``: test_run.py; what installers put there and remove: test_packaging.py."""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import site
import sys
from pathlib import Path

import pytest
from conftest import (
    FSDP_SHIM,
    Layout,
    affected_layout,
    clean_env,
    code_json,
    make_venv,
    run_code,
    run_command,
    run_scenario,
    scenario_results,
)

import _fsdp_shim

PACKAGE_ROOT = Path(_fsdp_shim.__file__).resolve().parent.parent
ARMED_BY_THE_PTH = "FSDP_SHIM={} (start-up file installed with the package)"


@pytest.fixture(scope="module")
def site_packages() -> Path:
    """Where this environment's install of fsdp-shim put its start-up files."""
    found = [Path(d) for d in site.getsitepackages() if (Path(d) / "fsdp_shim_env.pth").is_file()]
    assert found, "these tests need fsdp-shim installed here by pip or uv (pip install -e .)"
    return found[0]


# ----------------------------------------------------------------------------- the switch and what it costs
WHAT_START_UP_LEFT = """\
import json, sys
print(json.dumps([
    [getattr(finder, "__name__", "") for finder in sys.meta_path].count("fsdp_shim_finder"),
    getattr(sys.modules.get("_fsdp_shim"), "ARMED_BY", None),
    sorted(sys.modules),
]))
"""
"""Prints the shim's finders on ``sys.meta_path``, how the start-up module was armed (``None``: never), every module."""


@pytest.mark.per_python
def test_the_switch_read_by_the_pth_its_pep_829_companion_and_status_and_what_arming_imports(
    site_packages: Path, tmp_path: Path
) -> None:
    """``FSDP_SHIM`` set and not blank (``0`` too, read again at Lightning's import) arms one finder through the
    ``.pth`` and the ``.start`` entry point (run as 3.15's ``site`` will), importing no other module; unset or blank,
    nothing is imported (``status`` agrees). ``-I`` and ``-E`` still read the ``.pth``, ``-S`` reads nothing."""
    start_file = (site_packages / "fsdp_shim_env.start").read_text()
    entries = [line.strip() for line in start_file.splitlines() if line.strip()[:1] not in ("", "#")]
    assert entries == ["_fsdp_shim:arm_if_switched_on"]
    run_start = (
        f"import pkgutil, sys; sys.path.append({str(PACKAGE_ROOT)!r}); "
        f"[pkgutil.resolve_name(entry)() for entry in {entries!r}]\n"
    )
    seen = {}
    for value in (None, "", "  ", "0", "1"):
        env = clean_env(FSDP_SHIM=value)
        by_pth = json.loads(run_command([sys.executable, "-c", WHAT_START_UP_LEFT], env=env, cwd=tmp_path).stdout)
        by_start = run_command([sys.executable, "-S", "-c", run_start + WHAT_START_UP_LEFT], env=env, cwd=tmp_path)
        seen[value] = (by_pth, json.loads(by_start.stdout)[:2])
    reached = {}
    for flag, launcher in {"-I": (), "-E": (FSDP_SHIM, "run"), "-S": ()}.items():
        command = [*launcher, sys.executable, flag, "-c", WHAT_START_UP_LEFT]
        reached[flag] = json.loads(run_command(command, env=clean_env(FSDP_SHIM="1"), cwd=tmp_path).stdout)[:2]
    armed = [1, [ARMED_BY_THE_PTH.format("1")]]
    assert reached == {"-I": armed, "-E": armed, "-S": [0, None]}
    blank = run_command([FSDP_SHIM, "status", "--json"], env=clean_env(FSDP_SHIM=""), cwd=tmp_path)
    assert json.loads(blank.stdout)["armed"] == {"state": "not armed", "by": []}  # 0 and 1: test_status.py
    dormant = seen[None][0][2]
    assert [name for name in dormant if "fsdp" in name] == []
    assert set(seen["1"][0][2]) - set(dormant) == {"_fsdp_shim"}
    assert {value: (pth[:2], start) for value, (pth, start) in seen.items()} == {
        None: ([0, None], [0, []]),
        "": ([0, None], [0, []]),
        "  ": ([0, None], [0, []]),
        "0": ([1, [ARMED_BY_THE_PTH.format("0")]], [1, [ARMED_BY_THE_PTH.format("0")]]),
        "1": ([1, [ARMED_BY_THE_PTH.format("1")]], [1, [ARMED_BY_THE_PTH.format("1")]]),
    }


@pytest.mark.per_python
def test_the_start_up_module_imports_only_sys_and_runs_nothing_at_import() -> None:
    """``_fsdp_shim/__init__.py`` is what every armed interpreter imports at start: at import it imports ``sys``
    alone, defines functions and one class (``FSDPShimWarning``, about 0.01 ms), and calls nothing
    (benchmarks/startup_time.py times it)."""
    body = ast.parse(Path(_fsdp_shim.__file__).read_text(encoding="utf-8")).body
    assert {type(node) for node in body} <= {ast.Expr, ast.Import, ast.Assign, ast.FunctionDef, ast.ClassDef}
    assert [node.name for node in body if isinstance(node, ast.ClassDef)] == ["FSDPShimWarning"]
    assert [alias.name for node in body if isinstance(node, ast.Import) for alias in node.names] == ["sys"]
    statements = [node for node in body if not isinstance(node, ast.FunctionDef)]
    assert not [node for statement in statements for node in ast.walk(statement) if isinstance(node, ast.Call)]


LIGHTNING_IMPORTED = """\
import importlib.util, json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "wave"):
        if importlib.util.find_spec(name):
            __import__(name)
    loaded = "_fsdp_shim.activation" in sys.modules
    armed_by = list(sys.modules["_fsdp_shim"].ARMED_BY)
    try:
        status = __import__("fsdp_shim").status()  # another activation
    except ImportError:  # a shim that cannot load
        status = None
print(json.dumps({
    "armed_by": armed_by,
    "loaded_at_lightnings_import": loaded,
    "states": status and sorted({fix.state.value for ns in status.namespaces if ns.imported for fix in ns.fixes}),
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "fsdp-shim" in str(w.message)],
}))
"""
"""Imports Lightning, then fsdp_shim: how the shim was armed, whether Lightning loaded it, fix states, warnings."""


def test_an_off_value_wins_over_every_activation_and_an_unreadable_one_is_off_and_says_so(
    layouts: dict[str, Layout],
) -> None:
    """Off in the environment (the ``.pth`` armed, then ``import fsdp_shim``), or set by the script under
    ``fsdp-shim run`` (the ``.pth`` and the bootstrap armed): no activation loads the shim, nothing is patched,
    nothing is said. Unreadable: the shim loads only to say, once, that it is off."""
    affected_layout(layouts)
    off_in_env = code_json(LIGHTNING_IMPORTED, env=clean_env(FSDP_SHIM=" OFF "))
    set_in_script = "import os; os.environ['FSDP_SHIM'] = 'disabled'\n" + LIGHTNING_IMPORTED
    off_in_script = code_json(set_in_script, launcher=(FSDP_SHIM, "run"))
    unreadable = code_json(LIGHTNING_IMPORTED, env=clean_env(FSDP_SHIM="maybe"))
    assert off_in_env["armed_by"] == [ARMED_BY_THE_PTH.format(" OFF ")]
    assert off_in_script["armed_by"] == [ARMED_BY_THE_PTH.format("1"), "fsdp-shim run"]
    assert unreadable["armed_by"] == [ARMED_BY_THE_PTH.format("maybe")]
    for result in (off_in_env, off_in_script, unreadable):
        assert "switched off" in result["states"] and "patched" not in result["states"], result
    assert [r["loaded_at_lightnings_import"] for r in (off_in_env, off_in_script, unreadable)] == [False, False, True]
    assert off_in_env["warnings"] == off_in_script["warnings"] == []
    assert len(unreadable["warnings"]) == 1 and "FSDP_SHIM='maybe' is not a valid value" in unreadable["warnings"][0]


@pytest.mark.per_python
def test_python_m_fsdp_shim_never_activates_its_own_process_and_another_module_run_with_m_does(tmp_path: Path) -> None:
    """``python -m fsdp_shim`` imports the package before it runs the command, which must arm nothing (the package
    asks runpy which module it runs). A module run with ``-m`` that imports fsdp_shim activates, also where that
    module's own arguments are ``-m fsdp_shim``."""
    (tmp_path / "trainer_package").mkdir()
    (tmp_path / "trainer_package" / "__init__.py").write_text("import fsdp_shim\n")
    (tmp_path / "trainer_package" / "__main__.py").write_text("")
    report = tmp_path / "armed_by.json"
    (tmp_path / "sitecustomize.py").write_text(  # at exit, how the process was armed
        f"import atexit, json, sys\natexit.register(lambda: open({str(report)!r}, 'w').write(json.dumps("
        "getattr(sys.modules.get('_fsdp_shim'), 'ARMED_BY', []))))\n"
    )
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    expected = {
        "-m fsdp_shim --version": [],
        "-mfsdp_shim --version": [],
        "-m trainer_package -m fsdp_shim": ["import fsdp_shim"],
        "-c 'import fsdp_shim'": ["import fsdp_shim"],
    }
    armed = {}
    for command in expected:
        run_command([sys.executable, *shlex.split(command)], env=env, cwd=tmp_path, check=True)
        armed[command] = json.loads(report.read_text())
    assert armed == expected, sys.version


# ----------------------------------------------------------------------------- what the finder leaves of Lightning
SPECS_AND_LOADERS = """\
import hashlib, importlib.util, json, marshal, pkgutil, sys
from pathlib import Path

def digest(data):
    return hashlib.sha256(data).hexdigest()

def describe(spec, name):
    loader, reader = spec.loader, spec.loader.get_resource_reader(name)
    return {
        "spec": [spec.name, spec.origin, list(spec.submodule_search_locations or []), spec.cached,
                 spec.has_location, spec.parent, repr(spec.loader_state)],
        "loader": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "get_filename": loader.get_filename(name),
        "is_package": loader.is_package(name),
        "get_code": digest(marshal.dumps(loader.get_code(name))),
        "get_source": digest(loader.get_source(name).encode()),
        "get_resource_reader": [type(reader).__qualname__, str(reader.files())],
    }

def spec_before_import(name):  # a submodule's parent found, not imported; the finders asked in order
    if "." not in name:
        return importlib.util.find_spec(name)
    where = importlib.util.find_spec(name.rpartition(".")[0]).submodule_search_locations
    finders = [finder.find_spec for finder in sys.meta_path if hasattr(finder, "find_spec")]
    return next(filter(None, (find_spec(name, where, None) for find_spec in finders)))

names = ["lightning", "pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"]
names = [name for name in names if importlib.util.find_spec(name.partition(".")[0])]
before = {name: describe(spec_before_import(name), name) for name in names}
data = {}
for package in [name for name in names if "." not in name]:  # get_data imports the package through its spec
    file = Path(importlib.util.find_spec(package).origin).parent / "version.info"
    data[package] = [digest(file.read_bytes()), digest(pkgutil.get_data(package, "version.info"))]
modules = {name: sys.modules[name] for name in names}  # each __loader__ its spec's, with nothing of the shim's on it
after = {name: [m.__loader__ is m.__spec__.loader, "exec_module" in vars(m.__loader__), describe(m.__spec__, name)]
         for name, m in modules.items()}
import _fsdp_shim
from _fsdp_shim.wrappers import is_shim_wrapper, wrapper_chain
armed_at_start = list(_fsdp_shim.ARMED_BY)
_fsdp_shim.arm("a start-up hook that runs late")
status = sys.modules["_fsdp_shim.activation"].status().namespace("lightning.pytorch")
precision = sys.modules["lightning.pytorch.plugins.precision.fsdp"].FSDPPrecision.__dict__["convert_module"]
print(json.dumps({
    "before": before, "data": data, "after": after, "armed_at_start": armed_at_start,
    "finders": [getattr(finder, "__name__", "") for finder in sys.meta_path].count("fsdp_shim_finder"),
    "cast": status.fix("cast").state.value, "activated_after_import": status.activated_after_import,
    "shim_layers": sum(map(is_shim_wrapper, wrapper_chain(precision))),
}))
"""


def test_the_armed_finder_leaves_lightnings_specs_and_loaders_and_arming_after_lightning_patches_at_once(
    layouts: dict[str, Layout],
) -> None:
    """Armed at start (the ``.pth`` and the bootstrap), the finder leaves Lightning's specs, loaders, what they answer,
    ``get_data`` and each ``__loader__`` as they are without the shim, and patches at import; armed only after
    Lightning's import (a start-up hook that runs late), the shim patches at once."""
    affected_layout(layouts, "lightning")
    plain = code_json(SPECS_AND_LOADERS)
    armed = code_json(SPECS_AND_LOADERS, launcher=(FSDP_SHIM, "run"))
    assert armed["armed_at_start"] == [ARMED_BY_THE_PTH.format("1"), "fsdp-shim run"]
    assert plain["armed_at_start"] == []
    assert {"lightning", "lightning.pytorch"} <= set(armed["before"])
    assert [armed[key] for key in ("before", "data", "after")] == [plain[key] for key in ("before", "data", "after")]
    assert (armed["cast"], armed["activated_after_import"]) == ("patched", False)
    assert (plain["cast"], plain["activated_after_import"]) == ("patched", True)
    assert armed["finders"] == plain["finders"] == 1 and armed["shim_layers"] == plain["shim_layers"] == 1


def test_lightnings_launcher_ranks_get_the_fix_from_fsdp_shim_1_alone(
    tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    """Lightning's launcher starts rank 1 as a new interpreter of the same script, which never imports fsdp_shim:
    ``FSDP_SHIM=1`` in the environment arms it there too, and both ranks train in bfloat16."""
    affected_layout(layouts, "lightning")
    case = "init+pretrained:bf16-true"
    run_scenario("trainer", "lightning", "off", [case], 2, tmp_path / "out", env={"FSDP_SHIM": "1"})
    ranks = scenario_results(tmp_path / "out", 2)
    assert [ranks[rank][case]["flat_param_dtypes"] for rank in (0, 1)] == [["torch.bfloat16"]] * 2


# ----------------------------------------------------------------------------- without a working shim
@pytest.mark.per_python
def test_a_start_up_file_left_behind_by_a_removed_package_is_silent(site_packages: Path, tmp_path: Path) -> None:
    """``fsdp_shim_env.pth`` in an environment where fsdp-shim is gone: set or unset, interpreters start without a
    word and import nothing of fsdp-shim's."""
    venv = make_venv(tmp_path / "venv", [])
    shutil.copy(site_packages / "fsdp_shim_env.pth", venv.site_packages)
    code = "import sys; print([name for name in sys.modules if 'fsdp' in name])"
    for value in (None, "1"):
        proc = venv.run("-c", code, env=clean_env(FSDP_SHIM=value, PYTHONPATH=None), cwd=tmp_path, check=False)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "[]\n", ""), value


@pytest.mark.parametrize("module", ["_fsdp_shim/activation.py", "wrapt/__init__.py"], ids=["shim", "wrapt"])
def test_a_shim_or_a_wrapt_that_cannot_load_under_the_start_up_file_is_loud(
    module: str, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    """The ``.pth`` arms, but the shim, or its wrapt, cannot be imported: Lightning imports unpatched with a
    warning that says why (the shim: once, whatever imports follow; wrapt: per namespace, each fix failed in
    status), or in strict mode the import fails with an error that names the cause."""
    affected_layout(layouts, "lightning")
    broken = tmp_path / "broken" / module
    name, cause = broken.parent.name, f"ImportError: {broken.parent.name} is broken for the test"
    broken.parent.mkdir(parents=True)
    if name == "_fsdp_shim":
        shutil.copy(_fsdp_shim.__file__, broken.parent / "__init__.py")
    broken.write_text(f"raise ImportError('{name} is broken for the test', name={name!r})\n")
    env = clean_env(FSDP_SHIM="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "broken"), env.get("PYTHONPATH")]))
    result = code_json(LIGHTNING_IMPORTED, env=env)
    warned, states = result["warnings"], result["states"]
    strict = run_code(LIGHTNING_IMPORTED, env={**env, "FSDP_SHIM_STRICT": "1"}, expect_ok=False)
    shim = name == "_fsdp_shim"
    said = f"fsdp-shim: the shim could not be loaded ({cause})" if shim else "fsdp-shim: cannot patch lightning."
    assert warned[0].startswith(f"FSDPShimWarning: {said}") and all(cause in warning for warning in warned), warned
    assert (len(warned), states) == (1, None) if shim else states == ["failed"], warned
    kind = "ImportError" if shim else "fsdp_shim.FSDPShimError"
    ending = "; FSDP_SHIM_STRICT is on, so this import fails instead" if shim else f"{cause} (FSDP_SHIM_STRICT is on)"
    raised = strict.stderr.splitlines()[-1]
    assert (strict.returncode, strict.stdout) == (1, ""), strict.stderr
    assert raised.startswith(f"{kind}: {said}") and raised.endswith(ending), raised
