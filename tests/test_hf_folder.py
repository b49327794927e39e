"""A Hugging Face model folder survives make → apply whole: it loads with transformers, bit for bit.

The model is built from a config (no hub); its folder is what `save_pretrained`
writes: shards, index, config.json, generation_config.json, and tokenizer
files from a tokenizer trained on the spot. Run through the CLI as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ckpt_factory import folder_bytes

CLI = [sys.executable, "-m", "pulsediff.cli.main"]


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("the policy moves a little every step".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def hf_steps(tmp_path_factory):
    """Two steps of a small Llama saved by save_pretrained, BF16, sharded; the second also changes
    generation_config.json (a file that must travel whole) while the tokenizer stays (by hash)."""
    root = tmp_path_factory.mktemp("hf")
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tokenizer = _tokenizer()
    model.save_pretrained(root / "step0", max_shard_size="100KB")
    tokenizer.save_pretrained(root / "step0")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an RL-sized step: most BF16 values stay, a few move by one ULP or so
        for p in model.parameters():
            p.copy_((p.float() + 2e-3 * torch.randn(p.shape, generator=g) * p.float().abs()).to(torch.bfloat16))
    model.generation_config.temperature = 0.7
    model.generation_config.do_sample = True
    model.save_pretrained(root / "step1", max_shard_size="100KB")
    tokenizer.save_pretrained(root / "step1")
    return root / "step0", root / "step1"


def _logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16)
    ids = AutoTokenizer.from_pretrained(folder)("the policy moves a little", return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits


def test_rebuilt_model_folder_loads_with_transformers_bit_for_bit(hf_steps, tmp_path):
    step0, step1 = hf_steps
    shards = [p for p in step1.iterdir() if p.suffix == ".safetensors"]
    assert len(shards) > 1 and (step1 / "tokenizer.json").exists()  # the folder really is sharded
    patch, out = tmp_path / "1.pulsediff", tmp_path / "rebuilt"
    subprocess.run(CLI + ["make", str(step0), str(step1), "-o", str(patch)], check=True, capture_output=True)
    info = json.loads(subprocess.run(CLI + ["stats", str(patch), "--json"], check=True, capture_output=True).stdout)
    assert info["patch_bytes"] < sum(p.stat().st_size for p in shards) / 2  # the folder files did not bloat it
    subprocess.run(CLI + ["apply", str(step0), str(patch), "-o", str(out)], check=True, capture_output=True)

    assert folder_bytes(out) == folder_bytes(step1)  # config, generation config, tokenizer, shards, index
    assert torch.equal(_logits(out), _logits(step1))
    assert not torch.equal(_logits(step0), _logits(step1))  # the step did change what the model computes


def test_in_place_keeps_the_folder_loadable(hf_steps, tmp_path):
    step0, step1 = hf_steps
    worker = tmp_path / "worker"
    subprocess.run(["cp", "-r", str(step0), str(worker)], check=True)
    patch = tmp_path / "1.pulsediff"
    subprocess.run(CLI + ["make", str(step0), str(step1), "-o", str(patch)], check=True, capture_output=True)
    subprocess.run(CLI + ["apply", str(worker), str(patch), "--in-place"], check=True, capture_output=True)
    assert folder_bytes(worker) == folder_bytes(step1)
    assert torch.equal(_logits(worker), _logits(step1))


def test_a_base_folder_whose_kept_file_differs_is_refused_before_writing(hf_steps, tmp_path):
    step0, step1 = hf_steps
    base = tmp_path / "base"
    subprocess.run(["cp", "-r", str(step0), str(base)], check=True)
    (base / "tokenizer.json").write_text("{}")  # the patch keeps the tokenizer unchanged, by hash
    patch = tmp_path / "1.pulsediff"
    subprocess.run(CLI + ["make", str(step0), str(step1), "-o", str(patch)], check=True, capture_output=True)
    before = folder_bytes(base)
    run = subprocess.run(CLI + ["apply", str(base), str(patch), "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 1 and "tokenizer.json is not the file the patch was made against" in run.stderr
    assert not (tmp_path / "out").exists() and folder_bytes(base) == before
    run = subprocess.run(CLI + ["apply", str(base), str(patch), "--in-place"], capture_output=True, text=True)
    assert run.returncode == 1 and folder_bytes(base) == before
