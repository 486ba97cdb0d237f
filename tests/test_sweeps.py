"""The halves of the configuration sweeps (``tests/sweeps.py``): two runs of seeds of either
parity check every item, and each keeps what users run."""

from __future__ import annotations

import pytest

import sweeps
from bf16opt.precision import all_plans
from buckets import plan_id

DAYS = ({"BF16OPT_GPU_SAMPLE_SEED": "20261128"}, {"BF16OPT_GPU_SAMPLE_SEED": "20261129"})


def test_two_days_halves_are_disjoint_and_cover_every_item():
    items = [f"item-{k}" for k in range(200)]
    first, second = (sweeps.todays_half(items, environ=day) for day in DAYS)
    assert not set(first) & set(second) and sorted(first + second) == sorted(items)
    assert 60 <= len(first) <= 140  # about half: a hash, not an alternation
    assert first == [item for item in items if item in first]  # in the items' order


def test_items_kept_always_are_in_both_halves():
    items = list(range(100))
    halves = [sweeps.todays_half(items, key=str, always=lambda k: k < 10, environ=day) for day in DAYS]
    assert all(set(range(10)) <= set(half) for half in halves)
    assert sorted(set(halves[0]) | set(halves[1])) == items


def test_every_item_when_asked_and_a_bad_setting_is_refused():
    items = ["a", "b", "c", "d"]
    assert sweeps.todays_half(items, environ={sweeps.SWEEP_VARIABLE: "all", **DAYS[0]}) == items
    with pytest.raises(ValueError, match="BF16OPT_SWEEP must be 'all' or 'half'"):
        sweeps.todays_half(items, environ={sweeps.SWEEP_VARIABLE: "everything"})


def test_todays_plans_keep_every_preset_plan_and_cover_all_plans_in_two_days(monkeypatch):
    plans = all_plans(quality=True)
    presets = sweeps.preset_plans()
    monkeypatch.delenv(sweeps.SWEEP_VARIABLE, raising=False)
    days = []
    for day in DAYS:
        for name, value in day.items():
            monkeypatch.setenv(name, value)
        days.append(sweeps.todays_plans(plans, plan_id))
    assert presets & set(plans) and all(presets & set(plans) <= set(day) for day in days)
    assert set(days[0]) | set(days[1]) == set(plans)
    assert all(len(day) < len(plans) for day in days)
