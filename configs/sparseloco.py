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

import os
import runpy

# small_text.py's run (loaded by path: config files are not a package).
_SMALL_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_text.py")


def get_config():
  config = runpy.run_path(_SMALL_TEXT)["get_config"]()
  config.outer.compression = "chunk_topk"
  config.outer.topk_chunk = 4096
  config.outer.topk_fraction = 64 / 4096
  config.outer.topk_value_bits = 2
  config.outer.error_feedback = True
  config.outer.error_feedback_decay = 0.95
  config.outer.lr = 1.0
  config.outer.momentum = 0.0
  return config
