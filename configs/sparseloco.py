"""SparseLoCo: each round's pseudo-gradient sent as ~1.6% of its entries at 2 bits each.

  python -m diloco_jax.prepare --tokenizer=train --vocab_size=4096 --eval_fraction=0.05 \
      --input="$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/*.py" \
      --output=/tmp/stdlib_bpe4k
  python launch/local.py --hosts=2 -- --config=configs/sparseloco.py --workdir=/tmp/sparseloco

configs/small_text.py's model and corpus (the first command), with the wire of Sarfi,
Thérien, Lidin and Belilovsky 2025 ("SparseLoCo", arXiv 2508.15706): every host adds its
pseudo-gradient to an error-feedback accumulator decayed by β = 0.95, sends the 64 largest
entries of every chunk of 4096 (uint16 offsets, a sign and one magnitude bit each, two
float32 per chunk: 0.93% of float32's bytes), and keeps the rest in the accumulator. The
outer step is plain SGD on the mean with lr 1 and no momentum: the accumulator plays that
role.
"""

from diloco_jax import config as config_lib


def get_config():
  config = config_lib.get_default_config()
  config.mode = "sync"
  config.num_rounds = 20
  config.inner_steps = 25  # H.
  config.replicas_per_host = 2  # K = 2 replicas per host (4 on 2 hosts).
  config.batch_size = 16
  config.eval_every = 2
  config.eval_batches = 8

  config.model.num_layers = 2
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.mlp_dim = 512
  config.model.seq_len = 128

  config.data.source = "prepared"
  config.data.path = "/tmp/stdlib_bpe4k"  # The first command's --output.
  config.data.vocab_size = 4096  # Its manifest's (--vocab_size); the manifest's wins.

  config.inner.lr = 3e-3
  config.inner.warmup_steps = 50

  config.outer.compression = "chunk_topk"
  config.outer.topk_chunk = 4096
  config.outer.topk_fraction = 64 / 4096
  config.outer.topk_value_bits = 2
  config.outer.error_feedback = True
  config.outer.error_feedback_decay = 0.95
  config.outer.lr = 1.0
  config.outer.momentum = 0.0
  return config
