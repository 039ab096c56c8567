"""MuLoCo: DiLoCo with Muon as the inner optimizer and 2-bit pseudo-gradients on the wire.

  python -m diloco_jax.prepare --tokenizer=train --vocab_size=4096 --eval_fraction=0.05 \
      --input="$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/*.py" \
      --output=/tmp/stdlib_bpe4k
  python launch/local.py --hosts=2 -- --config=configs/muloco.py --workdir=/tmp/muloco

configs/small_text.py's model and corpus (the first command), trained by Muon on the
blocks' weight matrices (AdamW on embeddings, norms, biases and the head; Thérien et al.
2025, "MuLoCo", arXiv 2505.23725), with each pseudo-gradient sent as 2 bits per entry
(four levels per block of 256, 0.066x of float32's bytes) and what 2 bits could not
carry fed back into the next round's (error feedback).
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

  config.inner.optimizer = "muon"
  config.inner.lr = 3e-3  # AdamW's, for the embeddings, norms, biases and head.
  config.inner.muon_lr = 0.02
  config.inner.warmup_steps = 50

  config.outer.compression = "2bit"
  config.outer.error_feedback = True
  return config
