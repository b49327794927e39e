"""pulsediff as a vLLM weight-transfer backend: patches straight into a running engine.

vLLM (0.32+) loads weight-transfer backends by name (`WeightTransferConfig(backend="pulsediff")`);
`pulsediff.engines.vllm_plugin` registers this one through vLLM's `vllm.general_plugins` entry
point, so every vLLM process finds it without an import by hand. Then, offline or over
`vllm serve`'s routes:

    init_weight_transfer_engine({})            # optional: returns once the kernels are loaded and the host
                                               # state read (started with the engine), so that the first
                                               # update costs what the next ones do
                                               # (init_info takes nothing: see PULSEDIFF_VLLM_* below)
    start_weight_update()
    update_weights({"source": S, "step": N, "trust": K})
    finish_weight_update(weight_version=str(N))
    reset_prefix_cache()                       # KV computed with the old weights must not be served

An update may be prepared ahead: the same request with "prepare": true (in a session of its own,
without pausing: it returns at once) starts the fetch, the checks and the decode on a thread of
each worker that decodes (one per machine where the ranks share a host state) while the engine goes on
serving; the update of the same source then waits for it and
goes on from there, so that the engine stops for the load alone (`prepare_llm`, `vllm-sync
--prepare-ahead`). Nothing is loaded, and nothing the engine serves changes, until that update.

S is a patch file (a path, or an http(s):// or s3:// URL ending in .pulsediff) or a published
series (a folder, or an s3:// or http(s):// URL): the engine moves to step N (default: the
newest) by the cheapest chain of intact patches, as `pulsediff catch-up` does. K (an inline
`ed25519:` key or a list of them) takes only a series signed by one of them. The operator's
environment decides what a request cannot: PULSEDIFF_VLLM_TRUST (keys, or files of them, that
every update must be signed by), PULSEDIFF_VLLM_TRUST_STATE, PULSEDIFF_VLLM_CACHE.

What happens, in order:

1. Verify, touching nothing: the request's types; the manifest (and its signature under K); the
   chain's files (size, checksums, SHA-256 under K); then every patch is decoded against the
   `HostState` (engines/state.py: the checkpoint in host memory, kept at the engine's step), the
   base's and every rebuilt tensor's word sums checked against the patch's. The host state keeps
   what it takes to go back. The ranks of an engine on one machine share one host state
   (engines/shared_state.py): its owner verifies and decodes, the others follow it.
2. Agree (tensor-, context- and pipeline-parallel ranks, engines/agreement.py): the ranks exchange
   what they reached. Unless every rank verified the same target, every rank takes its host state
   back and the update is refused with one line (raised by the last rank; under vLLM's multiprocess
   executor the others close their session and return: agreement.py, "One rank raises"): the engine
   keeps serving its old weights on every rank. A malformed request is refused the same way.
3. Load into the engine, through the model's own `load_weights` (fused q/k/v and gate/up,
   tensor-parallel shards):
   - `reload` (vLLM's CPU backend, whose Linear weights are repacked into oneDNN handles and
     cannot be written in place): the layerwise reload vLLM's `reload_weights` does, fed from
     the host state instead of the disk. Every tensor goes in: a layer given only part of its
     weights would be finalized with the rest unset.
   - `sparse` (where every layer computes from its parameters as written: GPU engines of models
     that are not quantized or MLA, MoE layers included under the Triton kernels, and the CPU
     backend under PULSEDIFF_VLLM_UNPACKED=1, experts too; `transformed_layer` decides, layer by
     layer): only the changed elements, as (flat indices, values) in checkpoint coordinates
     through vLLM's `load_checkpoint_weight_patches`, in batches of at most 512 MiB of staged
     tensors.
   vLLM's loaders are not transactional. If one fails here (out of memory, say), the host
   state is already at the target and the engine's weights are undefined: the error says so,
   and the next update loads every tensor from the host state whatever it changes. On the CPU
   backend a failed layerwise reload leaves layers on the meta device and the next generate
   fails: restart the engine.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm.logger import init_logger

from pulsediff.engines.agreement import PREPARE, Outcome, Verdict, agree
from pulsediff.engines.shared_state import (
    Sharing,
    SharingUnavailable,
    close_changes,
    load_shared_host_state,
    publish_changes,
    read_changes,
    release,
    replica_key,
    replica_ranks,
)
from pulsediff.engines.state import Advance, HostState, load_host_state, parse_update_request
from pulsediff.engines.vllm_client import KEPT, UNDEFINED
from pulsediff.engines.vllm_plugin import BACKEND, UNPACKED_ENV  # noqa: F401 (public here too)
from pulsediff.errors import PulsediffError, UsageError

__all__ = ["PulsediffWeightTransferEngine", "PulsediffInitInfo", "PulsediffUpdateInfo", "BACKEND"]

TRUST_ENV = "PULSEDIFF_VLLM_TRUST"  # public keys (ed25519:... or files of them, comma-separated)
TRUST_STATE_ENV = "PULSEDIFF_VLLM_TRUST_STATE"  # the rollback record (default: signing.default_state_file())
CACHE_ENV = "PULSEDIFF_VLLM_CACHE"  # where remote series' files are fetched (default: remote.default_cache)
SHARE_ENV = "PULSEDIFF_VLLM_SHARE_HOST_STATE"  # "0": every rank keeps its own host copy (engines/shared_state.py)
logger = init_logger("vllm.pulsediff")  # under vLLM's logger: its handlers print it


@dataclass
class PulsediffInitInfo(WeightTransferInitInfo):
    """init_weight_transfer_engine's init_info: empty. What a request may not choose (the keys a series
    must be signed by, the rollback record, the download cache) is the operator's, set in the engine's
    environment: PULSEDIFF_VLLM_TRUST, PULSEDIFF_VLLM_TRUST_STATE, PULSEDIFF_VLLM_CACHE."""


@dataclass
class PulsediffUpdateInfo(WeightTransferUpdateInfo):
    """update_weights' update_info: {"source": S, "step": N, "trust": K, "prepare": P, "force": F}."""

    source: str
    step: int | None = None
    trust: tuple[str, ...] | None = None
    prepare: bool = False
    force: bool = False


class PulsediffWeightTransferEngine(WeightTransferEngine[PulsediffInitInfo, PulsediffUpdateInfo]):
    init_info_cls = PulsediffInitInfo
    update_info_cls = PulsediffUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.state: HostState | None = None
        self.sharing: Sharing | None = None  # this rank's part in the machine's one host state (None: its own)
        self.engine_number = next(_ENGINES)
        self.engine_stale = False  # the engine's weights are not the host state's (a load failed part-way)
        self.last_load = ""  # "reload" or "sparse": how the last update reached the engine
        self.reload_reason: str | None = None  # in_place_ok's finding, made once: "" where updates go in sparse
        self.reload_explained = False  # the one line on vLLM's rotary warning at a reload is said (load)
        self.last_prepared = False  # whether the last update went on from a preparation ("prepare")
        self.timings: dict[str, float] = {}  # the last update's seconds: verify_decode, load
        self._state_lock = threading.Lock()  # one read of the host state, whoever asks first
        # Beside the engine's own start: load the kernels an update runs and read the host state, which
        # a first update otherwise paid for (issue 45: 3.3 s against 1.4 s for the next on a 1 GB model).
        # An update that comes sooner waits for what it needs.
        dtypes = {torch.bfloat16, torch.float32} | {p.dtype for p in getattr(model, "parameters", list)()}
        self._warming = threading.Thread(target=self._ready, args=(dtypes,), name="pulsediff-warm-up", daemon=True)
        self._warming.start()

    def _ready(self, dtypes: set) -> None:
        try:
            self.host_state()
        except Exception as exc:  # noqa: BLE001 - the first update reads it again and says what is wrong
            logger.warning("pulsediff: the host state was not read ahead (%s: %s)", type(exc).__name__, exc)
        if not self.follower:  # a follower decodes nothing: its owner runs the kernels
            _warm_up(dtypes)

    # -- the four calls -----------------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> PulsediffInitInfo:
        if init_dict not in ({}, None):
            raise ValueError(f"pulsediff: init_info takes nothing (the operator sets {TRUST_ENV}, {TRUST_STATE_ENV} "
                             f"and {CACHE_ENV} in the engine's environment) {KEPT}")
        return PulsediffInitInfo()

    def init_transfer_engine(self, init_info: PulsediffInitInfo) -> None:
        """Return once the first update will cost what the next ones do: the kernels loaded and the host
        state read (the warm-up's thread, started with the engine; a failure there is logged, and the
        first update does that work itself)."""
        self._warming.join()
        self.host_state()

    def start_weight_update(self) -> None:
        """Nothing: the engine is touched only after update_weights has verified everything."""

    def parse_update_info(self, update_dict: dict[str, Any]) -> PulsediffUpdateInfo:
        try:
            return _typed(update_dict)
        except UsageError as exc:
            raise ValueError(f"pulsediff: {exc} {KEPT}") from None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(update_info)  # parsed inside, so that a bad request is agreed on like any refusal
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: "PulsediffUpdateInfo | dict[str, Any]") -> None:
        start = time.perf_counter()
        state, advance, failure, prepare, request = None, None, "", False, ()
        try:  # every failure here becomes this rank's outcome: each rank must reach the agreement
            if not isinstance(update_info, PulsediffUpdateInfo):
                update_info = _typed(update_info)  # a UsageError: one line, like any refusal below
            prepare = update_info.prepare
            cache = os.environ.get(CACHE_ENV) or None
            # The operator's keys, when set, decide: a request cannot drop them (nor take a lone patch file).
            trust = os.environ.get(TRUST_ENV, "").split(",") if os.environ.get(TRUST_ENV) else update_info.trust
            request = (update_info.source, update_info.step, list(trust) if trust else None,
                       os.environ.get(TRUST_STATE_ENV) or None, Path(cache) if cache else None, update_info.force)
            state = self.host_state()
            if not prepare and not self.follower:
                state.settle()
                state.drop_unjudged()
                # Staged: a rank keeps what it takes to go back until every rank has verified the same
                # target. After a preparation of the same source it goes on from there (usually: nothing
                # is left to do but the load).
                advance = state.advance(*request, stage=True)
        except BaseException as exc:  # the host state was put back, and the engine was not touched
            failure = str(exc) if isinstance(exc, PulsediffError) else f"{type(exc).__name__}: {exc}"
        mine = self.outcome(state, advance, failure, request, prepare)
        if prepare:
            return self.prepare(state, request, mine)
        try:
            self.take(state, advance, mine, start)
        finally:
            if self.sharing is not None:
                close_changes(self.sharing)  # every rank has loaded (or refused): its followers are done with them

    def take(self, state: HostState, advance, mine: Outcome, start: float) -> None:
        """The agreement on this rank's outcome, then the load (or the refusal)."""
        suffix = UNDEFINED if self.engine_stale else KEPT
        verdict = self.agreed(mine, "so no rank took the update")
        if verdict.refusal is not None:
            if advance is not None:
                try:
                    state.revert()
                except BaseException as exc:  # the host state no longer vouches for itself: it is re-hashed
                    verdict = Verdict(f"{verdict.refusal}; this rank could not take its update back ({exc})",
                                      verdict.speaks)
            return self.refuse(verdict, suffix)
        if advance is not None:
            state.commit()
        else:  # a follower: what its owner reached, in the host state they share
            owner = verdict.owner
            advance = Advance("applied" if owner.applied else "up-to-date", owner.step, owner.digest, links=0,
                              prepared=owner.prepared)
        if advance.status == "up-to-date" and not self.engine_stale:
            return
        verified = time.perf_counter()
        everything = self.engine_stale
        self.engine_stale = True
        failure = ""
        try:
            changes = None if everything else advance.changes
            if self.follower and not everything and self.in_place_ok():
                owner = verdict.owner  # no changes published (the owner loads every tensor): so does this rank
                changes = None if owner.changes_fd < 0 else read_changes(owner.pid, owner.changes_fd, state.tensors,
                                                                         owner.state, owner.digest)
            self.load(state, changes)
        except BaseException as exc:
            failure = f"the engine failed while loading verified weights ({type(exc).__name__}: {exc})"
        # Agreed again: a rank whose load failed leaves the model part old, part new on every rank.
        verdict = self.agreed(Outcome(self.rank, not failure, advance.digest, failure, reloaded=self.last_load == "reload"),
                              "so the update is incomplete")
        if self.sharing is not None and self.sharing.owner and any(o.reloaded for o in verdict.outcomes):
            state.sums.clear()  # another rank handed vLLM's reload these tensors (load(): nothing vouches for them)
        if verdict.refusal is not None:
            return self.refuse(verdict, UNDEFINED)
        self.engine_stale = False
        self.last_prepared = advance.prepared
        self.timings = {"verify_decode": verified - start, "load": time.perf_counter() - verified}
        logger.info("pulsediff: %s %s in %.3f s (%d links%s), loaded (%s) in %.3f s",
                    f"step {advance.step}" if advance.step is not None else advance.digest,
                    "verified and decoded by the rank that owns this machine's host state" if self.follower
                    else "verified and decoded", self.timings["verify_decode"], advance.links,
                    ", prepared ahead" if advance.prepared else "", self.last_load, self.timings["load"])

    @property
    def follower(self) -> bool:
        """Whether another rank on this machine owns the host state this rank maps (and decodes into it)."""
        return self.sharing is not None and not self.sharing.owner

    def outcome(self, state: HostState | None, advance, failure: str, request: tuple, prepare: bool) -> Outcome:
        """This rank's record for the agreement. An owner publishes the update's changes for its followers
        (when they will load only those)."""
        asked = _asked(request, prepare) if request else ""
        hashed = hashlib.sha256(repr((request, prepare)).encode()).digest()[:16]
        sharing = self.sharing
        if sharing is None or failure:
            digest = PREPARE if prepare else advance.digest if advance else ""
            return Outcome(self.rank, not failure, "" if failure else digest, failure, state=0 if sharing is None
                           else sharing.state_id, follows=self.follower, request=hashed, asked=asked)
        if not sharing.owner:
            return Outcome(self.rank, True, PREPARE if prepare else "", state=sharing.state_id, follows=True,
                           request=hashed, asked=asked)
        fd, applied = -1, advance is not None and advance.status == "applied"
        try:  # (every rank must reach the agreement: a failure here is this rank's outcome, and it reverts)
            if applied and not self.engine_stale and self.in_place_ok():
                fd = publish_changes(sharing, list(state.tensors), advance.changes, advance.digest)
        except Exception as exc:  # noqa: BLE001
            return Outcome(self.rank, False, "", f"the update's changes could not be shared with this machine's "
                           f"other ranks ({type(exc).__name__}: {exc})", state=sharing.state_id, request=hashed,
                           asked=asked)
        return Outcome(self.rank, True, PREPARE if prepare else advance.digest, state=sharing.state_id, applied=applied,
                       prepared=bool(advance and advance.prepared), pid=os.getpid(), changes_fd=fd,
                       step=advance.step if advance else None, request=hashed, asked=asked)

    def prepare(self, state: HostState | None, request: tuple, mine: Outcome) -> None:
        """update_info's "prepare": start verifying and decoding the update in the background
        (HostState.prepare) and return, touching nothing: the engine goes on serving (vLLM runs no
        model step while a worker call lasts). A later update of the same source waits for it and
        goes on from there, so that its own critical path is the load alone. The ranks agree first
        that every one of them was asked to prepare (a mix of preparations and updates is refused).
        A follower prepares nothing: its owner decodes into the state they share."""
        verdict = self.agreed(mine, "so no rank prepared the update")
        if verdict.refusal is not None:
            return self.refuse(verdict, UNDEFINED if self.engine_stale else KEPT)
        if self.follower:
            return
        try:
            state.drop_unjudged()  # an update interrupted before its verdict: the engine is where that began
            if not state.prepare(*request):
                logger.info("pulsediff: an earlier preparation is still running; this one was not started")
        except Exception as exc:  # nothing was started: the update will do the whole work itself
            logger.warning("pulsediff: the update could not be prepared (%s: %s)", type(exc).__name__, exc)

    def agreed(self, mine: Outcome, consequence: str) -> Verdict:
        """What every rank of this model replica concluded (engines/agreement.py); one rank: its own."""
        try:
            return agree(mine, self.rank_groups(), consequence)
        except Exception as exc:
            # Every rank that gets here refuses: none can know the others went on. A rank whose exchange
            # did succeed goes on, and waits in the next agreement (gloo's timeout ends it).
            return Verdict(f"the engine's ranks could not compare their updates ({type(exc).__name__}: {exc})", True)

    def refuse(self, verdict: Verdict, suffix: str) -> None:
        """Raise the refusal, from the last rank alone where the others can close their sessions
        (agreement.py, "One rank raises")."""
        message = f"pulsediff: {verdict.refusal} {suffix}"
        # Only vLLM's multiprocess executor reads the ranks' replies from one queue each (Ray's and a single
        # process's callers see every failure without a queue to desynchronise).
        if verdict.speaks or self.parallel_config.distributed_executor_backend != "mp" or not self.close_session():
            raise RuntimeError(message)
        logger.warning("%s (the last rank reports it)", message)

    def close_session(self) -> bool:
        """Close this worker's update session as vLLM closes one whose update_weights raised: its
        worker's `_weight_update_active` flag (vLLM 0.32), found up the call stack. False where it is
        not there (another vLLM): this rank then raises too."""
        frame = sys._getframe(1)
        while frame is not None:
            worker = frame.f_locals.get("self")
            if getattr(worker, "weight_transfer_engine", None) is self and isinstance(
                    getattr(worker, "_weight_update_active", None), bool):
                worker._weight_update_active = False
                self.reset_weight_update_target()
                return True
            frame = frame.f_back
        return False

    def finish_weight_update(self) -> None:
        """Nothing to finish: update_weights left the engine complete. The caller sets the weight version."""

    def shutdown(self) -> None:
        """vLLM's shutdown_weight_transfer_engine releases a trainer connection; the engine goes on serving.
        The host state is kept: it is the engine's weights, which a reload from the model folder is not.
        A preparation still running is waited for (it holds the host state's tensors)."""
        if self.state is not None:
            self.state.settle()

    # -- the host state and the load ---------------------------------------------------------

    def host_state(self) -> HostState:
        with self._state_lock:
            if self.state is None:
                # The engine was started from this folder: its weights are these tensors (a change made to
                # them another way, such as vLLM's reload_weights, is not seen here).
                folder = model_folder(self.model_config, self.vllm_config.load_config)
                key = self.share_key(folder)
                if key is not None:
                    try:
                        self.state, self.sharing = load_shared_host_state(folder, key, waiting=self._waiting)
                        weakref.finalize(self, release, self.sharing)  # an engine made again: its lock, its memory
                        logger.info("pulsediff: rank %d %s this machine's host state (%.2f GB)", self.rank,
                                    "owns" if self.sharing.owner else "maps", self.state.nbytes / 1e9)
                    except SharingUnavailable as exc:
                        logger.warning("pulsediff: rank %d keeps a host copy of its own (%s)", self.rank, exc)
                if self.state is None:
                    self.state = load_host_state(folder)
            return self.state

    def _waiting(self, seconds: float, holder: str) -> None:
        logger.info("pulsediff: rank %d has waited %.0f s for the rank that reads this machine's host state (%s)",
                    self.rank, seconds, holder or "starting")

    def share_key(self, folder: Path) -> str | None:
        """The name under which this engine's ranks on one machine share one host state
        (shared_state.replica_key), or None: one rank; Ray's workers, whose parent process every engine
        on the machine shares; or the operator's PULSEDIFF_VLLM_SHARE_HOST_STATE=0."""
        coordinators = self.coordinators()
        if not coordinators:
            return None
        config = self.parallel_config
        if os.environ.get(SHARE_ENV, "1") == "0" or config.distributed_executor_backend not in ("mp", "external_launcher"):
            logger.info("pulsediff: rank %d keeps a host copy of its own (%s)", self.rank,
                        f"{SHARE_ENV}=0" if os.environ.get(SHARE_ENV) == "0"
                        else f"the {config.distributed_executor_backend} executor's workers do not share one")
            return None
        import torch.distributed as dist

        ranks = replica_ranks(dist.get_rank(), coordinators)
        if ranks is None:
            logger.info("pulsediff: rank %d keeps a host copy of its own (its groups are not vLLM's layout)", self.rank)
            return None
        # torchrun's workers (external_launcher) share a parent across the replicas of its job: its run id and
        # the replica's ranks tell them apart; vLLM's multiprocess executor starts each engine's workers itself.
        # The count of engines this process made tells an engine made again in the same processes from the last.
        extra = repr((getattr(config, "data_parallel_rank", 0), os.environ.get("TORCHELASTIC_RUN_ID"),
                      os.environ.get("MASTER_PORT"), self.engine_number))
        return replica_key(str(folder), os.getppid(), ranks, extra)

    @property
    def rank(self) -> int:
        return int(getattr(self.parallel_config, "rank", 0) or 0)

    def rank_groups(self) -> list:
        """The CPU process groups over which this model replica's ranks agree on an update
        (engines/agreement.py): tensor-parallel, prefill-context-parallel, then pipeline-parallel
        (together the replica's world); none for one rank."""
        return [g.cpu_group for g in self.coordinators()]

    def coordinators(self) -> list:
        """vLLM's group coordinators of rank_groups (those of more than one rank)."""
        config = self.parallel_config
        if config.tensor_parallel_size * config.pipeline_parallel_size * getattr(
                config, "prefill_context_parallel_size", 1) == 1:
            return []
        from vllm.distributed import parallel_state

        groups = [parallel_state.get_tp_group()]
        if getattr(config, "prefill_context_parallel_size", 1) > 1:
            groups.append(parallel_state.get_pcp_group())
        groups.append(parallel_state.get_pp_group())
        return [g for g in groups if g.world_size > 1]

    def in_place_ok(self) -> bool:
        """Whether a write to a parameter is what the next forward pass uses, so that only the changed
        elements need to go in (the sparse path): `transformed_layer()` finds no layer that computes from
        a transformed copy of its weights."""
        if self.reload_reason is None:
            self.reload_reason = self.transformed_layer()
            if self.reload_reason:
                logger.info("pulsediff: updates take vLLM's layerwise reload of every tensor: %s", self.reload_reason)
        return not self.reload_reason

    def transformed_layer(self) -> str:
        """Why vLLM transforms this model's weights after loading them ("" if it does not), decided layer
        by layer. Quantized models are repacked and scaled, MLA attention derives matrices; a Linear
        layer computes from its weight as loaded only under the unquantized method (a ROCm router's
        bf16x3 split is a copy); a MoE layer computes from its experts as loaded only when unquantized
        under the Triton kernels (a Hopper or ROCm GPU's default) or vLLM's CPU experts kept plain by
        PULSEDIFF_VLLM_UNPACKED=1 (the others shuffle, pad or prepack them: FlashInfer, AITER, the CPU
        grouped gemm), and without expert load balancing (which moves experts between slots); the CPU
        backend's Linear layers compute from oneDNN handles unless unpacked. Such a layer needs the
        layerwise reload, which runs that processing again. A vLLM whose classes are not where this
        looks gets the reload."""
        try:
            from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
            from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
            from vllm.platforms import current_platform
        except ImportError as exc:
            return f"this vLLM's layer classes are not where pulsediff looks ({exc})"
        if getattr(self.model_config, "quantization", None):
            return f"a quantized model ({self.model_config.quantization})"
        if getattr(self.model_config, "use_mla", False):
            return "MLA attention"
        plain, cpu = torch.nn.functional.linear, current_platform.is_cpu()
        for name, module in self.model.named_modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, FusedMoEMethodBase) and not _experts_as_loaded(method):
                backend = getattr(getattr(method, "unquantized_backend", None), "value", type(method).__name__)
                return f"MoE layer {name} computes from its experts in the layout of {backend}"
            if isinstance(method, LinearMethodBase) and (not isinstance(method, UnquantizedLinearMethod)
                                                         or getattr(module, "_bf16x3_weight", None) is not None):
                return f"{name} computes from a transformed copy of its weight ({type(method).__name__})"
            if cpu and getattr(module, "cpu_linear", plain) is not plain:
                return f"{name} computes from a oneDNN handle (vLLM's CPU backend; {UNPACKED_ENV}=1 keeps it plain)"
        return ""

    def load(self, state: HostState, changes: dict | None) -> None:
        """Hand the host state's tensors to the engine: those in `changes` (name -> positions or None),
        or every one (`changes` None)."""
        if not self.in_place_ok():
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            self.last_load = "reload"
            try:
                reload_weights(self.vllm_config, self.model, weights_iterator=iter(state.tensors.items()),
                               weights_path=None, is_checkpoint_format=True)
                if not self.reload_explained and any(type(m).__name__ == "RotaryEmbedding" for m in self.model.modules()):
                    self.reload_explained = True
                    logger.info("pulsediff: vLLM's reload says 'RotaryEmbedding: Failed to load weights' at every "
                                "update (its own reload_weights from disk does too): the rotary cache is computed, "
                                "in no checkpoint, and vLLM puts it back as it was; nothing is wrong")
            finally:
                # vLLM's loaders were handed the host tensors themselves (a copy would cost the model's
                # size): nothing then vouches that none wrote into one, so the next update's base check
                # reads every tensor again instead of trusting the sums kept from this one.
                state.sums.clear()
            return
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        self.last_load = "sparse"
        sparse, dense = [], []
        for name in state.tensors if changes is None else changes:
            tensor = state.tensors[name]
            positions = None if changes is None else changes[name]
            if positions is not None and not len(positions):
                continue
            flat = tensor.reshape(-1)
            if positions is not None and tensor.dtype in SPARSE_DTYPES:
                index = torch.from_numpy(positions)
                values = flat[index]  # a copy: nothing the engine keeps aliases the host state
                if not torch.isnan(values).any():  # NaN marks "unchanged" in vLLM's sparse loader
                    sparse.append(CheckpointWeightPatch(name, tuple(tensor.shape), tensor.dtype, values, index))
                    continue
            dense.append(CheckpointWeightPatch(name, tuple(tensor.shape), tensor.dtype, flat.clone()))
        # One kind per call (vLLM's rule), and batches of at most STAGING_BYTES of checkpoint tensors: the
        # sparse loader stages a full NaN-filled tensor per patch where its values are, so the values go to
        # the device one batch at a time.
        for group in (sparse, dense):
            for batch in _batches(group):
                on_device = [p._replace(values=p.values.to(self.device), indices=None if p.indices is None
                                        else p.indices.to(self.device)) for p in batch]
                load_checkpoint_weight_patches(self.model, on_device, max_chunk_bytes=STAGING_BYTES)


def _experts_as_loaded(method) -> bool:
    """Whether a MoE layer's method computes from the expert weights as its loader wrote them. The CPU
    experts say so per layer (vllm_plugin.keep_weights_unpacked marks the ones it keeps plain)."""
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    if type(method) is not UnquantizedFusedMoEMethod or getattr(method.moe.moe_parallel_config, "enable_eplb", True):
        return False
    backend = method.unquantized_backend
    if backend in (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.BATCHED_TRITON):
        return True
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    return backend == UnquantizedMoeBackend.CPU and getattr(experts, "pulsediff_weights_as_loaded", False) is True


def _warm_up(dtypes: set) -> None:
    from pulsediff.engines.state import CHECK
    from pulsediff.ops.warm import warm_up

    try:
        logger.info("pulsediff: update kernels loaded in %.2f s", warm_up(dtypes, check=CHECK))
    except Exception as exc:  # noqa: BLE001 - a warm-up only saves time: the updates load what they need
        logger.warning("pulsediff: the update kernels were not loaded ahead (%s: %s)", type(exc).__name__, exc)


_ENGINES = itertools.count()  # engines made in this process (shared_state's key tells them apart)


def _asked(request: tuple, prepare: bool) -> str:
    """What a rank was asked, for a message: "prepare step 3 of /runs/a/outbox" (the source's end, where long)."""
    source, step = request[0], request[1]
    where = source if len(source) <= 80 else "..." + source[-77:]
    return f"{'prepare ' if prepare else ''}{'' if step is None else f'step {step} of '}{where}"


def _typed(update_dict) -> PulsediffUpdateInfo:
    """update_weights' update_info checked (state.parse_update_request: UsageError, one line) and typed."""
    request = parse_update_request(update_dict)
    return PulsediffUpdateInfo(request.source, request.step, request.trust, request.prepare, request.force)


SPARSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # NaN exists and torch.isnan works everywhere
STAGING_BYTES = 512 << 20


def _batches(patches: list) -> list[list]:
    """Consecutive runs of patches whose full checkpoint tensors add up to at most STAGING_BYTES (a larger
    tensor alone)."""
    out, run, size = [], [], 0
    for p in patches:
        nbytes = p.values.element_size() * int(torch.Size(p.shape).numel())
        if run and size + nbytes > STAGING_BYTES:
            out.append(run)
            run, size = [], 0
        run.append(p)
        size += nbytes
    return out + ([run] if run else [])


def model_folder(model_config, load_config=None) -> Path:
    """The local folder (or file) of the checkpoint the engine was started from. It is only read.
    Refused where the engine's weights are not that checkpoint's tensors as stored (dummy weights, GGUF,
    bitsandbytes, weights from elsewhere): patches are decoded against those tensors."""
    load_format = str(getattr(load_config, "load_format", "auto") or "auto").lower()
    if load_format not in ("auto", "safetensors"):
        raise PulsediffError(f"the pulsediff backend needs an engine loaded from safetensors (load_format "
                             f"'auto' or 'safetensors'), not '{load_format}'")
    if getattr(model_config, "model_weights", ""):
        raise PulsediffError("the pulsediff backend needs the engine's weights from its model folder, not from "
                             f"model_weights={model_config.model_weights!r}")
    model = str(model_config.model)
    path = Path(model)
    if path.exists():
        return path
    try:  # a Hugging Face repo id: the snapshot vLLM itself loaded, from the local cache only
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=getattr(model_config, "revision", None), local_files_only=True))
    except Exception as exc:
        raise PulsediffError(f"the pulsediff backend needs the model's checkpoint on this machine; {model} is "
                             f"neither a folder nor in the Hugging Face cache ({exc})") from None
