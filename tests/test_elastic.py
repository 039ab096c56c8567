"""Experimental elastic mode: 3 hosts, host 2 killed mid-run. Hosts 0 and 1 keep training
with 2 replicas; when host 2 comes back, every host restarts from a checkpoint at a round
boundary and the three train together to the end."""

import os
import re
import signal
import sys
import time

import pytest

from tests import multihost

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def test_survivors_continue_and_a_returning_host_rejoins(tmp_path):
  launcher = multihost.start([
      sys.executable, "launch/local.py", "--hosts=3", "--rejoin_after=15", "--",
      "--config=configs/tiny.py", f"--workdir={tmp_path}", "--config.replicas_per_host=1",
      "--config.num_rounds=60", "--config.inner_steps=5", "--config.inner.warmup_steps=5",
      "--config.elastic=True", "--config.elastic_timeout=5", "--heartbeat_timeout=5"])
  lines = []
  for line in launcher.stdout:  # until the three hosts have trained a few rounds
    lines.append(line)
    if re.search(r"\[host 0\] round +8/60 .*\| 3 replicas \|", line):
      break
  else:
    raise AssertionError("".join(lines[-60:]))
  victim = next(p for p in multihost.children(launcher.pid)
                if "--host_id=2" in open(f"/proc/{p}/cmdline").read().replace("\0", " "))
  os.kill(victim, signal.SIGKILL)
  t0 = time.monotonic()
  continued = None  # seconds from the SIGKILL until the survivors go on without host 2
  for line in launcher.stdout:
    lines.append(line)
    if "host(s) [2] stopped; continuing with hosts [0, 1]" in line:
      continued = time.monotonic() - t0
      break
  rest, _ = launcher.communicate(timeout=600)
  text = "".join(lines) + rest
  assert launcher.returncode == 0, text[-5000:]
  # Within the heartbeat and elastic timeouts (5 s each) and a round or two, long before
  # a collective's own deadline (20 x elastic_timeout) would end the job.
  assert continued is not None and continued < 30, (continued, text[-5000:])
  rounds = [(int(m.group(1)), int(m.group(2))) for m in re.finditer(
      r"\[host 0\] round +(\d+)/60 .*\| (\d) replicas \|", text)]
  counts = [k for _, k in rounds]
  # 3 replicas, then 2 while host 2 is away, then 3 again until the end.
  first_two, last_two = counts.index(2), len(counts) - 1 - counts[::-1].index(2)
  assert set(counts[:first_two]) == {3} and set(counts[first_two:last_two + 1]) == {2}
  assert set(counts[last_two + 1:]) == {3} and len(counts) - last_two - 1 >= 5, counts
  assert rounds[-1][0] == 60
  assert "host(s) [2] stopped; continuing with hosts [0, 1]" in text
  assert "asking to rejoin" in text and "a host returned; checkpoint" in text
  assert "every host asked for a restart" in text
  assert re.search(r"host 2: rejoining at round \d+: replicas from the anchor", text)
  assert "final eval loss" in text
