"""The benches of hosts that come and go (killed, preempted, joining, slowed, cut off)
still run: each one's `--smoke` end to end (tests/benches.py), and what a full run writes."""

import pytest

from tests import benches
from tests.benches import has

# The keys a full run writes: at the top of the JSON, in every row.
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


def check_linkdrop(result: dict) -> None:
  has(result, LINKDROP_KEYS)
  has(result["trial"], LINKDROP_TRIAL_KEYS)
  assert result["reference_completed"] and result["trial"]["completed"]
  assert result["trial"]["comparison"]["equal"]  # nothing dropped: the same run twice


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
  Each joiner takes its compiled programs from a member (every live host keeps its own
  cache). Restart: each event restarts the job (with one host more after the new id's arrival),
  which resumes; every round is kept with every host of the job that trained it."""
  assert [kind for kind, _ in result["plan"]] == ["kill_wipe", "join_new"]
  live, restart = result["paths"]["live"], result["paths"]["restart"]
  for path in (live, restart):
    for run in (path["uninterrupted"], path["churn"]):
      assert run["exit"] == 0 and run["rounds_completed"] == result["rounds"]
      assert run["final_eval_loss"] > 0
    assert len(path["churn"]["events"]) == 2 and path["churn"]["goodput"] > 0
    assert path["churn"]["goodput_each"] == [pytest.approx(path["churn"]["goodput"])]
  for e in live["churn"]["events"]:
    assert e["joined_at"] > e["round"] and e["source"] != e["host"], e
    assert e["state_bytes"] > 0 and e["back_s"] > 0, e
    # a wiped host and a new id take the members' compiled programs (their own caches)
    assert e["programs"]["files"] > 0 and e["programs"]["host"] != e["host"], e
    assert {"programs", "rehearse", "admitted", "resume"} <= set(e["start_seconds"]), e
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


def test_churn_goodput_is_against_the_uninterrupted_runs_together():
  from bench import churn  # pylint: disable=import-outside-toplevel
  before = {"kept_tokens": 100.0, "host_seconds": 10.0, "wall_s": 5.0}
  after = {"kept_tokens": 90.0, "host_seconds": 10.0, "wall_s": 5.0}
  churned = {"kept_tokens": 76.0, "host_seconds": 8.0, "wall_s": 4.0}
  both = churn.pooled([before, after])
  assert churn.goodput(both, churned, quota=True) == pytest.approx(76 / (190 / 20 * 8))
  assert churn.goodput(both, churned, quota=False) == pytest.approx(76 / (190 / 10 * 4))


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


CHECKS = {"chaos": check_chaos, "churn": check_churn, "hosts": check_hosts,
          "leave": check_leave, "linkdrop": check_linkdrop, "sizes": check_sizes,
          "stragglers": check_stragglers}


@pytest.mark.slow
@pytest.mark.parametrize("name", benches.smoke_params(sorted(CHECKS)))
def test_smoke(name, tmp_path):
  before = benches.results_digest()
  result, _ = benches.smoke(name, tmp_path)
  CHECKS[name](result)
  assert benches.results_digest() == before, "a smoke run changed bench/results/"
