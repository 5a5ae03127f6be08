"""Run one function of ``tests/children`` in this fresh interpreter and print its result as JSON.

    python tests/child.py children.environment:layouts '{"namespaces": {...}}'

The tests start every Lightning interaction in a new interpreter (import order, start-up files and
activation are then exactly what users meet), and the code those interpreters run lives in real
modules, linted like the rest, with its arguments as JSON on the command line. Nothing is imported
here before the function runs, so the function decides the import order.

``--sys-path DIR`` (repeatable) puts DIR first on ``sys.path``: for ``python -I``/``-S`` runs, which
ignore ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def main(argv: list[str]) -> None:
    prepend = []
    while argv[:1] == ["--sys-path"]:
        prepend.append(argv[1])
        argv = argv[2:]
    sys.path[:0] = prepend
    tests_directory = os.path.dirname(os.path.abspath(__file__))
    if tests_directory not in sys.path:  # python -I does not add the script's folder
        sys.path.insert(0, tests_directory)
    target, arguments = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    module_name, _, function_name = target.partition(":")
    result = getattr(importlib.import_module(module_name), function_name)(**arguments)
    print(json.dumps(result))
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        # A process group still up at interpreter exit can abort a finished run: see there.
        from _fsdp_shim.verify.probe import leave_process_group

        leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
