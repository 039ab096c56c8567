"""What a run shows its user: grouped TensorBoard tags, the W&B writer, the profile
window, the ETA, the progress bar, the launcher's help."""

import glob
import gzip
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
from jax.profiler import ProfileData
from tensorboard.backend.event_processing import event_accumulator

from diloco_jax import config as config_lib
from diloco_jax.reporting import profiling
from diloco_jax.reporting import progress
from diloco_jax.reporting import roundlog
from diloco_jax.loop import trainer
from diloco_jax.reporting import writers
from tests.multihost import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_record_field_has_a_group():
  record = {field: 1.0 for field in writers.TAGS}
  record.update(round=3, tokens=100, inner_step=12, time=1.7e9, resumed=True,
                delta_norm=[0.5, 0.25], hosts_steps=[4, 8], anchor_hash="ab12")
  tags = writers.scalars(record)
  assert not [t for t in tags if t.startswith("other/")]
  assert {"train/loss", "eval/loss", "eval/floor", "comm/bytes_sent", "outer/d2h",
          "outer/time", "throughput/tokens_per_sec", "progress/eta",
          "checkpoint/blocking"} <= set(tags)
  assert tags["outer/delta_norm/replica_1"] == 0.25 and "outer/delta_norm" not in tags
  assert tags["hosts/steps/host_1"] == 8  # per-host lists: one tag per host
  # the x axis, the wall clock, flags and hashes are not plotted
  lists = ("delta_norm", "hosts_steps")
  assert set(tags) == {tag for field, tag in writers.TAGS.items() if field not in lists} | {
      "outer/delta_norm/replica_0", "outer/delta_norm/replica_1", "hosts/steps/host_0",
      "hosts/steps/host_1"}
  assert writers.scalars({"new_field": 2}) == {"other/new_field": 2.0}


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
  """One run of 4 rounds with W&B (offline) on and a profile of rounds 2-3."""
  workdir = str(tmp_path_factory.mktemp("observed"))
  config = small_config(**{"num_rounds": 4, "log.wandb_project": "diloco-jax-test",
                           "profile.start_round": 2, "profile.num_rounds": 2})
  return config, workdir, trainer.train_and_evaluate(config, workdir)


def test_tensorboard_tags_are_grouped_and_hold_the_records(observed_run):
  config, workdir, result = observed_run
  events = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"))
  events.Reload()
  tags = set(events.Tags()["scalars"])
  assert {"train/loss", "eval/loss", "throughput/tokens_per_sec", "outer/time",
          "progress/eta", "hosts/steps/host_0", "hosts/busy/host_0", "hosts/idle/host_0",
          "hosts/tokens/host_0"} <= tags
  assert all("/" in t and not t.startswith("other/") for t in tags), tags
  loss = events.Scalars("train/loss")
  assert [e.step for e in loss] == [r["tokens"] for r in result.records]
  assert [e.value for e in loss] == pytest.approx([r["train_loss"] for r in result.records])


def test_wandb_writes_its_offline_run_in_the_workdir(observed_run):
  _, workdir, _ = observed_run
  with open(os.path.join(workdir, "wandb", "run_id")) as f:
    run_id = f.read().strip()
  runs = glob.glob(os.path.join(workdir, "wandb", f"offline-run-*-{run_id}",
                                f"run-{run_id}.wandb"))
  assert len(runs) == 1, os.listdir(os.path.join(workdir, "wandb"))
  with open(runs[0], "rb") as f:
    logged = f.read()
  assert b"train/loss" in logged and b"outer/time" in logged


def test_profile_of_the_window_loads_with_the_profilers_reader(observed_run):
  config, workdir, _ = observed_run
  [path] = profiling.xplane_files(workdir)
  names = {}
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      for event in line.events:
        names[event.name] = names.get(event.name, 0) + 1
  assert names.get("round 2") == names.get("round 3") == 1 and "round 1" not in names
  assert names["inner_step"] == 2 * config.inner_steps
  assert names["outer_step"] == 2
  # the dispatch thread's job, named with its round
  assert names.get("cross-host sum of pseudo-gradients (round 2)") == 1
  perfetto = glob.glob(os.path.join(os.path.dirname(path), "perfetto_trace.json.gz"))
  with gzip.open(perfetto[0]) as f:
    assert json.load(f)["traceEvents"]


def test_eta_counts_steady_rounds_only(observed_run):
  _, _, result = observed_run
  # round 1 compiles and rounds 2-3 are profiled: round 4 is the first steady one
  assert ["eta" in r for r in result.records] == [False, False, False, True]
  clock = [0.0]
  log = roundlog.RoundLog(writers.MetricsWriter("", enabled=False),
                          progress.ProgressBar(40, enabled=False), num_rounds=10, inner_steps=4,
                          num_replicas=1, printing=False, tokens_per_round=100,
                          finish_estimate=lambda: 0.5,  # the last checkpoint's write
                          clock=lambda: clock[0])
  # (round, its own time, when it ended): 1 compiles, 4 is profiled; from one round's end
  # to the next are 2, 4, (100), 3 seconds (saves included)
  for r, seconds, end in ((1, 29.0, 30.0), (2, 1.5, 32.0), (3, 3.5, 36.0), (4, 99.0, 136.0),
                          (5, 2.5, 139.0)):
    clock[0] = end
    log.open(r)
    log.timed(r, seconds, steady=r != 4)
  records = {r: log.figures(r) for r in range(1, 6)}  # the figures as the rounds ended
  assert "eta" not in records[1]
  assert records[2]["eta"] == pytest.approx(2.0 * 8 + 0.5)
  assert records[3]["eta"] == pytest.approx(3.0 * 7 + 0.5)
  assert records[4]["eta"] == pytest.approx(3.0 * 6 + 0.5)
  assert records[5]["eta"] == pytest.approx(3.0 * 5 + 0.5)
  assert records[5]["elapsed"] == pytest.approx(29 + 1.5 + 3.5 + 99 + 2.5)
  # written one round late: what passed since the round ended is taken off
  for record in records.values():
    record["loss_sum"] = 4.0
  clock[0] = 140.0
  log.write_through(5)
  assert log.writer.records[-1]["eta"] == pytest.approx(3.0 * 5 + 0.5 - 1.0)


def test_progress_bar_draws_on_a_terminal_only():
  class Terminal(io.StringIO):
    def isatty(self):
      return True

  terminal, pipe = Terminal(), io.StringIO()
  for stream in (terminal, pipe):
    bar = progress.ProgressBar(40, stream=stream)
    bar.update(10, "round 1/4")
    bar.close()
  assert "10/40" in terminal.getvalue() and "round 1/4" in terminal.getvalue()
  assert pipe.getvalue() == ""


@pytest.mark.parametrize("field, value, message", [
    ("log.wandb_mode", "cloud", "config.log.wandb_mode = 'cloud': must be one of"),
    ("profile.start_round", 5, "config.profile.start_round = 5: must be in [0, num_rounds"),
    ("profile.num_rounds", 0, "config.profile.num_rounds = 0: must be >= 1"),
])
def test_bad_reporting_fields_are_named(field, value, message):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(small_config(**{field: value}))
  assert message in str(e.value)


def test_wandb_project_without_wandb_installed_is_refused(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(config_lib.ConfigError, match=r"pip install 'diloco_jax\[wandb\]'"):
    config_lib.validate(small_config(**{"log.wandb_project": "p"}))


def test_local_launcher_help_shows_where_the_trainer_flags_go():
  def launch(*args):
    return subprocess.run([sys.executable, "launch/local.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)

  shown = launch("--help")
  assert shown.returncode == 0
  assert "python launch/local.py --hosts=4 -- --config=configs/tiny.py" in shown.stdout
  for args in (["--hosts=2", "--config=configs/tiny.py"], ["--hosts=2"]):
    wrong = launch(*args)
    assert wrong.returncode == 2 and "after `--`" in wrong.stderr, wrong.stderr


def test_round_line_shows_the_slowest_and_fastest_hosts_steps_when_they_differ():
  record = dict(round=3, inner_step=75, train_loss=1.0, tokens_per_sec=1e3, outer_time=0.01)
  assert "steps/host" not in roundlog.round_line({**record, "hosts_steps": [25, 25]}, 10, 250)
  line = roundlog.round_line({**record, "hosts_steps": [50, 25, 47]}, 10, 250)
  assert "| steps/host 25-50 |" in line
