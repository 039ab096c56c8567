"""The steps each host trains under balance = "speed" (diloco_jax/algo/balance.py)."""

import numpy as np
import pytest

from diloco_jax.algo import balance


def test_equal_hosts_decide_equal_steps_despite_jitter():
  rng = np.random.default_rng(0)
  for _ in range(100):
    times = (0.2 * (1 + rng.uniform(-0.04, 0.04, size=4))).tolist()
    assert balance.speed_steps(times, 50) == [50] * 4


def test_a_host_twice_as_slow_lets_the_others_fill_its_round():
  times = [0.1, 0.1, 0.2]  # seconds per step: host 2 is 2x slower
  fixed = [50, 50, 50]
  speed = balance.speed_steps(times, 50)
  assert speed == [100, 100, 50]
  np.testing.assert_allclose(balance.busy_fractions(times, fixed), [0.5, 0.5, 1.0])
  assert min(balance.busy_fractions(times, speed)) >= 0.95
  assert balance.round_seconds(times, speed) == balance.round_seconds(times, fixed)
  # tokens per round: 250 steps' worth against 150 in the same time
  assert sum(speed) / sum(fixed) == pytest.approx(5 / 3)


def test_steps_round_down_and_are_capped():
  # 1.9x as fast: 19 of H = 10 (never the longest phase of the round); 100x: capped at 4H
  assert balance.speed_steps([0.19, 0.1, 0.0019], 10) == [10, 19, 40]
  assert balance.speed_steps([1.0, 0.5], 10, max_factor=1) == [10, 10]
  for times, steps in [([0.19, 0.1], [10, 19]), ([0.3, 0.2, 0.1], [5, 7, 15])]:
    h = steps[0]
    got = balance.speed_steps(times, h)
    assert got == steps
    assert balance.round_seconds(times, got) == pytest.approx(max(times) * h)  # slowest's


@pytest.mark.parametrize("times", [[], [0.1, 0.0], [0.1, float("nan")], [0.1, -1.0],
                                   [float("inf"), 0.1]])
def test_bad_timings_are_refused(times):
  with pytest.raises(ValueError, match="seconds per inner step must be positive numbers"):
    balance.speed_steps(times, 10)
