"""Small checkpoints for tests, written with the safetensors library itself.

Tensors are built from raw random bits, so every bit pattern (NaNs, infinities,
signed zeros, subnormals) occurs, and changes are made on bit patterns.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pulsediff.io.dtypes import DTYPES

TORCH_DTYPES = {name: getattr(torch, d.torch_name) for name, d in DTYPES.items() if hasattr(torch, d.torch_name)}


def random_tensor(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    d = DTYPES[dtype]
    n = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, n * d.itemsize, dtype=np.uint8)
    if dtype == "BOOL":
        raw &= 1  # torch bools must be 0 or 1
    if n == 0:
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    t = torch.from_numpy(raw.copy()).view(TORCH_DTYPES[dtype])
    return t.reshape(shape)


def mutate(rng: np.random.Generator, t: torch.Tensor, density: float) -> torch.Tensor:
    """A copy of t with about `density` of its elements given new bit patterns."""
    out = t.clone()
    n = out.numel()
    if n == 0 or density == 0:
        return out
    itemsize = out.element_size()
    bits = out.reshape(-1).view(torch.uint8).numpy().reshape(n, itemsize) if itemsize > 1 else out.reshape(-1).view(torch.uint8).numpy().reshape(n, 1)
    mask = rng.random(n) < density
    if density >= 1.0:
        mask[:] = True
    if t.dtype == torch.bool:
        bits[mask, 0] ^= 1
    else:
        flip = rng.integers(1, 256, size=(int(mask.sum()),), dtype=np.uint8)
        bits[mask, 0] ^= flip  # a nonzero XOR: the element's bits really change
    return out


def save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path, shards: int, metadata: dict | None = None) -> Path:
    """A Hugging Face style folder: model-0000k-of-0000n.safetensors + index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save({n: tensors[n] for n in part}, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def save_series(folder: Path, steps: int, *, seed: int, shape: tuple[int, ...], tensors: int, density: float) -> None:
    """step_000000.safetensors .. step_{steps}: BF16 layers, each step changing about `density` of every tensor."""
    rng = np.random.default_rng(seed)
    state = {f"layers.{i}.weight": random_tensor(rng, "BF16", shape) for i in range(tensors)}
    for step in range(steps + 1):
        if step:
            state = {k: mutate(rng, v, density) for k, v in state.items()}
        save(state, folder / f"step_{step:06d}.safetensors")
