"""The default path (``ray.address: null``, one rank, one rollout worker) imports no Ray: the
training flow, its tasks and a one-process session run without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
import flows.train, tasks.rl, tasks.evaluation, agentgym.pipeline, agentgym.training.protocol
from agentgym.config import parse_config
cfg = parse_config({})
assert not cfg.uses_ray
loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
assert not loaded, loaded[:5]
print("no ray")
"""


def test_the_default_path_imports_no_ray():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "no ray" in out.stdout, out.stderr[-3000:]
