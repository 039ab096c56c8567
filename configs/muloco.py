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

import os
import runpy

# small_text.py's run (loaded by path: config files are not a package).
_SMALL_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_text.py")


def get_config():
  config = runpy.run_path(_SMALL_TEXT)["get_config"]()
  config.inner.optimizer = "muon"
  config.inner.muon_lr = 0.02  # inner.lr (3e-3) stays AdamW's, for embeddings, norms, head.
  config.outer.compression = "2bit"
  config.outer.error_feedback = True
  return config
