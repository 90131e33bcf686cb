"""The ILP is exact: on random small instances it matches brute force over every assignment."""

import itertools

import numpy as np
import pytest

from autopar.ilp import InfeasibleError, Problem, solve


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
