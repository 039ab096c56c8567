"""The side-by-side with torchft's DiLoCo (bench/peer.py): a 3.3M-param byte-level GPT.

  mkdir -p /tmp/stdlib_py && ln -sf "$(python -c \
      'import sysconfig; print(sysconfig.get_path("stdlib"))')"/*.py /tmp/stdlib_py/
  python launch/local.py --hosts=2 -- --config=configs/peer.py --workdir=/tmp/peer \
      --config.data.path=/tmp/stdlib_py

Two hosts with one replica each (K = 2), H = 50. The model is the one bench/peer.py builds
in PyTorch for torchft: vocab 256 (bytes), width 256, 4 blocks of 4 heads, MLP 1024 (GELU),
128 tokens, learned positions, pre-norm LayerNorm, untied head and no biases anywhere:
3,311,872 params on both sides. The data is the ~170 top-level modules of CPython's
standard library (4.7 MB); `config.data.path` has no default, since the stdlib directory
itself also holds its tests and site-packages (about 1 GB): the first command makes a
directory of links to the top-level modules, as bench/peer.py does. The inner lr is
constant (no warmup, no decay), as in the torch loop; there is no eval or checkpoint until
the last round, so that rounds time training alone.
"""

from diloco_jax import config as config_lib


def get_config():
  config = config_lib.get_default_config()
  config.mode = "sync"
  config.num_rounds = 4  # bench/peer.py sets its --rounds.
  config.inner_steps = 50  # H.
  config.replicas_per_host = 1  # One replica per host process; K = hosts.
  config.batch_size = 8
  config.eval_every = 1_000_000  # Evaluate after the last round only.
  config.eval_batches = 1
  config.checkpoint.every = 0  # Write a checkpoint after the last round only.

  config.model.family = "gpt"
  config.model.num_layers = 4
  config.model.d_model = 256
  config.model.num_heads = 4
  config.model.mlp_dim = 1024
  config.model.seq_len = 128
  config.model.tie_embeddings = False
  config.model.use_bias = False

  config.data.source = "text"  # A token per byte.
  config.data.vocab_size = 256
  config.data.path = ""  # Required: a text file or directory (see above).

  config.inner.lr = 1e-3
  config.inner.warmup_steps = 0  # Constant lr: warmup 0 and cosine decay to 1.0 x lr.
  config.inner.final_lr_fraction = 1.0
  config.inner.weight_decay = 0.1
  config.inner.b1 = 0.9
  config.inner.b2 = 0.95
  config.inner.clip_norm = 1.0  # The torch loop clips the same way.

  config.outer.lr = 0.7
  config.outer.momentum = 0.9
  config.outer.nesterov = True
  return config
