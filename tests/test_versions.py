from __future__ import annotations

import pytest

from fsdp_shim.backport import base_release, converts_only_in_connect, is_affected_release


@pytest.mark.parametrize(
    ("version", "affected"),
    [
        ("2.0.9", False),
        ("2.0.9.post0", False),
        ("2.1.0", True),
        ("2.1.0rc1", True),  # base 2.1.0: the "true" precisions are there
        ("2.1.4", True),
        ("2.2.0.post0", True),
        ("2.3.3", True),
        ("2.4.0", True),
        ("2.4.0+cu121", True),
        ("2.4.1.dev3", True),
        ("2.5.0rc0", False),  # the fix shipped in 2.5.0rc0; a plain PEP 440 compare says < 2.5.0
        ("2.5.0.dev20241101", False),
        ("2.5.0", False),
        ("2.5.0.post0", False),
        ("2.6.6", False),
        ("3.0.0", False),
        ("not-a-version", False),
        ("", False),
    ],
)
def test_affected_range_uses_the_base_version(version: str, affected: bool) -> None:
    assert is_affected_release(version) is affected


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.1.0", True),
        ("2.1.4", True),
        ("2.1.0rc1", True),
        ("2.2.0", False),
        ("2.2.0rc0", False),
        ("2.0.9", False),
        ("2.4.0", False),
    ],
)
def test_only_2_1_converts_in_connect(version: str, expected: bool) -> None:
    assert converts_only_in_connect(version) is expected


def test_base_release_pads_short_versions() -> None:
    assert base_release("2") == (2, 0, 0)
    assert base_release("2.4") == (2, 4, 0)
    assert base_release("2.4.0.1") == (2, 4, 0)
    assert base_release("junk") is None
