"""The benches of one job's speed, memory, bytes and quality still run: each one's `--smoke`
end to end (tests/benches.py), and what a full run writes."""

import math
import os

import pytest

from tests import benches
from tests.benches import has

# The keys a full run writes: at the top of the JSON, in "config", in every row.
CHECKPOINT_KEYS = {
    "anchor_bit_exact", "blocking_over_round", "checkpoint_mb", "config", "cpu_count",
    "device", "diloco_jax", "full_over_round", "jax", "orbax_checkpoint", "params",
    "restore_seconds", "restored_round", "round_seconds", "round_with_write_behind_seconds",
    "rounds", "save_blocking_seconds", "save_call_wall_seconds", "save_full_seconds", "saves",
    "state_bit_exact", "state_bytes", "total_seconds", "wall_over_round"}
CHECKPOINT_CONFIG_KEYS = {
    "batch_size", "checkpoint_keep", "d_model", "extrapolated", "inner_steps", "mlp_dim",
    "mode", "model", "num_heads", "num_layers", "overlap_rounds", "replicas_per_host",
    "rounds_timed", "seq_len", "vocab_size"}
DATA_KEYS = {"cpu_count", "demand", "input", "loader", "prepare", "ratio"}
DATA_PREPARE_KEYS = {"bytes_per_token", "mb_per_sec", "seconds", "text_mb", "tokenizer",
                     "tokens", "tokens_per_sec", "vocab_size", "workers"}
DATA_LOADER_KEYS = {"batch_size", "batches", "seconds", "seq_len", "setup_seconds",
                    "tokens_per_sec"}
DATA_DEMAND_KEYS = {"flops_per_token", "mfu", "model", "params", "peak_flops",
                    "tokens_per_sec"}
MEMORY_ROW_KEYS = {"config", "data", "estimate", "estimate_bytes", "fsdp", "layout",
                   "memory_per_device_bytes", "params", "replicas", "sequences_per_device",
                   "xla"}
MODELS_KEYS = {"config", "device", "ratio_llama_vs_gpt", "rounds_timed", "rows", "samples"}
MODELS_ROW_KEYS = {"family", "flops_per_sec", "flops_per_token", "mlp_dim", "params",
                   "tokens_per_sec"}
OUTER_STEP_ROW_KEYS = {
    "bytes_sent_per_round", "hosts", "model", "outer_d2h", "outer_h2d", "outer_mean",
    "outer_time", "outer_update", "params_millions", "anchor_hash_time", "anchor_check_time",
    "inner_step_time", "check_share_of_round"}
OVERHEAD_KEYS = {"config", "device", "jax", "ratio_diloco_vs_local", "ratio_diloco_vs_plain",
                 "ratio_diloco_vs_plain_big", "samples", "tokens_per_sec"}
OVERHEAD_CONFIG_KEYS = {"batch_size", "d_model", "inner_steps", "num_layers", "replicas",
                        "rounds_timed", "seq_len"}
LOOPS = {"diloco", "plain", "plain_big", "local"}
PEER_KEYS = {"config", "pair_ratios", "params", "ratio_tokens_per_sec", "runs", "same_model",
             "summary", "torchft_skipped", "startup", "inner_pair_ratios",
             "ratio_inner_tokens_per_sec"}
PEER_FIGURES = {"first_round_s", "max_peak_anon_mib", "max_peak_rss_mib", "outer_time_s",
                "round_time_s", "startup_s", "tokens_per_sec_per_replica"}
POISON_KEYS = {"poisoned_replica", "replicas", "rounds", "rows"}
POISON_ROW_KEYS = {"aggregation", "attack", "final_eval_loss", "skipped_rounds"}
WAN_KEYS = {"hosts", "rate_mbit", "rounds", "rows"}
WAN_ROW_KEYS = {"compute_utilization", "curve", "final_eval_loss", "idle_fraction", "mode",
                "outer_lr", "outer_momentum", "tokens_per_sec", "wall_s"}
WAN_COMM_ROW_KEYS = WAN_ROW_KEYS | {"bytes_per_host", "bytes_per_host_counted",
                                    "comm_s_per_round", "peak_bytes_per_sync"}


def check_checkpoint(result: dict) -> None:
  has(result, CHECKPOINT_KEYS)
  has(result["config"], CHECKPOINT_CONFIG_KEYS)
  assert result["anchor_bit_exact"] and result["state_bit_exact"]
  assert result["restored_round"] == result["rounds"][-1]["round"]
  assert result["round_with_write_behind_seconds"] is not None


def check_data(result: dict) -> None:
  has(result, DATA_KEYS)
  assert result["prepare"]
  for row in result["prepare"]:
    has(row, DATA_PREPARE_KEYS)
    assert row["mb_per_sec"] > 0
  has(result["loader"], DATA_LOADER_KEYS)
  has(result["demand"], DATA_DEMAND_KEYS)
  assert 1e4 < result["demand"]["tokens_per_sec"] < 1e6  # 150M params on one H100
  assert result["ratio"] > 0


def check_inner_step(result: dict) -> None:
  """--smoke: the peak, the step and its parts in diloco_jax; torch's side where the peer
  venv (bench/peer.py's) has torch (--smoke never creates it). XLA's FLOP count of the
  step is the analytic matmul count plus the elementwise ops (7% at --smoke's sizes)."""
  assert result["peak"]["flops_per_sec"] > 0
  assert all(r["best_flops_per_sec"] > 0 for r in result["peak"]["diloco_jax"]["sizes"])
  jax_step = result["step"]["diloco_jax"]
  assert jax_step["median_s"] > 0 and jax_step["plain_median_s"] > 0
  assert 0 < jax_step["share_of_peak"] <= jax_step["share_of_own_peak"]
  assert abs(result["flops"]["xla_over_analytic"] - 1) < 0.1, result["flops"]
  assert [r["component"] for r in result["components"]] == [
      "embeddings", "attention", "mlp", "head_loss", "update"]
  assert all(r["jax_ms"] > 0 and r["jax_in_step_ms"] > 0 for r in result["components"])
  jax_profile = result["profile"]["diloco_jax"]
  assert jax_profile["top"] and jax_profile["ops_ms_per_step"] > 0
  assert jax_profile["by_component"].get("other", 0) < 0.1 * jax_profile["ops_ms_per_step"]
  if result["torch_skipped"]:
    assert "torch" not in result["step"] and result["same_model"] is None
  else:
    assert result["step"]["torch"]["median_s"] > 0 and result["torch"]["threads"] == 1
    assert all(r["torch_ms"] > 0 for r in result["components"])
    assert result["profile"]["torch"]["top"]
    assert result["same_model"]["abs_diff"] <= 1e-4


def check_memory(result: dict) -> None:
  has(result, {"devices", "rows"})
  rows = {row["layout"]: row for row in result["rows"]}
  assert list(rows) == ["1x2", "2x1"]  # --smoke: configs/tiny.py on 2 devices
  for row in rows.values():
    has(row, MEMORY_ROW_KEYS)
  # A replica on one device holds more than one sharded over two.
  assert rows["1x2"]["memory_per_device_bytes"] < rows["2x1"]["memory_per_device_bytes"]


def check_models(result: dict) -> None:
  has(result, MODELS_KEYS)
  assert [row["family"] for row in result["rows"]] == ["gpt", "llama"]
  for row in result["rows"]:
    has(row, MODELS_ROW_KEYS)
    assert row["tokens_per_sec"] > 0
  gpt, llama = (row["params"] for row in result["rows"])
  assert abs(llama - gpt) <= 3 * result["config"]["d_model"] * result["config"]["num_layers"]


def check_outer_step(result: dict) -> None:
  has(result, {"rows", "rounds_timed"})
  assert result["rows"]
  for row in result["rows"]:
    has(row, OUTER_STEP_ROW_KEYS)
    assert row["bytes_sent_per_round"] > 0
    assert 0 < row["anchor_hash_time"] <= row["anchor_check_time"]


def check_overhead(result: dict) -> None:
  has(result, OVERHEAD_KEYS)
  has(result["config"], OVERHEAD_CONFIG_KEYS)
  assert set(result["tokens_per_sec"]) == LOOPS
  assert all(v > 0 for v in result["tokens_per_sec"].values())


def check_peer(result: dict) -> None:
  """diloco_jax always; torchft where its venv exists (--smoke never creates it)."""
  has(result, PEER_KEYS)
  sides = ["diloco_jax"] + ([] if result["torchft_skipped"] else ["torchft"])
  assert [s for s, runs in result["runs"].items() if runs] == sides
  for side in sides:
    has(result["summary"][side], PEER_FIGURES)
    assert result["summary"][side]["tokens_per_sec_per_replica"] > 0
  assert set(result["params"]) == set(sides) and len(set(result["params"].values())) == 1
  assert (result["ratio_tokens_per_sec"] is None) == result["torchft_skipped"]
  if not result["torchft_skipped"]:  # the torch model, given diloco_jax's params
    assert result["same_model"]["max_abs_logit_diff"] <= 1e-4
  # start-up alone: a fresh start, then one from the cache it filled (no torchft here)
  startup = result["startup"]
  assert [len(startup["reps"][k]) for k in ("diloco_jax_fresh", "diloco_jax_cached")] == [1, 1]
  assert startup["diloco_jax_cached"] > 0 and startup["diloco_jax_fresh"] > 0
  # a third host joins the running job with an empty workdir: it takes a member's programs
  (join,) = startup["join"]
  assert join["programs"]["files"] > 0 and join["programs"]["host"] in (0, 1), join
  assert 0 < join["own_s"] <= join["start_s"] and join["joined_round"] >= 1, join
  assert startup["diloco_jax_join_vs_cached"] > 0
  for run in result["runs"]["diloco_jax"]:  # the inner steps alone: the round less the sync
    assert run["inner_tokens_per_sec_per_replica"] >= run["tokens_per_sec_per_replica"]


def check_peer_wan(result: dict) -> None:
  """The smoke's diloco_jax settings on 127.0.0.1 (no torchft venv): every row's figures,
  the waiting share of a linked run measured against `alone`'s round, the loss at equal
  wall time at the shortest run's end, where that run's own curve ends."""
  has(result, {"config", "settings", "rates", "torchft_triton"})
  (rate,) = result["rates"].values()
  rows = rate["rows"]
  assert list(rows) == ["alone", "sync", "eager-4bit"]
  for name, row in rows.items():
    has(row, {"tokens_per_sec_per_replica", "wait_share", "curve", "final_eval_loss",
              "eval_loss_at_equal_wall", "round_time_s"})
    assert row["tokens_per_sec_per_replica"] > 0 and 0 <= row["wait_share"] <= 1
    assert len(row["curve"]) == result["config"]["rounds"]
  for name in ("sync", "eager-4bit"):  # the round less alone's, over the steady rounds
    row, alone = rows[name], rows["alone"]["round_time_s"]
    waits = [max(t - alone, 0) / t for t in row["round_times"][1:]]
    assert row["wait_share"] == pytest.approx(sorted(waits)[len(waits) // 2])
  shortest = min(("sync", "eager-4bit"), key=lambda n: rows[n]["wall_s"])
  assert rate["equal_wall_s"] == rows[shortest]["wall_s"]
  assert rows[shortest]["eval_loss_at_equal_wall"] == pytest.approx(
      rows[shortest]["final_eval_loss"])
  assert rows["alone"]["eval_loss_at_equal_wall"] is None
  assert rate["torchft_best"] is None


def check_poison(result: dict) -> None:
  has(result, POISON_KEYS)
  for row in result["rows"]:
    has(row, POISON_ROW_KEYS)
  # --smoke: every attack once, every aggregation at least once.
  assert sorted(r["attack"] for r in result["rows"]) == ["nan", "noise", "none", "scaled"]
  assert {r["aggregation"] for r in result["rows"]} == {"mean", "trimmed_mean", "median"}


def check_quality(result: dict) -> None:
  """--smoke: configs/sparseloco.py and configs/muloco.py train on 2 hosts, and what host
  0 sends per round is their format's share of a float32 exchange of the model (a ring
  all-reduce on 2 hosts sends 4 bytes per param)."""
  assert [r["method"] for r in result["rows"]] == ["sparseloco", "muloco"]
  assert result["complete"]  # the file is rewritten after each method; this is the last
  for row in result["rows"]:
    assert math.isfinite(row["final_eval_loss"]) and row["tokens"] > 0
    assert row["inner_seconds_per_round"] > 0 and 0 < row["utilization"] <= 1
  share = {r["method"]: r["bytes_per_round"] / (4 * r["params"]) for r in result["rows"]}
  assert 0.034 <= share["sparseloco"] <= 0.037, share  # 256 of 4096 at 2 bits: 3.6%
  assert share["muloco"] <= 0.07, share  # 2 bits per entry + a scale per 256: 0.066


def check_eta(result: dict) -> None:
  """--smoke: 6 rounds, fresh and preempted after round 3's line then resumed: every round
  a process trains after its first has an ETA, compared with the time left (not judged
  here: timing on a busy machine is for the bench's full run)."""
  fresh, resumed = result["runs"]
  assert fresh["run"] == "fresh" and fresh["rounds"] == [2, 3, 4, 5, 6]
  assert resumed["run"].startswith("resumed after round ")
  first = int(resumed["run"].split()[-1]) + 1  # the resumed process's first round: no ETA
  assert resumed["rounds"] == list(range(first + 1, 7))
  for run in result["runs"]:
    for row in run["rows"]:
      assert row["eta"] >= 0 and row["left"] > 0 and math.isfinite(row["error"])
    assert run["rows"][-1]["eta"] == 0  # the last round: printed as the run ends


def check_restart(result: dict) -> None:
  """--smoke: a preempted run resumed once with the cache it filled and once without: the
  resume with the cache found every program there (its figures are for the full run)."""
  assert result["fresh"]["start_to_first_step_s"] > 0
  assert [len(result["runs"][k]) for k in ("cache", "no_cache")] == [1, 1]
  assert result["runs"]["cache"][0]["compiled_anew"] == 0
  for kind in ("cache", "no_cache"):
    run = result["median"][kind]
    assert 0 < run["start_to_first_step_s"] < run["wall_s"]


def check_gpu_check(result: dict) -> None:
  """--smoke: every part on CPU with tiny shapes, none failed; part e times 'xla' alone
  (cuDNN is refused on a CPU, as config.model.attention='cudnn' is)."""
  parts = result["parts"]
  assert set(parts) == set("abcde") and not [p for p in parts.values() if "error" in p]
  assert parts["a"]["backend"] == "cpu" and "1 passed" in parts["a"]["tests"]
  assert parts["b"]["final_eval_loss"] > 0
  assert parts["c"]["tokens_per_sec"] > 0 and parts["c"]["attention"] == "xla"
  assert parts["d"]["sync"]["max_rel_loss_diff"] < 1e-5
  assert parts["d"]["sync"]["anchor_checked_rounds"] == parts["d"]["sync"]["rounds"]
  rows = parts["e"]["rows"]
  assert [r["attention"] for r in rows] == ["xla", "cudnn"] and "GPUs only" in rows[1]["skipped"]


def check_wan(result: dict, out: str) -> None:
  has(result, WAN_KEYS)
  assert [r["mode"] for r in result["rows"]] == ["none", "sync", "sync-live-mac", "sync@base"]
  assert result["baseline"]  # the checkout's commit
  for row in result["rows"]:
    has(row, WAN_ROW_KEYS if row["mode"] == "none" else WAN_COMM_ROW_KEYS)
  assert result["rows"][1]["bytes_per_host"][0] > 0  # the trainer's own count, no veth
  # Sync with host 0's coordinator, with one of its own and a join token, and by the
  # --baseline checkout's trainer (this one: the path NAME@base runs): on 2 hosts every sum
  # is a + b, so the runs are the same bits; the payloads are the same but for the words
  # riding with Δ, a few dozen bytes a round.
  sync, live, base = result["rows"][1], result["rows"][2], result["rows"][3]
  assert live["final_eval_loss"] == sync["final_eval_loss"] == base["final_eval_loss"]
  assert abs(live["bytes_per_host_counted"] - sync["bytes_per_host_counted"]) <= 2 * 64
  assert os.path.getsize(out.replace(".json", ".png")) > 0


def check_wire(result: dict) -> None:
  """--smoke: 2 hosts, gloo and the epoch wire (with and without a MAC) side by side, on
  loopback and on the slow-link pass; the wire's payload per host is the planner's float32
  ring formula exactly, its sum the same bits as gloo's (a + b either way on 2 hosts), the
  MACs 32 bytes + a 48-byte header per frame on top."""
  assert result["hosts"] == 2 and [r["size"] for r in result["rows"]] == [1000, 100000]
  # The slow-link pass, unshaped on 127.0.0.1 in a smoke run: the same rows, and rates.
  assert [link["rate_mbit"] for link in result["links"]] == [8.0]
  assert [r["size"] for r in result["links"][0]["rows"]] == [1000]
  assert set(result["links"][0]["rows"][0]["payload_mbit_per_s"]) == {"gloo", "wire",
                                                                       "wire_hmac"}
  for row in result["rows"] + result["links"][0]["rows"]:
    assert all(row["seconds"][side] > 0 for side in ("gloo", "wire", "wire_hmac"))
    assert row["payload_bytes_per_host"] == row["planner_bytes_per_host"] == 4 * row["size"]
    assert row["same_bits_as_gloo"] == {"wire": True, "wire_hmac": True}
    assert row["framed_bytes_per_host"]["wire_hmac"] == 4 * row["size"] + 2 * (48 + 32)
    assert row["ratio_gloo_over_wire"] > 0 and row["ratio_gloo_over_wire_hmac"] > 0


def check_plan(result: dict) -> None:
  """--smoke: the fit from the committed measured runs, which gives back the constants
  diloco_jax.plan ships (the fit is deterministic), every run predicted, the at-scale
  table whole."""
  import dataclasses  # pylint: disable=import-outside-toplevel

  from diloco_jax.planning import calibration  # pylint: disable=import-outside-toplevel
  assert result["constants"] == dataclasses.asdict(calibration.CONSTANTS)
  held = [r for r in result["rows"] if r["held_out"]]
  assert len(held) >= 6 and len(result["rows"]) > len(held) and result["held_out"] == len(held)
  for r in result["rows"]:
    assert r["predicted_round_s"] > 0 and r["measured_round_s"] > 0 and r["bytes_per_host"] > 0
  assert len(result["at_scale"]["rows"]) == 2 * 4 * 3 and len(result["at_scale"]["table6"]) == 4


def check_startup(result: dict) -> None:
  """--smoke: one rep, every phase measured; each trainer run printed its start-up line,
  then round 1's, then exited (the order only: no time is compared)."""
  assert result["smoke"] is True and len(result["reps"]) == 1
  for run in ("fresh", "cached", "cached_no_reexec"):
    times = result["reps"][0][run]
    assert 0 < times["startup_line"] <= times["round_line"] <= times["exit"], times
  assert set(result["phases"]) >= {"interpreter", "imports", "jax_start", "reexec",
                                   "fresh_round_line", "cached_round_line"}


CHECKS = {"startup": check_startup, "checkpoint": check_checkpoint, "data": check_data,
          "eta": check_eta, "gpu_check": check_gpu_check, "inner_step": check_inner_step,
          "memory": check_memory, "models": check_models,
          "outer_step": check_outer_step, "overhead": check_overhead, "peer": check_peer,
          "peer_wan": check_peer_wan, "plan": check_plan,
          "poison": check_poison, "quality": check_quality, "restart": check_restart,
          "wan": check_wan, "wire": check_wire}


@pytest.mark.slow
@pytest.mark.parametrize("name", benches.smoke_params(sorted(CHECKS)))
def test_smoke(name, tmp_path):
  before = benches.results_digest()
  result, out = benches.smoke(name, tmp_path)
  if name == "wan":
    check_wan(result, out)
  else:
    CHECKS[name](result)
  assert benches.results_digest() == before, "a smoke run changed bench/results/"
