"""`pulsediff publish` and `pulsediff catch-up`: checkpoint series in shell pipelines."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from pulsediff.errors import NotInSeriesError, OutputExistsError, PartialCatchUpError, PulsediffError, UsageError
from pulsediff.cli.checks import check_output
from pulsediff.cli.options import DEFAULT_CODEC, Codec, Device, Json, Precision, Quiet, TrustState
from pulsediff.cli.output import Output, plural



def publish(
    train_dir: Annotated[Path, typer.Argument(help="Folder where the trainer writes checkpoints, one per step (a "
                         "file or folder with the step number in its name); not one checkpoint's own folder.")],
    out_dir: Annotated[str, typer.Argument(metavar="DEST", help="Folder to fill with patches, anchors and manifest.json "
                       "(rsync it), or s3://bucket/prefix (endpoint, region and keys from the AWS_* variables or "
                       "AWS_PROFILE).")],
    anchor_every: Annotated[int, typer.Option("--anchor-every", help="Write a full anchor every N steps.")] = 10,
    keep: Annotated[Optional[int], typer.Option("--keep", help="Keep only the newest N anchors and what follows them.")] = None,
    # One flag, not --skips/--no-skips: the pair takes a help column of its own, which squeezed
    # every description to about 23 columns at 80. --skips (the default) is still accepted.
    no_skips: Annotated[bool, typer.Option("--no-skips", help="Write no skip patches (from 2, 4, 8, ... steps back; "
                                           "they let catch-up take few links).")] = False,
    _skips: Annotated[bool, typer.Option("--skips", hidden=True)] = True,
    watch: Annotated[bool, typer.Option("--watch", help="Keep publishing as new checkpoints appear (TRAIN_DIR "
                   "may be empty at first: the trainer has not saved yet).")] = False,
    interval: Annotated[float, typer.Option("--interval", metavar="SECONDS",
                                            help="Seconds between looks at TRAIN_DIR with --watch.")] = 2.0,
    idle_exit: Annotated[Optional[float], typer.Option("--idle-exit", metavar="SECONDS", help="With --watch: stop after this many "
                         "seconds with no new checkpoint, counted from the start (a first checkpoint being written "
                         "is waited for); exit 1 if TRAIN_DIR never held one.")] = None,
    pattern: Annotated[Optional[str], typer.Option("--step-pattern", help="Regex whose first matching group is the step "
                       "number in a name. Default: the number after 'step', else the last number.")] = None,
    ready: Annotated[Literal["stable", "marker"], typer.Option("--ready", metavar="WHEN", help="When a checkpoint is complete: stable (its files unchanged for "
                     "--settle seconds, and again after reading it) or marker (a NAME.done file beside it, written by "
                     "the trainer once the checkpoint is closed).")] = "stable",
    settle: Annotated[float, typer.Option("--settle", metavar="SECONDS", help="Seconds a checkpoint's files must be unchanged "
                      "before it is published (--ready stable).")] = 2.0,
    precision: Precision = "exact",
    codec: Codec = DEFAULT_CODEC,
    device: Device = "auto",
    digest: Annotated[Optional[Literal["tree", "flat"]], typer.Option("--digest", metavar="SCHEME", help="How a new "
                      "series hashes tensors: tree (the default) or flat (for workers older than pulsediff's format "
                      "1.4). A series keeps the scheme it began with.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Judge every checkpoint as a real run would and "
                       "list the files it would publish (and prune with --keep); make and write nothing.")] = False,
    sign: Annotated[Optional[Path], typer.Option("--sign", metavar="KEYFILE", help="Sign every manifest written "
                    "with this private key (pulsediff keygen); workers check it with catch-up --trust.")] = None,
    trust: Annotated[Optional[list[str]], typer.Option("--trust", metavar="PUBKEY", help="With --sign: also continue "
                     "a series signed by this key (the old one, while rotating keys); ed25519:... or a file of "
                     "them.")] = None,
    trust_state: TrustState = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Turn a trainer's checkpoints into patches and anchors that workers can rsync or fetch from S3."""
    from pulsediff.series.steps import DEFAULT_STEP_PATTERN
    from pulsediff.series.publish import publish as run

    out = Output(quiet=quiet or as_json, as_json=as_json)

    def said(report) -> None:  # once per look that published something (a later one: steps that had to settle)
        if watch:  # a line per step, as catch-up and vllm-sync --watch print theirs
            from pulsediff.cli.output import step_record

            newest = report.newest_found
            for step, nbytes, seconds in report.made:
                out.step(str(out_dir), step_record(step, nbytes, seconds, max(0, (newest or step) - step)))
            return
        steps = report.steps
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {steps[-1]}"
        out.info(f"published {which} into {out_dir}: {plural(report.patches, 'patch', 'patches')} and "
                 f"{plural(report.anchors, 'anchor')}")

    total = run(train_dir, out_dir, watch=watch, interval=interval, idle_exit=idle_exit, on_report=said,
                anchor_every=anchor_every, keep=keep, skips=not no_skips, precision=precision, codec=codec, device=device,
                pattern=pattern or DEFAULT_STEP_PATTERN, ready=ready, settle=settle, sign=sign, trust=trust or None,
                trust_state=trust_state, progress=out.progress(), digest=digest, **({"dry_run": True} if dry_run else {}))
    if as_json:
        summary = {"out_dir": str(out_dir), "steps": total.steps, "patches": total.patches, "anchors": total.anchors,
                   "pruned": total.pruned, "pending": total.pending, "skipped": total.skipped,
                   **({"dry_run": True, "would_write": total.would_write, "would_prune": total.would_prune}
                      if dry_run else {})}
        (out.json_line if watch else out.json)(summary)  # a watch's stdout is JSON lines throughout
        return
    if dry_run:
        for name in total.would_write:
            out.line(f"would write {name}")
        for name in total.would_prune:
            out.line(f"would prune {name}")
    for name, why in total.skipped.items():
        out.info(f"skipped {name}: {why}")
    for name, why in total.pending.items():
        out.info(f"not published yet: {name} ({'still being written' if why == 'settling' else why})")
    if total.pruned:
        out.info(f"pruned {plural(total.pruned, 'file')} older than the newest {plural(keep, 'anchor')}")
    if not (total.patches or total.anchors or total.pending):
        out.info(f"{out_dir} is up to date with {train_dir}")


def catch_up(
    checkpoint: Annotated[Path, typer.Argument(help="The worker's checkpoint (need not exist yet).")],
    patch_dir: Annotated[str, typer.Argument(metavar="SOURCE", help="Where `pulsediff publish` wrote: its folder (or an "
                         "rsync copy), an s3://bucket/prefix, or an http(s):// URL serving that folder.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="OUT", help="Write here instead of updating "
                      "CHECKPOINT in place (it must not exist, unless -f).")] = None,
    plan: Annotated[bool, typer.Option("--plan", help="Only print the files the cheapest chain needs, one per line "
                                       "(names for `rsync --files-from=-`; URLs for a remote SOURCE), judged from the "
                                       "manifest; change nothing.")] = False,
    cache: Annotated[Optional[Path], typer.Option("--cache", help="Remote SOURCE: folder for downloads (resumed from "
                     "there after an interruption). Default: ~/.cache/pulsediff/<one folder per SOURCE>.")] = None,
    trust: Annotated[Optional[list[str]], typer.Option("--trust", metavar="PUBKEY", help="Use only a manifest signed "
                     "by this key (ed25519:..., or a file of them; may be given twice while keys rotate), no older "
                     "than one accepted before, and only files with the SHA-256 it names.")] = None,
    trust_state: TrustState = None,
    device: Device = "auto",
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing OUT; in place, replace a "
                     "CHECKPOINT that is no step of the series (another run or model, or a step it no longer keeps) "
                     "with the newest step, rebuilt from an anchor.")] = False,
    step: Annotated[Optional[int], typer.Option("--step", metavar="N", min=0, help="Go to this step, not the newest "
                    "(an earlier one too: it is rebuilt from an anchor).")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Keep following SOURCE: look again every --interval seconds "
                                        "and print a line per step reached; a failed look (a broken or missing "
                                        "file, a source that cannot be reached) is said in one line, CHECKPOINT "
                                        "stays at its step, and the next look tries again.")] = False,
    interval: Annotated[float, typer.Option("--interval", metavar="SECONDS", min=0.1,
                                            help="With --watch: seconds between looks.")] = 2.0,
    idle_exit: Annotated[Optional[float], typer.Option("--idle-exit", metavar="SECONDS", min=0, help="With --watch: "
                         "stop after this many seconds without a new step.")] = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Bring a checkpoint to the newest published step by the cheapest intact chain."""
    from pulsediff.series.catch_up import catch_up as run

    if watch:
        if step is not None:
            raise UsageError("--watch follows the newest step; leave out --step")
        if plan:
            raise UsageError("--plan looks once; it does not go with --watch")
        if output is not None and not _same_file(output, checkpoint):
            raise UsageError("--watch keeps CHECKPOINT itself at the newest step; leave out -o")
    elif idle_exit is not None:
        raise UsageError("--idle-exit is for --watch")
    if output is not None and not plan and not _same_file(output, checkpoint):
        from pulsediff.series.catch_up import refuse_other_kind

        refuse_other_kind(output, checkpoint)  # before -f is advised: it cannot help there
        check_output(output, force=force)
    out = Output(quiet=quiet or as_json, as_json=as_json)
    if plan:
        from pulsediff.series.catch_up import plan_catch_up

        planned = plan_catch_up(checkpoint, patch_dir, trust=trust or None, trust_state=trust_state,
                                force=force, out=output, step=step)
        if as_json:
            out.json({"step": planned.step, "files": planned.files, "urls": planned.urls, "from_anchor": planned.from_anchor})
            return
        for where in planned.urls:
            out.line(where)
        return
    if watch:
        return _follow(checkpoint, patch_dir, out, interval, idle_exit, device=device, cache=cache, force=force,
                       trust=trust or None, trust_state=trust_state)
    result = run(checkpoint, patch_dir, output, device=device, cache=cache, progress=out.progress(), force=force,
                 trust=trust or None, trust_state=trust_state, step=step)
    if as_json:
        out.json({"output": str(result.output), "status": result.status, "step": result.step,
                  "newest": result.newest, "files": result.files, "from_anchor": result.from_anchor,
                  "skipped": result.problems})
    elif result.status == "partial":
        pass  # its one line is the error below
    elif result.status == "up-to-date" and _same_file(result.output, checkpoint):
        out.info(f"{checkpoint} is already at step {result.step}")
    elif result.status == "up-to-date":
        out.info(f"{checkpoint} is already at step {result.step}, and so now is {result.output}")
    else:
        files = result.files
        if result.from_anchor:
            then = f", then {plural(len(files) - 1, 'patch', 'patches')} ({', '.join(files[1:])})" if files[1:] else ""
            how = f"rebuilt from an anchor ({files[0]}){then}"
            if result.replaced:
                how = f"it was not a step of the series in {patch_dir}, so it was {how}"
        else:
            how = f"applied {plural(len(files), 'patch', 'patches')} to {checkpoint} ({', '.join(files)})"
        out.info(f"{result.output} is now at step {result.step}: {how}")
        for name in result.skipped:
            out.info(f"skipped {name}: {result.problems.get(name, 'missing or damaged')}")
    if result.status == "partial":
        raise PartialCatchUpError(str(result.output), result.step, result.newest, result.stopped)


# Refusals that no later look can change: a usage mistake, a checkpoint of another run, an existing output.
_FINAL = (UsageError, NotInSeriesError, OutputExistsError)


def _follow(checkpoint: Path, source: str, out: Output, interval: float, idle_exit: float | None, **kwargs) -> None:
    """catch-up --watch: the checkpoint kept at the newest step (cli/watch.py's loop)."""
    from pulsediff.cli.output import step_record
    from pulsediff.cli.watch import follow
    from pulsediff.series.catch_up import catch_up as run

    at = None  # the step the checkpoint is at, once known

    def look(start: float) -> tuple[dict | None, str]:
        nonlocal at
        result = run(checkpoint, source, None, progress=out.progress(), **kwargs)  # quiet under --json
        at = result.step
        record = None if result.status == "up-to-date" else step_record(
            result.step, result.bytes, time.perf_counter() - start, result.newest - result.step, files=result.files)
        stopped = f"stopped short of step {result.newest}: {result.stopped}" if result.status == "partial" else ""
        return record, stopped

    def failed(exc: PulsediffError) -> str:
        return f"{f'stays at step {at}' if at is not None else 'stays as it is'}: {exc}"

    follow(look, out, str(checkpoint), interval, idle_exit, _FINAL, failed, lambda: {"step": at})


def _same_file(a: Path, b: Path) -> bool:
    return a == b or a.resolve() == b.resolve()
