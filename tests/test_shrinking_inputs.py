"""Inputs that shrink while pulsediff reads them (issue 23): a trainer overwriting its checkpoint, a
sync tool replacing it, a full disk. The command must end with exit 1 and one line naming the file,
never die by a signal (a memory-mapped read of a truncated file is SIGBUS), and leave nothing behind.

Deterministic moments come from a hook in the pulsediff process that truncates a file right after
the checkpoint opens it, or after its k-th tensor read; a last test truncates from outside at
random moments while the command runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ckpt_factory import mutate, random_tensor, save

PULSEDIFF = [sys.executable, "-m", "pulsediff"]
TENSORS = 6

# Runs pulsediff's command line in a process where VICTIM is truncated to KEEP bytes once the
# checkpoint reading it has opened it (AFTER=0), right after the AFTER-th tensor read from it, or
# right after the output is committed (AFTER=-1).
HOOK = """
import os, sys
from pathlib import Path
from pulsediff.io import checkpoint
victim, keep, after = Path(os.environ["VICTIM"]).resolve(), int(os.environ["KEEP"]), int(os.environ["AFTER"])
reads = 0
done = False

def cut():
    global done
    if not done:
        done = True
        if keep < 0:  # written over in place, same size: the last bytes flipped, a new mtime
            with open(victim, "r+b") as f:
                f.seek(-16, os.SEEK_END)
                tail = f.read(16)
                f.seek(-16, os.SEEK_END)
                f.write(bytes(b ^ 0xFF for b in tail))
            st = os.stat(victim)
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        else:
            os.truncate(victim, keep)

opened = checkpoint.Checkpoint.__init__
def init(self, path):
    opened(self, path)
    if Path(path).resolve() == victim and after == 0:
        cut()
checkpoint.Checkpoint.__init__ = init

read = checkpoint.Checkpoint.raw_bytes
def raw_bytes(self, name):
    global reads
    bits = read(self, name)
    if Path(self.path).resolve() == victim:
        reads += 1
        if reads == after:
            cut()
    return bits
checkpoint.Checkpoint.raw_bytes = raw_bytes

from pulsediff.io import atomic
commit = atomic.StagedFiles.commit
def commit_then_cut(self):
    commit(self)
    if after == -1:
        cut()
atomic.StagedFiles.commit = commit_then_cut

from pulsediff.__main__ import main
sys.argv[0] = "pulsediff"
main()
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Six 2 MiB tensors a side: each read through the buffers pulsediff reuses."""
    tmp = tmp_path_factory.mktemp("shrink")
    rng = np.random.default_rng(23)
    base = {f"w{i}": random_tensor(rng, "BF16", (1024, 1024)) for i in range(TENSORS)}
    target = {k: mutate(rng, v, 0.01) for k, v in base.items()}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def _run_hooked(args, victim: Path, keep: int, after: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "VICTIM": str(victim), "KEEP": str(keep), "AFTER": str(after)}
    return subprocess.run([sys.executable, "-c", HOOK, *map(str, args)], capture_output=True, env=env,
                          timeout=300)


def _assert_changed(proc: subprocess.CompletedProcess, victim: Path) -> None:
    err = proc.stderr.decode()
    assert proc.returncode == 1, f"exit {proc.returncode} ({signal.Signals(-proc.returncode).name if proc.returncode < 0 else ''}): {err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pulsediff: error:"), err
    assert str(victim) in lines[0] and "changed while being read" in lines[0], err


# Moments: as soon as it is open; after the first tensor; midway through the rebuild, when the
# output's temporary file is open; after the last tensor was read (apply reads the base once, its
# digest taken by the rebuild: issue 32).
@pytest.mark.parametrize("after", [0, 1, TENSORS // 2, TENSORS])
@pytest.mark.parametrize("keep", ["half", "header"])
def test_base_truncated_during_apply(pair, tmp_path, after, keep):
    old, new = pair
    patch = tmp_path / "p.pulsediff"
    subprocess.run([*PULSEDIFF, "make", old, new, "-o", patch, "-q"], check=True, timeout=300)
    base = _copy(old, tmp_path / "base.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    size = base.stat().st_size
    proc = _run_hooked(["apply", base, patch, "-o", out / "new.safetensors", "-q"], base,
                       size // 2 if keep == "half" else size - TENSORS * (2 << 20) + 100, after)
    _assert_changed(proc, base)
    assert list(out.iterdir()) == []  # no output, no temporary


@pytest.mark.parametrize("after", [0, 1, TENSORS - 1])
@pytest.mark.parametrize("which", ["new", "old"])
def test_input_truncated_during_make(pair, tmp_path, after, which):
    old, new = (_copy(p, tmp_path / p.name) for p in pair)
    victim = new if which == "new" else old
    out = tmp_path / "out"
    out.mkdir()
    proc = _run_hooked(["make", old, new, "-o", out / "p.pulsediff", "-q"], victim,
                       victim.stat().st_size // 3, after)
    _assert_changed(proc, victim)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("which", ["new", "old"])
def test_input_written_over_in_place_during_make(pair, tmp_path, which):
    """A checkpoint written over in place at its own size (no fault, no shrink) while make reads
    it: what was read may mix old and new bytes, so make refuses it, naming the file (review of
    issue 23's guard: before, the patch was written)."""
    old, new = (_copy(p, tmp_path / p.name) for p in pair)
    victim = new if which == "new" else old
    out = tmp_path / "out"
    out.mkdir()
    proc = _run_hooked(["make", old, new, "-o", out / "p.pulsediff", "-q"], victim, -1, 1)
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert err.count("\n") == 1 and str(victim) in err and "changed while being read: it was written to in place" in err, err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("command, which", [("apply", "base"), ("make", "old"), ("make", "new"),
                                            ("squash", "base")])
def test_an_input_cut_after_the_output_is_committed_is_no_error(pair, tmp_path, command, which):
    """Once the output is checked and committed, an input cut short touches nothing pulsediff made:
    exit 0 and a whole output (found by the shrink trials of scripts/fuzz_campaign.py: closing the
    input reported the change, exit 1 beside a complete output under its real name)."""
    old, new = (_copy(p, tmp_path / p.name) for p in pair)
    want = new.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    if command == "apply":
        patch = tmp_path / "p.pulsediff"
        subprocess.run([*PULSEDIFF, "make", old, new, "-o", patch, "-q"], check=True, timeout=300)
        proc = _run_hooked(["apply", old, patch, "-o", out / "new.safetensors", "-q"], old, 100, -1)
        assert proc.returncode == 0, proc.stderr.decode()
        assert (out / "new.safetensors").read_bytes() == want
    elif command == "squash":  # a chain of one patch, squashed from a base that is cut once it is out
        base = _copy(old, tmp_path / "base.safetensors")
        patch = tmp_path / "p.pulsediff"
        subprocess.run([*PULSEDIFF, "make", old, new, "-o", patch, "-q"], check=True, timeout=300)
        proc = _run_hooked(["squash", old, patch, "-o", out / "p.pulsediff", "-q"], old, 100, -1)
        assert proc.returncode == 0, proc.stderr.decode()
        subprocess.run([*PULSEDIFF, "apply", base, out / "p.pulsediff", "-o", tmp_path / "rebuilt.safetensors",
                        "-q"], check=True, timeout=300)
        assert (tmp_path / "rebuilt.safetensors").read_bytes() == want
    else:
        victim = old if which == "old" else new
        base = _copy(old, tmp_path / "base.safetensors")
        proc = _run_hooked(["make", old, new, "-o", out / "p.pulsediff", "-q"], victim, 100, -1)
        assert proc.returncode == 0, proc.stderr.decode()
        subprocess.run([*PULSEDIFF, "apply", base, out / "p.pulsediff", "-o", tmp_path / "rebuilt.safetensors",
                        "-q"], check=True, timeout=300)
        assert (tmp_path / "rebuilt.safetensors").read_bytes() == want
    assert victim_cut(old if which != "new" else new)
    assert [p.name for p in out.iterdir()] == ["new.safetensors" if command == "apply" else "p.pulsediff"]


def victim_cut(path: Path) -> bool:
    return path.stat().st_size == 100


@pytest.mark.parametrize("command", ["digest", "stats"])
def test_checkpoint_truncated_while_read_by_reporting_commands(pair, tmp_path, command):
    old, new = (_copy(p, tmp_path / p.name) for p in pair)
    args = ["digest", new] if command == "digest" else ["stats", old, new]
    proc = _run_hooked(args, new, new.stat().st_size // 2, 1)
    _assert_changed(proc, new)


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    """128 MiB a side: long enough to be cut at a random moment from outside."""
    tmp = tmp_path_factory.mktemp("shrink-big")
    rng = np.random.default_rng(24)
    base = {f"w{i}": random_tensor(rng, "BF16", (4096, 4096)) for i in range(4)}
    target = {k: mutate(rng, v, 0.01) for k, v in base.items()}
    return save(base, tmp / "old.safetensors"), save(target, tmp / "new.safetensors")


def test_truncated_from_outside_at_random_moments(big_pair, tmp_path):
    """Another process truncates the input while make or apply runs, at random moments. Each run
    either finishes (the cut came after the last read: its output is whole) or fails with the one
    line; none dies by a signal, and a failed one leaves nothing."""
    old, new = big_pair
    patch = tmp_path / "p.pulsediff"
    subprocess.run([*PULSEDIFF, "make", old, new, "-o", patch, "-q"], check=True, timeout=300)
    rng = np.random.default_rng(25)
    for trial in range(6):
        work = tmp_path / f"t{trial}"
        out = work / "out"
        out.mkdir(parents=True)
        victim = _copy(new if trial % 2 else old, work / "victim.safetensors")
        if trial % 2:
            args = ["make", old, victim, "-o", out / "p.pulsediff", "-q"]
        else:
            args = ["apply", victim, patch, "-o", out / "new.safetensors", "-q"]
        proc = subprocess.Popen([*PULSEDIFF, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        delay = float(rng.uniform(0.5, 2.5))  # start-up (imports, Numba's cache) takes most of a second
        timer = threading.Timer(delay, os.truncate, (victim, victim.stat().st_size // 3))
        timer.start()
        _, err = proc.communicate(timeout=300)
        timer.join()
        err = err.decode()
        assert proc.returncode in (0, 1), f"trial {trial}, cut at {delay:.2f} s: exit {proc.returncode}: {err}"
        if proc.returncode == 1:
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("pulsediff: error:"), err
            assert list(out.iterdir()) == [], err


# Another checkpoint, open in the same process, is cut short and read past its new end (the guard
# maps zeros there and marks it); then make and apply of an unrelated pair run in that process.
OTHER_CUT = """
import os, sys
from pathlib import Path
from pulsediff import apply_patch, make_patch
from pulsediff.errors import CheckpointChangedError
from pulsediff.io.checkpoint import Checkpoint
old, new, other, work = map(Path, sys.argv[1:5])
ckpt = Checkpoint(other)
os.truncate(other, other.stat().st_size // 2)
print(int(ckpt.raw_bytes(ckpt.names[-1]).sum()))  # the last tensor lies past the cut: zeros, and a fault
try:
    ckpt.check_intact()
except CheckpointChangedError as exc:
    print("other: refused")
make_patch(old, new, work / "p.pulsediff", device="cpu")
apply_patch(old, work / "p.pulsediff", work / "out.safetensors", device="cpu")
print("same" if (work / "out.safetensors").read_bytes() == new.read_bytes() else "DIFFERENT")
try:
    ckpt.close()
except CheckpointChangedError:
    print("other: refused at close")
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64")),
                    reason="the guard is installed on Linux x86-64 and AArch64 only")
def test_a_checkpoint_that_changed_refuses_only_what_is_made_from_it(pair, tmp_path):
    """make and apply check their own inputs before they commit, not every file mapped in the
    process: a library user's other checkpoint, cut short in another thread's work, refused them
    (review of issue 23's guard: the check was process-wide)."""
    old, new = pair
    other = _copy(old, tmp_path / "other.safetensors")
    proc = subprocess.run([sys.executable, "-c", OTHER_CUT, str(old), str(new), str(other), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[1:4] == ["other: refused", "same", "other: refused at close"], proc.stdout


# A checkpoint closed while a view of it is alive (its map cannot close yet), then cut short.
CLOSED_WITH_A_VIEW = """
import os, sys
from pathlib import Path
from pulsediff.io import mapped
from pulsediff.io.checkpoint import Checkpoint
path = Path(sys.argv[1])
ckpt = Checkpoint(path)
view = ckpt.raw_bytes(ckpt.names[-1])  # keeps the map alive past close
ckpt.close()
os.truncate(path, path.stat().st_size // 2)
print(int(view.sum()))  # past the new end: zeros through the guard, no SIGBUS
mapped.check()  # the closed checkpoint's slot is out of the checks: another output is not refused
ckpt.check_intact()
print("not refused")
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64")),
                    reason="the guard is installed on Linux x86-64 and AArch64 only")
def test_a_checkpoint_closed_with_a_live_view_stays_guarded_but_refuses_nothing_later(pair, tmp_path):
    """Review of issue 23: its slot stayed in every later check, so a file it had once mapped, cut
    short long after, refused a manifest or patch made of other files."""
    victim = _copy(pair[0], tmp_path / "victim.safetensors")
    proc = subprocess.run([sys.executable, "-c", CLOSED_WITH_A_VIEW, str(victim)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "not", "refused"], proc.stdout


# -- the guard itself (pulsediff/io/mapped.py) -----------------------------------------------------

GUARD = """
import mmap, os, sys
import numpy as np
from pulsediff.io import mapped
path, watched = sys.argv[1], sys.argv[2] == "watched"
with open(path, "wb") as f:
    f.write(b"\\1" * (1 << 20))
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
view = np.frombuffer(m, np.uint8)
slot = mapped.watch(view.ctypes.data, len(m), path, len(m)) if watched else None
if not watched:
    mapped.watch(0, 1, "elsewhere", 1)  # the handler is installed, this map is not guarded
os.truncate(path, 4096)
print(int(view[:4096].sum()), int(view.sum()), type(mapped.changed(slot)).__name__, flush=True)
"""


def test_guarded_map_reads_zeros_past_the_new_end_and_says_so(tmp_path):
    if not (sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64")):
        pytest.skip("the guard is installed on Linux x86-64 and AArch64 only")
    proc = subprocess.run([sys.executable, "-c", GUARD, str(tmp_path / "f"), "watched"], capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().split() == ["4096", "4096", "CheckpointChangedError"]


def test_sigbus_outside_the_guarded_maps_still_kills(tmp_path):
    """The handler takes only faults inside the maps it guards: anything else dies as before."""
    if not (sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64")):
        pytest.skip("the guard is installed on Linux x86-64 and AArch64 only")
    proc = subprocess.run([sys.executable, "-c", GUARD, str(tmp_path / "f"), "unguarded"], capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGBUS, proc.stderr.decode()


GUARDED_PLATFORM = sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64")


@pytest.mark.skipif(not GUARDED_PLATFORM, reason="the guard is installed on Linux x86-64 and AArch64 only")
def test_the_guard_is_installed_here():
    """A guard that silently failed to compile (an llvmlite whose LLVM reads the other pointer
    style) would leave every other test here passing by luck or not at all: say so plainly."""
    code = "from pulsediff.io import mapped; print(bool(mapped._install()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr


@pytest.mark.skipif(not GUARDED_PLATFORM, reason="the guard is installed on Linux x86-64 and AArch64 only")
@pytest.mark.parametrize("pointers", ["opaque", "typed"])
def test_the_handler_compiles_in_either_pointer_style_this_llvm_reads(pointers):
    """_parse falls back to the other style: whichever this llvmlite's LLVM reads must verify."""
    import llvmlite.binding as ll

    from pulsediff.io import mapped

    ll.initialize_native_target()
    ir = mapped._ir(4096, pointers == "opaque")
    try:
        ll.parse_assembly(ir).verify()
    except RuntimeError:
        if pointers == "opaque" and ll.llvm_version_info[0] >= 17:
            raise  # LLVM 17 and later read nothing else
        pytest.skip(f"LLVM {ll.llvm_version_info[0]} does not read {pointers} pointers")


SIGNALLED = """
import faulthandler, os, signal, sys
from pulsediff.io import mapped
if sys.argv[1] == "faulthandler":
    faulthandler.enable()
assert mapped._install()
mapped.watch(0, 1, "elsewhere", 1)
os.kill(os.getpid(), signal.SIGBUS)  # si_code SI_USER: not a fault of a guarded map
print("still running", flush=True)
"""


@pytest.mark.skipif(not GUARDED_PLATFORM, reason="the guard is installed on Linux x86-64 and AArch64 only")
@pytest.mark.parametrize("before", ["default", "faulthandler"])
def test_a_sigbus_sent_by_kill_still_ends_the_process_and_keeps_the_handler_before(before):
    """The handler gives a SIGBUS that is not its own back to the action that was there before:
    the default (death by the signal) or faulthandler's (its traceback, then death)."""
    proc = subprocess.run([sys.executable, "-c", SIGNALLED, before], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)
    assert b"still running" not in proc.stdout
    if before == "faulthandler":
        assert b"Fatal Python error: Bus error" in proc.stderr, proc.stderr.decode()


def test_a_new_map_over_a_stale_slot_takes_its_place():
    """A map closed late (by the garbage collector) leaves its slot until then; a new map at an
    overlapping address means the old one is gone, so its slot is cleared, not matched first."""
    from pulsediff.io import mapped

    if not mapped._install():
        pytest.skip("no guard on this platform")
    stale = mapped.watch(1 << 40, 1 << 20, "old", 1 << 20)
    fresh = mapped.watch((1 << 40) + 4096, 4096, "new", 4096)
    try:
        _, ranges, _ = mapped._state
        covering = [s for s in mapped._paths if ranges[2 * s] <= 1 << 40 < ranges[2 * s + 1]]
        assert covering == []  # the stale range [2**40, 2**40 + 1 MiB) is gone
        assert mapped._paths[fresh][:2] == ("new", 4096)
        assert (ranges[2 * fresh], ranges[2 * fresh + 1]) == ((1 << 40) + 4096, (1 << 40) + 8192)
    finally:
        mapped.unwatch(fresh)


FORK_WHILE_HELD = """
import os, threading
from pulsediff.io import mapped
mapped._install()
held, release = threading.Event(), threading.Event()
def hold():
    with mapped._lock:
        held.set()
        release.wait()
t = threading.Thread(target=hold)
t.start()
held.wait()
pid = os.fork()
if pid == 0:
    os._exit(0 if mapped.watch(1 << 41, 4096, "x", 4096) is not None else 3)
release.set()
t.join()
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not GUARDED_PLATFORM, reason="the guard is installed on Linux x86-64 and AArch64 only")
def test_a_fork_while_another_thread_holds_the_guards_lock_leaves_the_child_working():
    proc = subprocess.run([sys.executable, "-c", FORK_WHILE_HELD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", (proc.stdout, proc.stderr)
