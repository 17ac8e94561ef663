"""StepCost: how long a step takes by its token count, as a line (a fixed cost plus a cost per token) fitted
to the recent steps, each older one weighing less; and so how many tokens add a given time to a step."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Each step's weight in the fit relative to the next one's: the fit follows the last hundred steps or so.
FORGET = 0.98
# The fit needs steps of different sizes: their token counts' weighted variance at least this.
MIN_VARIANCE = 1.0


@dataclass(frozen=True)
class Line:
    fixed_s: float
    per_token_s: float


class StepCost:
    def __init__(self) -> None:
        self._weight = self._tokens = self._seconds = self._tokens_sq = self._tokens_seconds = 0.0
        self.line: Line | None = None  # the last fit that held; None before steps of two sizes ran

    def record(self, tokens: int, seconds: float) -> None:
        self._weight = FORGET * self._weight + 1
        self._tokens = FORGET * self._tokens + tokens
        self._seconds = FORGET * self._seconds + seconds
        self._tokens_sq = FORGET * self._tokens_sq + tokens * tokens
        self._tokens_seconds = FORGET * self._tokens_seconds + tokens * seconds
        spread = self._weight * self._tokens_sq - self._tokens**2
        if spread < MIN_VARIANCE * self._weight**2:
            return  # steps of one size tell no slope: the last line stands
        per_token = (self._weight * self._tokens_seconds - self._tokens * self._seconds) / spread
        if per_token > 0:
            self.line = Line((self._seconds - per_token * self._tokens) / self._weight, per_token)

    def tokens_adding(self, seconds: float) -> int | None:
        """The most tokens that add `seconds` at most to a step's time; None while the cost is unknown."""
        if self.line is None:
            return None
        return math.floor(seconds / self.line.per_token_s)
