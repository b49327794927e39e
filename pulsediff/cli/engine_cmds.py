"""`pulsediff vllm-sync`: keep a running `vllm serve` at a series' newest step (engines/vllm_client.py)."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from pulsediff.cli.options import Json, Quiet
from pulsediff.cli.output import Output
from pulsediff.errors import NotInSeriesError, UsageError


def vllm_sync(
    server: Annotated[str, typer.Argument(help="The vLLM server's URL, e.g. http://127.0.0.1:8000. It must run with "
                                          "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                          "'{\"backend\": \"pulsediff\"}'.")],
    source: Annotated[str, typer.Argument(help="A published series (a folder, s3://bucket/prefix or http(s):// URL) "
                                          "or one patch file, readable both here and by the server's workers "
                                          "(the same path, or a URL).")],
    step: Annotated[Optional[int], typer.Option("--step", metavar="N", min=0,
                                                help="Move to this step, not the newest.")] = None,
    trust: Annotated[Optional[list[str]], typer.Option("--trust", metavar="PUBKEY", help="Take only a series signed by "
                     "this key (ed25519:..., or a file of them, read here; may be given twice). The server's own "
                     "PULSEDIFF_VLLM_TRUST, if set, decides.")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Keep following SOURCE: look again every --interval "
                                        "seconds until interrupted (Ctrl-C).")] = False,
    interval: Annotated[float, typer.Option("--interval", metavar="SECONDS", min=0.1,
                                            help="With --watch: seconds between looks.")] = 2.0,
    idle_exit: Annotated[Optional[float], typer.Option("--idle-exit", metavar="SECONDS", min=0, help="With --watch: "
                         "stop after this many seconds without a new step.")] = None,
    prepare_ahead: Annotated[float, typer.Option("--prepare-ahead", metavar="SECONDS", min=0.0,
                                                 help="Have the server's workers fetch, check and decode each update "
                                                 "in the background while it goes on generating, and pause only "
                                                 "this many seconds later: the pause then lasts for the load "
                                                 "alone (0: pause at once).")] = 0.0,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace weights the series does not list (another "
                                        "run's, or a step it no longer keeps) with its step, from an anchor. "
                                        "Without it they are refused, as catch-up refuses them.")] = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Move a running vLLM server to a step of a series: pause, verified update, caches reset, resume.

    Everything is checked before the server's weights change: a wrong base, a damaged or missing patch, a missing step or a bad signature leave it serving its old weights. With tensor or pipeline parallelism every worker takes the step, or none does.
    """
    from pulsediff.engines.vllm_client import ServerClient, sync_server

    out = Output(quiet=quiet or as_json, as_json=as_json)
    client = ServerClient(server)
    if watch and step is not None:
        raise UsageError("--watch follows the newest step; leave out --step")
    if idle_exit is not None and not watch:
        raise UsageError("--idle-exit is for --watch")
    if not watch:
        result = sync_server(server, source, step=step, trust=trust or None, client=client, prepare_ahead=prepare_ahead,
                             force=force)
        if as_json:
            out.json({"status": result.status, "weight_version": result.version, "before": result.before,
                      "seconds": round(result.seconds, 3), "prepared_ahead": round(result.prepared_ahead, 3),
                      "bytes": result.bytes, "lag": result.lag})
        elif result.status == "up-to-date":
            out.info(f"{server} is already at {_shown(result.version)}")
        else:
            ahead = f", prepared {result.prepared_ahead:.1f} s before" if result.prepared_ahead else ""
            out.info(f"{server} is now at {_shown(result.version)} (was {result.before or 'unknown'}; "
                     f"generation paused {result.seconds:.2f} s{ahead})")
        return
    _follow(server, source, client, out, interval, idle_exit, trust=trust or None, prepare_ahead=prepare_ahead,
            force=force)


# Refusals that no later look can change: a usage mistake, weights of another run.
_FINAL = (UsageError, NotInSeriesError)


def _follow(server: str, source: str, client, out: Output, interval: float, idle_exit: float | None,
            **kwargs) -> None:
    """vllm-sync --watch: a line per step the server takes, its pause too (cli/watch.py's loop); the server
    keeps serving its weights while a look fails."""
    from pulsediff.cli.output import step_record
    from pulsediff.cli.watch import follow
    from pulsediff.engines.vllm_client import sync_server

    def look(start: float) -> tuple[dict | None, str]:
        result = sync_server(server, source, client=client, **kwargs)
        if result.status == "up-to-date":
            return None, ""
        step = int(result.version) if result.version.isdigit() else result.version
        return step_record(step, result.bytes, time.perf_counter() - start, result.lag,
                           pause=round(result.seconds, 3), before=result.before), ""

    follow(look, out, server, interval, idle_exit, _FINAL, lambda exc: f"keeps its weights: {exc}", dict)


def _shown(version: str) -> str:
    """A weight version as the user reads it: "step 12", or a patch's target digest as it is."""
    return f"step {version}" if version.isdigit() else version
