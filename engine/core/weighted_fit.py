"""One exponentially weighted least-squares fit, y ~ c @ x, with a small ridge; coefficients clipped at 0.

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

    def __post_init__(self) -> None:
        self._a, self._b = np.zeros((self.width, self.width)), np.zeros(self.width)

    def observe(self, x: np.ndarray, y: float) -> None:
        self._a = self.decay * self._a + np.outer(x, x)
        self._b = self.decay * self._b + y * x
        self.observations += 1

    def weight(self, feature: int) -> float:
        """The decayed sum of squares of `feature` over the observations: how much of it the fit has seen."""
        return float(self._a[feature, feature])

    def coefficients(self) -> np.ndarray:
        return np.maximum(np.linalg.solve(self._a + self.ridge * np.eye(self.width), self._b), 0.0)
