"""``fsdp-shim verify``: train a model with the shim off and on, in fresh processes, and show side by
side what the shim changes. Nothing here is imported by ``import fsdp_shim``.

One job per module; the arrows are the only imports between them:

* ``command.py``: ``main``, run from ``cli.py``: a temporary folder, the plan, the output.
* ``options.py``: the options (``Options``, filled by ``cli.py``) and one probe's task
  (``ProbeRequest``), as JSON for the probe. Standard library only.
* ``plan.py``: what is decided from the gates and what is trained → ``protocol``, ``verdict``,
  ``progress``.
* ``protocol.py``: one probe process: command line, time limit, killing its process group, reading
  its files.
* ``verdict.py``: ``judge`` and ``overall``, and ``Section`` (one verdict with its figures).
* ``render.py``: the text output. ``progress.py``: the status line on stderr.
* ``results.py``: ``RankResult``, one rank's figures, written by the probe and read by the verdict.

Inside the probe process (started from ``fsdp_shim/_children/verify_probe.py``): ``probe.py`` (gate
and measure), ``measure.py`` (the figures), ``seed.py`` (verify's own model), ``cpu_guards.py``
(lifting Lightning's GPU checks in verify's own processes only).
"""
