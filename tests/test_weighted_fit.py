"""The weighted fit behind the step cost model: a non-negative least-squares solve, checked against scipy's."""
import numpy as np
import pytest
from scipy.optimize import nnls

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.weighted_fit import non_negative_solve


@pytest.mark.parametrize("seed", range(5))
def test_the_non_negative_solve_matches_scipy_nnls(seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        n = int(rng.integers(1, 6))
        m = int(rng.integers(n, 30))
        x, y, ridge = rng.normal(size=(m, n)), rng.normal(size=m), 1e-3
        expected, _ = nnls(np.vstack([x, np.sqrt(ridge) * np.eye(n)]), np.concatenate([y, np.zeros(n)]))
        got = non_negative_solve(x.T @ x + ridge * np.eye(n), x.T @ y)
        np.testing.assert_allclose(got, expected, atol=1e-9)
        for hint in (expected, rng.random(n) * (rng.random(n) < 0.5)):   # its own support, a random one
            hinted = non_negative_solve(x.T @ x + ridge * np.eye(n), x.T @ y, hint)
            np.testing.assert_allclose(hinted, expected, atol=1e-9)


def test_a_fit_predicts_the_steps_it_observed_when_a_coefficient_is_held_at_zero():
    """The steps a saturated burst gave one lent unit (EPYC, demo model): one-row decode steps while a first
    request streamed, two long prefill chunks, then 48-row decode steps at growing context. An unconstrained
    solve gives this data a negative per-row cost; clipping it to 0 predicted the next 48-row step at about
    twice what those steps took, and the planner stopped lending cores for the rest of the run."""
    rng, cost = np.random.default_rng(0), StepCostModel()
    for i in range(126):
        cost.observe(2, 1, 0, 0.0135 + rng.normal(0, 0.002), context=130 + i // 2)
    for rows, tokens, seconds in ((1, 2048, 1.79), (20, 2048, 1.34), (36, 1504, 1.08)):
        cost.observe(2, rows, tokens, seconds, context=rows * 129)
    observed = []
    for i in range(16):
        seconds = 0.075 + rng.normal(0, 0.008)
        observed.append(seconds)
        cost.observe(2, 48, 0, seconds, context=48 * (130 + i))
    predicted = cost.predict(2, 48, 0, context=48 * 147)
    assert min(observed) * 0.8 <= predicted <= max(observed) * 1.2
    assert (cost.coefficients(2) >= 0).all()


def test_the_coefficients_are_solved_again_after_each_observation():
    from pdserve.engine.core.weighted_fit import WeightedFit

    fit = WeightedFit(2, decay=1.0, ridge=1e-9)
    for rows in (1, 2, 3):
        fit.observe(np.array([1.0, rows]), 0.010 + 0.002 * rows)
    first = fit.coefficients()
    assert fit.coefficients() is first                             # one solve while nothing changes
    np.testing.assert_allclose(first, [0.010, 0.002], atol=1e-6)
    with pytest.raises(ValueError):
        first[0] = 1.0                                             # shared, so read-only
    for rows in (1, 2, 3):
        fit.observe(np.array([1.0, rows]), 0.030 + 0.002 * rows)
    np.testing.assert_allclose(fit.coefficients(), [0.020, 0.002], atol=1e-6)


def _served_step(rows: int, tokens: int) -> float:
    """Step seconds shaped as the decode unit's steps of a served SmolLM2 run (Xeon-167, two threads): 9 ms and
    3 ms a row decoding; a step that prefills pays 10 ms for its prompt path, then 0.3 ms a prompt token."""
    return 0.009 + 0.003 * rows + (0.010 + 0.0003 * tokens if tokens else 0.0)


def test_a_fit_fed_short_chunks_still_prices_long_ones_and_the_reverse():
    """The start-up profile's prefill steps (1, 1,024 and 2,048 tokens), then what a load of short prompts
    with one long one in ten gives a decode unit: decode steps of 1-5 rows and 64-token chunks. Priced per
    token alone, the short chunks' per-step cost moves into their tokens and a 1,024-token chunk was predicted
    at 1.3-1.5x its time (a long prompt then went to the one-core prefill unit); the profile alone priced a
    64-token chunk at 0.7x."""
    rng, cost = np.random.default_rng(0), StepCostModel()
    for rows, tokens in ((1, 0), (128, 0), (0, 1), (0, 1024), (0, 2048)):
        cost.observe(2, rows, tokens, _served_step(rows, tokens))
    assert cost.predict(2, 0, 64) == pytest.approx(_served_step(0, 64), rel=0.1)
    for _ in range(300):
        rows = int(rng.integers(1, 6))
        tokens = 64 if rng.random() < 0.05 else 0
        cost.observe(2, rows, tokens, _served_step(rows, tokens) * rng.normal(1.0, 0.05))
    for rows, tokens in ((0, 1024), (1, 1024), (0, 64), (2, 64)):
        assert cost.predict(2, rows, tokens) == pytest.approx(_served_step(rows, tokens), rel=0.1)
