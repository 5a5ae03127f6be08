"""Lightning 2.5.0's own ``test_convert_module`` cases (Trainer and Fabric precision plugins),
rewritten as ours: with the shim active they must hold on every release from 2.1.0 on, affected
ones included. On 2.1.0 the Trainer's class is ``FSDPPrecisionPlugin``."""

from __future__ import annotations

import pytest
from conftest import NAMESPACES, Layout, clean_env, last_json, run_python

from fsdp_shim.versions import base_release

CASES = [
    ("32-true", "torch.float32"),
    ("bf16-mixed", "torch.float32"),
    ("16-mixed", "torch.float32"),
    ("bf16-true", "torch.bfloat16"),
    ("16-true", "torch.float16"),
]


@pytest.fixture(scope="module")
def converted(layouts: dict[str, Layout]) -> dict[str, dict[str, list[str]]]:
    namespaces = [
        ns
        for package, layout in layouts.items()
        for ns, version in zip(NAMESPACES[package], (layout.trainer_version, layout.fabric_version))
        if base_release(version) >= (2, 1, 0)
    ]
    proc = run_python(
        """
import importlib, json
import fsdp_shim
import torch
out = {}
for ns in %r:
    module = importlib.import_module(ns + ".plugins.precision.fsdp")
    plugin_class = getattr(module, "FSDPPrecision", None) or module.FSDPPrecisionPlugin
    out[ns] = {}
    for precision in %r:
        layer = torch.nn.Linear(2, 2)
        before = [str(layer.weight.dtype), str(layer.bias.dtype)]
        result = plugin_class(precision=precision).convert_module(layer)
        out[ns][precision] = before + [str(result.weight.dtype), str(result.bias.dtype), result is layer]
print(json.dumps(out))
"""
        % (namespaces, [p for p, _ in CASES]),
        env=clean_env(),
        args=("-W", "ignore"),
    )
    return last_json(proc)


@pytest.mark.parametrize(("precision", "expected_dtype"), CASES)
@pytest.mark.parametrize(
    "namespace", ["lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"]
)
def test_convert_module(namespace: str, precision: str, expected_dtype: str, converted: dict) -> None:
    if namespace not in converted:
        pytest.skip(f"{namespace} (2.1 or later) is not installed")
    weight_before, bias_before, weight_after, bias_after, same_object = converted[namespace][precision]
    assert weight_before == bias_before == "torch.float32"
    assert weight_after == bias_after == expected_dtype
    assert same_object is True  # Module.to converts in place, as in 2.5.0
