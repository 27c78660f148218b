"""The step-cost model on its own: a known formula, noise, outliers, drift, the chunk it allows."""

from __future__ import annotations

import random
import statistics

import pytest

from conveyor.engine_core.step_cost import StepCostModel
from tests.fake_executor import StepCostFormula

FORMULA = StepCostFormula()


def random_step(rng: random.Random) -> tuple[int, int, int, int]:
    """(prefill, decode, pairs, requests) of a plausible step: decodes at various contexts and,
    two steps in three, a prompt chunk somewhere in its prompt."""
    num_decode = rng.randrange(1, 64)
    pairs = sum(rng.randrange(16, 1500) + 1 for _ in range(num_decode))
    num_prefill = rng.randrange(16, 512) if rng.random() < 0.67 else 0
    if num_prefill:
        start = rng.randrange(0, 1024)
        pairs += num_prefill * start + num_prefill * (num_prefill + 1) // 2
    return num_prefill, num_decode, pairs, num_decode + (1 if num_prefill else 0)


def run(
    model: StepCostModel,
    num_steps: int,
    rng: random.Random,
    noise: float = 0.03,
    slowdown: float = 1.0,
    outlier_rate: float = 0.0,
) -> list[float]:
    """Observe num_steps steps; each step's relative error against the noise-free truth, as
    predicted before the step was observed."""
    errors = []
    for _ in range(num_steps):
        features = random_step(rng)
        truth = slowdown * FORMULA.seconds(*features)
        measured = truth * (1.0 + rng.gauss(0.0, noise))
        if rng.random() < outlier_rate:
            measured *= 4.0
        if model.ready:
            errors.append(abs(model.predict(*features) - truth) / truth)
        model.observe(*features, measured)
    return errors


def test_the_model_learns_a_known_step_cost_to_within_a_few_percent():
    rng = random.Random(0)
    model = StepCostModel()
    run(model, 12, rng)  # the start-up profile's worth of steps
    model.set_prior_from_fit()
    errors = run(model, 200, rng)
    assert statistics.mean(errors[20:]) < 0.03
    assert max(errors[20:]) < 0.10


def test_outliers_barely_move_it():
    rng = random.Random(1)
    model = StepCostModel()
    run(model, 30, rng)
    # One step in twenty takes 4x as long (another process had the core).
    errors = run(model, 300, rng, outlier_rate=0.05)
    assert statistics.mean(errors[20:]) < 0.05
    assert sorted(errors[20:])[int(0.9 * len(errors[20:]))] < 0.10


def test_a_machine_that_slows_down_is_tracked_within_tens_of_steps():
    rng = random.Random(2)
    model = StepCostModel()
    run(model, 100, rng)
    errors = run(model, 300, rng, slowdown=1.5)
    assert errors[0] > 0.3, "the first step after the change is a surprise"
    assert statistics.mean(errors[30:]) < 0.05, "recovered"
    assert model.pace > 1.3, "the fast half took most of the change"


def test_the_largest_chunk_is_the_quadratics_root():
    rng = random.Random(3)
    model = StepCostModel()
    run(model, 60, rng, noise=0.0)
    base_features = (0, 32, 32 * 400, 32)
    base = model.predict(*base_features)
    for start, limit in ((0, 0.06), (700, 0.08), (3000, 0.2)):
        n = model.max_prompt_chunk(base, start, limit)
        assert n > 1

        def with_chunk(tokens: int, start: int = start) -> float:
            pairs = base_features[2] + tokens * start + tokens * (tokens + 1) // 2
            return model.predict(tokens, 32, pairs, 33)

        assert with_chunk(int(n)) <= limit + 1e-9
        assert with_chunk(int(n) + 2) > limit
    assert model.max_prompt_chunk(base, 0, base) == 0.0, "no room left"


@pytest.mark.parametrize("num_steps", [0, 3])
def test_an_unready_model_says_so(num_steps):
    model = StepCostModel()
    run(model, num_steps, random.Random(4))
    assert not model.ready
