"""Incremental per-model budget shares (:class:`daemon.state_budget.BudgetShares`): the total is
never exceeded, the shares stay within ``step**2`` of ``total / models``, the models are walked
O(1) times per admission or release amortised, and no thrash at a boundary."""

from __future__ import annotations

import math
import random

import pytest

from daemon.state_budget import STEP, BudgetShares

MIB = 1 << 20


def make(**kw) -> BudgetShares:
    return BudgetShares(64 * MIB, 1024 * MIB, 128 * MIB, 320 * MIB, **kw)


def check(b: BudgetShares) -> None:
    n = b.models
    assert n <= b.planned
    assert n * b.join_share <= b.join_total
    assert n * b.state_share <= b.state_total
    # planned is at most step**2 times the count (or ceil(n * step) at small counts), so the
    # shares are never more than that factor below the exact rule (rounding down aside)
    factor = max(b.step**2, (n * b.step + 1) / n) if n else 1
    assert b.planned <= n * factor + 1e-9 or n == 0
    if n:
        exact = min(b.state_per_model, b.state_total // n)
        assert b.state_share >= exact / factor - 1
        exact_j = min(b.join_per_model, b.join_total // n)
        assert b.join_share >= exact_j / factor - 1


def test_one_model_gets_the_per_model_cap_and_many_share_the_total():
    b = make()
    b.admit()
    assert b.shares() == (64 * MIB, 128 * MIB)
    b.set_count(10_000)
    check(b)
    assert b.state_share < 320 * MIB // 10_000 + 1
    assert b.state_share * 10_000 <= 320 * MIB


def test_admissions_walk_the_models_a_logarithmic_number_of_times():
    """Admitting n models one by one walks the models O(log n) times, and the total cost of
    those walks (models walked) is O(n): O(1) amortised per admission."""
    b = make()
    walks = walked = 0
    n = 20_000
    for _ in range(n):
        if b.admit():
            walks += 1
            walked += b.models
        check(b)
    assert walks <= math.log(n, STEP) + 3, walks
    assert walked <= n * (1 + 1 / (STEP - 1)) + 10, walked  # geometric series
    # the exact rule would have walked sum(1..n) ~ n**2 / 2 models
    assert walked < n * n / 2 / 100


def test_releases_walk_rarely_and_grow_the_shares():
    b = make(models=10_000)
    small = b.state_share
    walks = walked = 0
    while b.models > 10:
        if b.release():
            walks += 1
            walked += b.models
        check(b)
    assert walks <= math.log(1000, STEP) + 3
    assert walked <= 10_000 * 5
    assert b.state_share > small


def test_admit_and_release_at_a_boundary_do_not_thrash():
    b = make()
    for _ in range(1000):
        b.admit()
    changed = 0
    for _ in range(500):  # admit and release across whatever boundary is near
        changed += b.admit()
        changed += b.admit()
        changed += b.release()
        changed += b.release()
        check(b)
    assert changed <= 1


def test_random_walk_never_exceeds_the_budgets():
    rng = random.Random(3)
    b = make(step=1.1)
    for _ in range(20_000):
        if b.models and rng.random() < 0.45:
            b.release(rng.randint(1, min(b.models, 30)))
        else:
            b.admit(rng.randint(1, 30))
        check(b)


def test_shares_do_not_change_while_the_per_model_cap_binds():
    b = BudgetShares(1 * MIB, 1000 * MIB, 2 * MIB, 1000 * MIB)
    changes = [b.admit() for _ in range(300)]
    assert not any(changes[1:])  # 300 x 2 MiB fit in the total: always the cap
    assert b.shares() == (1 * MIB, 2 * MIB)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="step"):
        make(step=1.0)
    with pytest.raises(ValueError, match="state_total"):
        BudgetShares(1, 1, 1, 0)
    b = make()
    with pytest.raises(ValueError, match="models"):
        b.release()
