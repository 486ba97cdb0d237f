"""The parts of the configuration sweeps (``tests/sweeps.py``): the runs of consecutive days
check every item, and each keeps what users run."""

from __future__ import annotations

import pytest

import sweeps
from bf16opt.precision import all_plans
from buckets import plan_id

DAYS = [{"BF16OPT_GPU_SAMPLE_SEED": str(20261128 + k)} for k in range(sweeps.PARTS)]


def test_consecutive_days_parts_are_disjoint_and_cover_every_item():
    items = [f"item-{k}" for k in range(400)]
    parts = [sweeps.todays_part(items, environ=day) for day in DAYS]
    assert sorted(item for part in parts for item in part) == sorted(items)  # each item once
    expected = len(items) / sweeps.PARTS
    assert all(0.6 * expected <= len(part) <= 1.4 * expected for part in parts)  # a hash, not a rotation
    assert parts[0] == [item for item in items if item in parts[0]]  # in the items' order


def test_items_kept_always_are_in_every_part():
    items = list(range(100))
    parts = [sweeps.todays_part(items, key=str, always=lambda k: k < 10, environ=day) for day in DAYS]
    assert all(set(range(10)) <= set(part) for part in parts)
    assert sorted(set().union(*parts)) == items


def test_every_item_when_asked_and_a_bad_setting_is_refused():
    items = ["a", "b", "c", "d"]
    assert sweeps.todays_part(items, environ={sweeps.SWEEP_VARIABLE: "all", **DAYS[0]}) == items
    with pytest.raises(ValueError, match="BF16OPT_SWEEP must be 'all' or unset"):
        sweeps.todays_part(items, environ={sweeps.SWEEP_VARIABLE: "everything"})


def test_todays_plans_keep_every_preset_plan_and_cover_all_plans_in_turn(monkeypatch):
    plans = all_plans(quality=True)
    presets = sweeps.preset_plans() & set(plans)
    monkeypatch.delenv(sweeps.SWEEP_VARIABLE, raising=False)
    days = []
    for day in DAYS:
        for name, value in day.items():
            monkeypatch.setenv(name, value)
        days.append(sweeps.todays_plans(plans, plan_id))
    assert presets and all(presets <= set(day) for day in days)
    assert set().union(*days) == set(plans)
    assert all(len(day) < len(plans) for day in days)
