"""`pulsediff keygen KEYFILE`: an Ed25519 key pair for signing a series (publish --sign, catch-up --trust)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsediff.cli.options import Force, Json, Quiet


def keygen(
    keyfile: Annotated[Path, typer.Argument(metavar="KEYFILE", help="Where to write the private key (mode 0600).")],
    public: Annotated[bool, typer.Option("--public", help="Write nothing: print the public key of the private "
                                         "key in KEYFILE.")] = False,
    force: Force = False,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Make a key pair for signing a series; print its public key (one line, ed25519:...).

    The private key stays on the publisher (pulsediff publish --sign KEYFILE); workers get the public key (pulsediff catch-up --trust ed25519:...).
    """
    from pulsediff.series.signing import keygen as make, load_private_key, public_key_text
    from pulsediff.cli.output import Output

    out = Output(quiet=quiet or as_json, as_json=as_json)
    key = public_key_text(load_private_key(keyfile)) if public else make(keyfile, force=force)
    if as_json:
        out.json({"keyfile": str(keyfile), "public_key": key})
        return
    out.line(key)
    if not public:
        out.info(f"wrote the private key to {keyfile} (readable by you only; keep it on the publisher); "
                 f"give workers the public key above: pulsediff catch-up ... --trust {key}")
