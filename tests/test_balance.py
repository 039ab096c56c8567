"""The steps each host trains under balance = "speed" (diloco_jax/algo/balance.py)."""

import json
import os
import random
import re
import signal
import time

import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.algo import balance
from diloco_jax.checkpoints import store
from diloco_jax.loop import pacing
from tests import multihost


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


def pacer(host=0, **overrides):
  config = config_lib.get_default_config()
  config.update(dict(balance="speed", num_rounds=10, inner_steps=20, balance_every=2))
  config.update(overrides)
  return pacing.Pacer(config, host=host, num_hosts=2, replicas_per_host=3)


def arrive(p, r, busy, now=None):
  """Round r's sum as every host would see it: host h's replicas' steps, its busy seconds."""
  steps = np.repeat(np.array(p.steps(r), np.float32), p.replicas_per_host)
  return p.arrived(r, {"steps": steps, "busy": np.array(busy, np.float32)},
                   now=r if now is None else now)


def test_pacer_decides_at_the_window_end_and_replays_from_its_state():
  """Host 1 twice as slow: the window of rounds 1-2 (round 1 untimed) decides [40, 20]
  from round 3; the weights, the tokens and the lr schedule's length follow; timings that
  would move a host's steps by less than the tolerance move nothing; a checkpoint's state
  gives the same decisions back."""
  p = pacer()
  figures = arrive(p, 1, [0.0, 0.0])
  assert figures == {"hosts_steps": [20, 20], "hosts_busy": [0, 0], "hosts_idle": [0, 0]}
  assert arrive(p, 2, [0.4, 0.8])["hosts_idle"] == pytest.approx([0.4, 0.0])
  assert p.take_changed() and not p.take_changed()
  assert p.decisions == [pacing.Decision(1, (20, 20)), pacing.Decision(3, (40, 20))]
  assert p.scale(2) == 1.0 and p.scale(3) == np.float32(2 * 40 / 60)
  assert p.tokens_through(4, 10) == (40 + 40 + 60 + 60) * 3 * 10  # R = 3, 10 tokens a step
  assert p.schedule_steps() == 2 * 20 + 8 * 40 and p.schedule_steps(1) == 10 * 20
  arrive(p, 3, [0.85, 0.8])  # host 0 1.88x as fast: 37 steps, within 10% of 40
  arrive(p, 4, [0.85, 0.8])
  assert not p.take_changed() and p.steps(5) == (40, 20)
  arrive(p, 5, [1.2, 0.8])  # 1.33x: 26 steps
  arrive(p, 6, [1.2, 0.8], now=7)  # arrived a round late (delayed, eager): from round 8
  assert p.take_changed() and p.decisions[-1] == pacing.Decision(8, (26, 20))
  q = pacer(host=1)
  q.restore(json.loads(json.dumps(p.state())), same_world=True)
  assert q.decisions == p.decisions and q.scale(5) == np.float32(2 * 20 / 60)
  fresh = pacer()
  fresh.restore(p.state(), same_world=False)  # another host count: measured anew
  assert fresh.decisions == [pacing.Decision(1, (20, 20))]


def test_pacer_refuses_steps_the_hosts_disagree_on():
  p = pacer()
  with pytest.raises(pacing.BalanceError, match=r"round 1: the hosts trained \[4, 5\]"):
    p.arrived(1, {"steps": np.array([4, 4, 4, 5, 5, 5], np.float32),
                  "busy": np.zeros(2, np.float32)}, now=1)


def metrics(workdir):
  with open(os.path.join(multihost.host_dir(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.multihost
def test_speed_decides_weights_and_resumes_bit_identically_after_sigkill(tmp_path):
  """2 hosts, host 1 twice as slow (as measured: `multihost.paced`), mode delayed: the
  sums of rounds 2, 4, 6 decide [8, 4] steps from the round after they arrive. A run
  whose host 0 is SIGKILLed after checkpoint 4 and restarted ends where the uninterrupted
  run ends, every round's anchor hash, loss and steps the same: the decisions and the
  steps and timings of the sum in flight come back from the checkpoint."""
  run = dict(mode="delayed", replicas_per_host=1, num_rounds=8, balance="speed",
             balance_every=2, debug_checks=True, eval_every=2,
             _pace={"seconds": [0.01, 0.02]})
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  whole = multihost.run_hosts(tmp_path / "a", 2, **run)
  assert "balance: from round 4, inner steps per host [8, 4]" in whole[0]["output"]
  want = metrics(tmp_path / "a" / "work")
  assert [r["hosts_steps"] for r in want] == [[4, 4]] * 3 + [[8, 4]] * 5
  # steps of both hosts so far x 64 tokens (batch 4 x seq_len 16): 8 + 8 + 8, then + 12
  assert [r["tokens"] for r in want][2:5] == [64 * n for n in (24, 36, 48)]
  with open(multihost.host_dir(tmp_path / "a" / "work") / "run.json") as f:
    assert json.load(f)["balance"]["decisions"] == [{"from_round": 1, "steps": [4, 4]},
                                                    {"from_round": 4, "steps": [8, 4]}]
  # host 0's rounds from the 4th take 0.3 s more: the SIGKILL lands mid-run
  hosts = multihost.start_hosts(tmp_path / "b", 2, **run,
                                _slow={"host": 0, "from_round": 4, "seconds": 0.3})
  wait = time.monotonic() + 180
  ckpts = lambda: multihost.host_dir(tmp_path / "b" / "work") / store.CHECKPOINTS  # noqa
  while not (ckpts().is_dir() and any(d.isdigit() and int(d) >= 4 for d in os.listdir(ckpts()))):
    assert time.monotonic() < wait and hosts[0].poll() is None, "no checkpoint 4"
    time.sleep(0.05)
  time.sleep(random.uniform(0, 0.3))
  assert hosts[0].poll() is None, "host 0 ended before the SIGKILL"
  hosts[0].send_signal(signal.SIGKILL)
  # host 1 stops: host 0 served the job's coordinator
  (killed, _), _ = multihost.finish(hosts, timeout=120)
  assert killed == -signal.SIGKILL, killed
  resumed = multihost.run_hosts(tmp_path / "b", 2, **run)
  assert "resumed from checkpoint" in resumed[0]["output"], resumed[0]["output"][-3000:]
  # The SIGKILL hit mid-run: the restart resumed a round before the last (a run that had
  # finished resumes too, and ends the same), with round 8 still to train.
  line = re.search(r"resumed from checkpoint (\d+) .*; continuing at round \d+ of 8",
                   resumed[0]["output"])
  assert line and 4 <= int(line.group(1)) < 8, resumed[0]["output"][-3000:]
  got = metrics(tmp_path / "b" / "work")
  for key in ("round", "anchor_hash", "train_loss", "eval_loss", "hosts_steps", "tokens"):
    assert [r.get(key) for r in got] == [r.get(key) for r in want], key
  for a, b in zip(resumed, whole):
    for x, y in zip(a["leaves"], b["leaves"]):
      np.testing.assert_array_equal(x, y)
