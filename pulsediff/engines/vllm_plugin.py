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
        keep_linear_weights_unpacked()


def keep_linear_weights_unpacked() -> None:
    """PULSEDIFF_VLLM_UNPACKED=1 on vLLM's CPU backend: every Linear computes with plain F.linear
    from its BF16 `.weight` instead of a repacked oneDNN handle, as on a GPU. Slower; it exists so
    that the GPU engines' in-place (sparse) update can run, and be tested, on a CPU."""
    import torch
    from vllm.model_executor.layers import utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear

