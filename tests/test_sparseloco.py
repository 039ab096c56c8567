"""SparseLoCo's wire (chunk top-k, 2-bit values, a decayed error-feedback accumulator)
against an independent numpy implementation in float64, over several rounds, on one host
and on two host processes (tests/wire_main.py)."""

import json
import sys

import numpy as np
import pytest

from diloco_jax.algo import compress
from tests import multihost
from tests.wire_main import wire_deltas

SIZE, CHUNK, K_PER_CHUNK, ROUNDS, BETA = 1000, 64, 4, 4, 0.9
OUTER = {"compression": "chunk_topk", "topk_chunk": CHUNK, "topk_fraction": K_PER_CHUNK / CHUNK,
         "topk_value_bits": 2, "error_feedback": True, "error_feedback_decay": BETA}


def np_chunk_topk_2bit(x):
  """Per chunk of CHUNK entries (the last zero-padded): the K_PER_CHUNK largest |x| kept
  (a full sort), each non-zero one as its sign and the middle of its half of [min, max]
  of the kept non-zero magnitudes; kept zeros stay 0."""
  out = np.zeros(-(-x.size // CHUNK) * CHUNK)
  padded = np.concatenate([x, np.zeros(out.size - x.size)])
  for start in range(0, out.size, CHUNK):
    chunk = padded[start:start + CHUNK]
    keep = np.argsort(-np.abs(chunk), kind="stable")[:K_PER_CHUNK]
    keep = keep[chunk[keep] != 0]
    if not keep.size:
      continue
    mag = np.abs(chunk[keep])
    lo, hi = mag.min(), mag.max()
    width = (hi - lo) / 2
    half = np.zeros(mag.size) if width == 0 else np.minimum(np.floor((mag - lo) / width), 1)
    out[start + keep] = np.sign(chunk[keep]) * (lo + (half + 0.5) * width)
  return out[:x.size]


def np_sparseloco(num_hosts, replicas_per_host):
  """Each host: e <- beta e + sum of its replicas' deltas; sends Q(e); e <- e - Q(e).
  The mean: the sum of every host's Q(e) over K replicas. Returns means and residuals
  [rounds, hosts, SIZE]."""
  k = num_hosts * replicas_per_host
  e = np.zeros((num_hosts, SIZE))
  means, residuals = [], []
  for t in range(1, ROUNDS + 1):
    sent = []
    for h in range(num_hosts):
      e[h] = BETA * e[h] + sum(wire_deltas(h, m, t, SIZE).astype(np.float64)
                               for m in range(replicas_per_host))
      sent.append(np_chunk_topk_2bit(e[h]))
      e[h] -= sent[-1]
    means.append(sum(sent) / k)
    residuals.append(e.copy())
  return np.stack(means), np.stack(residuals)


def run_wire(tmp_path, num_hosts, replicas_per_host):
  spec = json.dumps({"outer": OUTER, "replicas_per_host": replicas_per_host, "size": SIZE,
                     "rounds": ROUNDS})
  port = multihost.free_port()
  procs = [multihost.start([sys.executable, "tests/wire_main.py", str(tmp_path), str(h),
                            str(num_hosts), str(port), spec]) for h in range(num_hosts)]
  for code, text in multihost.finish(procs, timeout=120):
    assert code == 0, text[-3000:]
  return [np.load(tmp_path / f"wire{h}.npz") for h in range(num_hosts)]


@pytest.mark.parametrize("num_hosts,replicas_per_host",
                         [(1, 2), pytest.param(2, 1, marks=pytest.mark.multihost)])
def test_accumulator_and_chunk_topk_equal_numpy(tmp_path, num_hosts, replicas_per_host):
  hosts = run_wire(tmp_path, num_hosts, replicas_per_host)
  want_means, want_residuals = np_sparseloco(num_hosts, replicas_per_host)
  for h, got in enumerate(hosts):
    # float32 against float64: the same entries kept and the same levels chosen.
    np.testing.assert_allclose(got["means"], want_means, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got["residuals"][:, 0], want_residuals[:, h], rtol=2e-5,
                               atol=1e-5)
    assert (np.count_nonzero(got["means"], axis=1)
            <= num_hosts * K_PER_CHUNK * -(-SIZE // CHUNK)).all()
  for other in hosts[1:]:  # every host holds the same mean, bit for bit
    np.testing.assert_array_equal(other["means"], hosts[0]["means"])
  if num_hosts == 2:  # an all-gather of one message: offsets, 2-bit codes, [lo, hi]
    chunks = -(-SIZE // CHUNK)
    message = 2 * K_PER_CHUNK * chunks + K_PER_CHUNK * chunks // 4 + 8 * chunks
    small = 4 + 4 * num_hosts  # the loss and the K bad-replica flags, summed alongside
    assert hosts[0]["sent"].tolist() == [message + small] * ROUNDS


def test_chunk_topk_round_trip():
  """The encoding alone: the kept entries and signs, the error bound of the levels, and
  the bytes of every value width."""
  x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
  for bits in compress.VALUE_BITS:
    options = dict(topk_fraction=1 / 64, topk_chunk=4096, value_bits=bits)
    enc = compress.encode(x, "chunk_topk", **options)
    y = compress.decode(enc, **options)
    kept = y != 0
    assert kept.sum() == 2 * 64 and (np.sign(y[kept]) == np.sign(x[kept])).all()
    for start in (0, 4096):
      chunk, got = x[start:start + 4096], y[start:start + 4096]
      mag = np.abs(chunk[got != 0])
      assert mag.min() >= np.sort(np.abs(chunk))[-64]  # the 64 largest
      bound = 0 if bits == 32 else (mag.max() - mag.min()) / 2 ** bits * (1 + 1e-5)
      assert np.abs(got[got != 0] - chunk[got != 0]).max() <= bound
    values = {2: 2 * 64 // 8, 4: 4 * 64 // 8, 32: 4 * 64}[bits]
    assert enc.nbytes == 2 * (2 * 64 + values + (0 if bits == 32 else 8))



@pytest.mark.parametrize("bits", [2, 4])
def test_chunk_topk_sends_zeros_as_zeros(bits):
  """A chunk with fewer non-zeros than k: the zeros top-k has to keep decode to exact 0,
  the non-zeros are quantized over their own [lo, hi] = [1, 3], and the bytes are those
  of a full chunk. The second chunk is all zeros and the third is zero-padded."""
  chunk = 64
  options = dict(topk_fraction=6 / chunk, topk_chunk=chunk, value_bits=bits)
  x = np.zeros(2 * chunk + 10, np.float32)
  x[:2] = [3, -1]
  x[2 * chunk + 4] = 0.5
  enc = compress.encode(x, "chunk_topk", **options)
  y = compress.decode(enc, **options)
  width = 2 / 2 ** (bits - 1)  # (hi − lo) / levels
  # 3 is in the top cell, 1 in the bottom one: each decodes to its cell's midpoint.
  want = np.zeros_like(x)
  want[:2] = [1 + (2 ** (bits - 1) - 0.5) * width, -(1 + 0.5 * width)]
  want[2 * chunk + 4] = 0.5  # alone in its chunk: lo = hi, sent exactly
  np.testing.assert_array_equal(y, want)
  # As many slots as a chunk with no zeros: uint16 offsets, packed codes, [lo, hi].
  assert enc.nbytes == 3 * (2 * 6 + 8) + -(-3 * 6 * bits // 8)
