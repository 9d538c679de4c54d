"""The main job's schedule: each xdist worker starts with its share of the long experiments."""

from __future__ import annotations

from lab import pytest_plugin


def _slices(order: list[str], workers: int) -> list[list[str]]:
    """The contiguous slices pytest-xdist's worksteal hands out, in its own arithmetic."""
    pending, out = list(order), []
    for index in range(workers):
        size = len(pending) // (workers - index)
        out.append(pending[:size])
        pending = pending[size:]
    return out


def test_each_worker_starts_with_a_different_long_experiment() -> None:
    items = [f"t{n}" for n in range(20)] + ["LONG-a"] + [f"u{n}" for n in range(9)] + ["LONG-b"]
    order = pytest_plugin.long_ones_first(items, 2, lambda item: item.startswith("LONG"))
    assert sorted(order) == sorted(items)
    first, second = _slices(order, 2)
    assert (first[0], second[0]) == ("LONG-a", "LONG-b")
    # The short ones keep pytest's order.
    assert [i for i in order if not i.startswith("LONG")] == [
        i for i in items if not i.startswith("LONG")]


def test_one_worker_runs_the_long_ones_first_and_nothing_is_lost() -> None:
    items = ["a", "L1", "b", "L2", "c"]
    assert pytest_plugin.long_ones_first(items, 1, lambda i: i.startswith("L")) == [
        "L1", "L2", "a", "b", "c"]
    many = pytest_plugin.long_ones_first(["L1", "L2", "L3", "x"], 2, lambda i: i[0] == "L")
    assert sorted(many) == ["L1", "L2", "L3", "x"]
