"""The step-cost model: how long a step will take, from what it holds, learned online.

Runs in the engine-core process. A step's time is modelled as linear in five features:

    time = c0 + c1 * prefill tokens + c2 * decode tokens + c3 * attention pairs + c4 * requests

``attention pairs`` counts every (query, key) pair the step's attention reads: a decode at context
L reads L + 1 keys; a prompt chunk of n tokens starting at position p reads n * p + n (n + 1) / 2.
On a GPU the decode part is the KV read that makes long contexts slow; on a CPU both parts are
compute. The other three are what every layer does per token, per sampled row and per step.

The model has a slow half and a fast half. The slow half, the coefficients, is weighted least
squares with exponential forgetting (an old step's weight decays by ``forgetting`` per step)
and a ridge pull towards a prior (the fit of the start-up profile) which never fades: a
direction the recent steps do not excite (say, no prompt for a minute) keeps the prior's value
instead of drifting, and the normal matrix never becomes singular. Each step weighs by its
relative error, as noise grows with a step's size. The fast half, ``pace``, multiplies every
prediction and follows a lasting change of speed (another process took a core) within a few
steps, while the coefficients catch up over tens. A step far off the prediction (a garbage
collection, a burst of other work) enters both clipped to a few typical relative errors, so one
outlier moves them little, while a lasting change still gets through as the error scale grows.

Cheap by construction: ``predict`` and ``max_prompt_chunk`` are a few float operations (the
scheduler calls them while it builds a step); ``observe`` updates a 5 x 5 system and solves it,
about 20 µs of plain Python, once per executed step, outside ``schedule()``.
"""

from __future__ import annotations

import math

NUM_FEATURES = 5
FEATURE_NAMES = ("fixed", "prefill_tokens", "decode_tokens", "attention_pairs", "num_reqs")
# Units that put each feature near 1 in a typical step, so one prior strength suits them all.
_TOKENS = 256.0
_PAIRS = 65536.0
_REQS = 64.0
# Steps before the model's predictions are used (the start-up profile provides them).
MIN_OBSERVATIONS = 6
# A residual enters the fit clipped to this many times the typical relative error, which
# is never taken below _MIN_ERROR_SCALE (a perfect synthetic fit must still learn a change).
_CLIP = 3.0
_MIN_ERROR_SCALE = 0.02
_ERROR_SCALE_RATE = 0.1
_PACE_RATE = 0.1


def features(
    num_prefill_tokens: int, num_decode_tokens: int, num_attention_pairs: int, num_reqs: int
) -> tuple[float, float, float, float, float]:
    return (
        1.0,
        num_prefill_tokens / _TOKENS,
        num_decode_tokens / _TOKENS,
        num_attention_pairs / _PAIRS,
        num_reqs / _REQS,
    )


class StepCostModel:
    """Predicted step time (seconds) from a step's features; refitted after every step."""

    def __init__(self, forgetting: float = 0.97, prior_strength: float = 0.05) -> None:
        self.forgetting = forgetting
        self.prior_strength = prior_strength
        n = NUM_FEATURES
        # Forgetting-weighted sums of x x^T and x y over the steps seen.
        self._gram = [[0.0] * n for _ in range(n)]
        self._moment = [0.0] * n
        self._prior = [0.0] * n
        self.coef = [0.0] * n
        self.num_observations = 0
        # Typical |measured - predicted| / predicted (a running mean), and the quantile.
        self.error_scale = 0.1
        # How fast the machine runs now relative to the coefficients (a lasting slowdown, like
        # another process taking a core, is tracked here within a few steps; the coefficients
        # follow over tens).
        self.pace = 1.0
        # A running mean of measured step times: the size a step's weight is relative to.
        self.typical_s = 0.0

    @property
    def ready(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS

    def predict(
        self, num_prefill_tokens: int, num_decode_tokens: int, num_pairs: int, num_reqs: int
    ) -> float:
        c = self.coef
        return self.pace * (
            c[0]
            + c[1] * (num_prefill_tokens / _TOKENS)
            + c[2] * (num_decode_tokens / _TOKENS)
            + c[3] * (num_pairs / _PAIRS)
            + c[4] * (num_reqs / _REQS)
        )

    def max_prompt_chunk(self, base_s: float, start: int, limit_s: float) -> float:
        """The largest chunk (tokens, fractional) of one more request's prompt, starting at
        position ``start``, that keeps a step predicted at ``base_s`` within ``limit_s``.

        The chunk adds c1 n + c3 (n start + n (n + 1) / 2) + c4: a quadratic in n, solved in
        closed form. Negative per-token costs (a fit pulled by collinear features) count as 0,
        so a chunk never looks free because of them; a model with no per-token cost at all
        gives infinity (the caller's token budget then decides).
        """
        c, pace = self.coef, self.pace
        per_token = pace * max(c[1], 0.0) / _TOKENS
        per_pair = pace * max(c[3], 0.0) / _PAIRS
        room = limit_s - base_s - pace * max(c[4], 0.0) / _REQS
        if room <= 0.0:
            return 0.0
        a = per_pair / 2.0
        b = per_token + per_pair * (start + 0.5)
        if a <= 0.0:
            return room / b if b > 0.0 else math.inf
        return (math.sqrt(b * b + 4.0 * a * room) - b) / (2.0 * a)

    def observe(
        self,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        num_pairs: int,
        num_reqs: int,
        measured_s: float,
    ) -> None:
        """Fold in one executed step's measured time."""
        x = features(num_prefill_tokens, num_decode_tokens, num_pairs, num_reqs)
        predicted = max(self.pace * sum(ci * xi for ci, xi in zip(self.coef, x)), 1e-6)
        y = measured_s
        if self.ready:
            relative = self._clipped_error(predicted, measured_s)
            y = predicted * (1.0 + relative)
            # The fast half of the model: a lasting slowdown moves the pace within a few steps.
            self.pace = min(max(self.pace * (1.0 + _PACE_RATE * relative), 1 / 16), 16.0)
            size = predicted
        else:
            size = measured_s
        y /= self.pace  # the coefficients describe the machine at pace 1
        # Noise grows with the step (another process steals a share of its time), so each step
        # weighs as 1 / its size^2, relative to the typical step: every step then counts by its
        # relative error, and the prior's strength keeps one meaning whatever the step times.
        self.typical_s += 0.05 * (measured_s - self.typical_s) if self.typical_s else measured_s
        ratio = self.typical_s / max(size, 0.25 * self.typical_s, 1e-9)
        weight = ratio * ratio
        lam = self.forgetting
        gram, moment = self._gram, self._moment
        for i in range(NUM_FEATURES):
            row, wxi = gram[i], weight * x[i]
            for j in range(i, NUM_FEATURES):
                row[j] = lam * row[j] + wxi * x[j]
            moment[i] = lam * moment[i] + wxi * y
        self.num_observations += 1
        self.coef = self._solve()

    def _clipped_error(self, predicted: float, measured: float) -> float:
        """(measured - predicted) / predicted, clipped to _CLIP typical errors."""
        relative = (measured - predicted) / max(predicted, 1e-9)
        bound = _CLIP * max(self.error_scale, _MIN_ERROR_SCALE)
        clipped = min(max(relative, -bound), bound)
        # Capped: steps that keep taking wildly different times must not widen the clip (and
        # the pace's step) without end.
        self.error_scale += _ERROR_SCALE_RATE * (min(abs(clipped), 1.0) - self.error_scale)
        return clipped

    def set_prior_from_fit(self) -> None:
        """Make the current fit the value every unexcited direction returns to (after the
        start-up profile)."""
        self._prior = list(self.coef)

    def _solve(self) -> list[float]:
        """(G + r I) coef = m + r prior over the features, none of them negative.

        A step cannot get faster by holding more, but features that move together (decode
        tokens and requests, in a run of decode-only steps) let an unconstrained fit trade a
        negative coefficient against a positive one, and a prediction that goes negative for
        some other step. So a coefficient that comes out negative is fixed at 0 and the rest
        are solved again (at most once per feature; usually not at all).
        """
        free = list(range(NUM_FEATURES))
        while True:
            solved = self._solve_on(free)
            negative = [i for i, c in zip(free, solved) if c < 0.0]
            if not negative:
                coef = [0.0] * NUM_FEATURES
                for i, c in zip(free, solved):
                    coef[i] = c
                return coef
            free.remove(min(negative, key=lambda i: solved[free.index(i)]))

    def _solve_on(self, free: list[int]) -> list[float]:
        """The ridge solution over the features in ``free``, by Cholesky (G + r I is symmetric
        positive definite; only G's upper triangle is kept)."""
        n, r, gram = len(free), self.prior_strength, self._gram
        if n == 0:
            return []
        lower = [[0.0] * n for _ in range(n)]
        for i in range(n):
            li = lower[i]
            for j in range(i + 1):
                lj = lower[j]
                s = gram[free[j]][free[i]] - sum(li[k] * lj[k] for k in range(j))
                if i == j:
                    li[i] = math.sqrt(max(s + r, 1e-12))
                else:
                    li[j] = s / lj[j]
        z = [0.0] * n
        for i in range(n):
            rhs = self._moment[free[i]] + r * self._prior[free[i]]
            z[i] = (rhs - sum(lower[i][k] * z[k] for k in range(i))) / lower[i][i]
        coef = [0.0] * n
        for i in reversed(range(n)):
            coef[i] = (z[i] - sum(lower[k][i] * coef[k] for k in range(i + 1, n))) / lower[i][i]
        return coef
