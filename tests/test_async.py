"""Async DiLoCo in `simulate`: delayed (docs/algorithms.md §3) and eager (§4) against
independent numpy implementations written here, and their invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_jax
from diloco_jax.algo import diloco
from diloco_jax.algo import optim
from diloco_jax.loop.join import own_for_joiner
from tests.test_simulate import B
from tests.test_simulate import D
from tests.test_simulate import H
from tests.test_simulate import K
from tests.test_simulate import NumpyAdamW
from tests.test_simulate import O
from tests.test_simulate import T
from tests.test_simulate import inner_config
from tests.test_simulate import loss_fn
from tests.test_simulate import make_problem
from tests.test_simulate import np_grads

LR, MU = 0.7, 0.9


@pytest.fixture(autouse=True)
def x64():
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", False)


def nesterov(params, buf, grad, lr=LR, mu=MU):
  buf = {k: mu * buf[k] + grad[k] for k in params}
  return {k: params[k] - lr * (grad[k] + mu * buf[k]) for k in params}, buf


def inner_phase(start, opt, batches, t, m):
  local = {k: v.copy() for k, v in start.items()}
  for h in range(H):
    batch = {k: v[t, m, h] for k, v in batches.items()}
    local = opt.step(local, np_grads(local, batch))
  return local


def np_delayed(params, batches, inner, k=K):
  """§2: Δ against this round's start; the previous round's mean applied one round late."""
  s = {n: v.copy() for n, v in params.items()}
  buf = {n: np.zeros_like(v) for n, v in params.items()}
  opts = [NumpyAdamW(inner, T * H, params) for _ in range(k)]
  in_flight = None
  for t in range(T):
    deltas = []
    for m in range(k):
      local = inner_phase(s, opts[m], batches, t, m)
      deltas.append({n: s[n] - local[n] for n in s})
    if in_flight is not None:
      s, buf = nesterov(s, buf, in_flight)
    in_flight = {n: sum(d[n] for d in deltas) / k for n in s}
  s, buf = nesterov(s, buf, in_flight)  # drained at the end
  return s


def np_eager(params, batches, inner, k=K):
  """§3: each replica m applies Δ_m/K + (Δ̄_prev − Δ_m,prev/K) with its own momentum."""
  theta = [{n: v.copy() for n, v in params.items()} for _ in range(k)]
  buf = [{n: np.zeros_like(v) for n, v in params.items()} for _ in range(k)]
  prev = [{n: np.zeros_like(v) for n, v in params.items()} for _ in range(k)]
  prev_mean = {n: np.zeros_like(v) for n, v in params.items()}
  opts = [NumpyAdamW(inner, T * H, params) for _ in range(k)]
  for t in range(T):
    deltas = []
    for m in range(k):
      local = inner_phase(theta[m], opts[m], batches, t, m)
      deltas.append({n: theta[m][n] - local[n] for n in params})
    for m in range(k):
      grad = {n: deltas[m][n] / k + (prev_mean[n] - prev[m][n] / k) for n in params}
      theta[m], buf[m] = nesterov(theta[m], buf[m], grad)
    prev = deltas
    prev_mean = {n: sum(d[n] for d in deltas) / k for n in params}
  # Drain: the proxy Δ_m/K is replaced by the last mean, with Nesterov's immediate
  # coefficient lr(1+μ) and no momentum step.
  final = [{n: theta[m][n] - LR * (1 + MU) * (prev_mean[n] - prev[m][n] / k) for n in params}
           for m in range(k)]
  return {n: sum(f[n] for f in final) / k for n in params}


def run(mode, params, batches, inner):
  return diloco_jax.simulate(
      loss_fn, params, batches, inner_optimizer=optim.inner_optimizer(inner, T * H),
      outer_optimizer=optax.sgd(LR, momentum=MU, nesterov=True), mode=mode)


@pytest.mark.device
@pytest.mark.parametrize("mode, reference", [("delayed", np_delayed), ("eager", np_eager)])
def test_matches_numpy_float64(mode, reference):
  params, batches = make_problem(5)
  inner = inner_config()
  result = run(mode, params, batches, inner)
  expected = reference(params, batches, inner)
  for n in expected:
    np.testing.assert_allclose(result.params[n], expected[n], atol=1e-10, rtol=0)
  sync = run("sync", params, batches, inner)
  assert not np.allclose(result.params["w"], sync.params["w"], atol=1e-6)  # a real difference


def test_eager_one_replica_is_sync_bit_for_bit():
  params, batches = make_problem(6)
  one = {n: v[:, :1] for n, v in batches.items()}
  inner = inner_config()
  eager, sync = run("eager", params, one, inner), run("sync", params, one, inner)
  for n in params:
    np.testing.assert_array_equal(eager.params[n], sync.params[n])
  np.testing.assert_array_equal(eager.losses, sync.losses)


def test_constant_mock():
  """Each inner step adds −c; with μ=0 (docs/algorithms.md §8): delayed^(r) = sync^(r−1)
  before the drain and sync after it; eager applies Hc/K in round 1 and Hc from round 2 on,
  then the drain."""
  c, eta = 0.25, 0.5
  params = {"w": np.ones(3)}
  batches = {"x": np.zeros((T, K, H, 1))}
  linear = lambda p, b: (p["w"].sum() * c + 0 * b["x"].sum())
  kw = dict(inner_optimizer=optax.sgd(1.0), outer_optimizer=optax.sgd(eta))
  sync = diloco_jax.simulate(linear, params, batches, mode="sync", **kw)
  delayed = diloco_jax.simulate(linear, params, batches, mode="delayed", **kw)
  eager = diloco_jax.simulate(linear, params, batches, mode="eager", **kw)
  np.testing.assert_allclose(sync.params["w"], 1 - T * eta * H * c, atol=1e-14)
  np.testing.assert_allclose(delayed.params["w"], sync.params["w"], atol=1e-14)  # drained
  assert int(delayed.outer_state.step) == T
  # Eager: H c/K, then H c per round; the drain adds the missing (1 − 1/K) H c.
  np.testing.assert_allclose(eager.params["w"], 1 - T * eta * H * c, atol=1e-14)
  np.testing.assert_allclose(eager.outer_state.params["w"][0],  # before the drain
                             1 - eta * H * c * (1 / K + (T - 1)), atol=1e-14)


# Live membership (docs/algorithms.md §4, "K per round"): replica 3, a host of its own,
# leaves after round 3, and replica 2, another, after round 5: the means of rounds 1-3 are
# over K = 4, those of rounds 4-5 over 3, the later ones over 2.
LIVE_KS = (4, 4, 4, 3, 3, 2, 2)  # K_r, the replicas in round r's mean
LIVE_HOSTS = ((0, 1), (2,), (3,))  # each host's replicas: one with two, two with one


def np_eager_live(params, batches, inner, ks=LIVE_KS):
  """Eager with a K per round, written from §4: in round r every replica still there
  applies Δ_m/K_{r−1} + (Δ̄^(r−1) − Δ_m^(r−1)/K_{r−1}), Δ̄^(r−1) being divided by
  K_{r−1} (the static K, ks[0], in round 1). Replicas m ≥ K_r have left by round r.
  Returns (θ_m after the last round, θ_m after the drain) of the replicas still there."""
  theta = [{n: v.copy() for n, v in params.items()} for _ in range(ks[0])]
  buf = [{n: np.zeros_like(v) for n, v in params.items()} for _ in range(ks[0])]
  prev = [{n: np.zeros_like(v) for n, v in params.items()} for _ in range(ks[0])]
  prev_mean = {n: np.zeros_like(v) for n, v in params.items()}
  opts = [NumpyAdamW(inner, len(ks) * H, params) for _ in range(ks[0])]
  k_prev = ks[0]
  for t, k in enumerate(ks):
    deltas = []
    for m in range(k):
      local = inner_phase(theta[m], opts[m], batches, t, m)
      deltas.append({n: theta[m][n] - local[n] for n in params})
    for m in range(k):
      grad = {n: deltas[m][n] / k_prev + (prev_mean[n] - prev[m][n] / k_prev)
              for n in params}
      theta[m], buf[m] = nesterov(theta[m], buf[m], grad)
    prev = deltas
    prev_mean = {n: sum(d[n] for d in deltas) / k for n in params}
    k_prev = k
  final = [{n: theta[m][n] - LR * (1 + MU) * (prev_mean[n] - prev[m][n] / k_prev)
            for n in params} for m in range(ks[-1])]
  return theta[:ks[-1]], final


@pytest.mark.device
def test_eager_with_k_per_round_matches_numpy_float64():
  """The rule driven as `OuterStep` drives it on each host, given each arrived mean's K
  as `diloco.arrived_k` gives it, against `np_eager_live`; one compiled outer step for
  the static K and one for every other K."""
  rng = np.random.default_rng(7)
  shape = (len(LIVE_KS), LIVE_KS[0], H, B, D)
  batches = {"x": rng.normal(size=shape), "y": rng.normal(size=shape[:-1] + (O,))}
  params = {"w": rng.normal(size=(D, O)) * 0.1, "b": np.zeros(O)}
  inner = inner_config()
  opts = [NumpyAdamW(inner, len(LIVE_KS) * H, params) for _ in range(LIVE_KS[0])]
  rule = diloco.Eager(optax.sgd(LR, momentum=MU, nesterov=True), LIVE_KS[0])
  traces = []

  def apply(*args):
    traces.append((args[2] is None, args[3] is None, len(args[1]["w"])))
    return rule.apply(*args)

  apply, drain = jax.jit(apply), jax.jit(rule.drain)
  anchor = jax.tree.map(jnp.asarray, params)
  states = [rule.init(anchor, len(replicas)) for replicas in LIVE_HOSTS]
  mean, k = None, None  # round 1: no mean yet, the static K
  for t, k_t in enumerate(LIVE_KS):
    live = [h for h, replicas in enumerate(LIVE_HOSTS) if max(replicas) < k_t]
    sent = []
    for h in live:
      start = jax.tree.map(np.asarray, rule.start(states[h]))
      deltas_R = {n: [] for n in params}
      for i, m in enumerate(LIVE_HOSTS[h]):
        own = {n: v[i] for n, v in start.items()}
        local = inner_phase(own, opts[m], batches, t, m)
        for n in params:
          deltas_R[n].append(own[n] - local[n])
      deltas_R = {n: jnp.asarray(np.stack(v)) for n, v in deltas_R.items()}
      states[h] = apply(states[h], deltas_R, mean, k)
      sent.append(deltas_R)
    total = jax.tree.map(lambda *d: jnp.concatenate(d), *sent)
    mean, k = diloco.divide(diloco.replica_sum(total), k_t), diloco.arrived_k(k_t, 4)
  # One trace per shape (R = 2 or 1) and (mean, static K), (mean, other K) or no mean: the
  # K = 3 and K = 2 rounds of host 0 share one program.
  assert sorted(traces) == [(False, False, 1), (False, False, 2), (False, True, 1),
                            (False, True, 2), (True, True, 1), (True, True, 2)]

  expected_theta, expected_final = np_eager_live(params, batches, inner)
  hosts_left = [h for h, replicas in enumerate(LIVE_HOSTS) if max(replicas) < LIVE_KS[-1]]
  theta = [states[h].params for h in hosts_left]
  final = [rule.final(drain(states[h], mean, k)) for h in hosts_left]
  rows = lambda trees: [{n: np.asarray(tree[n][i]) for n in params}
                        for tree in trees for i in range(len(tree["w"]))]
  for got, want in zip(rows(theta) + rows(final), expected_theta + expected_final,
                       strict=True):
    for n in params:
      np.testing.assert_allclose(got[n], want[n], atol=1e-10, rtol=0)


# A host joins a live job (docs/algorithms.md §11): hosts of one replica each, replica h on
# host h; hosts 0 and 1 train from round 1, host 2 is admitted at the end of round 3, takes
# the state after it, catches up in round 4 (no steps, a zero Δ counted by no mean) and
# trains rounds 5-7. The means of rounds 1-4 are over K = 2 (the static K), the later ones
# over 3.
JOIN_STARTS = (0, 0, 3)  # the round index (0-based) whose start state each host takes
JOIN_ROUNDS = 7


def join_problem(seed, replicas=1):
  """A problem for the join's hosts with `replicas` each (replica h·R + i on host h)."""
  rng = np.random.default_rng(seed)
  shape = (JOIN_ROUNDS, len(JOIN_STARTS) * replicas, H, B, D)
  batches = {"x": rng.normal(size=shape), "y": rng.normal(size=shape[:-1] + (O,))}
  params = {"w": rng.normal(size=(D, O)) * 0.1, "b": np.zeros(O)}
  return params, batches


def joiner_adamw(inner, params, t):
  """A joiner's inner optimizer, first training in round index t: fresh moments at the
  run's step count then."""
  opt = NumpyAdamW(inner, JOIN_ROUNDS * H, params)
  opt.count = t * H
  return opt


def trains(start, t):
  """Whether a replica that took the state at the start of round index `start` trains,
  and is in the mean, in round index t: from the start (0), or after its catch-up round."""
  return start == 0 or t > start


def np_anchor_join(params, batches, inner, starts=JOIN_STARTS, delay=1):
  """Sync (delay 0) or delayed (1) with joiners, written from §2, §3 and §11: a replica
  admitted at the end of round t takes the shared anchor, trains nothing in round t+1 and
  is in no mean of it; it trains from round t+2, from the anchor every replica starts it
  from, with fresh moments at the run's step count; each mean is divided by the replicas
  that took part in it. Returns (the anchor every replica starts the next round from,
  after every round; the final (drained) anchor)."""
  s = {n: v.copy() for n, v in params.items()}
  buf = {n: np.zeros_like(v) for n, v in params.items()}
  opts = {m: NumpyAdamW(inner, JOIN_ROUNDS * H, params) for m, t in enumerate(starts) if t == 0}
  in_flight, anchors = None, []
  for t in range(JOIN_ROUNDS):
    live = [m for m, start in enumerate(starts) if trains(start, t)]
    opts.update({m: joiner_adamw(inner, params, t) for m in live if m not in opts})
    deltas = []
    for m in live:
      local = inner_phase(s, opts[m], batches, t, m)
      deltas.append({n: s[n] - local[n] for n in s})
    mean = {n: sum(d[n] for d in deltas) / len(live) for n in s}
    if delay == 0:
      s, buf = nesterov(s, buf, mean)
    elif in_flight is not None:
      s, buf = nesterov(s, buf, in_flight)
    in_flight = mean
    anchors.append(s)
  if delay:
    s, buf = nesterov(s, buf, in_flight)
  return anchors, s


def np_eager_join(params, batches, inner, starts=JOIN_STARTS, mu=MU):
  """Eager with joiners, written from §4 ("K per round") and §11: a replica admitted at the
  end of round t takes the first member's (θ_m, b_m, Δ_m,prev); in round t+1 its Δ is zero
  and in no mean, and it applies 0/K_t + (Δ̄^(t) − Δ_src^(t)/K_t) like every replica; it
  trains from round t+2 with fresh moments. Returns (θ_m after every round, for the
  replicas there in that round; θ_m after the drain)."""
  n_all = len(starts)
  zeros = lambda: {n: np.zeros_like(v) for n, v in params.items()}  # noqa: E731
  theta = [{n: v.copy() for n, v in params.items()} for _ in range(n_all)]
  buf = [zeros() for _ in range(n_all)]
  prev = [zeros() for _ in range(n_all)]
  prev_mean = zeros()
  opts = {m: NumpyAdamW(inner, JOIN_ROUNDS * H, params) for m, t in enumerate(starts) if t == 0}
  k_prev = len(opts)  # the static K: no mean has arrived in round 1
  history = []
  for t in range(JOIN_ROUNDS):
    here = [m for m, start in enumerate(starts) if start <= t]
    for m in here:
      if starts[m] == t and t > 0:  # admitted: the sender is the first member
        src = here[0]
        theta[m], buf[m], prev[m] = ({n: v.copy() for n, v in tree[src].items()}
                                     for tree in (theta, buf, prev))
    live = [m for m in here if trains(starts[m], t)]
    for m in live:
      opts.setdefault(m, joiner_adamw(inner, params, t))
    deltas = {m: zeros() for m in here}
    for m in live:
      local = inner_phase(theta[m], opts[m], batches, t, m)
      deltas[m] = {n: theta[m][n] - local[n] for n in params}
    for m in here:
      grad = {n: deltas[m][n] / k_prev + (prev_mean[n] - prev[m][n] / k_prev)
              for n in params}
      theta[m], buf[m] = nesterov(theta[m], buf[m], grad, mu=mu)
    for m in here:
      prev[m] = deltas[m]
    prev_mean = {n: sum(deltas[m][n] for m in live) / len(live) for n in params}
    k_prev = len(live)
    history.append([theta[m] for m in here])
  final = [{n: theta[m][n] - LR * (1 + mu) * (prev_mean[n] - prev[m][n] / k_prev)
            for n in params} for m in here]
  return history, final


def drive_join(rule, params, batches, inner, starts=JOIN_STARTS, replicas=1):
  """The rule driven on each host (`replicas` replicas each, replica h·R + i) as
  `OuterStep` drives it, with the join as `loop/join.py` makes it: at the end of round t,
  after the members' outer step of round t and the arrival of round t's mean, the joiner
  takes `rule.split` of the first member's state (eager: its own part through
  `own_for_joiner`: every replica the first one's), and the mean of round t as it
  arrived, with its K; in round t+1 it trains nothing and sends a zero Δ that no mean
  counts (wire/exchange.py's `idle`), and applies the round's outer step like every
  member. Returns (per round, every replica's start of the next round, by replica; per
  replica, the trained params; per round, the mean and the K it was divided by, and each
  replica's Δ, zero where it caught up)."""
  hosts, r = range(len(starts)), replicas
  ids = lambda h: [h * r + i for i in range(r)]  # noqa: E731
  opts = {m: NumpyAdamW(inner, JOIN_ROUNDS * H, params) for h in hosts if starts[h] == 0
          for m in ids(h)}
  static_k = len(opts)
  apply, drain = jax.jit(rule.apply), jax.jit(rule.drain)
  anchor = jax.tree.map(jnp.asarray, params)
  states = {h: rule.init(anchor, r) for h in hosts if starts[h] == 0}
  mean, k = None, None  # round 1: no mean yet, the static K
  history, means, sent_by_round = [], [], []
  to_np = lambda tree: {n: np.asarray(v) for n, v in tree.items()}  # noqa: E731
  rows = lambda tree: ([{n: v[i] for n, v in to_np(tree).items()} for i in range(r)]  # noqa: E731
                       if rule.per_replica else [to_np(tree)] * r)
  for t in range(JOIN_ROUNDS):
    for h in hosts:
      if starts[h] == t and t > 0:
        shared, own = rule.split(states[min(states)])
        if own is not None:
          own = own_for_joiner(own, r)
        states[h] = rule.join(shared, own)
    deltas = {}
    for h in sorted(states):
      starts_h = rows(rule.start(states[h]))
      deltas_R = {n: [] for n in params}
      for m, start in zip(ids(h), starts_h):
        if trains(starts[h], t):
          opts.setdefault(m, joiner_adamw(inner, params, t))
          local = inner_phase(start, opts[m], batches, t, m)
        else:  # catching up: no steps, its Δ θ − θ exactly zero
          local = start
        for n in params:
          deltas_R[n].append(start[n] - local[n])
      deltas[h] = {n: jnp.asarray(np.stack(v)) for n, v in deltas_R.items()}
    sent = [deltas[h] for h in sorted(states) if trains(starts[h], t)]
    total = jax.tree.map(lambda *d: jnp.concatenate(d), *sent)
    count = len(sent) * r
    this_mean = diloco.divide(diloco.replica_sum(total), count)
    this_k = diloco.arrived_k(count, static_k)
    if rule.delay == 0:
      mean, k = this_mean, this_k
    for h in sorted(states):
      states[h] = apply(states[h], deltas[h], mean, k)
    history.append({m: start for h in sorted(states)
                    for m, start in zip(ids(h), rows(rule.start(states[h])))})
    mean, k = this_mean, this_k
    means.append((to_np(mean), count))
    sent_by_round.append({m: {n: np.asarray(d[n][i]) for n in params}
                          for h, d in deltas.items() for i, m in enumerate(ids(h))})
  final = {}
  for h in sorted(states):
    trained = rule.final(drain(states[h], mean if rule.delay else None, k))
    for m, row in zip(ids(h), rows(trained)):
      final[m] = row
  return history, final, means, sent_by_round


def outer_rule(mode, mu=MU, replicas=1):
  return mode(optax.sgd(LR, momentum=mu, nesterov=True),
              sum(t == 0 for t in JOIN_STARTS) * replicas)


def replica_starts(replicas: int, starts=JOIN_STARTS) -> tuple[int, ...]:
  """The round each replica starts at: its host's (replica h·R + i on host h)."""
  return tuple(t for t in starts for _ in range(replicas))


@pytest.mark.device
@pytest.mark.parametrize("rule, replicas", [(diloco.Delayed, 1), (diloco.Delayed, 2),
                                            (diloco.Sync, 1)])
def test_anchor_join_matches_numpy_float64(rule, replicas):
  """§11, sync and delayed: the joiner takes the shared anchor and momentum (delayed: and
  the mean of round t as it arrived), catches up in round t+1 with a zero Δ that no mean
  counts, and trains from round t+2. The anchor after every round is the same on every
  host, the joiner's from its first round; with one or two replicas per host."""
  params, batches = join_problem(8, replicas)
  inner = inner_config()
  starts = replica_starts(replicas)
  history, final, means, _ = drive_join(outer_rule(rule, replicas=replicas), params,
                                        batches, inner, replicas=replicas)
  anchors, drained = np_anchor_join(params, batches, inner, starts=starts, delay=rule.delay)
  for t, (got, want) in enumerate(zip(history, anchors, strict=True)):
    assert sorted(got) == [h for h, start in enumerate(starts) if start <= t]
    for h in got:
      for n in params:
        np.testing.assert_array_equal(got[h][n], got[0][n])  # bit for bit on every host
        np.testing.assert_allclose(got[h][n], want[n], atol=1e-10, rtol=0)
  for h in final:
    for n in params:
      np.testing.assert_array_equal(final[h][n], final[0][n])
      np.testing.assert_allclose(final[h][n], drained[n], atol=1e-10, rtol=0)
  catch_up = JOIN_STARTS[-1]  # its round's mean is the members' alone, over their K
  assert [count for _, count in means] == [2 * replicas] * (catch_up + 1) + [
      3 * replicas] * (JOIN_ROUNDS - catch_up - 1)
  _, alone = np_anchor_join(params, batches, inner, starts=starts[:2 * replicas],
                            delay=rule.delay)
  assert not np.allclose(final[0]["w"], alone["w"], atol=1e-6)  # the join made a difference


@pytest.mark.device
@pytest.mark.parametrize("mu, replicas", [(MU, 1), (0.0, 1), (MU, 2)])
def test_eager_join_matches_numpy_float64(mu, replicas):
  """§11, eager: every replica of the joiner takes the sender's first replica's
  (θ_m, b_m, Δ_m,prev) and applies the eager rule with K per round. Against
  `np_eager_join` after every round and after the drain (one or two replicas per host);
  with μ = 0, every replica after round t+1, the joiner's included, is at
  θ⁰ − η[Σ_{s≤t} Δ̄^(s) + Δ_m^(t+1)/K_t]."""
  params, batches = join_problem(9, replicas)
  inner = inner_config()
  starts = replica_starts(replicas)
  rule = outer_rule(diloco.Eager, mu, replicas)
  history, final, means, sent = drive_join(rule, params, batches, inner, replicas=replicas)
  expected, expected_final = np_eager_join(params, batches, inner, starts=starts, mu=mu)
  for got, want in zip(history, expected, strict=True):
    assert len(got) == len(want)
    for h, theta in zip(sorted(got), want):
      for n in params:
        np.testing.assert_allclose(got[h][n], theta[n], atol=1e-10, rtol=0)
  for h, theta in zip(sorted(final), expected_final, strict=True):
    for n in params:
      np.testing.assert_allclose(final[h][n], theta[n], atol=1e-10, rtol=0)
  if mu == 0.0:  # the telescoped form of §4, which the joiner reaches in its first round
    t = JOIN_STARTS[-1]  # the round index of round t+1
    past = {n: sum(means[s][0][n] for s in range(t)) for n in params}
    k_t = means[t - 1][1]
    for h, theta in history[t].items():
      for n in params:
        want = params[n] - LR * (past[n] + sent[t][h][n] / k_t)
        np.testing.assert_allclose(theta[n], want, atol=1e-10, rtol=0)
  _, alone = np_eager_join(params, batches, inner, starts=starts[:2 * replicas], mu=mu)
  mean = lambda thetas: {n: sum(th[n] for th in thetas) / len(thetas) for n in params}
  assert not np.allclose(mean(list(final.values()))["w"], mean(alone)["w"], atol=1e-6)
