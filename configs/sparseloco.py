"""SparseLoCo: each round's pseudo-gradient sent as 6.25% of its entries at 2 bits each.

  python -m diloco_jax.prepare --tokenizer=train --vocab_size=4096 --eval_fraction=0.05 \
      --input="$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/*.py" \
      --output=/tmp/stdlib_bpe4k
  python launch/local.py --hosts=2 -- --config=configs/sparseloco.py --workdir=/tmp/sparseloco

configs/small_text.py's model and corpus (the first command), with the wire of Sarfi,
Thérien, Lidin and Belilovsky 2025 ("SparseLoCo", arXiv 2508.15706): every host adds its
pseudo-gradient to an error-feedback accumulator decayed by β = 0.95, sends the 256 largest
entries of every chunk of 4096 (uint16 offsets, a sign and one magnitude bit each, two
float32 per chunk: 3.6% of float32's bytes), and keeps the rest in the accumulator. The
outer step is plain SGD on the mean with no momentum: the accumulator plays that role.

Density and lr are bench/quality.py's sweep's (K = 4, 20 rounds of H = 24): 64 of 4096
(the paper's 1.6%) ended 10.9% above sync DiLoCo, since what is not sent waits rounds in
the accumulator; 256 of 4096 at lr 1, 2.5%; at lr 2 (plain SGD moving about what sync's
momentum moves), 0.4%; at 60 rounds 0.2% below sync with its tuned outer step (2.4% above
it on the whole standard library tree, 6.7x the text: bench/quality.py --stdlib=tree).
"""

import os
import runpy

# small_text.py's run (loaded by path: config files are not a package).
_SMALL_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_text.py")


def get_config():
  config = runpy.run_path(_SMALL_TEXT)["get_config"]()
  config.outer.compression = "chunk_topk"
  config.outer.topk_chunk = 4096
  config.outer.topk_fraction = 256 / 4096
  config.outer.topk_value_bits = 2
  config.outer.error_feedback = True
  config.outer.error_feedback_decay = 0.95
  config.outer.lr = 2.0
  config.outer.momentum = 0.0
  return config
