"""The default job: sync DiLoCo, 4 replicas on one host, a small GPT on synthetic data.

  python -m diloco_jax.train --config=configs/tiny.py --workdir=/tmp/diloco_tiny

About a minute on 2 CPU cores; ends near the loss floor. Every field is declared and
explained in diloco_jax/config.py; this file changes only what it names.
"""

from diloco_jax import config as config_lib


def get_config():
  config = config_lib.get_default_config()
  config.mode = "sync"
  config.num_rounds = 32  # 32 rounds x 25 inner steps = 800 steps per replica.
  config.inner_steps = 25  # H.
  config.replicas_per_host = 4  # K = 4 replicas, all on this host.
  config.batch_size = 16  # Sequences per replica per step.
  config.eval_batches = 8  # 8 x 16 held-out sequences per evaluation.

  config.model.num_layers = 2
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.mlp_dim = 256
  config.model.seq_len = 64

  config.data.source = "synthetic"  # Order-2 Markov chain with a known entropy rate.
  config.data.vocab_size = 16  # 256 contexts of 2 tokens: learnable in a minute on a CPU.
  config.data.branching = 3  # Each context has 3 likely successors (floor 0.94 nats).

  config.inner.lr = 3e-3
  config.inner.warmup_steps = 40
  return config
