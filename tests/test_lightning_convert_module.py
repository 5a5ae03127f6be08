"""Lightning 2.5.0's own ``test_convert_module`` cases (Trainer and Fabric precision plugins),
rewritten as ours: with the shim active they must hold on every release from 2.1.0 on, affected
ones included. On 2.1.0 the Trainer's class is ``FSDPPrecisionPlugin``."""

from __future__ import annotations

import pytest
from conftest import NAMESPACES, Layout, child_json

from fsdp_shim.backport import FIRST_AFFECTED, base_release

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
        if base_release(version) >= FIRST_AFFECTED
    ]
    return child_json(
        "convert_module:convert_all",
        {"namespaces": namespaces, "precisions": [p for p, _ in CASES]},
        python_args=("-W", "ignore"),
    )


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
