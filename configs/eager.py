"""Async DiLoCo with eager updates on configs/small_text.py's model and corpus.

  python -m diloco_jax.prepare --tokenizer=train --vocab_size=4096 --eval_fraction=0.05 \
      --input="$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/*.py" \
      --output=/tmp/stdlib_bpe4k
  python launch/local.py --hosts=2 -- --config=configs/eager.py --workdir=/tmp/eager

Each round's cross-host mean runs on the dispatch thread while the next inner phase
trains, and each replica applies its own fresh pseudo-gradient at once and the others' a
round late (Kale et al. 2025). The stale half is amplified by the outer momentum, so
eager wants a smaller outer step than sync: in bench/quality.py's sweep (K = 4, 20 rounds
of H = 24) lr 0.7 with Nesterov 0.3 was eager's best (0.5: +1.5%, 0.7: +4.8%, lr 1.0:
+4.5%); at 60 rounds it ended 2.7% above sync with sync's own tuned step (6.4% above on
the whole standard library tree, 6.7x the text: bench/quality.py --stdlib=tree).
"""

import os
import runpy

# small_text.py's run (loaded by path: config files are not a package).
_SMALL_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_text.py")


def get_config():
  config = runpy.run_path(_SMALL_TEXT)["get_config"]()
  config.mode = "eager"
  config.outer.lr = 0.7
  config.outer.momentum = 0.3
  return config
