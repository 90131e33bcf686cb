"""The intra-op ILP as mathematics, and a thin OR-Tools (HiGHS) wrapper that solves it.

Given nodes v with strategies s ∈ S_v, each with cost c_v(s) and memory m_v(s), and edges
(u, v) with a cost matrix C_uv(s, t):

    minimise    Σ_v Σ_s c_v(s)·x_vs  +  Σ_(u,v) Σ_(s,t) C_uv(s,t)·e_uvst
    subject to  Σ_s x_vs = 1                               (one strategy per node)
                Σ_t e_uvst = x_us,  Σ_s e_uvst = x_vt       (e is the transport plan of two one-hots)
                Σ_v Σ_s m_v(s)·x_vs ≤ M                     (memory per device)
                x binary, e ∈ [0, 1]

For binary x the transport constraints force e_uvst = x_us·x_vt, so the objective is exact, and
the LP relaxation is tighter than Alpa's `e ≥ x_u + x_v − 1`. DESIGN.md records why HiGHS and
not CP-SAT: on a 50-node × 6-strategy instance CP-SAT had not proven optimality after 60 s, HiGHS
was optimal in about 1 s.

When the time limit stops HiGHS, OR-Tools (9.15) hands back no incumbent in most cases (status
99, "unknown") and, when it does, reports the incumbent itself as the best bound. So `solve` builds
its own feasible assignment (`heuristic`) and measures the gap against the better of
`lower_bound` and the LP relaxation's optimum (when that finishes within the limit too). (Solution
hints are not passed: OR-Tools' HiGHS wrapper crashes on them.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ortools.linear_solver import pywraplp

from autopar.contract.errors import AutoparError


class InfeasibleError(AutoparError):
    """No assignment fits in memory; `least_memory` is what the leanest one needs."""

    def __init__(self, message: str, least_memory: float) -> None:
        super().__init__(message)
        self.least_memory = least_memory


class SolverError(AutoparError):
    """The solver failed, and no assignment could be built without it."""


def problem_size(problem: Problem) -> str:
    return f"{len(problem.node_costs)} groups, {len(problem.edges)} edges"


@dataclass
class Problem:
    node_costs: list[np.ndarray]  # per node: cost of each strategy (seconds)
    node_memory: list[np.ndarray]  # per node: bytes per device of each strategy
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (u, v) -> |S_u| × |S_v| costs
    memory_limit: float = float("inf")

    def add_edge(self, u: int, v: int, costs: np.ndarray) -> None:
        """Edges between the same pair of nodes add up (repeated layers share variables)."""
        if u == v:  # a node feeding itself (tied layers): only the diagonal can happen
            self.node_costs[u] = self.node_costs[u] + np.diag(costs)
            return
        key = (u, v) if u < v else (v, u)
        costs = costs if u < v else costs.T
        self.edges[key] = self.edges[key] + costs if key in self.edges else costs

    def objective(self, choice: list[int]) -> float:
        total = sum(float(c[s]) for c, s in zip(self.node_costs, choice))
        return total + sum(float(m[choice[u], choice[v]]) for (u, v), m in self.edges.items())

    def memory(self, choice: list[int]) -> float:
        return sum(float(m[s]) for m, s in zip(self.node_memory, choice))

    def least_memory(self) -> float:
        return float(sum(m.min() for m in self.node_memory))


@dataclass(frozen=True)
class Solution:
    choice: list[int]
    objective: float
    status: str  # "optimal" or "feasible" (time limit hit; `gap` says how far from proven)
    gap: float
    solve_time_s: float
    num_variables: int
    num_constraints: int


def solve(problem: Problem, time_limit_s: float = 30.0) -> Solution:
    """Solve with HiGHS through OR-Tools' linear solver; at the time limit, the best of its
    incumbent (if any) and `heuristic`, with the gap to the best lower bound known."""
    least = problem.least_memory()
    if least > problem.memory_limit:
        raise InfeasibleError(
            f"no sharding fits: the leanest assignment needs {least / 2**30:.2f} GiB per device, "
            f"the limit is {problem.memory_limit / 2**30:.2f} GiB", least)
    solver, x, objective = _model(problem, time_limit_s, integer=True)
    start = time.perf_counter()
    status = solver.Solve()
    limited = status == pywraplp.Solver.FEASIBLE or time.perf_counter() - start >= time_limit_s

    def solution(choice: list[int], state: str, gap: float) -> Solution:
        return Solution(choice=choice, objective=problem.objective(choice), status=state, gap=gap,
                        solve_time_s=solver.wall_time() / 1000, num_variables=solver.NumVariables(),
                        num_constraints=solver.NumConstraints())

    def solver_choice() -> list[int]:
        return [int(np.argmax([var.solution_value() for var in vars_])) for vars_ in x]

    if status == pywraplp.Solver.OPTIMAL:
        return solution(solver_choice(), "optimal", 0.0)
    if status == pywraplp.Solver.INFEASIBLE:
        raise InfeasibleError(
            f"no sharding fits in {problem.memory_limit / 2**30:.2f} GiB per device (the leanest strategies "
            f"need {least / 2**30:.2f} GiB, but not in one consistent assignment)", least)
    if not limited:
        raise SolverError(f"the ILP solver failed (status {status}) on {problem_size(problem)} "
                          f"after {solver.wall_time() / 1000:.2f} s")
    candidates = [heuristic(problem)]
    if status == pywraplp.Solver.FEASIBLE:
        candidates.append(solver_choice())
    candidates = [c for c in candidates if c is not None and problem.memory(c) <= problem.memory_limit]
    if not candidates:
        raise SolverError(f"the ILP solver found no assignment within {time_limit_s:g} s "
                          f"({problem_size(problem)}): raise the time limit (--time-limit)")
    choice = min(candidates, key=problem.objective)
    value = problem.objective(choice)
    bound = max(lower_bound(problem), _relaxation(problem, time_limit_s))
    if status == pywraplp.Solver.FEASIBLE and objective.BestBound() < value:  # OR-Tools may report the incumbent
        bound = max(bound, objective.BestBound())
    gap = max(0.0, (value - bound) / max(abs(value), 1e-12))
    return solution(choice, "optimal" if gap < 1e-9 else "feasible", 0.0 if gap < 1e-9 else gap)  # the bound proves it


def _model(problem: Problem, time_limit_s: float, integer: bool) -> tuple[Any, list[list[Any]], Any]:
    """The HiGHS model (binary strategy variables, or their LP relaxation), its variables, its objective."""
    solver = pywraplp.Solver.CreateSolver("HIGHS")
    solver.SuppressOutput()
    # the limit goes to HiGHS in seconds: OR-Tools' SetTimeLimit rounds to whole ms, and 0 ms means none.
    # No absolute gap: HiGHS's default (1e-6) is as large as a stage's whole cost in seconds
    solver.SetSolverSpecificParametersAsString(
        f"output_flag=false\nlog_to_console=false\nmip_abs_gap=0\ntime_limit={float(time_limit_s)!r}\n")
    var = solver.BoolVar if integer else (lambda name: solver.NumVar(0.0, 1.0, name))
    x = [[var(f"x{v}_{s}") for s in range(len(c))] for v, c in enumerate(problem.node_costs)]
    objective = solver.Objective()
    for v, costs in enumerate(problem.node_costs):
        solver.Add(sum(x[v]) == 1, f"one_strategy_{v}")
        for s, c in enumerate(costs):
            objective.SetCoefficient(x[v][s], float(c))
    for (u, v), costs in problem.edges.items():
        _add_edge(solver, objective, x[u], x[v], costs, f"{u}_{v}")
    if np.isfinite(problem.memory_limit):
        solver.Add(sum(float(m) * var for mem, vars_ in zip(problem.node_memory, x)
                       for m, var in zip(mem, vars_) if m) <= problem.memory_limit, "memory")
    objective.SetMinimization()
    return solver, x, objective


def _relaxation(problem: Problem, time_limit_s: float) -> float:
    """The LP relaxation's optimum, a lower bound (tight for this formulation: see the module
    docstring), or -inf when it does not finish within the limit either."""
    solver, _, objective = _model(problem, time_limit_s, integer=False)
    return objective.Value() if solver.Solve() == pywraplp.Solver.OPTIMAL else -np.inf


def lower_bound(problem: Problem) -> float:
    """No assignment costs less (whatever the signs), though none may reach it: each node's cost
    is split evenly over its edges, and every edge (and edgeless node) is taken at its cheapest."""
    degree = np.zeros(len(problem.node_costs))
    for u, v in problem.edges:
        degree[[u, v]] += 1
    total = sum(float(c.min()) for c, d in zip(problem.node_costs, degree) if not d)
    for (u, v), m in problem.edges.items():
        total += float((m + problem.node_costs[u][:, None] / degree[u] + problem.node_costs[v][None, :] / degree[v]).min())
    return total


def heuristic(problem: Problem, sweeps: int = 20) -> list[int] | None:
    """A feasible assignment without the solver, for when it stops at its limit (kept if better than
    the solver's incumbent, when it has one): the fastest
    strategy of each node, or where that breaks the memory limit the leanest, each improved one
    node at a time (moves that lower the objective and stay within memory). None: nothing fits."""
    fast = [int(np.argmin(c)) for c in problem.node_costs]
    lean = [int(np.lexsort((c, m))[0]) for c, m in zip(problem.node_costs, problem.node_memory)]
    starts = [c for c in (fast, lean) if problem.memory(c) <= problem.memory_limit]
    return min((_descend(problem, c, sweeps) for c in starts), key=problem.objective, default=None)


def _descend(problem: Problem, start: list[int], sweeps: int) -> list[int]:
    """Local search: one node, then the two ends of one edge (consistent shardings often change
    in pairs), take their best strategies given the rest; only moves that lower the objective
    and stay within memory."""
    neighbours: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in problem.node_costs]
    for (u, v), m in problem.edges.items():
        neighbours[u].append((v, m, True))
        neighbours[v].append((u, m, False))
    choice, used, mem, limit = list(start), problem.memory(start), problem.node_memory, problem.memory_limit

    def local(v: int, skip: int = -1) -> np.ndarray:  # v's cost per strategy, the others fixed
        return problem.node_costs[v] + sum((m[:, choice[w]] if first else m[choice[w], :])
                                           for w, m, first in neighbours[v] if w != skip)

    for _ in range(sweeps):
        moved = False
        for v in range(len(choice)):
            cost = np.where(used - mem[v][choice[v]] + mem[v] <= limit, local(v), np.inf)
            best = int(np.argmin(cost))
            if cost[best] < cost[choice[v]]:
                used += mem[v][best] - mem[v][choice[v]]
                choice[v], moved = best, True
        for (u, v), m in problem.edges.items():
            cost = m + local(u, v)[:, None] + local(v, u)[None, :]
            fits = used - mem[u][choice[u]] - mem[v][choice[v]] + mem[u][:, None] + mem[v][None, :] <= limit
            cost = np.where(fits, cost, np.inf)
            s, t = np.unravel_index(int(np.argmin(cost)), cost.shape)
            if cost[s, t] < cost[choice[u], choice[v]]:
                used += mem[u][s] + mem[v][t] - mem[u][choice[u]] - mem[v][choice[v]]
                choice[u], choice[v], moved = int(s), int(t), True
        if not moved:
            break
    return choice if problem.memory(choice) <= limit else list(start)


def _add_edge(solver, objective, xu: list, xv: list, costs: np.ndarray, name: str) -> None:
    if not costs.any():
        return  # free edge: no variables needed
    if len(xu) == 1 or len(xv) == 1:  # one side fixed: the cost is linear in the other side
        for s, var in enumerate(xu):
            for t, var2 in enumerate(xv):
                target = var2 if len(xu) == 1 else var
                objective.SetCoefficient(target, objective.GetCoefficient(target) + float(costs[s, t]))
        return
    e = [[solver.NumVar(0.0, 1.0, f"e{name}_{s}_{t}") for t in range(len(xv))] for s in range(len(xu))]
    for s in range(len(xu)):
        solver.Add(sum(e[s]) == xu[s])
    for t in range(len(xv)):
        solver.Add(sum(e[s][t] for s in range(len(xu))) == xv[t])
    for s in range(len(xu)):
        for t in range(len(xv)):
            if costs[s, t]:
                objective.SetCoefficient(e[s][t], float(costs[s, t]))
