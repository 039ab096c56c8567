"""A 1.1B-param Llama-style model (TinyLlama-1.1B's shapes) in bf16, one replica per host.

Shapes are TinyLlama-1.1B's (Zhang et al. 2024, arXiv 2401.02385), which OpenDiLoCo
(arXiv 2407.07852) also trained with DiLoCo at 1B: 22 blocks of width 2048, 32 query heads
sharing 4 key/value heads (grouped-query attention), SwiGLU width 5632, RoPE base 10000,
untied head, a 2048-token context. With a 32k vocabulary that is 1.10B params.

  python -m diloco_jax.train --config=configs/llama_1b.py --workdir=/ckpt/llama1b \
      --config.data.path=/data/corpus_spm32k

Per replica a step is 512 sequences of 2048 tokens (1M tokens), accumulated over 32
micro-batches of 16; each block's activations are recomputed in the backward pass
(`remat`) so that a replica fits one 80 GB GPU. The DiLoCo recipe is configs/gpt_150m.py's
(H=500, outer Nesterov lr 0.7, momentum 0.9; inner AdamW lr 4e-4 with 1,000 warmup steps).
The vocabulary is the corpus's; the parameter count and FLOPs per token are printed at
start. Every field is explained in diloco_jax/config.py.
"""

import os
import runpy

# The DiLoCo run of gpt_150m.py (loaded by path: config files are not a package).
_GPT_150M = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_150m.py")


def get_config():
  config = runpy.run_path(_GPT_150M)["get_config"]()
  config.grad_accum_steps = 32  # 16-sequence micro-batches of 2048 tokens.
  config.model.family = "llama"
  config.model.num_layers = 22
  config.model.d_model = 2048
  config.model.num_heads = 32
  config.model.num_kv_heads = 4
  config.model.mlp_dim = 5632
  config.model.rope_base = 10000.0
  config.model.seq_len = 2048
  config.model.remat = "block"
  config.model.dtype = "bfloat16"
  return config
