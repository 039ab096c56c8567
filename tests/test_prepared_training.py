"""Training on prepared corpora (data.source = "prepared"): the eval loss falls and bits per
byte are reported, a preempted or SIGKILLed run resumes bit-identically (the data
iterators' state is in the checkpoint), and `python -m diloco_jax.prepare` then training,
for every input format and tokenizer. The pipeline's reading: tests/test_prepared_data.py."""

import json
import math
import os
import random
import re
import signal
import sys
import time

import jax
import numpy as np
import pytest

from diloco_jax.checkpoints import store
from diloco_jax.loop import trainer
from diloco_jax.models import exported
from diloco_jax.models import family as family_lib
from diloco_jax.models import model as model_lib
from diloco_jax.runtime import preemption
from tests import multihost
from tests.prepared_dirs import SEQ_LEN
from tests.prepared_dirs import VOCAB
from tests.prepared_dirs import data_config
from tests.prepared_dirs import draw
from tests.prepared_dirs import host_data
from tests.prepared_dirs import tags
from tests.prepared_dirs import train_config


def test_trainer_trains_on_prepared_data(prepared, tmp_path, capsys):
  config = train_config(prepared, num_rounds=4, **{"inner.lr": 1e-2})
  result = trainer.train_and_evaluate(config, str(tmp_path))
  evals = [r["eval_loss"] for r in result.records]
  assert evals[-1] < evals[0] - 0.3, evals
  bpt = result.records[0]["train_loss"] / result.records[0]["train_bpb"] / math.log(2)
  assert bpt == pytest.approx(host_data(data_config(prepared)).spec.bytes_per_token["train"])
  assert all("train_bpb" in r and "eval_bpb" in r for r in result.records)
  out = capsys.readouterr().out
  assert re.search(r"train \d+\.\d{4} \(\d\.\d{3} bpb\) \| eval \d+\.\d{4} \(\d\.\d{3} bpb\)",
                   out), out[-2000:]
  assert "bits/byte" in out.splitlines()[-1]
  with open(tmp_path / "metrics.jsonl") as f:
    assert all("eval_bpb" in json.loads(line) for line in f)
  assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_preempted_run_resumes_bit_identically(prepared, tmp_path, monkeypatch, capsys):
  """Stop after round 2 of 4, run again: the same params and records as a run never
  stopped (the data iterators' state is in the checkpoint). The second run resumed from
  checkpoint 2: a silent start from round 1 would reproduce the reference too."""
  config = train_config(prepared, num_rounds=4, **{"checkpoint.every": 0})
  reference = trainer.train_and_evaluate(config, str(tmp_path / "ref"))
  with monkeypatch.context() as m:
    m.setattr(preemption.Preemption, "reached", lambda self, r: r == 2)
    first = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert first.preempted_at == 2
  capsys.readouterr()
  resumed = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  out = capsys.readouterr().out
  assert "resumed from checkpoint 2 (" in out and "continuing at round 3 of 4" in out, out
  assert re.findall(r"^round +(\d+)/4 ", out, re.M) == ["3", "4"], out  # not 1 and 2 again
  with open(tmp_path / "run" / "run.json") as f:
    assert json.load(f)["start"]["round"] == 2
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(reference.params),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  keys = ("round", "train_loss", "eval_loss", "train_bpb", "eval_bpb")
  assert ([[r[k] for k in keys] for r in resumed.records]
          == [[r[k] for k in keys] for r in reference.records])


# A pretrained model of its own shape, and a vocabulary of 3 more tokens than the corpus's.
GPT2 = family_lib.ModelConfig(vocab_size=VOCAB + 3, seq_len=16, num_layers=2, d_model=32,
                             num_heads=2, mlp_dim=64, family="gpt", tie_embeddings=True)


def pretrained_gpt(directory) -> str:
  """A GPT2LMHeadModel directory of GPT2's shape (Hugging Face's layout, by our export)."""
  params = model_lib.init_params(GPT2, jax.random.key(7))
  exported.write(os.path.join(directory, "model.safetensors"), GPT2, params)
  return str(directory)


def launch(workdir, path, max_restarts=0, init_from=None):
  return multihost.start([
      sys.executable, "launch/local.py", "--hosts=2", f"--max_restarts={max_restarts}", "--",
      f"--workdir={workdir}", "--config=configs/tiny.py", "--config.replicas_per_host=1",
      "--config.num_rounds=8", "--config.inner_steps=5", "--config.inner.warmup_steps=5",
      "--config.batch_size=4", "--config.model.seq_len=16", "--config.eval_batches=2",
      "--config.data.source=prepared", f"--config.data.path={path}",
      f"--config.data.vocab_size={VOCAB}", "--config.debug_checks=True",
      *([f"--config.model.init_from={init_from}"] if init_from else []),
      "--heartbeat_timeout=20"])


def host_pid(launcher, host: int) -> int:
  for pid in multihost.children(launcher.pid):
    with open(f"/proc/{pid}/cmdline") as f:
      if f"--host_id={host}" in f.read().replace("\0", " "):
        return pid
  raise AssertionError(f"host {host} not running")


def records(workdir):
  with open(os.path.join(multihost.host_dir(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.multihost
def test_sigkill_restart_resumes_bit_identically(prepared, tmp_path):
  """Host 1 killed (SIGKILL) after checkpoint 3 of a 2-host run started from a pretrained
  model (config.model.init_from, its own shape); the launcher restarts both, which resume
  and end where an uninterrupted run ends, anchor hashes included (compared across hosts
  after every round, the first too: debug_checks)."""
  model = pretrained_gpt(tmp_path / "gpt")
  text = launch(tmp_path / "ref", prepared, init_from=model).communicate(timeout=300)[0]
  assert "final eval loss" in text, text[-4000:]
  assert f"config.model.init_from = {model}: from its config.json, vocab_size 0 -> 260" in text
  with open(multihost.host_dir(tmp_path / "ref") / "run.json") as f:
    run = json.load(f)
  assert run["init_from"]["path"] == model
  assert run["num_params"] == model_lib.num_params_of(GPT2)
  launcher = launch(tmp_path / "run", prepared, max_restarts=1, init_from=model)
  ckpts = lambda: multihost.host_dir(tmp_path / "run") / store.CHECKPOINTS  # noqa: E731
  deadline = time.monotonic() + 180
  while not (ckpts().is_dir() and any(d.isdigit() and int(d) >= 3 for d in os.listdir(ckpts()))):
    assert launcher.poll() is None and time.monotonic() < deadline, \
        launcher.communicate()[0][-4000:]
    time.sleep(0.05)
  time.sleep(random.uniform(0, 0.3))
  os.remove(os.path.join(model, "model.safetensors"))  # a resumed run reads only config.json
  os.kill(host_pid(launcher, 1), signal.SIGKILL)
  text = launcher.communicate(timeout=300)[0]
  assert launcher.returncode == 0, text[-4000:]
  assert "restart 1/1" in text and "resumed from checkpoint" in text, text[-4000:]
  assert f"config.model.init_from = {model}: its weights are not used" in text
  got, want = records(tmp_path / "run"), records(tmp_path / "ref")
  assert [r["round"] for r in got] == list(range(1, 9))
  for key in ("anchor_hash", "train_loss", "eval_loss", "train_bpb", "eval_bpb"):
    assert [r.get(key) for r in got] == [r.get(key) for r in want], key


@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("train", marks=pytest.mark.slow)])
def test_through_prepare(tmp_path, documents, tokenizer):
  """`python -m diloco_jax.prepare` on a JSONL of the tagged documents (small shards, so
  replicas take blocks of several): 2 hosts x 2 replicas on disjoint documents, none of
  them drawn for eval by prepare, eval batches from those; training lowers the eval loss."""
  with open(tmp_path / "corpus.jsonl", "w") as f:
    f.writelines(json.dumps({"text": d}) + "\n" for d in documents[0] + documents[1])
  out = tmp_path / "prepared"
  options = [f"--tokenizer={tokenizer}", "--workers=0", "--shard_tokens=8000",
             "--eval_fraction=0.15", *(["--vocab_size=320"] if tokenizer == "train" else [])]
  proc = multihost.start([sys.executable, "-m", "diloco_jax.prepare",
                          f"--input={tmp_path / 'corpus.jsonl'}", f"--output={out}", *options])
  text = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, text[-3000:]
  manifest = json.loads((out / "manifest.json").read_text())
  assert len(manifest["splits"]["train"]["shards"]) > 2
  decode = None  # bytes
  if tokenizer == "train":
    import tokenizers  # prepare's dependency, needed here only
    decoder = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    def decode(w):
      return decoder.decode([int(t) for t in w]).encode()
  c = data_config(str(out), vocab_size=manifest["vocab_size"])
  hosts = [host_data(c, host_index=h, num_hosts=2) for h in range(2)]
  seen = [tags(w, decode) for w in draw(hosts, 100)]
  eval_split = np.concatenate([np.fromfile(out / s["file"], manifest["dtype"])
                               for s in manifest["splits"]["eval"]["shards"]])
  held_out = tags([eval_split], decode)  # prepare's draw: every eval document
  assert held_out and tags(hosts[0].eval_batches.reshape(-1, SEQ_LEN + 1), decode) <= held_out
  for a in range(4):
    assert seen[a] and not seen[a] & held_out
    for b in range(a + 1, 4):
      assert not seen[a] & seen[b]
  config = train_config(str(out), num_rounds=4, **{"inner.lr": 1e-2,
                                                   "data.vocab_size": manifest["vocab_size"]})
  result = trainer.train_and_evaluate(config, str(tmp_path / "work"))
  evals = [r["eval_loss"] for r in result.records]
  assert evals[-1] < evals[0] - 0.3, evals
  assert all(r["eval_bpb"] > 0 for r in result.records)


@pytest.mark.parametrize("fmt, tokenizer", [("parquet", "bytes"), ("save_to_disk", "bytes"),
                                             ("jsonl.gz", "tokenizer.json"),
                                             pytest.param("txt", "sentencepiece",
                                                          marks=pytest.mark.slow)])
def test_trains_on_every_input_format_and_tokenizer(tmp_path, fmt, tokenizer):
  """prepare, then train, for each kind of input and of tokenizer file: the eval loss falls
  (tests/test_prepare.py checks the corpora themselves, token by token)."""
  from tests import corpora as tp
  texts = tp.make_texts(400, seed=5)
  option = "--tokenizer=bytes"
  if tokenizer == "tokenizer.json":  # a BPE trained on other text, as a user's own file
    assert tp.run(f"--input={tp.write_jsonl(tmp_path / 'o.jsonl', tp.make_texts(200))}",
                  f"--output={tmp_path / 'bpe'}", "--tokenizer=train",
                  "--vocab_size=320") == 0
    option = f"--tokenizer={tmp_path / 'bpe' / 'tokenizer.json'}"
  elif tokenizer == "sentencepiece":
    import sentencepiece as spm
    lines = [line for t in tp.make_texts(200) for line in t.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), eos_id=2, minloglevel=2,
                                   model_prefix=str(tmp_path / "spm"), vocab_size=80)
    option = f"--tokenizer={tmp_path / 'spm.model'}"
  source = tp.WRITERS[fmt](tmp_path, texts)
  out = tmp_path / "prepared"
  assert tp.run(f"--input={source}", f"--output={out}", option, "--eval_fraction=0.1",
                "--workers=0") == 0
  vocab = json.loads((out / "manifest.json").read_text())["vocab_size"]
  config = train_config(str(out), num_rounds=4, **{"inner.lr": 1e-2, "data.vocab_size": vocab})
  result = trainer.train_and_evaluate(config, str(tmp_path / "work"))
  evals = [r["eval_loss"] for r in result.records]
  assert evals[-1] < evals[0] - 0.3, evals
