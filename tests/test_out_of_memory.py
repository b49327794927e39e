"""Memory that runs out in disguise (issue 23): while a module loads lazily (numba, torch), the dynamic
loader fails to map a library ("failed to map segment from shared object", which llvmlite reports as
a library it could not find), and a thread whose stack cannot be mapped is "can't start new thread".
Each is one line saying memory ran out, exit 1; not a broken install, not an internal error (exit 3).
Hooks in the pulsediff process raise them where memory would run out."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save

LOADER = "/venv/lib/python3/site-packages/llvmlite/binding/libllvmlite.so: failed to map segment from shared object"

FAILING_IMPORT = f"""
import sys
failing = sys.argv.pop(1)
class OutOfMemory:
    def find_spec(self, name, path=None, target=None):
        if name == failing:
            try:
                raise OSError({LOADER!r})
            except OSError:  # as llvmlite does: its own error, the loader's as its context
                raise OSError("Could not find/load shared object file 'libllvmlite.so'")
sys.meta_path.insert(0, OutOfMemory())
from pulsediff.__main__ import main
sys.argv[0] = "pulsediff"
main()
"""

NO_THREADS = """
import sys, threading
def start(self):
    raise RuntimeError("can't start new thread")
threading.Thread.start = start
from pulsediff.__main__ import main
sys.argv[0] = "pulsediff"
main()
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oom")
    rng = np.random.default_rng(31)
    base = {f"w{i}": random_tensor(rng, "BF16", (256, 256)) for i in range(3)}
    target = {k: mutate(rng, v, 0.02) for k, v in base.items()}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


def _assert_out_of_memory(proc, contains: str) -> None:
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pulsediff: error: out of memory"), err
    assert contains in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("module", ["numba", "typer"])  # during the command; while the CLI itself loads
def test_library_that_cannot_be_mapped_is_out_of_memory(pair, tmp_path, module):
    old, new = pair
    out = tmp_path / "p.pulsediff"
    proc = subprocess.run([sys.executable, "-c", FAILING_IMPORT, module, "make", str(old), str(new), "-o", str(out)],
                          capture_output=True, timeout=300)
    _assert_out_of_memory(proc, "failed to map segment")
    assert not out.exists()


def test_thread_that_cannot_start_is_out_of_memory(pair, tmp_path):
    old, new = pair
    out = tmp_path / "p.pulsediff"
    proc = subprocess.run([sys.executable, "-c", NO_THREADS, "make", str(old), str(new), "-o", str(out)],
                          capture_output=True, timeout=300)
    _assert_out_of_memory(proc, "cannot start a thread")
    assert list(tmp_path.iterdir()) == []
