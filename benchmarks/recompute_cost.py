"""What the recompute fix's wrappers cost, as ratios measured in one invocation.

The recompute fix wraps ``CheckpointFunction.forward`` (reentrant) and the non-reentrant generator of
``torch.utils.checkpoint``: every checkpoint call goes through one of them, and its recompute runs the
checkpointed function pinned to the forward's default dtype. This script measures, in one process, with
the shim's wrappers on (``fsdp_shim.activate()``) and off (``fsdp_shim.deactivate()``), interleaved
and alternating which goes first, and checks before every timing that the wrappers really are on or off
(the type of the objects on ``torch.utils.checkpoint``):

1. **Per checkpoint call**: ``checkpoint(block, x, use_reentrant=...)`` forward and backward of a tiny
   block (``Linear(64, 64)`` and a GELU on a 4 x 64 input, one intra-op thread), so the call itself
   dominates; once with the forward in float32 (the dtype does not change: the pin only looks) and once
   with the forward under a bfloat16 default dtype and the backward in float32 (as Lightning's
   ``bf16-true`` leaves them: the pin switches the dtype for the recompute and back). Figures in
   microseconds of the process's CPU time per call (on a CPU backward runs in the calling thread), which
   time spent waiting for a core on a shared machine does not inflate as it does wall-clock time.
2. **Per training step**: a stack of pre-norm transformer blocks (causal attention with
   ``scaled_dot_product_attention`` and a 4x MLP), each checkpointed, parameters in bfloat16, the forward
   under ``torch.set_default_dtype(torch.bfloat16)`` and the backward and AdamW step outside it, as
   Lightning's ``bf16-true`` runs them. The blocks give every tensor an explicit dtype, so the run
   without the shim trains too and the two do the same arithmetic.

Each figure is the min and median over the repetitions; ratios are per interleaved pair (on / off),
so drift in the machine's load cancels out.

Usage (Lightning 2.4.0 from the matrix session, or any Lightning the shim patches):

    PYTHONPATH=.matrix/mixed-2.4.0:. python benchmarks/recompute_cost.py [--width 1024 --seq 512
        --batch 1 --blocks 4 --steps 2 --step-reps 6] [--calls 400 --call-reps 15] [--skip-steps]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

if os.environ.get("FSDP_SHIM", "").strip().lower() in ("0", "false", "off", "no", "disable", "disabled"):
    sys.exit("recompute_cost.py: unset FSDP_SHIM (it switches the shim off for the whole process)")
os.environ.pop("FSDP_SHIM_DISABLED_FIXES", None)

import importlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

fsdp_shim = importlib.import_module("fsdp_shim")  # activates the shim, before Lightning
lightning = importlib.import_module("lightning")  # the shim patches when Lightning is imported

WRAPPED = (
    (checkpoint.CheckpointFunction, "forward"),
    *((checkpoint, name) for name in ("_checkpoint_without_reentrant_generator_impl",) if name in vars(checkpoint)),
)
"""What the recompute fix wraps on this torch: the reentrant entry and the newest non-reentrant generator
(``_checkpoint_without_reentrant_generator_impl`` from torch 2.14, the name without ``_impl`` before)."""
if len(WRAPPED) == 1:
    WRAPPED = (*WRAPPED, (checkpoint, "_checkpoint_without_reentrant_generator"))


def wrapper_types() -> list[str]:
    return [type(vars(owner)[name]).__name__ for owner, name in WRAPPED]


def shim(on: bool) -> None:
    """Switch the wrappers on or off, and check that they are."""
    (fsdp_shim.activate if on else fsdp_shim.deactivate)()
    types = wrapper_types()
    if on and types != ["ShimWrapper"] * len(types):
        raise SystemExit(f"the shim's wrappers are not on: {types}")
    if not on and "ShimWrapper" in types:
        raise SystemExit(f"the shim's wrappers are not off: {types}")


def interleaved(measure: Callable[[], float], reps: int) -> dict[str, list[float]]:
    """``measure()`` with the shim off and on, ``reps`` pairs, alternating which goes first."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            shim(mode == "on")
            times[mode].append(measure())
    shim(True)
    return times


def summary(times: dict[str, list[float]]) -> tuple[float, ...]:
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    added = [on - off for on, off in zip(times["on"], times["off"])]
    return (
        min(times["off"]),
        statistics.median(times["off"]),
        min(times["on"]),
        statistics.median(times["on"]),
        min(ratios),
        statistics.median(ratios),
        statistics.median(added),
    )


# ---------------------------------------------------------------------------------------- per call
def per_call(calls: int, reps: int) -> list[tuple[str, tuple[float, ...]]]:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add their wake-ups to the noise
    try:
        return _per_call(calls, reps)
    finally:
        torch.set_num_threads(threads)


def _per_call(calls: int, reps: int) -> list[tuple[str, tuple[float, ...]]]:
    rows = []
    layer = nn.Linear(64, 64)
    x = torch.randn(4, 64)

    def plain() -> float:
        start = time.process_time()
        for _ in range(calls):
            F.gelu(layer(x)).sum().backward()
        return (time.process_time() - start) / calls * 1e6

    x.requires_grad_(True)
    plain()
    without = statistics.median(plain() for _ in range(reps))
    print(f"the same block without checkpointing, float32: {without:.1f} µs per forward + backward (median)")
    for forward_dtype in (torch.float32, torch.bfloat16):
        layer = nn.Linear(64, 64).to(forward_dtype)
        x = torch.randn(4, 64, dtype=forward_dtype, requires_grad=True)

        def block(t: torch.Tensor, layer: nn.Module = layer) -> torch.Tensor:
            return F.gelu(layer(t))

        for reentrant in (False, True):

            def measure(block=block, x=x, forward_dtype=forward_dtype, reentrant=reentrant) -> float:
                start = time.process_time()
                for _ in range(calls):
                    torch.set_default_dtype(forward_dtype)
                    try:
                        out = checkpoint.checkpoint(block, x, use_reentrant=reentrant)
                    finally:
                        torch.set_default_dtype(torch.float32)
                    out.sum().backward()
                return (time.process_time() - start) / calls * 1e6

            for _ in range(2):  # warm-up, both ways
                for on in (False, True):
                    shim(on)
                    measure()
            label = f"{'reentrant' if reentrant else 'non-reentrant'}, forward in {str(forward_dtype)[6:]}"
            rows.append((label, summary(interleaved(measure, reps))))
    return rows


# ---------------------------------------------------------------------------------------- per step
class Block(nn.Module):
    """A pre-norm transformer block; every tensor it makes has an explicit dtype."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, width: int, heads: int, blocks: int, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x.float().pow(2).mean()


def per_step(args: argparse.Namespace) -> list[tuple[str, tuple[float, ...]]]:
    rows = []
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = Model(args.width, args.width // 64, args.blocks, reentrant).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        # Reentrant checkpointing gives a block's parameters gradients only if its input needs one.
        x = torch.randn(args.batch, args.seq, args.width, dtype=torch.bfloat16, requires_grad=reentrant)

        def step(model: nn.Module = model, x: torch.Tensor = x, optimizer: torch.optim.Optimizer = optimizer) -> None:
            torch.set_default_dtype(torch.bfloat16)  # what bf16-true's forward_context does
            try:
                loss = model(x)
            finally:
                torch.set_default_dtype(torch.float32)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def measure(step: Callable[[], None] = step) -> float:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            return (time.perf_counter() - start) / args.steps * 1e3

        for _ in range(2):  # warm-up, both ways
            for on in (False, True):
                shim(on)
                step()
        label = (
            f"{'reentrant' if reentrant else 'non-reentrant'}, {args.blocks} x width {args.width}, "
            f"seq {args.seq}, batch {args.batch}"
        )
        rows.append((label, summary(interleaved(measure, args.step_reps))))
        print(f"  done: {label}", file=sys.stderr, flush=True)
    return rows


def table(title: str, unit: str, rows: list[tuple[str, tuple[float, ...]]], digits: int) -> str:
    lines = [
        f"| {title} | off, min | off, median | on, min | on, median | on / off, min | on / off, median "
        "| on - off, median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, (off_min, off_med, on_min, on_med, r_min, r_med, added) in rows:
        lines.append(
            f"| {label} | {off_min:.{digits}f} {unit} | {off_med:.{digits}f} {unit} | {on_min:.{digits}f} {unit} "
            f"| {on_med:.{digits}f} {unit} | {r_min:.3f} | {r_med:.3f} | {added:+.{digits}f} {unit} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="checkpoint calls per timing (per-call table)")
    parser.add_argument("--call-reps", type=int, default=15, help="interleaved pairs (per-call table)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="training steps per timing (per-step table)")
    parser.add_argument("--step-reps", type=int, default=6, help="interleaved pairs (per-step table)")
    parser.add_argument("--skip-steps", action="store_true", help="only the per-call table")
    args = parser.parse_args()

    shim(True)
    print(
        f"torch {torch.__version__}, Lightning {lightning.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; wrapped: "
        + ", ".join(f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in WRAPPED)
    )
    print()
    rows = per_call(args.calls, args.call_reps)
    print()
    print(
        table(
            f"per checkpoint call, forward + backward, CPU time ({args.call_reps} pairs of {args.calls} calls)",
            "µs",
            rows,
            1,
        )
    )
    if not args.skip_steps:
        print()
        print(table(f"per training step ({args.step_reps} pairs of {args.steps} steps)", "ms", per_step(args), 0))


if __name__ == "__main__":
    main()
