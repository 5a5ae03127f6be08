"""Test-only: torch's ``torch.utils.checkpoint`` as docs/upstream/checkpoint-default-dtype.patch makes it.

First on ``PYTHONPATH`` (tests/conftest.py: ``patched_checkpoint_env``), Python imports this file at start-up: it
puts a finder first on ``sys.meta_path`` that serves ``torch.utils.checkpoint`` from a copy of the installed torch's
file with the patch applied by ``git apply`` (no fuzz), made once per file and patch in a temporary folder named by
their hash; the installed torch is never written. Where the patch does not apply, importing torch fails, naming the
release. Imported under another name (tests/conftest.py asks it whether the patch applies), it installs nothing.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

PATCH = Path(__file__).resolve().parents[2] / "docs" / "upstream" / "checkpoint-default-dtype.patch"
MODULE = "torch.utils.checkpoint"
RELATIVE = Path("torch", "utils", "checkpoint.py")  # the path the patch names, without its ``a/``


class PatchDoesNotApply(ImportError):
    pass


def installed_checkpoint() -> Path:
    """The installed torch's ``torch/utils/checkpoint.py``, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise PatchDoesNotApply("no torch is installed here")
    return Path(next(iter(spec.submodule_search_locations)), *RELATIVE.parts[1:])


def _apply(original: bytes, folder: Path) -> subprocess.CompletedProcess[str]:
    """``git apply`` in ``folder``, holding the original file alone (no repository above: GIT_CEILING_DIRECTORIES)."""
    (folder / RELATIVE).parent.mkdir(parents=True)
    (folder / RELATIVE).write_bytes(original)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(folder.parent)}
    command = ["git", "apply", "--whitespace=nowarn", str(PATCH)]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, check=False)


def patched_copy(original: Path) -> Path:
    """The patched copy of ``original`` (made here if it is not there yet); raises ``PatchDoesNotApply``."""
    text, patch = original.read_bytes(), PATCH.read_bytes()
    cache = Path(tempfile.gettempdir(), f"fsdp-shim-patched-checkpoint-{os.getuid()}")
    folder = cache / hashlib.sha256(text + b"\0" + patch).hexdigest()[:24]
    if (folder / RELATIVE).is_file():
        return folder / RELATIVE
    cache.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=cache, prefix="work-"))
    try:
        proc = _apply(text, work)
        if proc.returncode != 0:
            raise PatchDoesNotApply(
                f"{PATCH.name} does not apply to torch {version('torch')} ({original}): "
                + "; ".join(line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip())
            )
        try:
            work.rename(folder)  # whole or not at all; another process may have made it meanwhile
        except OSError:
            if not (folder / RELATIVE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder / RELATIVE


def patch_problem() -> str | None:
    """Why the patch cannot be applied to the installed torch, or None where it can."""
    try:
        patched_copy(installed_checkpoint())
    except (PatchDoesNotApply, OSError) as error:
        return str(error)
    return None


class PatchedCheckpointFinder:
    """Serves ``torch.utils.checkpoint`` from the patched copy; every other module as before."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            raise PatchDoesNotApply(f"torch {version('torch')} has no {MODULE} file to patch")
        return importlib.util.spec_from_file_location(fullname, patched_copy(Path(spec.origin)))


if __name__ == "sitecustomize":
    sys.meta_path.insert(0, PatchedCheckpointFinder)
