#!/usr/bin/env python
"""Where a live apply into CUDA tensors spends its time: the host (Python, launches, syncs) or
the device (kernels). For issue 45's GPU item: on an H200, `apply_to_state_dict` into a 7B
shape takes about 2.1 s while its kernels, scaled from one large tensor, need about 0.4 s.

    python scripts/profile_gpu_live.py                 # 4 layers of the 7B shape, 1% changed
    python scripts/profile_gpu_live.py --layers 32     # the whole 7B shape
    NUMBA_ENABLE_CUDASIM=1 python scripts/profile_gpu_live.py --tiny   # checks the script runs

One warm-up apply (kernels compiled and loaded), then, each from the same base:
- the wall time of `apply_to_state_dict` (median of --repeats), checked bit for bit;
- cProfile of one apply: the Python functions by own time and by time below them;
- torch.profiler of one apply (a real GPU only): device time per kernel, host time per CUDA
  runtime call (launches, copies, synchronisations) and how many of each.
Device busy time against the wall time is the split the issue needs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_gpu import llama_7b_shapes  # noqa: E402  (the one definition of the 7B shape)
from benchlib import alternate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="toy sizes for the Numba CUDA simulator")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from numba import config

    from pulsediff.ops.live import apply_to_state_dict
    from pulsediff.ops.make import make_patch_bytes

    simulated = bool(config.ENABLE_CUDASIM)
    if simulated and not args.tiny:
        print("the simulator measures nothing: use --tiny to check the script", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available() and not simulated
    shapes = (llama_7b_shapes(vocab=24, hidden=8, inter=12, layers=1) if args.tiny
              else llama_7b_shapes(layers=args.layers))
    gen = torch.Generator().manual_seed(args.seed)
    old, new = {}, {}
    for name, shape in shapes:
        o = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        bits = o.view(torch.int16).clone()
        flat = bits.view(-1)
        picked = torch.rand(flat.numel(), generator=gen) < args.density
        picked[0] = True  # a toy tensor changes too
        where = picked.nonzero().flatten()
        flat[where] += torch.where(torch.rand(where.numel(), generator=gen) < 0.5, 1, -1).to(torch.int16)  # +-1 ULP
        old[name], new[name] = o, bits.view(torch.bfloat16)
    changes = sum(int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in old)
    elements = sum(t.numel() for t in old.values())
    patch = make_patch_bytes(old, new, device="cpu")
    device = "cuda" if on_gpu else "cpu"  # the simulator runs the CUDA kernels on torch CPU tensors
    base = {n: t.to(device) for n, t in old.items()}
    live = {n: t.clone() for n, t in base.items()}

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def restore():
        for n in live:
            live[n].copy_(base[n])
        sync()

    def once() -> float:
        restore()
        t0 = time.perf_counter()
        apply_to_state_dict(live, patch)
        sync()
        return time.perf_counter() - t0

    print(f"## Live apply, profiled: {len(shapes)} tensors, {elements:,} BF16 elements, {changes:,} changes, "
          f"patch {len(patch):,} bytes, on {torch.cuda.get_device_name() if on_gpu else device}\n")
    once()  # warm-up: compiles or loads the kernels
    walls = alternate({"apply": once}, args.repeats, warmup=False)["apply"]  # once() times its own region
    exact = all(torch.equal(live[n].view(torch.int16).cpu(), new[n].view(torch.int16)) for n in live)
    print(f"wall: median {statistics.median(walls) * 1e3:.1f} ms of {args.repeats} "
          f"({', '.join(f'{w * 1e3:.1f}' for w in walls)}); bit for bit: {'yes' if exact else 'NO'}\n")

    restore()
    prof = cProfile.Profile()
    prof.enable()
    apply_to_state_dict(live, patch)
    sync()
    prof.disable()
    for key, count in (("tottime", 30), ("cumtime", 30)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(count)
        text = out.getvalue()
        print(f"### cProfile by {key}\n\n```\n{text[text.find('ncalls'):].rstrip()}\n```\n")

    if on_gpu:
        from torch.profiler import ProfilerActivity, profile

        restore()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            t0 = time.perf_counter()
            apply_to_state_dict(live, patch)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels, runtime = {}, {}
        for e in tp.events():
            dev_us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) or 0
            if e.device_type.name == "CUDA":
                n, us = kernels.get(e.name, (0, 0.0))
                kernels[e.name] = (n + 1, us + dev_us)
            elif e.name.startswith("cuda") or e.name.startswith("cu"):
                n, us = runtime.get(e.name, (0, 0.0))
                runtime[e.name] = (n + 1, us + e.cpu_time)
        busy = sum(us for _, us in kernels.values()) / 1e3
        print(f"### torch.profiler (one apply, {wall * 1e3:.1f} ms under the profiler)\n")
        print(f"device busy (sum of kernel and copy times): {busy:.1f} ms\n")
        print("| device activity | count | ms |\n|---|---:|---:|")
        for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"| `{name[:90]}` | {n} | {us / 1e3:.2f} |")
        print("\n| host runtime call | count | ms |\n|---|---:|---:|")
        for name, (n, us) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:20]:
            print(f"| `{name[:90]}` | {n} | {us / 1e3:.2f} |")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
