"""The finder that ``fsdp_shim.pth`` (the file ``fsdp-shim install`` writes) puts on ``sys.meta_path``.

Every interpreter of the environment runs the start-up file, so it must cost nothing measurable and
import nothing: importing even a small module costs a file lookup and, where no ``.pyc`` can be
written, a compilation on every start. So the file carries this module's source and runs it with
``exec`` (``fsdp_shim.startup_files.PTH_TEXT``); the source lives here, as a real module, so that it is
linted and tested like the rest. Nothing imports this module at run time. Two finders, this one and
``_fsdp_shim_startup``'s, because the second is a module that the start-up file must not import.

The finder answers only for Lightning's top-level packages (``WATCHED``). It imports nothing inside
``find_spec``, where the import system holds its global lock: it asks the finders after it for the spec
and wraps the loader, whose ``exec_module`` imports ``_fsdp_shim_startup`` outside that lock and hands
the import over to it (``hand_over``), which loads the shim. The file carries the code below the two
marker lines, not this docstring: the first part is compiled at every interpreter start, the second
(finding the spec, wrapping the loader) only when a process first looks up a Lightning package, which
keeps the start-up file's cost within noise of a bare interpreter (see docs/benchmarks.md). So the
first part has no comments or docstrings (they would be compiled on every start); what it does:

* ``fsdp_shim_watcher`` is a function that is its own ``find_spec``, so no class is built at start-up.
  It answers for a watched package, or for any import once a watched package is done executing
  (another finder in front of it loaded that one itself); the first time, it compiles the second part.

From then on ``_fsdp_shim_startup``'s own watcher does the work and this finder is inert (``WATCHED``
emptied, never removed: removing a finder while another thread iterates ``sys.meta_path`` can make that
thread skip one). A Lightning package that another finder in front of this one loaded itself is handed
over at the next import this finder sees.

If ``_fsdp_shim_startup`` is gone (``pip uninstall`` left the start-up file behind), Lightning imports as
if the file were not there; if it is from another fsdp-shim version (no ``hand_over``), the same, with
a warning.
"""

import sys

SOURCE = "startup file"
WATCHED: "list[str]" = []
HAND_OVER = ""
# The start-up file runs only the two parts below, in a namespace of its own that holds these three
# names (how the shim was armed, the packages still to hand over, the second part's source) and
# ``sys``, and puts the finder first on ``sys.meta_path`` itself. Here they only name what that
# namespace holds.


# ----------------------------------------------------------------------------- compiled at start-up
def fsdp_shim_watcher(name, path=None, target=None):
    if name not in WATCHED:
        modules = sys.modules
        if not [1 for p in WATCHED if getattr(getattr(modules.get(p), "__spec__", 0), "_initializing", 1) is False]:
            return None
    if "watched_spec" not in globals():
        exec(HAND_OVER, globals())
    return watched_spec(name, path, target)


fsdp_shim_watcher.find_spec = fsdp_shim_watcher


# ----------------------------------------------------------------------------- compiled at first use
def watched_spec(name: str, path: object, target: object) -> object:
    """The spec the other finders give ``name``, its loader wrapped to hand the import over."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None and getattr(finder, "__name__", "") != "fsdp_shim_watcher":
            spec = find(name, path, target)
            if spec is not None:
                break
    else:
        return None
    real = spec.loader
    if real is None or not hasattr(real, "exec_module"):
        return spec

    def exec_module(module: object) -> None:
        try:
            import _fsdp_shim_startup

            hand_over = _fsdp_shim_startup.hand_over
        except Exception as error:
            for finder in sys.meta_path:  # this finder and a second copy (site may read the file twice)
                if getattr(finder, "__name__", "") == "fsdp_shim_watcher":
                    finder.__globals__["WATCHED"].clear()  # inert: one warning, no failed import at each import
            if not isinstance(error, ImportError):
                import warnings

                warnings.warn(
                    f"fsdp-shim: this start-up file does not match the installed fsdp-shim ({error!r}); "
                    "Lightning runs without the shim. Run `fsdp-shim install` again.",
                    stacklevel=2,
                )
            module.__loader__ = module.__spec__.loader = real  # type: ignore[attr-defined]
            real.exec_module(module)
            return
        hand_over(module, real, SOURCE)

    exec_module.create_module = getattr(real, "create_module", lambda spec: None)  # type: ignore[attr-defined]
    exec_module.exec_module = exec_module  # type: ignore[attr-defined]
    spec.loader = exec_module
    return spec
