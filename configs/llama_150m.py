"""A ≈125M-param Llama-style model (SmolLM-135M's shapes) in bf16, one replica per GPU host.

Shapes are those of SmolLM-135M (Hugging Face, HuggingFaceTB/SmolLM-135M, 2024): 30
blocks of width 576, 9 query heads sharing 3 key/value heads (grouped-query attention),
SwiGLU width 1536, tied embeddings, RoPE base 10000. With a 32k vocabulary that is 125M
params (SmolLM's own 49k vocabulary makes it 135M). The context is 1024 tokens, and the
training recipe is configs/gpt_150m.py's (DiLoCo, arXiv 2311.08105, Table 5), so the two
families can be compared at about the same size and budget.

  python -m diloco_jax.prepare --input='/data/corpus/*.jsonl.gz' --text_field=text \
      --tokenizer=/models/spm32k.model --workers=32 --output=/data/corpus_spm32k
  python -m diloco_jax.train --config=configs/llama_150m.py --workdir=/ckpt/llama150m \
      --config.data.path=/data/corpus_spm32k

The vocabulary is the corpus's (its manifest.json replaces `config.data.vocab_size`). The
parameter count and FLOPs per token are printed at start. Every field is explained in
diloco_jax/config.py.
"""

import os
import runpy

# The DiLoCo run of gpt_150m.py (loaded by path: config files are not a package).
_GPT_150M = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_150m.py")


def get_config():
  config = runpy.run_path(_GPT_150M)["get_config"]()  # rounds, H, batch, optimizers, data
  config.model.family = "llama"
  config.model.num_layers = 30
  config.model.d_model = 576
  config.model.num_heads = 9
  config.model.num_kv_heads = 3
  config.model.mlp_dim = 1536
  config.model.tie_embeddings = True
  config.model.rope_base = 10000.0
  config.model.seq_len = 1024
  config.model.dtype = "bfloat16"  # Params stay float32; matmuls run in bf16.
  return config
