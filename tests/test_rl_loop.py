"""The real job, short: README.md's RL-loop block run as written (examples/rl_loop.py for 10 steps with both
faults), in the engine tests' venv. A trainer steps by GRPO, a vLLM engine is kept current by the pulsediff
backend with every update prepared ahead, a file worker follows the signed series with `catch-up --watch
--trust`; at steps 5 and 10 the engine answers as a fresh engine on the step's folder and the worker's digest
is the trainer's. The publisher is killed while it writes step 3 and a patch of step 7 is broken: the engine
and the worker stay at the step before, say so in one line, and go on once the series is whole.
scripts/soak_rl.py runs the same loop for 300 steps (docs/BENCHMARKS.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("PULSEDIFF_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/run tests it in .venv-vllm)")

ROOT = Path(__file__).parent.parent


def readme_block(heading: str) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(heading):]
    section = section[section.index("```\n") + 4:]
    return section[:section.index("```\n")].splitlines()


def test_readme_rl_loop_runs_ten_steps_through_both_faults(tmp_path):
    block = readme_block("## The whole loop")
    assert 0 < len(block) <= 15
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the block runs in the repository's folder
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(block)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    lines = out.splitlines()
    assert "every check held" in lines
    for step in (5, 10):  # the engine against a fresh engine, the worker's digest against the trainer's
        assert f"step {step}: engine equal to a fresh engine on the step; file worker's digest equal to the " \
               "trainer's" in lines
    # The publisher killed while writing step 3: the engine refuses a step the series does not list yet.
    assert "step 3: publisher killed while it wrote the step's files" in lines
    (stays,) = [line for line in lines if line.startswith("step 3: engine stays at step 2: ")]
    assert "step 3" in stays.split(": ", 2)[2]
    assert "step 3: file worker stays at step 2" in lines and "step 3: publisher restarted" in lines
    assert re.search(r"^step 4: reward .* engine at 4$", out, re.M)  # on again once the publisher is back
    # A patch of step 7 broken: the engine and the worker stay at 6, each saying why in one line.
    assert "step 7: patch-00000006-00000007.pulsediff broken in the series" in lines
    (stays,) = [line for line in lines if line.startswith("step 7: engine stays at step 6: ")]
    assert stays.endswith("(the engine keeps its weights)") and "collective_rpc" not in stays  # the worker's line
    assert any(line.startswith("step 7: file worker stays at step 6: ") for line in lines)
    assert re.search(r"^step 8: reward .* engine at 8$", out, re.M)
