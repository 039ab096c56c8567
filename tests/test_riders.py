"""What rides a sum of pseudo-gradients (`wire.exchange.Rider`): summed over the hosts with
Δ and given back by name, a count that divides the mean, words kept in a checkpointed sum
in flight and sent again on resume; and the loop's riders (the pacer, elastic's members)."""

import pathlib
import re

import jax
import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.membership import manager as membership
from diloco_jax.loop import pacing
from diloco_jax.runtime import preemption
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange


class TwinHosts:
  """Two hosts that send the same: every sum over hosts is twice this host's."""
  num_hosts, host_index, bytes_sent, live, device = 2, 0, 0, [0, 1], None

  def sum(self, tree):
    return jax.tree.map(lambda x: np.asarray(x) * 2, tree)

  def atomic(self, what, op):
    del what
    return op(self)


class Rider:
  """Words `value` + the round (two words), asked for each round it rides."""

  def __init__(self, name, *, keep=False, divisor=None, value=0.0):
    self.name, self.keep, self.divisor, self.value, self.asked = name, keep, divisor, value, []

  def words(self, round_):
    self.asked.append(round_)
    return {"n": np.float32(self.value), "r": np.array([round_, -round_], np.float32)}

  def like(self):
    return {"n": np.float32(0), "r": np.zeros(2, np.float32)}


def test_riders_come_back_by_name_and_a_kept_ones_words_are_sent_again():
  count = Rider("count", divisor="n", value=3.0)  # 3 replicas per host are live, not 4
  kept = Rider("kept", keep=True, value=5.0)
  deltas_R = {"w": np.arange(8, dtype=np.float32).reshape(4, 2)}  # R = 4
  with dispatch.Dispatcher() as dispatcher:
    ex = exchange.Exchange(config_lib.get_default_config().outer, collective=TwinHosts(),
                           dispatcher=dispatcher, replicas_per_host=4, riders=(count, kept))
    pending = ex.submit(deltas_R, np.float32(1), np.ones(4, bool), round_=7)
    arrived = ex.wait(pending, diagnostics=False)
    assert {name: {w: x.tolist() for w, x in words.items()}
            for name, words in arrived.riders.items()} == {
                "count": {"n": 6.0, "r": [14.0, -14.0]}, "kept": {"n": 10.0, "r": [14.0, -14.0]}}
    # the mean divides the hosts' Σ by the count the rider summed (6), not K = 8
    np.testing.assert_array_equal(arrived.mean["w"], 2 * deltas_R["w"].sum(axis=0) / 6)
    saved = ex.inflight(pending)  # a checkpoint holds the kept rider's words under its name
    assert set(saved) == set(ex.inflight_like(deltas_R)) == {
        "deltas", "loss", "finite", "round", "key", "kept"}
    kept.value = count.value = 4.0  # a resumed run's riders would say otherwise now
    again = ex.wait(ex.resubmit(saved, {}), diagnostics=False)
  assert again.riders["kept"]["n"] == 10.0 and again.riders["count"]["n"] == 8.0
  assert kept.asked == [7] and count.asked == [7, 7]
  np.testing.assert_array_equal(again.mean["w"], arrived.mean["w"] * 6 / 8)


@pytest.mark.parametrize("riders, message", [
    ((Rider("a"), Rider("a")), "each needs its own name"),
    ((Rider("deltas"),), "each needs its own name"),
    ((Rider("a", divisor="n"), Rider("b", divisor="n")), "only one may count"),
])
def test_riders_that_would_collide_are_refused(riders, message):
  with pytest.raises(ValueError, match=message):
    exchange.Exchange(config_lib.get_default_config().outer, collective=TwinHosts(),
                      dispatcher=None, replicas_per_host=1, riders=riders)


def test_the_loops_riders():
  """The pacer keeps its words under 'speed' only; live membership's members count the
  replicas that the mean divides by and say whether a host waits to join, and their sum
  comes back as the round's figures; the stop word rides every sum."""
  config = config_lib.get_default_config()
  fixed = pacing.Pacer(config, host=1, num_hosts=2, replicas_per_host=3)
  config.balance = "speed"
  speed = pacing.Pacer(config, host=1, num_hosts=2, replicas_per_host=3)
  assert (fixed.name, fixed.keep, speed.keep, fixed.divisor) == ("pace", False, True, None)
  assert jax.tree.map(np.shape, speed.words(4)) == jax.tree.map(np.shape, speed.like())
  members = membership.LiveReplicas(replicas_per_host=3, pending=lambda: True)
  assert (members.name, members.keep, members.divisor) == ("members", False, "replicas")
  assert members.words(4) == {"replicas": 3, "hosts": 1, "pending": 1}
  assert jax.tree.map(np.shape, members.words(4)) == jax.tree.map(np.shape, members.like())
  assert membership.Fixed.riders == () and membership.Fixed.figures({}) == {}
  stop = preemption.Preemption()
  assert (stop.name, stop.keep, stop.divisor, stop.words(4)) == ("stop", False, None,
                                                                 {"stop": 0})
  stop.request()
  assert stop.words(4) == {"stop": 1}
  stop.arrived({"stop": {"stop": np.float32(0)}})
  assert not stop._agreed  # pylint: disable=protected-access
  stop.arrived({"stop": {"stop": np.float32(2)}})  # two hosts were asked
  assert stop._agreed  # pylint: disable=protected-access
  # Live: a host's own SIGTERM is its alone (it leaves); the coordinator's stop of the whole
  # job is the word, and every host stops once a sum brings it.
  job = [False]
  live = preemption.Preemption(job_stopping=lambda: job[0])
  live.request()
  assert live.words(4) == {"stop": 0} and live.reached(4)
  live = preemption.Preemption(job_stopping=lambda: job[0])
  job[0] = True
  assert live.words(4) == {"stop": 1} and not live.reached(4)
  live.arrived({"stop": {"stop": np.float32(1)}})
  assert live.reached(4)


def test_the_wire_names_no_feature():
  """The wire carries riders whatever they serve: no word of the loop's features in it."""
  wire = pathlib.Path(exchange.__file__).parent
  named = [f"{path.name}:{n}: {line.strip()}" for path in sorted(wire.glob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if re.search("pace|elastic|rejoin", line, re.IGNORECASE)]
  assert named == []
