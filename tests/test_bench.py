"""Every script in bench/ still runs: `--help`, and `--smoke` end to end.

A smoke run is the bench's own code (the trainer, the launcher, the JSON and the table) on
tiny sizes, in seconds; it must exit 0, write the JSON keys a full run writes (to the
--out given here) and leave bench/results/ alone. When a change to the trainer breaks a
bench, these tests say so.
"""

import argparse
import glob
import hashlib
import json
import math
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = ("chaos", "churn", "checkpoint", "data", "eta", "gpu_check", "hosts", "inner_step",
           "leave", "linkdrop", "memory", "models",
           "outer_step", "overhead", "peer", "peer_wan", "plan", "poison", "quality", "restart",
           "sizes", "startup", "stragglers", "wan", "wire")
HELPERS = {"cpushare", "netns", "report"}  # bench/ modules that are not benches (as _*.py):
# the benches' helpers, and report.py, which renders their results as docs/performance.md
MULTIHOST = {"chaos", "sizes", "churn", "gpu_check", "hosts", "leave",
             "linkdrop", "outer_step", "peer", "peer_wan", "quality", "stragglers",
             "wan", "wire"}
TIMEOUT_S = 300  # a smoke run takes seconds to tens of seconds on 2 busy CPU cores

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
SIZES_KEYS = {
    "anchors_equal", "config", "epochs", "exit_codes", "join_after_start_seconds",
    "join_round", "longest_sum_wait_seconds", "nobody_evicted", "round_seconds_after_join",
    "round_seconds_before_join", "rounds_shared", "slowdown", "state_bytes",
    "transfer_over_timeout", "transfer_seconds"}
HOSTS_KEYS = {"cpu_count", "jax_imported", "lease_s", "mb", "rounds", "rows", "sums_exact"}
HOSTS_ROW_KEYS = {
    "commit_median_s", "commit_p90_s", "commit_requests_per_round", "connections_per_host",
    "coordinator_cpu_s_per_round", "coordinator_requests_per_round", "epoch_first_sum_s",
    "epochs", "frames_formula", "frames_per_sum_per_host", "heartbeats_per_round", "host_rss_mb",
    "hosts", "jax_imported", "join_admitted_s", "join_epoch_change_s", "leave_epoch_change_s",
    "leave_noticed_s", "payload_bytes_per_sum_per_host", "rounds_committed", "sum_median_s",
    "sums_exact", "tcp_sockets_per_host", "wall_s"}
LINKDROP_KEYS = {"drop_s", "env", "heartbeat_timeout", "reference_completed", "rounds", "side",
                 "train_args", "trial"}
LINKDROP_TRIAL_KEYS = {"attempts", "comparison", "completed", "name"}
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


def has(d: dict, keys: set) -> None:
  assert keys <= set(d), f"missing {sorted(keys - set(d))}"


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


def check_linkdrop(result: dict) -> None:
  has(result, LINKDROP_KEYS)
  has(result["trial"], LINKDROP_TRIAL_KEYS)
  assert result["reference_completed"] and result["trial"]["completed"]
  assert result["trial"]["comparison"]["equal"]  # nothing dropped: the same run twice


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


def check_chaos(result: dict) -> None:
  """--smoke: 3 hosts with their own workdirs. Resumed on 2 (host 2's replica is gone), one
  of them killed and its workdir wiped (it heals from a peer), then resumed on 4: host 3
  is new and host 2's disk is two restarts old, so both heal. The run completes, its
  anchors compared across hosts every round (debug_checks); the data rule after a
  host-count change is tests/test_storage.py's."""
  events = result["events"]
  assert [e["kind"] for e in events] == ["fewer", "kill_wipe", "more"], events
  assert [e["hosts_after"] for e in events] == [2, 2, 4]
  assert [e["checkpoint_hosts"] for e in events] == [3, 2, 2]
  assert events[0]["healed"] == [] and events[0]["heal_bytes"] == 0
  assert events[1]["healed"] == [events[1]["host"]] and events[1]["heal_bytes"] > 0
  assert events[2]["healed"] == [2, 3] and events[2]["heal_bytes"] == events[1]["heal_bytes"]
  assert all(e["resumed_from"] <= e["reached"] + 1 and e["down_s"] > 0 for e in events)
  assert result["rounds_completed"] == result["rounds"] == 50
  assert result["events_survived"] == 3
  assert result["final_eval_loss"] > 0 and result["uninterrupted"]["final_eval_loss"] > 0


def check_churn(result: dict) -> None:
  """--smoke: 3 hosts, on each path one host killed with its disk wiped, then a fourth
  host id arriving. Live: the killed host is started again and the new one (a SIGUSR1 to
  the launcher) starts; each joins at a later round with the state from another host, and
  the job is whole again; every round is kept once, with the replicas that took part.
  Restart: each event restarts the job (with one host more after the new id's arrival),
  which resumes; every round is kept with every host of the job that trained it."""
  assert [kind for kind, _ in result["plan"]] == ["kill_wipe", "join_new"]
  live, restart = result["paths"]["live"], result["paths"]["restart"]
  for path in (live, restart):
    for run in (path["uninterrupted"], path["churn"]):
      assert run["exit"] == 0 and run["rounds_completed"] == result["rounds"]
      assert run["final_eval_loss"] > 0
    assert len(path["churn"]["events"]) == 2 and path["churn"]["goodput"] > 0
  for e in live["churn"]["events"]:
    assert e["joined_at"] > e["round"] and e["source"] != e["host"], e
    assert e["state_bytes"] > 0 and e["back_s"] > 0, e
    assert e["first_round_s"] > 0 and e["joined_round_s"] > 0 and (
        e["joined_next_round_s"] > 0) and (
        e["joined_at"] < e["round"] + 2 or e["members_round_s"] > 0), e
  assert result["quota"] is None  # (never in --smoke)
  for path in (live, restart):  # the host-seconds: --hosts for the wall, one more after
    ref, churn = path["uninterrupted"], path["churn"]  # the join_new
    assert ref["host_seconds"] == pytest.approx(result["hosts"] * ref["wall_s"])
    assert (result["hosts"] * churn["wall_s"] < churn["host_seconds"]
            < (result["hosts"] + 1) * churn["wall_s"]), churn
    assert 0 < ref["round_s"] < ref["wall_s"] / result["rounds"]
  assert live["churn"]["events"][1]["host"] == result["hosts"]  # the spare id
  full = restart["uninterrupted"]["kept_tokens"]  # (the live job's spare id never started)
  assert live["uninterrupted"]["kept_tokens"] == full
  assert live["churn"]["kept_tokens"] > 0
  assert all(e["back_s"] > 0 and e["resumed_at"] >= 1 for e in restart["churn"]["events"])
  # restart: every round with 3 hosts, and one more from the round it resumed at with 4
  rounds, grown = result["rounds"], restart["churn"]["events"][1]["resumed_at"]
  per_replica_round = full / (result["hosts"] * rounds)
  assert restart["churn"]["kept_tokens"] == pytest.approx(
      full + (rounds - grown + 1) * per_replica_round), restart["churn"]


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


def check_stragglers(result: dict) -> None:
  """--smoke: 2 hosts, the second slowed (a CPU quota, or a core shared with a spinning
  process), under 'fixed' and 'speed': per host figures from the trainer's records, and
  both runs' eval curves compared at equal wall time and equal tokens."""
  runs = result["runs"]
  assert set(runs) == {"fixed", "speed"}
  for run in runs.values():
    assert len(run["busy_share"]) == len(run["wait_share"]) == result["hosts"] == 2
    assert run["tokens"] > 0 and run["tokens_per_sec"] > 0 and run["eval_curve"]
  assert runs["fixed"]["steps_per_host"] == [{"from_round": 1, "steps": [2, 2]}]  # H = 2
  for point in ("at_equal_wall", "at_equal_tokens"):
    assert result[point]["fixed"] > 0 and result[point]["speed"] > 0


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


def check_leave(result: dict) -> None:
  """--smoke: 2 hosts in sync, host 1 SIGKILLed after round 2's line: host 0 trains to the
  end alone (K 2 -> 1 in its records), beside the uninterrupted run of the same hosts."""
  (row,) = result["rows"]
  assert row["mode"] == "sync" and row["uninterrupted"]["replicas"] == [2, 2, 2, 2]
  left = row["with_kills"]
  assert left["rounds"] == 4 and left["replicas"][:2] == [2, 2] and left["replicas"][-1] == 1
  assert len(left["seconds_to_next_round"]) == 1
  assert row["loss_ratio"] == left["final_eval_loss"] / row["uninterrupted"]["final_eval_loss"]


def check_hosts(result: dict) -> None:
  """--smoke: 4 and 6 host processes without jax, one leaving and one joining: every sum
  the same bits as numpy's over its epoch's members; a socket per member (N-1 PUSH, 1
  PULL) and 2(N-1) frames per sum per host (each span fits a chunk at --smoke's size)."""
  has(result, HOSTS_KEYS)
  assert result["sums_exact"] and not result["jax_imported"]
  assert [r["hosts"] for r in result["rows"]] == [4, 6]
  for row in result["rows"]:
    has(row, HOSTS_ROW_KEYS)
    n = row["hosts"]
    assert row["sums_exact"] and row["rounds_committed"] >= result["rounds"]
    assert row["epochs"] == 3  # all n, n-1 after the leave, n with the joiner
    assert row["connections_per_host"] == n and row["tcp_sockets_per_host"] >= 2 * (n - 1)
    assert row["frames_per_sum_per_host"] == row["frames_formula"] == 2 * (n - 1)
    assert 0 < row["commit_median_s"] <= row["commit_p90_s"] and row["sum_median_s"] > 0
    assert row["leave_epoch_change_s"] > 0 and row["join_epoch_change_s"] > 0
    assert row["coordinator_requests_per_round"] >= n  # a commit per member per round


def check_sizes(result: dict) -> None:
  """--smoke: host 2 starts late, is admitted with the members' state and trains on with
  them: every host exits 0, no epoch drops a host before the stop, the last has all three,
  and host 2's anchor hash is the others' in every round they share."""
  has(result, SIZES_KEYS)
  assert result["exit_codes"] == [0, 0, 0]
  assert result["nobody_evicted"] and result["epochs"][-1]["hosts"] == [0, 1, 2]
  assert result["anchors_equal"] and result["rounds_shared"] >= 1
  assert result["state_bytes"] > 0 and result["transfer_seconds"] >= 0
  assert result["join_round"] >= 1 and result["join_after_start_seconds"] > 0


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


CHECKS = {"chaos": check_chaos, "hosts": check_hosts, "sizes": check_sizes, "startup": check_startup, "churn": check_churn, "checkpoint": check_checkpoint, "data": check_data,
          "eta": check_eta, "gpu_check": check_gpu_check, "inner_step": check_inner_step,
          "leave": check_leave,
          "linkdrop": check_linkdrop,
          "memory": check_memory, "models": check_models,
          "outer_step": check_outer_step, "overhead": check_overhead, "peer": check_peer, "peer_wan": check_peer_wan,
          "plan": check_plan,
          "poison": check_poison, "quality": check_quality, "restart": check_restart,
          "stragglers": check_stragglers, "wan": check_wan, "wire": check_wire}


def run_bench(name: str, *flags: str) -> tuple[int, str]:
  """Runs bench/NAME.py in its own process group, all of which a timeout kills."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen([sys.executable, os.path.join("bench", f"{name}.py"), *flags],
                          cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"bench/{name}.py {' '.join(flags)}: no exit in {TIMEOUT_S} s:\n{out[-5000:]}")
  return proc.returncode, out


def results_digest() -> dict[str, str]:
  return {path: hashlib.sha256(open(path, "rb").read()).hexdigest()
          for path in sorted(glob.glob(os.path.join(REPO, "bench", "results", "*")))}


def test_every_bench_is_tested():
  scripts = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "bench", "*.py"))}
  assert {s for s in scripts if not s.startswith("_")} - HELPERS == set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_help(name):
  code, out = run_bench(name, "--help")
  assert code == 0, out[-5000:]
  assert "usage:" in out and "--smoke" in out and "--out" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.multihost)
                                  if n in MULTIHOST else n for n in BENCHES])
def test_smoke(name, tmp_path):
  before = results_digest()
  out = str(tmp_path / "x.json")
  # peer: diloco_jax's side only, whatever this machine has installed (torchft needs torch).
  extra = [f"--venv={tmp_path / 'no_venv'}"] if name in ("peer", "peer_wan") else []
  if name == "wan":  # NAME@base: a checkout's trainer (here this one's) beside this one
    extra = [f"--baseline={REPO}", "--modes=none,sync,sync-live-mac,sync@base"]
  code, log = run_bench(name, "--smoke", f"--out={out}", *extra)
  assert code == 0, log[-5000:]
  with open(out) as f:
    result = json.load(f)
  assert result["smoke"] is True
  # Where the figures came from, which bench/report.py prints beside them.
  has(result, {"command", "date", "machine"})
  assert result["command"].startswith(f"python bench/{name}.py --smoke --out=")
  if name == "wan":
    check_wan(result, out)
  else:
    CHECKS[name](result)
  assert results_digest() == before, "a smoke run changed bench/results/"


def test_peer_torch_model_gives_diloco_jax_logits():
  """bench/peer.py's check before it times anything, run for real (test_smoke's peer run
  has no torchft venv and skips it): diloco_jax's initial params at --smoke's shapes,
  loaded into bench/_peer_torch.py's torch model, give diloco_jax's logits up to float32
  rounding. The torch of the [hf] extra stands in for the venv: --check needs no torchft."""
  pytest.importorskip("torch", reason="torch comes with the [hf] extra")
  sys.path.insert(0, REPO)
  from bench import peer  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(config=peer.peer_config.get_config(), **peer.SMOKE)
  check = peer.check_same_model(args, sys.executable)  # raises past 1e-4
  # Measured 9e-8 on logits up to 0.5; a LayerNorm eps of 1e-6 against 1e-5 gives 3e-3.
  assert check["max_abs_logit_diff"] <= 1e-5 and check["max_abs_logit"] > 0.1, check


def test_hosts_beyond_the_cores_get_an_equal_cpu_quota_not_a_shared_core():
  """bench/cpushare.py: with hosts <= cores each is pinned to its own core; with more, each
  command runs in a cgroup of its own whose CFS quota is 0.9 x cores / hosts of a core
  (a process started so is in it, and the cgroups are gone afterwards)."""
  sys.path.insert(0, REPO)
  from bench import cpushare  # pylint: disable=import-outside-toplevel
  cores = len(os.sched_getaffinity(0))
  few = cpushare.Placement(cores, pin=True)
  assert few.command(cores - 1, ["x"])[:2] == ["taskset", "-c"] and not few.quota
  assert cpushare.Placement(cores + 1, pin=False).command(0, ["x"]) == ["x"]
  if os.geteuid() != 0 or not (os.path.isdir(cpushare.V1) or os.path.isfile(
      os.path.join(cpushare.V2, "cgroup.controllers"))):
    pytest.skip("a CPU quota needs root and the cgroup cpu controller")
  with cpushare.Placement(cores + 1, pin=True, tag="djtest") as many:
    assert many.share == pytest.approx(0.9 * cores / (cores + 1))
    done = subprocess.run(many.command(1, ["cat", "/proc/self/cgroup"]), capture_output=True,
                          text=True, check=True)
    assert many.groups[1] in done.stdout
    paths = [many._path(i) for i in range(cores + 1)]  # pylint: disable=protected-access
    quota = os.path.join(paths[1], "cpu.cfs_quota_us" if os.path.isdir(cpushare.V1)
                         else "cpu.max")
    with open(quota) as f:
      assert int(f.read().split()[0]) == int(many.share * cpushare.PERIOD_US)
  assert not any(os.path.exists(p) for p in paths)


def test_quality_variant_replaces_the_methods_own_flag():
  """bench/quality.py --variant=NAME=eager:--config.outer.momentum=0.5: the variant's
  momentum replaces eager's in place (the JSON's `overrides` lists each key once)."""
  sys.path.insert(0, REPO)
  from bench import quality
  assert quality.override(["--config.mode=eager", "--config.outer.momentum=0.3"],
                          ["--config.outer.momentum=0.5", "--config.outer.lr=1.0"]) == [
      "--config.mode=eager", "--config.outer.momentum=0.5", "--config.outer.lr=1.0"]
  assert quality.override([], ["--config.outer.lr=2.0"]) == ["--config.outer.lr=2.0"]
