"""One exponentially weighted least-squares fit, y ~ c @ x, with a small ridge and coefficients >= 0.

The step cost model (engine.actors.step_cost) and the draft gate's fit of decode steps (engine.core.spec_policy)
each keep one per thread count."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class WeightedFit:
    width: int
    decay: float = 0.97
    ridge: float = 1e-3
    observations: int = 0
    _a: np.ndarray = field(init=False)
    _b: np.ndarray = field(init=False)
    _solved: np.ndarray | None = field(init=False, default=None)   # coefficients() until the next observation
    _support: np.ndarray | None = field(init=False, default=None)  # the latest solution (non_negative_solve's hint)

    def __post_init__(self) -> None:
        self._a, self._b = np.zeros((self.width, self.width)), np.zeros(self.width)

    def observe(self, x: np.ndarray, y: float) -> None:
        self._a = self.decay * self._a + np.outer(x, x)
        self._b = self.decay * self._b + y * x
        self.observations += 1
        self._solved = None

    def weight(self, feature: int) -> float:
        """The decayed sum of squares of `feature` over the observations: how much of it the fit has seen."""
        return float(self._a[feature, feature])

    def coefficients(self) -> np.ndarray:
        """The best fit with no coefficient below 0 (a non-negative least-squares solve, not a clipped
        unconstrained one: clipping a negative per-row cost to 0 once predicted a large decode step far above
        every step the fit had observed, and cost adaptive mode its lent cores for the rest of a run).
        Solved once per observation (the planner reads them several times a step); read-only."""
        if self._solved is None:
            self._solved = non_negative_solve(self._a + self.ridge * np.eye(self.width), self._b, self._support)
            self._solved.setflags(write=False)
            self._support = self._solved
        return self._solved


def non_negative_solve(a: np.ndarray, b: np.ndarray, hint: np.ndarray | None = None) -> np.ndarray:
    """argmin over c >= 0 of c @ a @ c - 2 b @ c, for a symmetric positive definite `a` (the normal equations
    of a least-squares fit). The first of these whose optimality conditions hold, each exact: the unconstrained
    solution, the solution on `hint`'s nonzero coefficients (a previous solution: a fit observed one step more
    keeps its support), else Lawson and Hanson's active-set method."""
    tolerance = 1e-12 * max(1.0, float(np.abs(b).max(initial=0.0)))
    supports = [np.ones(len(b), dtype=bool)] + ([] if hint is None else [hint > 0])
    for free in supports:
        c = _optimal_on(a, b, free, tolerance)
        if c is not None:
            return c
    return _active_set(a, b, tolerance)


def _optimal_on(a: np.ndarray, b: np.ndarray, free: np.ndarray, tolerance: float) -> np.ndarray | None:
    """The solution with coefficients outside `free` at 0, where it is the constrained optimum (its free
    coefficients positive, no gradient pointing into a zero one), else None."""
    c = np.zeros(len(b))
    if free.any():
        c[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
    if (c[free] > 0).all() and ((b - a @ c)[~free] <= tolerance).all():
        return c
    return None


def _active_set(a: np.ndarray, b: np.ndarray, tolerance: float) -> np.ndarray:
    n = len(b)
    free, c = np.zeros(n, dtype=bool), np.zeros(n)
    for _ in range(3 * n):
        gradient = np.where(free, -np.inf, b - a @ c)
        if gradient.max() <= tolerance:
            break
        free[int(gradient.argmax())] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
            if (z[free] > 0).all():
                c = z
                break
            blocking = free & (z <= 0)
            step = float(np.min(c[blocking] / (c[blocking] - z[blocking])))
            c = c + step * (z - c)
            free &= c > tolerance
    return c
