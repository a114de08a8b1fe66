"""The step cost model of adaptive mode: seconds of one step on one compute unit, fit online."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class StepCostModel:
    """Seconds of one step on one compute unit, fit by exponentially weighted least squares."""

    decay: float = 0.97
    ridge: float = 1e-3
    _fits: dict[int, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)

    def observe(self, threads: int, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        a, b, n = self._fits.get(threads, (np.zeros((3, 3)), np.zeros(3), 0))
        x = np.array([1.0, decode_rows, prefill_tokens])
        self._fits[threads] = (self.decay * a + np.outer(x, x), self.decay * b + seconds * x, n + 1)

    def coefficients(self, threads: int) -> np.ndarray | None:
        """(fixed, per decode row, per prefill token) seconds, or None before three observations."""
        fit = self._fits.get(threads) or next((f for t, f in sorted(self._fits.items(), reverse=True)), None)
        if fit is None or fit[2] < 3:
            return None
        a, b, _ = fit
        return np.maximum(np.linalg.solve(a + self.ridge * np.eye(3), b), 0.0)

    def predict(self, threads: int, decode_rows: int, prefill_tokens: int) -> float | None:
        c = self.coefficients(threads)
        return None if c is None else float(c @ [1.0, decode_rows, prefill_tokens])

    def seconds_per_prefill_token(self, threads: int) -> float | None:
        c = self.coefficients(threads)
        return None if c is None or c[2] <= 0 else float(c[2])
