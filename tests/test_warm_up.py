"""ops.warm.warm_up: after it, a first apply of the dtypes it was given loads no kernel (no Numba
dispatcher gains a signature), so a server's first update costs what its next ones do."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_after_warm_up_a_first_apply_loads_no_kernel():
    code = textwrap.dedent("""
        import sys, numpy as np, torch, numba
        import pulsediff
        from pulsediff.ops.warm import warm_up
        import pulsediff.kernels.cpu_batch, pulsediff.kernels.cpu, pulsediff.kernels.entropy

        def loaded():
            out = {}
            for name, mod in list(sys.modules.items()):
                if name.startswith("pulsediff"):
                    for attr, obj in vars(mod).items():
                        if isinstance(obj, numba.core.registry.CPUDispatcher):
                            out[f"{name}.{attr}"] = len(obj.signatures)
            return out

        warm_up([torch.bfloat16, torch.float32, torch.float16])
        assert "pulsediff.ops.make" not in sys.modules  # stored patches: make's kernels are not loaded
        before = loaded()
        assert before["pulsediff.kernels.cpu_batch.apply_batch"] >= 2, before
        rng = np.random.default_rng(0)
        old = {f"e{i}": torch.from_numpy(rng.normal(0, 0.02, (64, 48)).astype(np.float32)).bfloat16()
               for i in range(30)}
        old["big"] = torch.from_numpy(rng.normal(0, 0.02, (1100, 1000)).astype(np.float32)).bfloat16()
        old["norm"] = torch.ones(48)
        new = {k: v.clone() for k, v in old.items()}
        for v in new.values():
            flat = v.view(-1)
            flat[::37] = flat[::37] * 1.01 + 1e-4
        patch = pulsediff.make_patch_bytes(old, new)
        before = loaded()
        pulsediff.apply_to_state_dict(old, patch, check="prefer-sums")
        assert all(torch.equal(old[k].view(torch.int16 if old[k].element_size() == 2 else torch.int32),
                               new[k].view(torch.int16 if new[k].element_size() == 2 else torch.int32)) for k in old)
        after = loaded()
        grew = {k: (before.get(k, 0), n) for k, n in after.items() if n != before.get(k, 0)}
        assert not grew, grew
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_stored_warm_up_patches_are_what_make_writes_today():
    """Run scripts/make_warm_patches.py where this fails: the warm-up must load the kernels that today's
    patches need."""
    from importlib import resources

    from pulsediff.ops.make import make_patch_bytes
    from pulsediff.ops.warm import WIDTHS, warm_pair, warm_patch_name

    stored = resources.files("pulsediff.ops") / "warm_patches"
    for width in WIDTHS:
        assert (stored / warm_patch_name(width)).read_bytes() == make_patch_bytes(*warm_pair(width)), \
            f"the stored warm-up patch of width {width} is not what make writes: run scripts/make_warm_patches.py"
