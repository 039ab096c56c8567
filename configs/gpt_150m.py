"""The DiLoCo paper's scale: a ≈150M-param GPT in bf16 compute, one replica per GPU host.

First prepare a corpus (once, on a machine with many cores; the output directory must be
readable by every host), then train on it:

  python -m diloco_jax.prepare --input='/data/corpus/*.jsonl.gz' --text_field=text \
      --tokenizer=/models/spm32k.model --workers=32 --output=/data/corpus_spm32k
  python -m diloco_jax.train --config=configs/gpt_150m.py --workdir=/ckpt/gpt150m \
      --config.data.path=/data/corpus_spm32k

The vocabulary is the corpus's: `config.data.vocab_size` is replaced by its manifest.json's
(32000 for a 32k SentencePiece model; `--tokenizer=train --vocab_size=32000` trains one on
the input instead), with a note at start when the two differ. For a smoke
test without data, add `--config.data.source=synthetic --config.data.vocab_size=1024
--config.data.markov_order=1`.

Hyperparameters follow DiLoCo (arXiv 2311.08105) Table 5: H=500, inner AdamW lr 4e-4 with
1,000 warmup steps and weight decay 0.1, batch 512 x 1024 tokens, outer Nesterov lr 0.7,
momentum 0.9. Every field is explained in diloco_jax/config.py.
"""

from diloco_jax import config as config_lib


def get_config():
  config = config_lib.get_default_config()
  config.mode = "sync"
  config.num_rounds = 176  # 176 x 500 = 88k inner steps, the paper's budget.
  config.inner_steps = 500  # H.
  config.replicas_per_host = 1  # One replica per GPU host; K = number of hosts.
  config.batch_size = 512  # Sequences per replica per inner step (the paper's batch).
  config.grad_accum_steps = 8  # 64-sequence micro-batches fit an 80 GB GPU comfortably.
  config.eval_every = 4  # Rounds between evaluations of the anchor.
  config.eval_batches = 4  # 4 x 512 held-out sequences.

  config.model.num_layers = 12
  config.model.d_model = 768
  config.model.num_heads = 12
  config.model.mlp_dim = 3072
  config.model.seq_len = 1024
  config.model.dtype = "bfloat16"  # Params stay float32; matmuls run in bf16.

  config.data.source = "prepared"
  config.data.path = ""  # Required: --config.data.path=DIR, the output of diloco_jax.prepare.
  config.data.vocab_size = 32000  # The manifest's replaces it (the tokenizer's).

  config.inner.lr = 4e-4
  config.inner.warmup_steps = 1000
  config.inner.final_lr_fraction = 0.1
  config.inner.weight_decay = 0.1
  config.inner.b2 = 0.95

  config.outer.lr = 0.7
  config.outer.momentum = 0.9
  config.outer.nesterov = True
  return config
