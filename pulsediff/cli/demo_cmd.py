"""`pulsediff demo`: the whole job on a checkpoint pair it makes itself."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path
from typing import Annotated

import typer

from pulsediff.cli.options import Device, Quiet
from pulsediff.cli.output import Output, human_bytes


DEMO_MARK = ".pulsediff-demo"  # in a folder the demo wrote: the next demo replaces its files


def demo(
    directory: Annotated[Path, typer.Option("--dir", help="Where to write the example checkpoints and patch.")] = Path("pulsediff-demo"),
    lr: Annotated[float, typer.Option("--lr", help="Learning rate of the RL-like AdamW step.")] = 1e-6,
    device: Device = "auto",
    force: Annotated[bool, typer.Option("--force", "-f", help="Write the demo's files into a folder that holds files "
                                        "of those names from elsewhere (a previous demo's are replaced anyway).")] = False,
    quiet: Quiet = False,
) -> None:
    """Pretrain a small transformer briefly, take one AdamW step at lr 1e-6, then make, apply, verify and show stats."""
    # OpenMP threads (torch's and Numba's) spin while they wait for work: with
    # the two cores shared, that made a 20-step training 112 s against 14 s
    # passive (the old demo took 3-12 minutes); idle, the two are alike. OpenMP
    # reads the setting when it loads, so it is set before torch and Numba are
    # imported; the user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from pulsediff.ops.apply import apply_patch
    from pulsediff.example import DEMO_RECIPE, make_example_pair
    from pulsediff.ops.inspect import checkpoint_digest_of
    from pulsediff.ops.make import make_patch
    from pulsediff.ops.stats import stats_of_patch_file

    from pulsediff.example import STEP_NAME
    from pulsediff.errors import OutputExistsError

    # Every file the demo writes. A demo just runs again: its own folder (marked) is replaced; files of those
    # names that some other hand put there are replaced only when asked.
    written = [directory / STEP_NAME.format(0), directory / STEP_NAME.format(1), directory / "step.pulsediff",
               directory / "rebuilt.safetensors"]
    existing = next((p for p in written if p.exists() or p.is_symlink()), None)
    if existing is not None and not force and not (directory / DEMO_MARK).is_file():
        raise OutputExistsError(str(existing), "it was not written by a demo: give -f/--force (or another --dir)")
    out = Output(quiet=quiet)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DEMO_MARK).write_text("written by `pulsediff demo`, which replaces this folder's demo files\n")
    warmup = DEMO_RECIPE["warmup_steps"]
    out.info(f"[1/4] training a small Llama-shaped transformer into {directory}/: {warmup} pretraining-like steps, "
             f"then one RL-like AdamW step at lr {lr:g} (FP32 master weights, BF16 checkpoints) ...")
    with out.steps("training", warmup + 1, every=10) as bar:
        old, new = make_example_pair(directory, lr=lr, **DEMO_RECIPE, on_step=lambda done, total, loss: bar.update(
            done, f"{'RL step, ' if done > warmup else ''}loss {loss:.2f}"))
    patch = directory / "step.pulsediff"
    rebuilt = directory / "rebuilt.safetensors"
    out.info(f"[2/4] pulsediff make {old} {new} -o {patch}")
    make_patch(old, new, patch, device=device, progress=out.progress(), force=True)  # the demo's own files
    out.info(f"[3/4] pulsediff apply {old} {patch} -o {rebuilt}")
    apply_patch(old, patch, rebuilt, device=device, progress=out.progress(), force=True)
    identical = filecmp.cmp(rebuilt, new, shallow=False)
    same_digest = checkpoint_digest_of(rebuilt) == checkpoint_digest_of(new)
    if not (identical and same_digest):
        from pulsediff.errors import PulsediffError

        raise PulsediffError(f"demo failed: {rebuilt} differs from {new}")
    out.info(f"[4/4] {rebuilt} is byte-identical to {new} (cmp and digest agree)")
    s = stats_of_patch_file(patch)
    out.table("demo result", ["", ""], [
        ("checkpoint", f"{human_bytes(new.stat().st_size)} ({s.elements:,} elements)"),
        ("changed elements", f"{s.changed:,} ({100 * s.density:.3f}%), {100 * (1 - s.density):.2f}% unchanged"),
        ("patch", human_bytes(s.patch_bytes)),
        ("ratio", f"{s.ratio:.1f}x smaller than the checkpoint"),
        ("bits per changed element", f"{s.bits_per_changed:.2f}" if s.bits_per_changed else "-"),
        ("bit-identical", "yes"),
    ])
