"""Names, constants and file-kind sniffing that reading a header or a manifest needs, without numpy
or mmap (io/checkpoint.py re-exports them), so that `stats PATCH` and help start in a fraction of a
second."""

from __future__ import annotations

from pulsediff.io.safetensors_header import MAX_HEADER_BYTES

INDEX_NAME = "model.safetensors.index.json"
PRECISIONS = ("exact", "bf16")
PATCH_MAGIC = b"PULSEDIF"


def is_plain_filename(name: str) -> bool:
    """A name that stays inside its folder: no separators, no '..', no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


# torch.save writes a zip archive (since PyTorch 1.6) or, before that, a bare pickle
# (protocol 2 and up start with 0x80 then the protocol number).
_ZIP_MAGIC = b"PK\x03\x04"
PICKLE_ADVICE = (
    "it is a PyTorch pickle checkpoint (torch.save, .bin/.pt), which pulsediff does not load because "
    "unpickling can run code; where you trust the file, convert it: "
    "safetensors.torch.save_file(torch.load(PATH, weights_only=True), 'model.safetensors')"
)

# A patch given where a checkpoint belongs (its magic would otherwise read as a header length of 5e18):
# a patch's first bytes are format/container.py's MAGIC, a layer above this one; a test pins the two equal.
PATCH_ADVICE = ("it is a pulsediff patch, not a checkpoint; apply it to its base (pulsediff apply BASE {path} -o OUT) "
                "or look inside (pulsediff stats {path})")


def looks_like_pickle(prefix: bytes) -> bool:
    """True for the first bytes of a torch.save file. Never unpickles anything.

    A safetensors file's first 8 bytes are its header length, which may
    happen to begin with the same bytes, but its 9th byte is always the
    header's opening brace.
    """
    if prefix[8:9] == b"{":
        return False
    return prefix.startswith(_ZIP_MAGIC) or (len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5)


def looks_like_safetensors(prefix: bytes) -> bool:
    """True for the first 9 bytes of a safetensors file (header length in bounds, then a JSON object)."""
    return len(prefix) >= 9 and prefix[8:9] == b"{" and 2 <= int.from_bytes(prefix[:8], "little") <= MAX_HEADER_BYTES
