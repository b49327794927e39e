"""The real pipeline, end to end: trainer -> publish --watch -> rsync -> catch-up.

A small training loop writes checkpoints into a folder while `pulsediff
publish --watch` runs beside it; `rsync -a` copies the patch folder to a
receiver on a loop, and the receiver runs `pulsediff catch-up`. At the end
the receiver's checkpoint must be byte-identical to the trainer's last one,
also when a patch is deleted or corrupted in the receiver's copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pulsediff.format.manifest import Manifest
from pulsediff.series.publish import publish_once

PULSEDIFF = [sys.executable, "-m", "pulsediff"]
STEPS = 7

TRAINER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from safetensors.torch import save_file
    out = Path(sys.argv[1]); steps = int(sys.argv[2])
    torch.manual_seed(0)
    class Tiny(torch.nn.Module):  # named like a transformer, so stats can sort layers by type
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(256, 64)
            self.q_proj = torch.nn.Linear(64, 64)
            self.up_proj = torch.nn.Linear(64, 64)
            self.norm = torch.nn.LayerNorm(64)
            self.lm_head = torch.nn.Linear(64, 256)
        def forward(self, t):
            x = self.embed_tokens(t)
            x = x + torch.tanh(self.q_proj(x))
            return self.lm_head(self.norm(x + torch.relu(self.up_proj(x))))
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (64, 16))
    def loss():
        x = model(data[:, :-1]); return torch.nn.functional.cross_entropy(x.reshape(-1, 256), data[:, 1:].reshape(-1))
    for _ in range(30):  # pretrain-like warm-up
        opt.zero_grad(); loss().backward(); opt.step()
    for g in opt.param_groups: g["lr"] = 1e-5
    for step in range(steps + 1):
        if step:
            opt.zero_grad(); loss().backward(); opt.step()
        save_file({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()},
                  str(out / f"step_{step:06d}.safetensors"))
        time.sleep(0.4)
""")


def rsync(src: Path, dst: Path) -> None:
    """Mirror the folder the way the README says: without publish's in-progress temporaries, which a rename
    can take away between rsync's listing and its read (exit 24, "some files vanished")."""
    proc = subprocess.run(["rsync", "-a", "--exclude=*.pulsediff-tmp", f"{src}/", f"{dst}/"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, f"rsync exit {proc.returncode}: {proc.stderr.decode()}"


def catch_up(ckpt: Path, folder: Path, quiet: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*PULSEDIFF, "catch-up", str(ckpt), str(folder), *(["-q"] if quiet else [])],
                          capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    if shutil.which("rsync") is None:
        if os.environ.get("CI"):
            pytest.fail("rsync is missing: .ci/run must install it")
        pytest.skip("rsync is not installed")
    root = tmp_path_factory.mktemp("pipeline")
    train, pub, recv = root / "train", root / "pub", root / "recv"
    for d in (train, pub, recv):
        d.mkdir()
    worker = root / "worker.safetensors"
    (root / "trainer.py").write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(root / "trainer.py"), str(train), str(STEPS)])
    # --idle-exit counts from the start while train/ is empty: the publisher starts once the trainer (torch's
    # import and warm-up, seconds on a busy machine) has saved, as a user would give it more time otherwise.
    deadline = time.monotonic() + 120
    while not any(train.iterdir()) and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    publisher = subprocess.Popen([*PULSEDIFF, "publish", str(train), str(pub), "--watch", "--interval", "0.2",
                                  "--idle-exit", "4", "--anchor-every", "3", "-q"])
    catch_ups = 0
    try:
        deadline = time.monotonic() + 240
        while publisher.poll() is None and time.monotonic() < deadline:
            rsync(pub, recv)
            if (recv / "manifest.json").exists():
                catch_ups += catch_up(worker, recv).returncode == 0
            time.sleep(0.3)
    finally:
        trainer.wait(timeout=120)
        if publisher.poll() is None:
            publisher.kill()
    assert trainer.returncode == 0 and publisher.returncode == 0
    rsync(pub, recv)
    proc = catch_up(worker, recv)
    assert proc.returncode == 0, proc.stderr.decode()
    return root, train, recv, worker, catch_ups


def test_receiver_ends_byte_identical(pipeline):
    root, train, recv, worker, catch_ups = pipeline
    last = train / f"step_{STEPS:06d}.safetensors"
    assert worker.read_bytes() == last.read_bytes()
    assert catch_ups >= 1  # the worker followed along while training ran, not only at the end
    manifest = Manifest.load(recv)
    assert {e.step for e in manifest.entries} == set(range(STEPS + 1))
    assert [e.step for e in manifest.entries if e.kind == "anchor"] == [0, 3, 6]


def start_at_step(root: Path, train: Path, step: int, name: str) -> Path:
    ckpt = root / name
    shutil.copy(train / f"step_{step:06d}.safetensors", ckpt)
    return ckpt


def test_deleted_patch_falls_back_to_an_anchor(pipeline):
    root, train, recv, _, _ = pipeline
    copy = root / "recv-deleted"
    shutil.copytree(recv, copy)
    (copy / "patch-00000005-00000006.pulsediff").unlink()  # the only patch that starts at step 5
    ckpt = start_at_step(root, train, 5, "w-del.safetensors")
    proc = catch_up(ckpt, copy, quiet=False)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "from an anchor" in proc.stderr.decode()
    assert ckpt.read_bytes() == (train / f"step_{STEPS:06d}.safetensors").read_bytes()


def test_corrupted_patch_falls_back_and_never_gives_a_wrong_result(pipeline):
    root, train, recv, _, _ = pipeline
    copy = root / "recv-corrupt"
    shutil.copytree(recv, copy)
    victim = copy / "patch-00000005-00000006.pulsediff"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    ckpt = start_at_step(root, train, 5, "w-bad.safetensors")
    proc = catch_up(ckpt, copy, quiet=False)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "skipped patch-00000005-00000006.pulsediff: damaged" in proc.stderr.decode()
    assert "from an anchor" in proc.stderr.decode()
    assert ckpt.read_bytes() == (train / f"step_{STEPS:06d}.safetensors").read_bytes()


def test_skip_patches_keep_catch_up_short(pipeline):
    root, train, recv, _, _ = pipeline
    ckpt = start_at_step(root, train, 0, "w-skip.safetensors")
    proc = catch_up(ckpt, recv, quiet=False)
    assert proc.returncode == 0, proc.stderr.decode()
    applied = len(re.findall(r"(?:patch|anchor)-[\d-]+\.pulsediff", proc.stderr.decode()))  # the files it names
    assert applied <= 3  # skip patches or an anchor: never seven one-step links
    assert ckpt.read_bytes() == (train / f"step_{STEPS:06d}.safetensors").read_bytes()


def test_unreachable_newest_step_stops_at_the_newest_reachable_one(pipeline):
    root, train, recv, _, _ = pipeline
    copy = root / "recv-last-bad"
    shutil.copytree(recv, copy)
    last = copy / "patch-00000006-00000007.pulsediff"
    last.write_bytes(last.read_bytes()[:-1])  # the only way to step 7
    ckpt = start_at_step(root, train, 4, "w-partial.safetensors")
    proc = catch_up(ckpt, copy)
    assert proc.returncode == 4 and b"is now at step 6 of 7; stopped: patch-00000006-00000007.pulsediff" in proc.stderr
    assert ckpt.read_bytes() == (train / "step_000006.safetensors").read_bytes()
    # from step 6 nothing newer is reachable: an error, and the checkpoint is untouched
    before = ckpt.read_bytes()
    proc = catch_up(ckpt, copy)
    assert proc.returncode == 1 and b"no intact chain" in proc.stderr
    assert ckpt.read_bytes() == before


def test_keep_prunes_old_chains_but_keeps_what_the_newest_anchor_needs(pipeline, tmp_path):
    root, train, _, _, _ = pipeline
    out = tmp_path / "pub"
    publish_once(train, out, anchor_every=2, keep=2, device="cpu")
    manifest = Manifest.load(out)
    anchors = sorted(e.step for e in manifest.entries if e.kind == "anchor")
    assert anchors == [4, 6]
    assert min(e.step for e in manifest.entries) == 4
    assert all(e.step > 4 for e in manifest.entries if e.kind == "patch")
    assert sorted(p.name for p in out.iterdir() if p.name != "manifest.json") == sorted(e.file for e in manifest.entries)
    worker = tmp_path / "fresh.safetensors"
    assert catch_up(worker, out).returncode == 0
    assert worker.read_bytes() == (train / f"step_{STEPS:06d}.safetensors").read_bytes()
    assert json.loads((out / "manifest.json").read_text())["version"] == 1


def test_series_stats_and_plot(pipeline, tmp_path):
    _, train, _, _, _ = pipeline
    png = tmp_path / "series.png"
    proc = subprocess.run([*PULSEDIFF, "stats", str(train), "--json", "--plot", str(png)], capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    s = json.loads(proc.stdout)
    assert s["steps"] == list(range(STEPS + 1))
    assert [d["k"] for d in s["k_step_density"]] == [1, 2, 4]
    pair = json.loads(subprocess.run([*PULSEDIFF, "stats", str(train / "step_000002.safetensors"),
                                      str(train / "step_000003.safetensors"), "--json"], capture_output=True).stdout)
    assert s["step_density"][2]["changed"] == pair["changed"]
    densities = [d["density"] for d in s["k_step_density"]]
    assert 0 < densities[0] <= densities[1] <= densities[2] < 1  # further apart, more changed
    assert set(s["layer_density"]) <= {"attention", "mlp", "embeddings", "norms", "lm_head", "other"}
    assert {"attention", "mlp", "embeddings", "norms", "lm_head"} <= set(s["layer_density"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def plan(ckpt: Path, folder: Path) -> list[str]:
    proc = subprocess.run([*PULSEDIFF, "catch-up", str(ckpt), str(folder), "--plan"], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode().splitlines()


def test_plan_lets_a_worker_fetch_only_the_files_it_needs(pipeline):
    """manifest first, then `catch-up --plan | rsync --files-from=-`: no anchor crosses the link."""
    root, train, recv, _, _ = pipeline
    inbox = root / "inbox-plan"
    inbox.mkdir()
    shutil.copy(recv / "manifest.json", inbox / "manifest.json")
    ckpt = start_at_step(root, train, 2, "w-plan.safetensors")
    needed = plan(ckpt, inbox)
    assert needed and not any(name.startswith("anchor") for name in needed)
    subprocess.run(["rsync", "-a", "--files-from=-", f"{recv}/", f"{inbox}/"], input="\n".join(needed).encode(),
                   check=True, capture_output=True, timeout=60)
    assert sorted(p.name for p in inbox.iterdir()) == sorted(["manifest.json", *needed])
    proc = catch_up(ckpt, inbox, quiet=False)
    assert proc.returncode == 0, proc.stderr.decode()
    assert f"({', '.join(needed)})" in proc.stderr.decode()  # it applied exactly the planned chain
    assert ckpt.read_bytes() == (train / f"step_{STEPS:06d}.safetensors").read_bytes()
    assert plan(ckpt, inbox) == []  # up to date: nothing to fetch
    fresh = plan(root / "no-such-worker.safetensors", inbox)
    assert fresh[0].startswith("anchor")  # a fresh worker starts from an anchor
