# Owner(s): ["module: unknown"]
# Tests for docs/upstream/checkpoint-default-dtype.patch, written as TestCheckpoint in torch's
# test/test_utils.py is. A forward run under torch.set_default_dtype (PyTorch Lightning's "bf16-true"
# and "16-true" precisions set it around the forward only) is recomputed in the backward: the
# recomputation must see the forward's default dtype, or tensors made without an explicit dtype
# (torch.ones, a causal mask from torch.full, torch.tensor(0.1)) differ from the forward's.

import functools

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    set_default_dtype,
)
from torch.utils.checkpoint import (
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)


class DefaultDtypeBlock(nn.Module):
    # Makes tensors in the default dtype: one changes the output's dtype (float32 * bfloat16 is
    # float32), one only its values (a bfloat16 0.1 is 0.10009765625).
    def __init__(self, dtype):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=dtype)
        self.seen = []

    def forward(self, x):
        self.seen.append(torch.get_default_dtype())
        h = self.lin(x)
        return (h * torch.ones(4)).sin() + (h.float() * torch.tensor(0.1)).to(h.dtype)


def _grads(dtype, run):
    # Forward under the default dtype, backward outside it, as Lightning runs them.
    torch.manual_seed(0)
    block = DefaultDtypeBlock(dtype)
    x = torch.randn(2, 4, dtype=dtype, requires_grad=True)
    with set_default_dtype(dtype):
        out = run(block, x)
    out.sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())], block.seen


class TestCheckpointDefaultDtype(TestCase):
    def _assert_like_no_checkpoint(self, dtype, run):
        expected, _ = _grads(dtype, lambda block, x: block(x))
        grads, seen = _grads(dtype, run)
        self.assertGreater(len(seen), 1)  # recomputed
        self.assertEqual(set(seen), {dtype})
        self.assertEqual(grads, expected, atol=0, rtol=0)
        self.assertEqual(torch.get_default_dtype(), torch.float32)

    @parametrize("use_reentrant", [True, False])
    @parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
    def test_checkpoint_recomputes_in_forward_default_dtype(self, dtype, use_reentrant):
        self._assert_like_no_checkpoint(dtype, lambda block, x: checkpoint(block, x, use_reentrant=use_reentrant))

    @parametrize("early_stop", [True, False])
    def test_nested_checkpoint_default_dtype(self, early_stop):
        def run(block, x):
            def outer(x):
                return checkpoint(block, x, use_reentrant=False)

            with set_checkpoint_early_stop(early_stop):
                return checkpoint(outer, x, use_reentrant=False)

        self._assert_like_no_checkpoint(torch.bfloat16, run)

    def test_selective_checkpoint_default_dtype(self):
        context_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])

        def run(block, x):
            return checkpoint(block, x, use_reentrant=False, context_fn=context_fn)

        self._assert_like_no_checkpoint(torch.bfloat16, run)

    @parametrize("use_reentrant", [True, False])
    def test_checkpoint_sequential_default_dtype(self, use_reentrant):
        def run(block, x):
            return checkpoint_sequential(nn.Sequential(block, nn.Identity()), 2, x, use_reentrant=use_reentrant)

        self._assert_like_no_checkpoint(torch.bfloat16, run)

    @parametrize("use_reentrant", [True, False])
    def test_checkpoint_backward_under_another_default_dtype(self, use_reentrant):
        # The recomputation runs in the forward's float32 and leaves the backward's float64 as it was.
        block = DefaultDtypeBlock(torch.float32)
        out = checkpoint(block, torch.randn(2, 4, requires_grad=True), use_reentrant=use_reentrant)
        with set_default_dtype(torch.float64):
            out.sum().backward()
            self.assertEqual(torch.get_default_dtype(), torch.float64)
        self.assertEqual(block.seen, [torch.float32, torch.float32])

    @parametrize("use_reentrant", [True, False])
    def test_checkpoint_default_dtype_restored_when_recompute_raises(self, use_reentrant):
        calls = []

        def fn(x):
            calls.append(torch.get_default_dtype())
            if len(calls) > 1:
                raise ValueError("recompute failed")
            return x.sin()

        with set_default_dtype(torch.bfloat16):
            out = checkpoint(fn, torch.randn(4, dtype=torch.bfloat16, requires_grad=True), use_reentrant=use_reentrant)
        with self.assertRaisesRegex(ValueError, "recompute failed"):
            out.sum().backward()
        self.assertEqual(calls, [torch.bfloat16, torch.bfloat16])
        self.assertEqual(torch.get_default_dtype(), torch.float32)


instantiate_parametrized_tests(TestCheckpointDefaultDtype)

if __name__ == "__main__":
    run_tests()
