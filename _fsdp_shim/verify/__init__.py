"""``fsdp-shim verify``: train a model with the shim off and on, in fresh processes, and show side by
side what each fix changes. Nothing here is imported by ``import fsdp_shim``.

In verify's own process: ``command`` (run from ``cli.py``: what to train) starts probes with
``protocol``, judges with ``verdict`` and shows with ``output``; ``records`` is what both sides
exchange. In the probe (``_fsdp_shim/children/verify_probe.py``): ``probe``, ``measure``, ``seed``
(verify's own model) and ``cpu_guards`` (Lightning's GPU checks, lifted in verify's processes only).
"""
