"""A synthetic source with a known floor: sequences of a sparse Markov chain over token ids,
whose exact expected loss under the true model (the floor) and best unigram loss are
computed from the chain itself."""

from __future__ import annotations

import numpy as np

# A little uniform probability in every context keeps the chain ergodic (a unique
# stationary distribution) while the transitions stay sparse.
UNIFORM_MIX = 0.01


def markov_chain(vocab_size: int, order: int, branching: int, seed: int) -> np.ndarray:
  """Transition table P[context, next] with V**order contexts; context = Σ x_i V^(order-1-i)."""
  rng = np.random.default_rng(seed)
  num_contexts = vocab_size ** order
  probs = np.zeros((num_contexts, vocab_size))
  successors = np.argsort(rng.random((num_contexts, vocab_size)), axis=1)[:, :branching]
  weights = rng.dirichlet(np.ones(branching), size=num_contexts)
  np.put_along_axis(probs, successors, weights, axis=1)
  return (1 - UNIFORM_MIX) * probs + UNIFORM_MIX / vocab_size


def _context_transition(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """For each context and next token, the index of the following context."""
  c, v = probs.shape
  return (np.arange(c)[:, None] * v) % c + np.arange(v)[None, :], np.arange(c)


def stationary_distribution(probs: np.ndarray, tol: float = 1e-15) -> np.ndarray:
  """The stationary distribution over contexts, by power iteration to machine precision."""
  nxt, _ = _context_transition(probs)
  pi = np.full(probs.shape[0], 1.0 / probs.shape[0])
  for _ in range(100_000):
    new = np.bincount(nxt.ravel(), weights=(pi[:, None] * probs).ravel(),
                      minlength=probs.shape[0])
    if np.abs(new - pi).max() < tol:
      return new
    pi = new
  raise RuntimeError("Markov chain: stationary distribution did not converge")


def entropy(p: np.ndarray, axis=-1) -> np.ndarray:
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=axis)


def entropy_rate(probs: np.ndarray, pi: np.ndarray) -> float:
  """h = Σ_c π(c) H(P[c, :]) in nats per token."""
  return float(pi @ entropy(probs))


def loss_floor(probs: np.ndarray, order: int, seq_len: int) -> float:
  """Expected per-token loss of the true conditional on targets 1..L of a sequence whose
  first `order` tokens are a stationary sample: early targets see fewer than `order`
  tokens of context, so they cost H(x_j | x_<j) > h."""
  v = probs.shape[1]
  pi = stationary_distribution(probs)
  joint = pi.reshape((v,) * order)  # stationary law of `order` consecutive tokens
  # H(x_j | x_<j) = H(x_0..x_j) − H(x_0..x_{j−1}) for j = 1 .. order−1.
  cond = [entropy(joint.sum(axis=tuple(range(j + 1, order))).ravel())
          - entropy(joint.sum(axis=tuple(range(j, order))).ravel()) for j in range(1, order)]
  h = entropy_rate(probs, pi)
  early = cond[:seq_len]
  return float((sum(early) + (seq_len - len(early)) * h) / seq_len)


def unigram_loss_of_chain(probs: np.ndarray) -> float:
  v = probs.shape[1]
  marginal = stationary_distribution(probs).reshape(v, -1).sum(axis=1)
  return float(entropy(marginal))


def sample_sequences(probs: np.ndarray, order: int, num: int, length: int,
                     seed: int) -> np.ndarray:
  """`num` sequences of `length` tokens, vectorised over sequences, stationary start."""
  c, v = probs.shape
  rng = np.random.default_rng(seed)
  pi = stationary_distribution(probs)
  ctx = np.searchsorted(np.cumsum(pi), rng.random(num) * np.cumsum(pi)[-1], side="right")
  ctx = np.minimum(ctx, c - 1)
  out = np.empty((num, length), np.int32)
  for i in range(order):  # Unpack the starting context into its tokens.
    out[:, i] = (ctx // v ** (order - 1 - i)) % v
  cdf = np.cumsum(probs, axis=1)
  for t in range(order, length):
    u = rng.random(num) * cdf[ctx, -1]
    tok = np.minimum((cdf[ctx] < u[:, None]).sum(axis=1), v - 1)
    out[:, t] = tok
    ctx = (ctx * v) % c + tok
  return out
