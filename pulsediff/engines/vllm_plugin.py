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
    BF16 `.weight` instead of a repacked oneDNN handle, and every unquantized MoE layer without biases
    whose gated activation is SiLU with plain torch from its fused `w13_weight`/`w2_weight`
    instead of the CPU grouped gemm's prepacked copy (others keep it, and the reload): the weights are
    used as loaded, as on a GPU. Slower; it exists so that the GPU engines' in-place (sparse) update
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
    prepack, grouped_gemm = CPUUnquantizedExperts.process_weights_after_loading, CPUUnquantizedExperts.apply

    def as_loaded(self, layer) -> None:
        # Layer by layer: experts the plain path computes are left as loaded (no padding, no prepacking)
        # and marked so (engines/vllm.py then lets the layer take sparse updates); others keep vLLM's own.
        self.pulsediff_weights_as_loaded = _plain_activation(self.moe_config) is not None \
            and getattr(layer, "w13_bias", None) is None and getattr(layer, "w2_bias", None) is None
        if not self.pulsediff_weights_as_loaded:
            prepack(self, layer)

    def apply(self, *args, **kwargs) -> None:
        (_plain_experts if getattr(self, "pulsediff_weights_as_loaded", False) else grouped_gemm)(self, *args, **kwargs)

    CPUUnquantizedExperts.process_weights_after_loading = as_loaded
    CPUUnquantizedExperts.apply = apply


def _plain_activation(moe_config):
    """The torch function of a gated activation the plain path computes, act(gate) * up, or None: SiLU
    (Qwen-MoE, Mixtral, DeepSeek, Llama 4), the one checked against vLLM's kernel (tests/test_vllm_engine.py)."""
    import torch.nn.functional as F

    return F.silu if getattr(getattr(moe_config, "activation", None), "value", None) == "silu" else None


def _plain_experts(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                   expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                   apply_router_weight_on_input) -> None:
    """The routed experts in plain torch from fused weights as loaded (vLLM's modular `apply`):
    w1 is (experts, 2 x intermediate, hidden), gate rows then up rows; w2 is (experts, hidden,
    intermediate); expert_map maps global experts to this rank's (-1: another rank's). Where the
    router weights were applied to the input already, they are not applied again."""
    import torch

    act = _plain_activation(self.moe_config)
    ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
    half = w1.shape[1] // 2
    total = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    for expert in torch.unique(ids).tolist():
        if expert < 0:  # routed to an expert another rank holds
            continue
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = hidden_states[token] @ w1[expert].t()
        y = (act(h[:, :half]) * h[:, half:]) @ w2[expert].t()
        weight = 1.0 if apply_router_weight_on_input else topk_weights[token, slot].float()[:, None]
        total.index_add_(0, token, y.float() * weight)
    output.copy_(total.to(output.dtype))
