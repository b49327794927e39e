"""`pulsediff stats TRAIN_DIR`: per-step patch sizes, densities by layer type, the k-step curve and the plot.

The series is made here with known densities per layer type, and every
number the command reports is checked against an independent count over the
safetensors files (bit patterns compared in torch) or against the patch `make` writes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ckpt_factory import save
from pulsediff.series.stats import layer_type

PULSEDIFF = [sys.executable, "-m", "pulsediff"]

# name -> (shape, layer type as the test expects it, fraction of elements changed per step)
TENSORS = {
    "model.embed_tokens.weight": ((512, 64), "embeddings", 0.002),
    "model.layers.0.input_layernorm.weight": ((64,), "norms", 0.0),
    "model.layers.0.self_attn.q_proj.weight": ((64, 64), "attention", 0.01),
    "model.layers.0.self_attn.o_proj.weight": ((64, 64), "attention", 0.01),
    "model.layers.0.mlp.up_proj.weight": ((128, 64), "mlp", 0.015),
    "model.layers.0.mlp.down_proj.weight": ((64, 128), "mlp", 0.015),
    "model.norm.weight": ((64,), "norms", 0.0),
    "lm_head.weight": ((512, 64), "lm_head", 0.04),
}
# Step 3 changes much more (a learning-rate spike): the densities span more than a decade.
SCALE = {1: 1.0, 2: 1.2, 3: 25.0, 4: 0.8}


def make_series(folder) -> list:
    """BF16 checkpoints step_0..step_4; changes are +-1 ULP on the bit pattern, as RL steps make them."""
    rng = np.random.default_rng(7)
    state = {name: torch.from_numpy((rng.standard_normal(shape) * 0.02).astype(np.float32)).to(torch.bfloat16)
             for name, (shape, _, _) in TENSORS.items()}
    folder.mkdir()
    paths = [save(state, folder / "step_000000.safetensors")]
    for step, scale in SCALE.items():
        new = {}
        for name, (_, _, density) in TENSORS.items():
            bits = state[name].view(torch.int16).numpy().copy().reshape(-1)
            mask = rng.random(bits.size) < density * scale
            bits[mask] += rng.choice(np.array([-1, 1], np.int16), int(mask.sum()))
            new[name] = torch.from_numpy(bits.reshape(state[name].shape)).view(torch.bfloat16)
        state = new
        paths.append(save(state, folder / f"step_{step:06d}.safetensors"))
    return paths


def changed_by_type(a, b) -> dict[str, list[int]]:
    """{type: [changed, total]} between two files, by bit pattern, with the test's own type table."""
    x, y = load_file(str(a)), load_file(str(b))
    out: dict[str, list[int]] = {}
    for name, (_, kind, _) in TENSORS.items():
        slot = out.setdefault(kind, [0, 0])
        slot[0] += int((x[name].view(torch.int16) != y[name].view(torch.int16)).sum())
        slot[1] += x[name].numel()
    return out


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    root = tmp_path_factory.mktemp("series")
    paths = make_series(root / "train")
    png = root / "series.png"
    proc = subprocess.run([*PULSEDIFF, "stats", str(root / "train"), "--json", "--plot", str(png)],
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    return root, paths, png, json.loads(proc.stdout)


def test_patch_bytes_per_step_are_the_patches_make_writes(series):
    root, paths, _, s = series
    assert s["steps"] == [0, 1, 2, 3, 4] and s["codec"] == "ctx-rans"
    for i, d in enumerate(s["step_density"]):
        patch = root / f"p{i}.pulsediff"
        proc = subprocess.run([*PULSEDIFF, "make", str(paths[i]), str(paths[i + 1]), "-o", str(patch), "-q"],
                              capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode()
        assert d["patch_bytes"] == patch.stat().st_size
        assert d["dense_bytes"] == paths[i + 1].stat().st_size
        assert d["ratio"] == pytest.approx(d["dense_bytes"] / d["patch_bytes"])
        assert d["bits_per_changed"] == pytest.approx(8 * d["patch_bytes"] / d["changed"])
    # More changes, more bytes: the spike step's patch is the largest.
    sizes = [d["patch_bytes"] for d in s["step_density"]]
    assert max(sizes) == sizes[2] > 5 * sizes[0]


def test_densities_by_layer_type_match_an_independent_count(series):
    _, paths, _, s = series
    totals: dict[str, list[int]] = {}
    for i, d in enumerate(s["step_density"]):
        expected = changed_by_type(paths[i], paths[i + 1])
        assert d["changed"] == sum(c for c, _ in expected.values())
        assert d["density"] == pytest.approx(d["changed"] / sum(t for _, t in expected.values()))
        for kind, (changed, total) in expected.items():
            assert d["by_type"][kind]["changed"] == changed and d["by_type"][kind]["total"] == total
            totals.setdefault(kind, [0, 0])
            totals[kind][0] += changed
            totals[kind][1] += total
    assert set(s["layer_types"]) == {"embeddings", "attention", "mlp", "norms", "lm_head"}
    for kind, (changed, total) in totals.items():
        assert s["layer_types"][kind]["density"] == pytest.approx(changed / total)
        assert s["layer_density"][kind] == s["layer_types"][kind]["density"]
    # The LM head is its own type, and the densest, as made; the embeddings are the sparsest that change.
    lt = s["layer_types"]
    assert lt["lm_head"]["density"] > 10 * lt["embeddings"]["density"] > 0
    assert lt["norms"]["changed"] == 0 and lt["norms"]["patch_bytes"] == 0
    assert sum(v["patch_share"] for v in lt.values()) == pytest.approx(1.0)
    assert lt["lm_head"]["patch_share"] > 0.5


def test_k_step_density_matches_an_independent_count(series):
    _, paths, _, s = series
    assert [d["k"] for d in s["k_step_density"]] == [1, 2, 4]
    for entry in s["k_step_density"]:
        k = entry["k"]
        counts = [changed_by_type(paths[i], paths[i + k]) for i in range(len(paths) - k)]
        changed = sum(c for pair in counts for c, _ in pair.values())
        total = sum(t for pair in counts for _, t in pair.values())
        assert entry["pairs"] == len(counts)
        assert entry["density"] == pytest.approx(changed / total)


def test_plot_is_a_png_of_the_four_panels(series):
    _, _, png, _ = series
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (990, 1430)  # 13 x 9 inches at 110 dpi
    assert img[..., :3].std() > 0.1  # something is drawn, not a blank page


def test_table_shows_patch_sizes_and_layer_types(series):
    root, _, _, s = series
    proc = subprocess.run([*PULSEDIFF, "stats", str(root / "train")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "bits/changed" in out and "ratio" in out
    first = s["step_density"][0]
    assert f"{first['ratio']:.1f}x" in out and f"{100 * first['density']:.4f}%" in out
    assert "lm_head" in out and f"{100 * s['layer_types']['lm_head']['patch_share']:.1f}%" in out


def test_plot_of_a_single_step(tmp_path):
    """Two checkpoints: one step, no k-step curve beyond k = 1; the plot still renders."""
    paths = make_series(tmp_path / "all")
    one = tmp_path / "one"
    one.mkdir()
    for p in paths[:2]:
        (one / p.name).write_bytes(p.read_bytes())
    png = tmp_path / "one.png"
    proc = subprocess.run([*PULSEDIFF, "stats", str(one), "--plot", str(png), "--json"], capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    s = json.loads(proc.stdout)
    assert [d["k"] for d in s["k_step_density"]] == [1] and len(s["step_density"]) == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, kind", [
    ("model.embed_tokens.weight", "embeddings"),
    ("lm_head.weight", "lm_head"),
    ("transformer.wte.weight", "embeddings"),
    ("transformer.wpe.weight", "embeddings"),
    ("gpt_neox.embed_in.weight", "embeddings"),
    ("embed_out.weight", "lm_head"),
    ("output_layer.weight", "lm_head"),  # Megatron
    ("tok_embeddings.weight", "embeddings"),  # Meta's Llama
    ("output.weight", "lm_head"),
    ("layers.0.attention.wq.weight", "attention"),
    ("layers.0.feed_forward.w1.weight", "mlp"),
    ("model.layers.3.mlp.gate_proj.weight", "mlp"),
    ("transformer.h.0.attn.c_attn.weight", "attention"),
    ("transformer.h.0.ln_1.weight", "norms"),
    ("model.norm.weight", "norms"),
    ("model.layers.0.post_attention_layernorm.weight", "norms"),
    ("layers.0.attention.output.dense.weight", "attention"),
    ("rotary_emb.inv_freq", "other"),
])
def test_layer_type(name, kind):
    assert layer_type(name) == kind


def test_plot_into_a_missing_folder_is_one_line_before_any_work(series):
    root, _, _, _ = series
    proc = subprocess.run([*PULSEDIFF, "stats", str(root / "train"), "--plot", str(root / "nowhere" / "s.png")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"pulsediff: error: cannot write {root / 'nowhere' / 's.png'}: "
                                                f"folder {root / 'nowhere'} does not exist"]
    assert not (root / "nowhere").exists()
