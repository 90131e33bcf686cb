"""The ILP is exact: on random small instances it matches brute force over every assignment."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

from autopar.contract.plan import Plan
from autopar.planner.ilp import InfeasibleError, Problem, _relaxation, heuristic, lower_bound, solve


def random_problem(rng, memory_tight: bool) -> Problem:
    n = int(rng.integers(2, 9))
    sizes = rng.integers(1, 5, n)
    p = Problem([rng.uniform(0, 10, k) for k in sizes], [rng.uniform(1, 5, k) for k in sizes])
    for _ in range(int(rng.integers(1, 2 * n))):
        u, v = rng.choice(n, 2, replace=False)
        p.add_edge(int(u), int(v), rng.uniform(0, 10, (sizes[u], sizes[v])) * (rng.random() < 0.8))
    if memory_tight:
        p.memory_limit = p.least_memory() + rng.uniform(0, 2) * n
    return p


def brute_force(p: Problem) -> float:
    best = float("inf")
    for choice in itertools.product(*[range(len(c)) for c in p.node_costs]):
        if p.memory(list(choice)) <= p.memory_limit + 1e-9:
            best = min(best, p.objective(list(choice)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_ilp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, memory_tight=seed % 2 == 1)
    sol = solve(p)
    assert sol.status == "optimal" and sol.gap == 0
    assert sol.objective == pytest.approx(brute_force(p), rel=1e-6, abs=1e-9)
    assert p.memory(sol.choice) <= p.memory_limit + 1e-6


def test_infeasible_memory_states_the_least_needed():
    p = Problem([np.array([1.0, 2.0])], [np.array([3 * 2**30, 2 * 2**30])], memory_limit=2**30)
    with pytest.raises(InfeasibleError, match="needs 2.00 GiB per device, the limit is 1.00 GiB") as err:
        solve(p)
    assert err.value.least_memory == 2 * 2**30


def test_self_edges_of_tied_layers_use_the_diagonal():
    p = Problem([np.array([0.0, 1.0])], [np.zeros(2)])
    p.add_edge(0, 0, np.array([[5.0, 0.0], [0.0, 0.0]]))  # layer i's output feeding layer i+1's input
    assert solve(p).choice == [1]


def big_problem(seed: int, n: int = 40, k: int = 6) -> Problem:
    """Random costs on a layered graph (3 edges per node): HiGHS needs about a second to prove it."""
    rng = np.random.default_rng(seed)
    p = Problem([rng.uniform(0, 10, k) for _ in range(n)], [rng.uniform(1, 5, k) for _ in range(n)])
    for v in range(1, n):
        for u in rng.choice(v, min(v, 3), replace=False):
            p.add_edge(int(u), v, rng.uniform(0, 10, (k, k)))
    return p


@pytest.mark.parametrize("headroom", [1.05, float("inf")])
def test_time_limit_without_incumbent_returns_a_feasible_plan_and_its_gap(headroom):
    p = big_problem(0)
    p.memory_limit = p.least_memory() * headroom
    fastest = [int(np.argmin(c)) for c in p.node_costs]
    assert (p.memory(fastest) > p.memory_limit) == (headroom < 2)  # tight: the leanest start is the one that fits
    sol = solve(p, time_limit_s=1e-4)
    assert sol.status == "feasible" and len(sol.choice) == len(p.node_costs)
    assert all(0 <= s < len(c) for s, c in zip(sol.choice, p.node_costs))
    assert p.memory(sol.choice) <= p.memory_limit
    assert sol.objective == pytest.approx(p.objective(sol.choice))
    assert 0 < sol.gap < 1
    # the gap is measured to a valid bound: the combinatorial one, or the LP relaxation's when it finishes in time
    assert lower_bound(p) - 1e-9 <= sol.objective * (1 - sol.gap) <= sol.objective
    assert sol.objective < p.objective(fastest if headroom > 2 else  # local search improved on where it started
                                       [int(np.lexsort((c, m))[0]) for c, m in zip(p.node_costs, p.node_memory)])


@pytest.mark.parametrize("seed", range(30))
def test_lower_bound_and_heuristic_bracket_the_optimum(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, memory_tight=seed % 2 == 1)
    best, choice = brute_force(p), heuristic(p)
    assert lower_bound(p) <= best + 1e-9
    assert _relaxation(p, 10.0) <= best + 1e-9
    assert p.memory(choice) <= p.memory_limit + 1e-9 and p.objective(choice) >= best - 1e-9


def test_cli_plans_through_the_time_limit_and_warns_with_the_gap(tmp_path):
    out = tmp_path / "plan.json"
    # a tensor-parallel layout: the search's own plan on this mesh is data parallel, whose solves are trivial
    proc = subprocess.run([sys.executable, "-m", "autopar", "plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4",
                           "--manual", "1,4,1", "--time-limit", "0.0001", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    limited = plan.search["time_limited"]
    assert limited and all(0 < s["gap"] < 1 for s in limited)
    warnings = [line for line in proc.stderr.splitlines() if "time limit hit" in line]
    assert len(warnings) == 1  # one warning, for the chosen plan's stages only
    assert all(f"stage {s['stage']} (layers" in warnings[0] and f"gap {s['gap']:.1%}" in warnings[0] for s in limited)
    assert "0.0001 s limit" in warnings[0] and "raise --time-limit" in warnings[0]


def test_no_warning_when_every_solve_is_optimal(caplog, capsys, tmp_path):
    from autopar.cli import main

    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4", "--out", str(tmp_path / "p.json")]) == 0
    assert "time limit" not in caplog.text and "time_limited" not in Plan.load(tmp_path / "p.json").search
