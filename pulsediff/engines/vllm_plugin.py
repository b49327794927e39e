"""vLLM's `vllm.general_plugins` entry point: registers the `pulsediff` weight-transfer backend.

vLLM calls `register()` in every process it starts (the API server, the engine core, each
worker), before it builds the model. Registration is lazy: pulsediff.engines.vllm (and with it
torch, numba and zstandard) is imported only when an engine is created with
`weight_transfer_config={"backend": "pulsediff"}`. Importing this module imports nothing of
pulsediff's but the backend's name, so a vLLM without that config pays nothing.
"""

from __future__ import annotations

import os

BACKEND = "pulsediff"
UNPACKED_ENV = "PULSEDIFF_VLLM_UNPACKED"


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as exc:  # a vLLM without weight-transfer backends: never stop it from starting
        import logging

        logging.getLogger("vllm.pulsediff").warning("pulsediff: this vLLM has no weight-transfer backends (%s); "
                                                    "the pulsediff backend is not registered", exc)
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "pulsediff.engines.vllm", "PulsediffWeightTransferEngine")
    except ValueError:  # registered already: vLLM may load plugins more than once in a process
        pass
    if os.environ.get(UNPACKED_ENV, "") == "1":
        keep_weights_unpacked()


def keep_weights_unpacked() -> None:
    """PULSEDIFF_VLLM_UNPACKED=1 on vLLM's CPU backend: every Linear computes with plain F.linear from its
    BF16 `.weight` instead of a repacked oneDNN handle, and every unquantized MoE layer with plain torch
    from its fused `w13_weight`/`w2_weight` instead of the CPU grouped-gemm's prepacked copy: the weights
    are used as loaded, as on a GPU. Slower; it exists so that the GPU engines' in-place (sparse) update
    can run, and be tested, on a CPU."""
    import torch
    from vllm.model_executor.layers import utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the modular CPU experts: its MoE layers keep the reload path
        return
    CPUUnquantizedExperts.process_weights_after_loading = _no_prepacking
    CPUUnquantizedExperts.apply = _plain_experts
    CPUUnquantizedExperts.pulsediff_weights_as_loaded = True  # engines/vllm.py: MoE layers may take the sparse path


def _no_prepacking(self, layer) -> None:
    """No padding and no prepacking: the layer computes from the weights its loader wrote."""


def _plain_experts(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                   expert_map, *args, **kwargs) -> None:
    """The routed experts in plain torch from fused weights as loaded: w1 is (experts, 2 x intermediate,
    hidden), gate rows then up rows; w2 is (experts, hidden, intermediate). Gated SiLU, the activation of
    every MoE family vLLM's CPU backend serves unquantized here; the others are refused."""
    import torch
    import torch.nn.functional as F

    if getattr(activation, "value", activation) != "silu":
        raise NotImplementedError(f"{UNPACKED_ENV}=1 computes MoE experts with SiLU only, not {activation}")
    ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
    w1_bias, w2_bias = getattr(self, "w1_bias", None), getattr(self, "w2_bias", None)
    half = w1.shape[1] // 2
    total = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    for expert in torch.unique(ids).tolist():
        if expert < 0:  # routed to an expert another rank holds
            continue
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = hidden_states[token] @ w1[expert].t()
        if w1_bias is not None:
            h = h + w1_bias[expert]
        y = (F.silu(h[:, :half]) * h[:, half:]) @ w2[expert].t()
        if w2_bias is not None:
            y = y + w2_bias[expert]
        total.index_add_(0, token, y.float() * topk_weights[token, slot].float()[:, None])
    output.copy_(total.to(output.dtype))
