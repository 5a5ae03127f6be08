"""One rank of a two-rank group under torchrun, and the rank check's wait on it: rank 0 reports and waits
(``_fsdp_shim.rank_check.exchange``); rank 1 starts late and never reports, as a rank without the shim, whose
next step is the collective that ``tests/child.py`` ends with. Times are ``time.time()``: one clock, one host."""

from __future__ import annotations

import os
import time
from typing import Any


def rank(backend: str, late_by: float, wait: float, grace: float, poll: float) -> dict[str, Any]:
    """Rank 1 sleeps ``late_by`` s before it imports torch (a slow start); rank 0 waits at most ``wait`` s
    (the group's own timeout is longer, so that rank 1's collective outlasts the wait). With ``nccl`` each
    rank takes the GPU of its rank, and rank 0 also lists the store's keys after joining (torch 2.4 and later)."""
    this_rank = int(os.environ["RANK"])
    if this_rank == 1:
        time.sleep(late_by)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from _fsdp_shim import rank_check

    if backend == "nccl":
        torch.cuda.set_device(this_rank)
    joining = time.time()
    dist.init_process_group(backend, timeout=timedelta(seconds=wait + 60))
    result: dict[str, Any] = {"rank": this_rank, "torch": torch.__version__, "joining": joining}
    if this_rank == 0:
        store = dist.distributed_c10d._get_default_store()
        result.update(checking=time.time(), joined_then=rank_check.every_rank_joined(store, 2))
        base = store
        while hasattr(base, "underlying_store"):
            base = base.underlying_store
        result["keys"] = sorted(base.list_keys()) if hasattr(base, "list_keys") else None
        reports, early = rank_check.exchange(store, 1, 0, 2, {"rank": 0}, wait, grace, poll)
        result.update(ended=time.time(), reported=sorted(reports), early=early)
    return result
