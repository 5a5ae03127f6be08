"""torch's checkpoint on its own (no Lightning, no shim): every way of checkpointing a block, each a forward under a
default dtype and a backward outside it (as Lightning's "true" precisions run them), recorded so that torch as
installed and torch with the upstream patch can be compared bit for bit, and each case with the block unchecked.
The block makes tensors without an explicit dtype, so its result depends on the default dtype of each run of it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as ckpt

FEATURES = 8
SEEN: list[str] = []  # the default dtype at every run of the block's forward (forward and recomputes), per case


class Block(nn.Module):
    def __init__(self, dtype: torch.dtype, dropout: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, FEATURES, dtype=dtype)
        self.dropout = nn.Dropout(0.5) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(str(torch.get_default_dtype()))
        h = self.dropout(self.lin(x))
        return (h * torch.ones(FEATURES)).sin() + (h.float() * torch.tensor(0.1)).to(h.dtype)


def nested(block: Block, x: torch.Tensor, inner_reentrant: bool) -> torch.Tensor:
    return ckpt.checkpoint(lambda x: ckpt.checkpoint(block, x, use_reentrant=inner_reentrant), x, use_reentrant=False)


def without_early_stop(block: Block, x: torch.Tensor) -> torch.Tensor:
    with ckpt.set_checkpoint_early_stop(False):
        return ckpt.checkpoint(block, x, use_reentrant=False)


def checkpointed(**options: Any) -> Callable[[Block, torch.Tensor], torch.Tensor]:
    return lambda block, x: ckpt.checkpoint(block, x, **options)


def sequential(block: Block, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    return ckpt.checkpoint_sequential(nn.Sequential(block, nn.Identity()), 2, x, use_reentrant=reentrant)


def selective(block: Block, x: torch.Tensor) -> torch.Tensor:
    """``create_selective_checkpoint_contexts``: the linear's output saved, the rest recomputed."""
    policy = functools.partial(ckpt.create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
    return ckpt.checkpoint(block, x, use_reentrant=False, context_fn=policy)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def forward_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The Lightning-side alternative (docs/upstream.md): a ``context_fn`` that torch's checkpoint calls in
    the forward, whose second context manager runs the recompute in the default dtype read there."""
    return contextlib.nullcontext(), default_dtype(torch.get_default_dtype())


def lightning_wrapper(**options: Any) -> Callable[[Block, torch.Tensor], torch.Tensor]:
    """How Lightning's ``activation_checkpointing_policy`` checkpoints a block (``_setup_activation_checkpointing``:
    torch's ``checkpoint_wrapper``, non-reentrant), with the alternative's ``context_fn`` passed through it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return lambda block, x: checkpoint_wrapper(block, context_fn=forward_contexts, **options)(x)


CASES: dict[str, tuple[bool, Callable[[Block, torch.Tensor], torch.Tensor]]] = {
    # name: (dropout in the block, how it runs)
    "none": (False, lambda block, x: block(x)),
    "reentrant": (False, checkpointed(use_reentrant=True)),
    "nonreentrant": (False, checkpointed(use_reentrant=False)),
    "nested": (False, functools.partial(nested, inner_reentrant=False)),
    "nested-reentrant-inside": (False, functools.partial(nested, inner_reentrant=True)),
    "selective": (False, selective),
    "early-stop-off": (False, without_early_stop),
    "sequential-reentrant": (False, functools.partial(sequential, reentrant=True)),
    "sequential-nonreentrant": (False, functools.partial(sequential, reentrant=False)),
    "debug": (False, checkpointed(use_reentrant=False, debug=True)),
    "no-determinism-check": (False, checkpointed(use_reentrant=False, determinism_check="none")),
    "rng-none": (True, lambda block, x: block(x)),
    "rng-reentrant": (True, checkpointed(use_reentrant=True)),
    "rng-nonreentrant": (True, checkpointed(use_reentrant=False)),
    "rng-not-preserved-reentrant": (True, checkpointed(use_reentrant=True, preserve_rng_state=False)),
    "rng-not-preserved-nonreentrant": (True, checkpointed(use_reentrant=False, preserve_rng_state=False)),
    # The Lightning-side alternative, and the two ways it is refused.
    "lightning-context-fn": (False, lightning_wrapper()),
    "lightning-context-fn-debug": (False, lightning_wrapper(debug=True)),
    "lightning-context-fn-reentrant": (False, checkpointed(use_reentrant=True, context_fn=forward_contexts)),
}
"""Each checked against ``none`` (``rng-*``: ``rng-none``), whose block has the same weights and input."""


def digest(tensors: list[torch.Tensor | None]) -> str:
    found = hashlib.sha256()
    for tensor in tensors:
        found.update(b"none" if tensor is None else str(tensor.dtype).encode() + tensor.float().numpy().tobytes())
    return found.hexdigest()


def one_case(name: str, dtype: torch.dtype) -> dict[str, Any]:
    dropout, run = CASES[name]
    SEEN.clear()
    torch.manual_seed(0)
    block = Block(dtype, dropout)
    x = torch.randn(4, FEATURES, dtype=dtype, requires_grad=True)
    torch.manual_seed(1)  # the dropout masks: the same draw in every case
    try:
        with default_dtype(dtype):
            out = run(block, x)
        out.sum().backward()  # outside the forward's default dtype, as Lightning runs it
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {"error": f"{type(error).__name__}: {message}", "seen": list(SEEN)}
    grads = digest([x.grad, *(p.grad for p in block.parameters())])
    after = str(torch.get_default_dtype())
    return {
        "error": None,
        "seen": list(SEEN),
        "output": digest([out.detach()]),
        "grads": grads,
        "default_dtype_after": after,
    }


def behaviours(dtypes: list[str]) -> None:
    """Every case in every dtype, with whether this torch's checkpoint has the upstream patch, printed as
    JSON; then the process ends without finalization (``leave_process_group``): torch 2.15.0 was seen to
    crash at interpreter exit (SIGSEGV) after a ``CheckpointError`` in a backward, its results complete."""
    from _fsdp_shim.verify.probe import leave_process_group  # activates nothing

    result = {
        "torch": torch.__version__,
        "patched": hasattr(ckpt, "_default_dtype_context"),
        "file": ckpt.__file__,
        "results": {dtype: {name: one_case(name, getattr(torch, dtype)) for name in CASES} for dtype in dtypes},
    }
    print(json.dumps(result))
    leave_process_group()
