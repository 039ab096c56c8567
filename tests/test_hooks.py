"""The round loop's hooks (loop/hooks.py) and the store's save policy."""

import pytest

from diloco_jax.checkpoints import store
from diloco_jax.loop import hooks as hooks_lib


def test_hooks_run_in_order_on_their_schedule_and_a_stop_ends_the_round_there():
  calls = []
  hooks = hooks_lib.Hooks()
  hooks.add("a", before=lambda r: calls.append(("before a", r)),
            after=lambda r: calls.append(("a", r)))
  hooks.add("b", after=lambda r: calls.append(("b", r)) or r == 4, every=2)
  hooks.add("c", after=lambda r: calls.append(("c", r)))
  stops = []
  for r in range(1, 5):
    hooks.before_round(r)
    stops.append(hooks.after_round(r))
  assert stops == [False, False, False, True]
  assert calls == [("before a", 1), ("a", 1), ("c", 1),
                   ("before a", 2), ("a", 2), ("b", 2), ("c", 2),
                   ("before a", 3), ("a", 3), ("c", 3),
                   ("before a", 4), ("a", 4), ("b", 4)]  # b stopped the run: no c
  assert hooks.names == ["a", "b", "c"]
  with pytest.raises(ValueError, match="hook 'd': every = 0"):
    hooks.add("d", after=print, every=0)


def test_the_save_policy_saves_every_n_rounds_and_at_a_preemption_never_the_last_round():
  policy = store.SavePolicy(every=3, last_round=7)
  assert [r for r in range(1, 8) if policy.due(r, preempted=False)] == [3, 6]
  assert [r for r in range(1, 8) if policy.due(r, preempted=True)] == [1, 2, 3, 4, 5, 6]
  never = store.SavePolicy(every=0, last_round=7)
  assert [r for r in range(1, 8) if never.due(r, preempted=False)] == []
