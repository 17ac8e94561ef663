"""StepCost: the line fitted to steps' times, and the tokens a time budget holds."""

from __future__ import annotations

from serve_app.engine.step_cost import StepCost


def test_the_fit_finds_the_fixed_cost_and_the_cost_per_token() -> None:
    cost = StepCost()
    assert cost.tokens_adding(1.0) is None  # nothing measured yet
    for tokens in [1, 16, 64, 128, 3, 40] * 5:
        cost.record(tokens, 0.030 + 0.002 * tokens)
    assert cost.line is not None
    assert abs(cost.line.fixed_s - 0.030) < 1e-9 and abs(cost.line.per_token_s - 0.002) < 1e-12
    assert cost.tokens_adding(0.0305) == 15
    assert cost.tokens_adding(0.001) == 0


def test_steps_of_one_size_tell_no_slope_and_recent_steps_weigh_most() -> None:
    cost = StepCost()
    cost.record(8, 0.1)
    assert cost.tokens_adding(1.0) is None  # one size tells no slope
    for tokens in (8, 32) * 3:
        cost.record(tokens, 0.020 + 0.001 * tokens)
    for _ in range(1000):
        cost.record(20, 0.040)  # one size a long while: the last line stands
    assert cost.tokens_adding(0.060) is not None
    for tokens in (10, 50) * 200:  # the host got slower: the fit follows it
        cost.record(tokens, 0.040 + 0.004 * tokens)
    assert cost.line is not None and abs(cost.line.per_token_s - 0.004) < 1e-6
    assert cost.tokens_adding(0.0205) == 5
