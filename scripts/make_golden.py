"""Write the golden files of the current patch format version into tests/golden/.

Run when a format version or codec is added: it writes only the files that do
not exist yet, so the committed ones stay as an older pulsediff wrote them.
Never delete a golden file to "fix" a failing test: the point of those files
is that patches written by an old pulsediff keep applying, byte for byte.

    python scripts/make_golden.py tests/golden/v1      # format 1.0 (committed by pulsediff 0.1.0)
    python scripts/make_golden.py tests/golden/v1.1    # format 1.1: layout digest, model folders
    python scripts/make_golden.py tests/golden/v1.2    # format 1.2: per-tensor word sums
    python scripts/make_golden.py tests/golden/v1.3    # format 1.3: codec ctx-ac
    python scripts/make_golden.py tests/golden/v1.4    # format 1.4: tree tensor hashes (and one flat)
    python scripts/make_golden.py tests/golden/v1.5    # format 1.5: layout.cast (and a bf16 patch of BF16 files)
    python scripts/make_golden.py tests/golden/v2.0    # format 2.0: the tensor table
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pulsediff import make_patch
from pulsediff.ops.inspect import checkpoint_digest_of


CODECS = ("gap-zstd", "ctx-rans", "ctx-ac")
SINCE = {"ctx-ac": (1, 3)}  # codecs newer than format 1.0: no golden file of an older version has them


def version_of(out: Path) -> tuple[int, int]:
    return (tuple(int(x) for x in out.name.lstrip("v").split(".")) + (0,))[:2]


def codecs_of(out: Path) -> tuple[str, ...]:
    return tuple(c for c in CODECS if version_of(out) >= SINCE.get(c, (1, 0)))


def _write_once(path: Path, write) -> None:
    if not path.exists():
        write(path)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    codecs = codecs_of(out)
    rng = np.random.default_rng(20261122)
    g = torch.Generator().manual_seed(20261122)
    w = torch.randn(48, 40, generator=g).bfloat16()
    w2 = w.clone().view(torch.int16)
    w2.view(-1)[torch.from_numpy(rng.choice(w2.numel(), 30, replace=False))] += 1  # 1-ULP moves, as at RL lrs
    base = {"w": w, "f32": torch.randn(64, generator=g), "ids": torch.arange(6), "gone": torch.ones(2)}
    target = {"w": w2.view(torch.bfloat16), "f32": base["f32"] * 2, "ids": base["ids"], "added": torch.zeros(3, dtype=torch.float16)}
    if version_of(out) >= (1, 4):
        # Tree hashes (1.4) of more than one chunk: 280,000 bytes, a whole 256 KiB leaf and a short one.
        big = torch.linspace(-2, 2, 140_000).bfloat16()
        base["big"] = big
        target["big"] = (big.view(torch.int16) + (torch.arange(140_000) % 97 == 5)).view(torch.bfloat16)
    _write_once(out / "base.safetensors", lambda p: save_file(base, str(p), metadata={"step": "0"}))
    _write_once(out / "target.safetensors", lambda p: save_file(target, str(p), metadata={"step": "1"}))
    for codec in codecs:
        _write_once(out / f"exact.{codec}.pulsediff", lambda p: make_patch(
            out / "base.safetensors", out / "target.safetensors", p, codec=codec, device="cpu"))
    if version_of(out) >= (1, 4):  # a 1.4 writer's flat-hashed patch (make --digest flat) reads too
        _write_once(out / "exact.ctx-rans.flat.pulsediff", lambda p: make_patch(
            out / "base.safetensors", out / "target.safetensors", p, device="cpu", digest="flat"))

    m0 = torch.randn(32, 16, generator=g) * 0.02
    m1 = m0 + 1e-6 * torch.randn(32, 16, generator=g).sign()
    _write_once(out / "base32.safetensors", lambda p: save_file({"m": m0}, str(p)))
    _write_once(out / "target32.safetensors", lambda p: save_file({"m": m1}, str(p)))
    _write_once(out / "target32.as-bf16.safetensors", lambda p: save_file({"m": m1.bfloat16()}, str(p)))
    for codec in codecs:
        _write_once(out / f"bf16.{codec}.pulsediff", lambda p: make_patch(
            out / "base32.safetensors", out / "target32.safetensors", p, precision="bf16", codec=codec, device="cpu"))

    expected = {}
    # Each version's digests as its writer recorded them: flat before 1.4, tree from then on.
    scheme = "tree" if version_of(out) >= (1, 4) else "flat"
    for codec in codecs:
        expected[f"exact.{codec}.pulsediff"] = {
            "base": "base.safetensors", "target": "target.safetensors",
            "target_digest": checkpoint_digest_of(out / "target.safetensors", scheme=scheme)}
        expected[f"bf16.{codec}.pulsediff"] = {
            "base": "base32.safetensors", "target": "target32.as-bf16.safetensors",
            "target_digest": checkpoint_digest_of(out / "target32.safetensors", "bf16", scheme=scheme)}
    if version_of(out) >= (1, 4):
        expected["exact.ctx-rans.flat.pulsediff"] = {
            "base": "base.safetensors", "target": "target.safetensors",
            "target_digest": checkpoint_digest_of(out / "target.safetensors", scheme="flat")}
    if version_of(out) >= (1, 5):
        # A bf16 patch of files that are BF16 already (layout.cast false): its appliers write the
        # trainer's layout, metadata and all ("step": "1"), not the base's (FORMAT.md §5.2).
        _write_once(out / "base16.safetensors", lambda p: save_file({"w": w}, str(p), metadata={"step": "0"}))
        _write_once(out / "target16.safetensors", lambda p: save_file({"w": w2.view(torch.bfloat16)}, str(p),
                                                                      metadata={"step": "1"}))
        _write_once(out / "bf16.uncast.ctx-rans.pulsediff", lambda p: make_patch(
            out / "base16.safetensors", out / "target16.safetensors", p, precision="bf16", device="cpu"))
        expected["bf16.uncast.ctx-rans.pulsediff"] = {
            "base": "base16.safetensors", "target": "target16.safetensors",
            "target_digest": checkpoint_digest_of(out / "target16.safetensors", "bf16", scheme=scheme)}
    _folder_cases(out, g, expected, codecs)
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


def _folder_cases(out: Path, g: torch.Generator, expected: dict, codecs: tuple[str, ...]) -> None:
    """Format 1.1 and later: sharded model folders with their other files (config, tokenizer)."""
    if out.name == "v1":
        return  # format 1.0 had no folder files; its golden files are as 0.1.0 wrote them
    def save_folder(folder: Path, tensors: dict, config: str, extra: dict[str, str]) -> None:
        folder.mkdir()
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
        for shard, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, str(folder / shard))
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (folder / "config.json").write_text(config)
        for name, text in extra.items():
            (folder / name).write_text(text)

    base = {"a": torch.randn(16, 8, generator=g).bfloat16(), "b": torch.randn(8, generator=g).bfloat16(),
            "c": torch.randn(4, 4, generator=g).bfloat16(), "d": torch.arange(5)}
    target = dict(base, a=(base["a"].view(torch.int16) + (torch.arange(128).view(16, 8) % 7 == 0)).view(torch.bfloat16))
    tokenizer = json.dumps({"model": {"vocab": {f"t{i}": i for i in range(50)}}})
    _write_once(out / "base_dir", lambda p: save_folder(p, base, '{"model_type": "llama", "step": 0}\n',
                                                        {"tokenizer.json": tokenizer, "notes.txt": "dropped"}))
    _write_once(out / "target_dir", lambda p: save_folder(p, target, '{"model_type": "llama", "step": 1}\n',
                                                          {"tokenizer.json": tokenizer}))
    for codec in codecs:
        name = f"exact.folder.{codec}.pulsediff"
        _write_once(out / name, lambda p: make_patch(out / "base_dir", out / "target_dir", p, codec=codec, device="cpu"))
        expected[name] = {"base": "base_dir", "target": "target_dir",
                          "target_digest": checkpoint_digest_of(out / "target_dir",
                                                                scheme="tree" if version_of(out) >= (1, 4) else "flat")}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder of one format version, e.g. tests/golden/v1.2")
    main(ap.parse_args().out)
