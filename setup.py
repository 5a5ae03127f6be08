"""Ships ``fsdp_shim_env.pth`` at the top of the wheel, next to the package.

setuptools copies only packages and modules into a wheel, so a start-up file needs a build step of
its own (pytest-cov ships ``pytest-cov.pth`` the same way). The file lands in site-packages, where
every interpreter reads it, and pip records it, so ``pip uninstall`` removes it. Editable installs
get it too (their wheel is built by ``editable_wheel``, not ``build_py``), so a development
environment behaves like a user's. Everything else about the package is in ``pyproject.toml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

STARTUP_FILE = Path(__file__).parent / "fsdp_shim_env.pth"


class BuildPyWithStartupFile(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(STARTUP_FILE), str(Path(self.build_lib) / STARTUP_FILE.name), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / STARTUP_FILE.name)]


class _StrategyWithStartupFile:
    """Wraps the editable strategy (a context manager that fills the editable wheel) and adds the file."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def __enter__(self) -> _StrategyWithStartupFile:
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.strategy.__exit__(*exc)

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self.strategy(wheel, files, mapping)
        wheel.writestr(STARTUP_FILE.name, STARTUP_FILE.read_bytes())


class EditableWheelWithStartupFile(editable_wheel):
    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _StrategyWithStartupFile(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithStartupFile, "editable_wheel": EditableWheelWithStartupFile})
