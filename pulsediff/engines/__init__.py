"""Inference engines fed from patches: the layer above series/ and ops/.

- state.py: `HostState`, the checkpoint an engine holds, in checkpoint coordinates and host
  memory, moved along a series with every file and tensor verified before anything is written;
  the engine-independent half of every engine backend.
- agreement.py: an engine's tensor- and pipeline-parallel ranks take an update all together or
  not at all (each stages it in its host state, then they compare what they reached).
- vllm.py: the vLLM weight-transfer backend (worker side), registered by vllm_plugin.py.
- vllm_client.py: drives a running `vllm serve` over its HTTP routes (`pulsediff vllm-sync`).

vLLM is imported in vllm.py, when vLLM itself creates the backend, and by vllm_plugin.register, which
vLLM calls; nothing else here imports it.
"""
