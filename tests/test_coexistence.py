"""The shim next to other code that patches the same methods, with real
Lightning in fresh interpreters: it composes with what was there, never takes another library's
wrapper for its own, never removes one, and says so when it cannot simply remove its own."""

from __future__ import annotations

import pytest
from conftest import Layout, an_affected_namespace, child_json, clean_env

QUIET = ("-W", "ignore::DeprecationWarning")


def child(target: str, arguments: dict) -> dict:
    return child_json(f"coexistence:{target}", arguments, env=clean_env(), python_args=QUIET)


# Which class holds convert_module differs per release (2.1.0, 2.1.x, 2.2-2.4): one kind runs on every
# release; the rest of this file is the shim's own logic and runs once, in the default session.
@pytest.mark.parametrize("kind", [pytest.param("plain", marks=pytest.mark.release_independent), "wrapt"])
def test_a_wrapper_put_there_first_is_composed_with_not_mistaken_for_the_fix(
    kind: str, layouts: dict[str, Layout]
) -> None:
    namespace, _ = an_affected_namespace(layouts)
    result = child("foreign_wrapper_first", {"namespace": namespace, "kind": kind})
    assert result["dtype_on"] == "torch.bfloat16"  # the fix applies...
    assert result["their_calls_on"] == 1  # ...and their code still runs
    status = result["status_on"]
    assert status["affected"] is True and status["patched"] is True
    assert "wraps" in status["reason"] and "which was there before" in status["reason"]
    assert result["theirs_restored"] is True  # deactivate() puts back their object itself
    assert result["dtype_off"] == "torch.float32"
    assert result["their_calls_off"] == 1


@pytest.mark.release_independent
def test_a_wrapper_put_on_top_is_never_taken_for_the_shims_own(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts)
    result = child("foreign_wrapper_on_top", {"namespace": namespace})
    assert result["foreign_counts_as_shim_wrapper"] is False
    assert result["status_on"]["patched"] is True
    assert "is under a " in result["status_on"]["reason"]
    assert result["dtype_on"] == "torch.bfloat16"
    # deactivate(): their wrapper stays on the class, the shim's (under it) passes calls through.
    assert len(result["deactivate_warnings"]) == 1
    assert "has wrapped it since" in result["deactivate_warnings"][0]
    assert result["foreign_still_on_class"] is True
    assert result["dtype_off"] == "torch.float32"
    assert result["status_off"]["patched"] is False
    assert result["status_off"]["reason"].startswith("deactivated; ")
    assert "passes calls through" in result["status_off"]["reason"]
    # activate(): the buried wrapper is switched back on, nothing is stacked or adopted.
    assert result["foreign_still_on_class_after_activate"] is True
    assert result["shim_layers"] == 1
    assert result["dtype_reactivated"] == "torch.bfloat16"
    assert result["status_reactivated"]["patched"] is True
    assert result["foreign_still_on_class_at_the_end"] is True
    assert result["dtype_at_the_end"] == "torch.float32"
    assert result["their_calls"] == 4  # each of the four conversions above went through their wrapper


@pytest.mark.release_independent
def test_a_replaced_wrapper_is_reported_and_the_replacement_kept(layouts: dict[str, Layout]) -> None:
    namespace, _ = an_affected_namespace(layouts)
    result = child("shim_wrapper_replaced", {"namespace": namespace})
    assert result["status"]["patched"] is False
    assert "other code replaced its wrapper" in result["status"]["reason"]
    assert result["replacement_kept"] is True
    assert len(result["deactivate_warnings"]) == 1 and "already been replaced" in result["deactivate_warnings"][0]
