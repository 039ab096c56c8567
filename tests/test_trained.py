"""trained.load: the model a run evaluates, read back from its workdir in one process (what
sample and export start from). Every mode's final model is checked on the runs of the
resume tests (`same_params`); here, earlier checkpoints and workdirs without one."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax.data import pipeline as data_lib
from diloco_jax.readback import trained
from diloco_jax.loop import trainer
from diloco_jax.models import model as model_lib
from tests.multihost import small_config


def same_params(model: trained.Trained, result) -> None:
  """`model` holds the run's final params, in their tree: bit for bit, except eager's
  mean over K (there a sum on the wire / K, here numpy's mean). Called on the runs of
  other tests: every mode's resume test (tests/test_checkpoint.py) and ddp's."""
  assert model.finished and model.round == model.config.num_rounds
  assert jax.tree.structure(model.params) == jax.tree.structure(result.params)
  for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(result.params), strict=True):
    if model.config.mode == "eager":
      np.testing.assert_allclose(a, np.asarray(b), rtol=0, atol=1e-6)
    else:
      np.testing.assert_array_equal(a, np.asarray(b))


def test_an_earlier_checkpoint_and_bad_workdirs(tmp_path):
  config = small_config(num_rounds=3)
  config.checkpoint.keep = 5
  trainer.train_and_evaluate(config, str(tmp_path / "run"))
  second = trained.load(str(tmp_path / "run"), step=2)
  assert (second.round, second.finished) == (2, False)
  with pytest.raises(trained.LoadError, match=r"no checkpoint 7; there are \[1, 2, 3\]"):
    trained.load(str(tmp_path / "run"), step=7)
  with pytest.raises(trained.LoadError, match="no checkpoints/ directory; is it the --workdir"):
    trained.load(str(tmp_path / "nothing"))
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  with pytest.raises(trained.LoadError, match="no finished checkpoint yet"):
    trained.load(str(tmp_path / "empty"))


def eval_loss(model: trained.Trained) -> float:
  """The run's eval loss, recomputed from the loaded params on its eval batches."""
  c = model.config
  data = data_lib.make_host_data(c.data, seq_len=c.model.seq_len, batch_size=c.batch_size,
                                 replicas_per_host=c.replicas_per_host,
                                 num_eval_batches=c.eval_batches)
  loss_fn = jax.jit(model_lib.make_loss_fn(model.model))
  return float(np.mean([loss_fn(model.params, jnp.asarray(b)) for b in data.eval_batches]))


def final_eval_loss(workdir) -> float:
  from tests import multihost  # pylint: disable=import-outside-toplevel
  with open(multihost.host_dir(workdir) / "metrics.jsonl") as f:
    return [json.loads(line) for line in f][-1]["eval_loss"]
