"""A sharded folder updated in place and killed at any rename ends old or new, never a mix.

The apply runs in a child process whose os.replace kills it (SIGKILL) at the
k-th call: before the intent record is in place (k = 1), or between any two
of the renames that follow. The next pulsediff run that opens the folder must
find it either untouched (and apply again) or finish the update.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pulsediff import apply_patch, make_patch
from pulsediff.io.atomic import INTENT_NAME
from pulsediff.ops.inspect import checkpoint_digest_of

from ckpt_factory import folder_bytes, mutate, random_tensor, save_sharded

KILL_AT = """
import os, signal, sys
calls = 0
real_replace = os.replace
def replace(a, b, **kw):
    global calls
    calls += 1
    if calls == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(a, b, **kw)
os.replace = replace
from pulsediff import apply_patch
apply_patch(sys.argv[2], sys.argv[3], in_place=True, device="cpu")
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kill")
    rng = np.random.default_rng(11)
    base = {f"t{i}": random_tensor(rng, "BF16", (64,)) for i in range(8)}
    target = {k: mutate(rng, v, 0.2) for k, v in base.items()}
    old = save_sharded(base, tmp / "old", 4)
    new = save_sharded(target, tmp / "new", 3)  # resharded: one old shard must go away
    (old / "config.json").write_text('{"step": 0}')
    (new / "config.json").write_text('{"step": 1}')
    make_patch(old, new, tmp / "p", device="cpu")
    return old, new, tmp / "p"


@pytest.mark.parametrize("kill_at", range(1, 7))
def test_killed_in_place_apply_is_old_or_finished(folders, tmp_path, kill_at):
    old, new, patch = folders
    worker = tmp_path / "worker"
    subprocess.run(["cp", "-r", str(old), str(worker)], check=True)
    run = subprocess.run([sys.executable, "-c", KILL_AT, str(kill_at), str(worker), str(patch)], capture_output=True)
    assert run.returncode == -9, run.stderr  # it really was killed in the middle
    journaled = (worker / INTENT_NAME).exists()
    if not journaled:  # killed before the record: nothing visible changed
        visible = {k: v for k, v in folder_bytes(worker).items() if not k.startswith(".")}
        assert visible == folder_bytes(old)
    # The next run that opens the folder (here: a digest) finishes a journaled update first.
    digest = checkpoint_digest_of(worker)
    assert digest == checkpoint_digest_of(new if journaled else old)
    apply_patch(worker, patch, in_place=True, device="cpu")  # then apply (again) is right either way
    assert folder_bytes(worker) == folder_bytes(new)
    assert not [p for p in worker.iterdir() if p.name.startswith(".")]  # no temporaries, no record left
