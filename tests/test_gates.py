"""Which Lightning releases each fix applies to, and what it wraps there: pure functions, in this process,
against literal tables (Lightning's own classes are read against the same table in test_activation.py)."""

from __future__ import annotations

import pytest
from children.classes import CAST_WRAPS, WITH_MODEL_PARALLEL

from _fsdp_shim import NAMESPACES
from _fsdp_shim.config import CAST, RECOMPUTE, base_release
from _fsdp_shim.fixes import cast_targets, rank_check_targets


@pytest.mark.parametrize(
    ("version", "cast", "cast_built_in", "recompute"),
    [
        ("2.0.9", False, False, False),
        ("2.0.9.post0", False, False, False),
        ("2.1.0rc1", True, False, True),  # base 2.1.0: the "true" precisions are there
        ("2.1.0", True, False, True),
        ("2.2.0.post0", True, False, True),
        ("2.4.0+cu121", True, False, True),
        ("2.4.1.dev3", True, False, True),
        ("2.5.0rc0", False, True, True),  # the cast shipped in 2.5.0rc0; a plain PEP 440 compare says < 2.5.0
        ("2.5.0.dev20241101", False, True, True),
        ("2.5.0", False, True, True),
        ("2.6.6", False, True, True),
        ("3.0.0", False, True, True),  # no release has the recompute fix
        ("not-a-version", False, False, False),
        ("", False, False, False),
    ],
)
def test_each_fix_gates_on_the_base_release(version: str, cast: bool, cast_built_in: bool, recompute: bool) -> None:
    assert (CAST.affects(version), CAST.built_in(version)) == (cast, cast_built_in)
    assert (RECOMPUTE.affects(version), RECOMPUTE.built_in(version)) == (recompute, False)


def test_base_release_parsing() -> None:
    assert [base_release(v) for v in ("2", "2.4", "2.4.0.1", "2.5.0rc0", "2.4.0+cu121", "junk")] == [
        (2, 0, 0),
        (2, 4, 0),
        (2, 4, 0),
        (2, 5, 0),
        (2, 4, 0),
        None,
    ]


@pytest.mark.parametrize("version", sorted(CAST_WRAPS))
@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_the_cast_and_the_rank_check_wrap_what_the_table_says(namespace: str, version: str) -> None:
    """Per namespace and affected release, the classes and methods of the literal table; only ``convert_module``
    and 2.1.x's ``connect`` are wrapped where the class inherits them."""
    kind = NAMESPACES[namespace]
    cast = cast_targets(namespace, version)
    assert sorted(f"{t.class_name}.{t.attribute}" for t in cast) == sorted(CAST_WRAPS[version][kind])
    assert {t.attribute for t in cast if t.inherited} == {"convert_module"} | (
        {"connect"} if kind == "trainer" and version.startswith("2.1.") else set()
    )
    parallel = ["model_parallel.ModelParallelStrategy"] if version in WITH_MODEL_PARALLEL else []
    assert [t.label(namespace) for t in rank_check_targets(namespace, version)] == [
        *(
            f"{namespace}.strategies.{name}.setup_environment"
            for name in ["fsdp.FSDPStrategy", "ddp.DDPStrategy", *parallel]
        ),
        "torch.distributed.distributed_c10d.rendezvous",
    ]
