"""The worker-loop example (examples/worker_loop.py) runs end to end on CPU tensors, bit-identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "worker_loop.py"


def test_worker_loop_example(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    run = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path), "--steps", "2"], capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2 and all("logits bit-identical: True" in line for line in lines)
    assert lines[-1].startswith("step 2:")
