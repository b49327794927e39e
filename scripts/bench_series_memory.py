#!/usr/bin/env python
"""What a codec with memory could save on a series (issue 34, part 2): a prototype of ideal code lengths.

    python scripts/gen_series.py --out DIR --lrs 3e-6 --steps 12
    python scripts/bench_series_memory.py DIR/lr3e-06 [--history 1 2 4]

For each step t of the series (pair t-1 -> t) it measures, in bits per changed element:

- ctx-ac: the bytes `ctx-ac` writes for the BF16 tensors' sections (the memoryless codec as built);
- memoryless ideal: every element's "changed?" coded by an adaptive binary model per exponent
  class (KT counts, as ctx-ac's), and each change's sign at 1 bit: the reference the memory model
  is compared with, so that both sides pay the same modelling approximations;
- with memory: the same, with the context extended by what a worker following the series already
  holds: how many steps ago the element last changed (0 = never within the history, capped at
  --history) and, for the sign, the sign of its last change (when within the history).

The gain is memory / memoryless ideal, applied to ctx-ac's size as the estimate of a memory codec.
The state a worker keeps for it: ceil(log2(history + 1)) + 1 bits per element (age, last sign).
Positions are modelled per element here (a walk over every element of the base); a real codec
would code the recently changed elements as a flag list and the rest as ctx-ac does.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@njit(cache=True)
def _kt_cost(n0, n1, bit):
    p0 = (n0 + 0.5) / (n0 + n1 + 1.0)
    return -math.log2(p0 if bit == 0 else 1.0 - p0)


@njit(cache=True)
def series_step_cost(base, target, age, last_sign, history):
    """Ideal bits (memoryless, with memory) for one step of one tensor; updates age and last_sign.

    age[i]: steps since element i last changed (0: not within `history`); last_sign[i]: 1 if that
    change went down. Contexts: exponent class (8 bits of BF16) x age for "changed?", and age > 0
    x last sign for the sign."""
    classes = 256
    ages = history + 1
    c0 = np.zeros((classes, ages), np.float64)  # counts of "unchanged" per context
    c1 = np.zeros((classes, ages), np.float64)
    m0 = np.zeros(classes, np.float64)  # the memoryless model: class only
    m1 = np.zeros(classes, np.float64)
    s0 = np.zeros((2, 2), np.float64)  # sign contexts: (has a last sign, last sign) -> counts of up / down
    s1 = np.zeros((2, 2), np.float64)
    memoryless = 0.0
    memory = 0.0
    for i in range(base.size):
        c = (base[i] >> 7) & 0xFF
        a = age[i]
        changed = 1 if base[i] != target[i] else 0
        memoryless += _kt_cost(m0[c], m1[c], changed)
        memory += _kt_cost(c0[c, a], c1[c, a], changed)
        if changed:
            m1[c] += 1
            c1[c, a] += 1
            down = 1 if ((np.int32(target[i]) - np.int32(base[i])) & 0xFFFF) >= 0x8000 else 0
            known = 1 if a > 0 else 0
            ctx = last_sign[i] if known else 0
            memoryless += 1.0
            memory += _kt_cost(s0[known, ctx], s1[known, ctx], down)
            if down:
                s1[known, ctx] += 1
            else:
                s0[known, ctx] += 1
            age[i] = 1
            last_sign[i] = down
        else:
            m0[c] += 1
            c0[c, a] += 1
            if a > 0:
                age[i] = a + 1 if a < history else 0
    return memoryless, memory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("series", type=Path, help="a folder of step_*.safetensors (scripts/gen_series.py)")
    ap.add_argument("--history", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from pulsediff.codecs import get_codec
    from pulsediff.io.dtypes import DTYPES

    steps = sorted(args.series.glob("step_*.safetensors"))
    if len(steps) < 3:
        raise SystemExit("need a series of 3 or more steps")
    states = [load_file(str(p)) for p in steps]
    names = [n for n, t in states[0].items() if t.dtype == torch.bfloat16]
    bits = [{n: s[n].view(torch.int16).numpy().view(np.uint16).ravel() for n in names} for s in states]
    codec = get_codec("ctx-ac")
    print(f"{args.series}: {len(steps)} steps, {len(names)} BF16 tensors\n")
    print("| step | changed | ctx-ac b/el | " + " | ".join(f"history {h}: gain, est. b/el" for h in args.history)
          + " |")
    print("|---:|---:|---:|" + "---:|" * len(args.history))
    memo = {h: ({n: np.zeros(bits[0][n].size, np.int64) for n in names},
                {n: np.zeros(bits[0][n].size, np.int64) for n in names}) for h in args.history}
    totals = {h: [0.0, 0.0] for h in args.history}
    for t in range(1, len(steps)):
        changed = 0
        ac_bits = 0
        ideal = {h: [0.0, 0.0] for h in args.history}
        for n in names:
            a, b = bits[t - 1][n], bits[t][n]
            m, enc = codec.encode_pair(a, b, dtype=DTYPES["BF16"])
            changed += m
            ac_bits += 8 * enc.length if enc is not None else 0
            for h in args.history:
                age, sign = memo[h]
                lo, hi = series_step_cost(a, b, age[n], sign[n], h)
                ideal[h][0] += lo
                ideal[h][1] += hi
        row = [f"{t}", f"{100 * changed / sum(x.size for x in bits[t].values()):.2f}%", f"{ac_bits / changed:.2f}"]
        for h in args.history:
            gain = 1 - ideal[h][1] / ideal[h][0]
            if t > h:  # the first steps have no history yet
                totals[h][0] += ac_bits
                totals[h][1] += ac_bits * (1 - gain)
            row.append(f"{100 * gain:.1f}%, {ac_bits * (1 - gain) / changed:.2f}")
        print("| " + " | ".join(row) + " |")
    print()
    for h in args.history:
        state_bits = math.ceil(math.log2(h + 1)) + 1
        print(f"history {h}: steps past the first {h}, ctx-ac {totals[h][0] / 8e3:,.1f} kB -> est. "
              f"{totals[h][1] / 8e3:,.1f} kB ({100 * (1 - totals[h][1] / max(totals[h][0], 1)):.1f}% smaller); "
              f"worker state {state_bits} bits per element ({100 * state_bits / 16:.0f}% of the BF16 model)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
