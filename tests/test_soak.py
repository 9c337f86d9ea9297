"""The soak under faults (`scripts/soak.py`), short: a real server, 8 clients, faults mixed in."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_short_soak_leaves_the_server_healthy_and_idle():
  """48 requests at 8 clients (streams dropped mid-way, client timeouts, malformed bodies,
  prompts over the context, structured requests) then a burst over --max_queue=4: no 5xx but
  the queue's 503 server_busy (with Retry-After), every well-formed request answered, no slot
  or queue entry left, resident memory within 64 MB of its post-warm-up size, the same greedy
  reply before and after."""
  proc = subprocess.run(
      [sys.executable, "scripts/soak.py", "--spawn", "--requests=48", "--clients=8",
       "--max_tokens=12", "--max_queue=4", "--warmup_requests=8", "--overflow", "--seed=1"],
      cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["failures"] == [] and result["health"] == 200
  counts = result["counts"]
  assert counts["malformed"] and set(counts["malformed"]) <= {"400", "413", "415", "422"}
  assert set(counts["oversized"]) == {"400"}  # Over the context: 400, never a 5xx.
  assert counts["drop"].get("dropped mid-stream", 0) > 0
  assert counts["stream"].get("200", 0) > 0
  assert result["idle"] == result["idle_after_overflow"] == {
      "pijax_requests_running": 0.0, "pijax_requests_waiting": 0.0, "pijax_slots_live": 0.0}
  over = result["overflow"]
  assert over["ok"] + over["busy_503"] == over["burst"] == 2 * (8 + 4)
  assert over["busy_503"] > 0 and over["ok"] >= 8 + 4
  assert result["rss_growth_mb"] <= 64
