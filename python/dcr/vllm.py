"""dcr as a vLLM weight-transfer backend (docs/vllm.md).

``pip install`` of the dcr package registers the backend ``"dcr"`` through
the ``vllm.general_plugins`` entry point (:func:`register`), on both sides:

- :class:`DcrWeightTransferEngine` runs in every vLLM worker. It is a rank
  of one engine of the run in the store (``docs/protocol.md``, "Engines of
  several ranks"): ``init_info = {"store": URL, ...}`` (:class:`DcrInitInfo`)
  joins the run, ``update_info = {"version": N}`` returns once version N is
  committed and the engine's parameters hold exactly its bits.
- :class:`DcrTrainerWeightTransferEngine` runs in the trainer: it publishes
  each version of a vLLM ``WeightSource``, or of the trainer's own shards
  in one or several processes (:class:`DcrSenders`), with
  :class:`dcr.ShardPublisher` and drives start / update / finish on a
  ``VLLMWeightSyncClient``.

Placement comes from the model's own ``load_weights``, traced once at
``init_info`` time (:func:`dcr.trace.record_layout`) in the parameters'
*load form* (the shapes ``load_weights`` writes, recorded by vLLM before
loading). Where a layer's live parameters are still their load form after
vLLM's post-load processing (on a GPU every unquantized linear, embedding,
norm and expert tensor; on CPU the norms and embeddings), dcr applies the
frames to them in place, on their device, keeping their addresses (CUDA
graphs captured them), and reruns the layer's processing if it has one.
Only layers that vLLM transformed after loading (CPU GEMM packing replaces
a linear layer's weight by a packed copy) keep a host copy in load form:
dcr applies the frames there, and once a version is whole those layers are
rebuilt from it. Which layers are which, and the host bytes they hold, is
in :func:`join_report`. The engine's parameters only move from one whole
version to the next inside the ``update_weights`` call, when vLLM runs no
forward pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping, Optional

import torch

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import dcr
from . import _fp8_scale_shape
from ._tensors import torch_dtype
from .trace import overlaps, record_layout

BACKEND = "dcr"
logger = logging.getLogger(__name__)
ADOPT_CANDIDATES = 64  # DcrInitInfo.adopt_loaded: how many of the newest committed versions are compared

__all__ = [
    "BACKEND", "register", "DcrInitInfo", "DcrUpdateInfo", "DcrWeightTransferEngine", "DcrTrainerInitInfo",
    "DcrTrainerWeightTransferEngine", "DcrSenders", "LLMClient", "load_form_digests", "join_report",
    "param_addresses", "fresh_load_form_digests",
]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers backend ``"dcr"``
    with vLLM's worker-side and trainer-side factories (lazily: this module
    is imported only where the backend is used). Idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DcrWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "DcrTrainerWeightTransferEngine")


# ---- The run in the store --------------------------------------------------------

def _open_run(url: str, run_id: Optional[str]) -> tuple:
    """(store, run record) of the run at ``url``; ValueError when there is
    none or it is another run than ``run_id``."""
    try:
        store = dcr.open_store(url, create_root=False)
        run = json.loads(store.get("run.json"))
    except dcr.NotFoundError as e:
        raise ValueError(f"dcr: no run at store '{url}' (run.json not found): {e.message}") from e
    except dcr.DcrError as e:
        raise ValueError(f"dcr: cannot read the run at store '{url}': {e.message}") from e
    if run_id is not None and run.get("run_id") != run_id:
        raise ValueError(f"dcr: the store '{url}' holds run '{run.get('run_id')}', not run '{run_id}'")
    return store, run


def _latest_commit(store: "dcr.Store") -> int:
    """The newest committed version in the store (-1 when none)."""
    newest = -1
    for key, _, _ in store.list("commits/"):
        stem = key.rsplit("/", 1)[-1]
        if stem.startswith("v") and stem.endswith(".json") and stem[1:-5].isdigit():
            newest = max(newest, int(stem[1:-5]))
    return newest


# ---- The worker side ---------------------------------------------------------------

@dataclass
class DcrInitInfo(WeightTransferInitInfo):
    """``init_info`` of the worker engine.

    store: the run's store URL (``file://``, ``s3://``; docs/stores.md).
    run_id: refuse a store that holds another run (None: any).
    engine: the engine's name in the run, the same on every rank (default:
        the host and the engine process).
    state_dir: where each rank keeps its journal (``<state_dir>/rank<r>``;
        default: a directory under the system's temporary directory).
    poll_s: how often the store is polled while following.
    join_timeout_s: the longest init may take to join the run.
    relay: relay addresses (``tcp://host:port``: the node's relay, then its
        ancestors; ``dcr relay``) from which every rank takes the frame
        objects; what none delivers comes from the store. Acks go through
        the store.
    relay_key, relay_pub: CURVE key files for the relays (``dcr relay keygen``);
        required with ``relay`` unless ``relay_insecure`` is true (plain TCP
        to relays run with ``--insecure``: trusted networks only).
    relay_poll_s: with ``relay``, in a tree that carries the publisher's
        notices, how often the store is looked at between notices.
    adopt_loaded: when the checkpoint the engine loaded (its model
        directory's safetensors) is a committed version of the run (its
        digest, summed over the ranks, is the version's), join from it: no
        snapshot is downloaded, only the deltas after it. The newest
        ``ADOPT_CANDIDATES`` committed versions and version 0 are compared.
    metrics: ``HOST:PORT``: each rank serves its Prometheus metrics
        (docs/metrics.md) at ``http://HOST:PORT+rank/metrics`` (port 0: a
        free one each; ``join_report["metrics_url"]`` says which).
    recheck: before each update, every rank reads the bits dcr holds again
        (the parameters it writes in place, its host copies) and compares
        each chunk's digest with the one it tracked through its own writes:
        bits changed outside dcr since the last version (another loader, a
        stray in-place write, memory damage) are named in the log and in
        ``join_report["outside_changes"]``, and the rank rejoins from the
        run's newest snapshot rather than report a version over them. A
        pass over the rank's bytes per update; ``False``: O(changed
        elements), trusting that nothing else writes the parameters.
    """

    store: str
    run_id: Optional[str] = None
    engine: Optional[str] = None
    state_dir: Optional[str] = None
    poll_s: float = 0.05
    join_timeout_s: float = 600.0
    relay: Optional[list] = None
    relay_key: Optional[str] = None
    relay_pub: Optional[str] = None
    relay_insecure: bool = False
    relay_poll_s: float = 1.0
    adopt_loaded: bool = True
    metrics: Optional[str] = None
    recheck: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ValueError("dcr: init_info 'store' must be a store URL")
        if self.engine is not None and (not isinstance(self.engine, str) or not self.engine or "/" in self.engine):
            raise ValueError(f"dcr: init_info 'engine' must be a name without '/', not {self.engine!r}")
        if not (isinstance(self.poll_s, (int, float)) and 0 < self.poll_s <= 60):
            raise ValueError(f"dcr: init_info 'poll_s' must be in (0, 60], not {self.poll_s!r}")
        if not (isinstance(self.relay_poll_s, (int, float)) and 0.001 <= self.relay_poll_s <= 3600):
            raise ValueError(f"dcr: init_info 'relay_poll_s' must be in [0.001, 3600], not {self.relay_poll_s!r}")
        if self.relay is not None and (not isinstance(self.relay, (list, tuple)) or not self.relay or
                                       not all(isinstance(a, str) and a for a in self.relay)):
            raise ValueError(f"dcr: init_info 'relay' must be a list of relay addresses, not {self.relay!r}")
        for k in ("relay_key", "relay_pub"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v or self.relay is None):
                raise ValueError(f"dcr: init_info '{k}' must be a key file path, given with 'relay', not {v!r}")
        if not isinstance(self.relay_insecure, bool) or (self.relay_insecure and
                                                          (self.relay is None or self.relay_key is not None)):
            raise ValueError("dcr: init_info 'relay_insecure' must be a bool, true only with 'relay' and no 'relay_key'")
        if self.metrics is not None and (not isinstance(self.metrics, str) or
                                         not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\[\]]+):[0-9]{1,5}", self.metrics)):
            raise ValueError(f"dcr: init_info 'metrics' must be HOST:PORT, not {self.metrics!r}")
        if not isinstance(self.recheck, bool):
            raise ValueError(f"dcr: init_info 'recheck' must be a bool, not {self.recheck!r}")


@dataclass
class DcrUpdateInfo(WeightTransferUpdateInfo):
    """``update_info``: the version to reach, and how long to wait for it."""

    version: int
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"dcr: update_info 'version' must be a version number, not {self.version!r}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"dcr: update_info 'timeout_s' must be positive, not {self.timeout_s!r}")


# Post-load processing that may run again on parameters in load form (it
# rebuilds kernels or packed copies from them); any other is refused.
_IDEMPOTENT_PROCESSING = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")
# Block-FP8 layers (a checkpoint with ``weight_block_size: [128, 128]``, as
# DeepSeek-V3's): each E4M3 weight's BF16 boxes are placed (trace.py), and
# the receiver keeps their BF16 master and requantizes the 128 x 128 blocks
# a version touches into the weight's host copy and its ``*_scale_inv``
# (Receiver ``fp8``). The layer is then refreshed from its host copies, as
# vLLM reloads a layer: load form in, its processing run again.
_FP8_BLOCK_PROCESSING = ("Fp8LinearMethod", "Fp8MoEMethod")
_FP8_SCALE_OF = {"weight": "weight_scale_inv", "w13_weight": "w13_weight_scale_inv", "w2_weight": "w2_weight_scale_inv"}


def _why_not_supported(qm: Any) -> Optional[str]:
    """None when dcr can follow a layer with quantization method ``qm``; else why not."""
    kind = type(qm).__name__
    if kind in _IDEMPOTENT_PROCESSING:
        return None
    if kind not in _FP8_BLOCK_PROCESSING:
        return "the dcr backend supports unquantized and block-FP8 models"
    if not getattr(qm, "block_quant", False):
        return ("per-tensor FP8 is not supported (one scale spans the tensor: a version that changes any element "
                "requantizes it whole); serve a block-FP8 checkpoint (weight_block_size [128, 128])")
    if [int(b) for b in qm.weight_block_size] != [128, 128]:
        return f"FP8 blocks of {list(qm.weight_block_size)} are not supported (dcr quantizes 128 x 128 blocks)"
    if getattr(qm.quant_config, "is_scale_e8m0", False):
        return "UE8M0 block scales are not supported (dcr writes F32 weight_scale_inv)"
    return None


class _Slot:
    """One live parameter: its module, attribute, load-form metadata (a meta
    tensor carrying the loader's attributes, or None) and dcr's target for
    it in load form: a host copy, or (``in_place``) the live parameter's
    own data."""

    def __init__(self, module: torch.nn.Module, attr: str, meta: Optional[torch.Tensor], live: torch.Tensor):
        self.module, self.attr, self.meta = module, attr, meta
        self.aliases: list = []  # other (module, attr) holding the same Parameter (tied embeddings)
        spec = meta if meta is not None else live
        self.host = torch.zeros(tuple(spec.shape), dtype=spec.dtype, device="cpu")
        self.in_place = False

    def why_not_in_place(self, compare: bool) -> Optional[str]:
        """None when the live parameter is a tensor in load form that dcr can
        write in place (same shape, dtype, contiguous), holding, when
        ``compare``, the host copy's bits (loaded from the engine's own
        checkpoint: vLLM's processing left them as they were loaded); else
        why not."""
        live = self.module._parameters[self.attr]
        if live is None or live.device.type == "meta":
            return f"'{self.attr}' is gone after loading"
        if not _same_form(live, self.host):
            return (f"repacked: live '{self.attr}' is {live.dtype} {list(live.shape)}, its load form "
                    f"{self.host.dtype} {list(self.host.shape)}")
        if not live.is_contiguous():
            return f"live '{self.attr}' is not contiguous (strides {list(live.stride())})"
        if compare and not torch.equal(live.detach().view(-1).view(torch.uint8),
                                       self.host.to(live.device).view(-1).view(torch.uint8)):
            return f"processed: live '{self.attr}' holds other bits than its load form"
        return None

    def materialize(self, device: torch.device) -> torch.Tensor:
        """A fresh parameter in load form (with the loader's attributes) on ``device``."""
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        spec = self.meta if self.meta is not None else getattr(self.module, self.attr)
        t = torch.empty(tuple(spec.shape), dtype=spec.dtype, device=device)
        t.__class__ = spec.__class__
        t.__dict__ = spec.__dict__.copy()
        return restore_layer_refs(t, self.module)


class _LoadForm:
    """dcr's target in a vLLM worker: host tensors in the load form of every
    parameter of ``model``, and the way back to the live parameters."""

    def __init__(self, model: torch.nn.Module):
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        self.model = model
        self.why_host: dict = {}  # layer name -> why it keeps host copies (place_live)
        self.slots: dict = {}
        self.of_module: dict = {}  # id(module) -> the names of its slots
        for name, live in model.named_parameters():
            module, attr = _parameter_owner(model, name)
            info = LAYERWISE_INFO.get(module)
            meta = info.restore_metadata[0].get(attr) if info is not None else None
            self.slots[name] = _Slot(module, attr, meta, live)
            self.of_module.setdefault(id(module), []).append(name)
        owner = {id(s.module._parameters[s.attr]): s for s in self.slots.values()}
        for name, p in model.named_parameters(remove_duplicate=False):
            module, attr = _parameter_owner(model, name)
            s = owner.get(id(p))
            if s is not None and (s.module is not module or s.attr != attr):
                s.aliases.append((module, attr))
        self.fp8_scales: dict = {}  # an E4M3 weight's slot -> the slot of its weight_scale_inv
        for name, s in self.slots.items():
            qm = getattr(s.module, "quant_method", None)
            why = _why_not_supported(qm) if qm is not None else None
            if why is not None:
                raise NotImplementedError(f"dcr: parameter '{name}' belongs to a layer quantized with "
                                          f"{type(qm).__name__}: {why}")
            if s.host.dtype == torch.float8_e4m3fn:
                self.fp8_scales[name] = self._scale_slot(name, s)

    def _scale_slot(self, name: str, s: _Slot) -> str:
        """The slot of the block scales of E4M3 weight ``name``: an F32
        ``weight_scale_inv`` with a scale per 128 x 128 block."""
        qm = getattr(s.module, "quant_method", None)
        scale = name[:-len(s.attr)] + _FP8_SCALE_OF.get(s.attr, "")
        if type(qm).__name__ not in _FP8_BLOCK_PROCESSING or scale not in self.slots:
            raise NotImplementedError(f"dcr: '{name}' is E4M3 without block scales beside it ({scale}); the dcr "
                                      "backend supports block-FP8 linear and expert weights")
        got, want = self.slots[scale].host, _fp8_scale_shape(s.host.shape)
        if got.dtype != torch.float32 or list(got.shape) != want:
            raise NotImplementedError(f"dcr: the scales '{scale}' of '{name}' are {got.dtype} {list(got.shape)}; "
                                      f"expected float32 {want} (one per 128 x 128 block)")
        return scale

    @property
    def tensors(self) -> dict:
        return {n: s.host for n, s in self.slots.items()}

    def place_live(self, compared: bool) -> None:
        """Makes the live parameters themselves dcr's target, layer by layer,
        where every parameter of the layer is still in load form (compared
        bit for bit with the host copies when the engine's checkpoint was
        loaded into them, ``compared``; otherwise only layers without
        post-load processing, whose live parameters are what was loaded).
        Their host copies are dropped; the other layers keep theirs."""
        self.why_host = {}
        for names in self.of_module.values():
            slots = [self.slots[n] for n in names]
            layer = names[0].rpartition(".")[0]
            qm = getattr(slots[0].module, "quant_method", None)
            why = next((w for w in (s.why_not_in_place(compared) for s in slots) if w), None)
            if why is None and any(n in self.fp8_scales for n in names):
                why = "block FP8: requantized into host copies in load form, the layer refreshed from them"
            if why is None and qm is not None and not compared:
                why = f"processed by {type(qm).__name__}, and the engine's checkpoint could not be compared"
            if why is not None:
                self.why_host[layer] = why
                continue
            for s in slots:
                s.host = s.module._parameters[s.attr].data
                s.in_place = True

    def report(self) -> dict:
        """Where dcr applies each layer's frames, and the host bytes it holds."""
        host = {n: s for n, s in self.slots.items() if not s.in_place}
        return {"host_bytes": sum(s.host.numel() * s.host.element_size() for s in host.values()),
                "host_layers": dict(sorted(self.why_host.items())),
                "in_place": sorted(n for n, s in self.slots.items() if s.in_place),
                "in_place_bytes": sum(s.host.numel() * s.host.element_size()
                                      for s in self.slots.values() if s.in_place)}

    def check_in_place(self) -> None:
        """Every in-place target is still its live parameter's data (a
        post-load processing that rebinds a parameter would leave dcr
        writing a tensor the model no longer reads)."""
        for name, s in self.slots.items():
            live = s.module._parameters[s.attr]
            if s.in_place and (live is None or live.data_ptr() != s.host.data_ptr()):
                raise RuntimeError(f"dcr: the post-load processing of '{name}' replaced the parameter dcr applies "
                                   "versions to in place; this engine cannot follow the run")
    @contextlib.contextmanager
    def loading_into(self, tensors: Mapping[str, torch.Tensor]):
        """Within: the model's parameters are ``tensors`` (load form, host,
        carrying the loader's attributes), so ``model.load_weights`` writes
        there and not into the live parameters, which are put back after."""
        saved = []
        try:
            for name, s in self.slots.items():
                if s.in_place and tensors[name] is s.host:
                    continue  # the live parameter, in load form: written where it is
                saved.append((s.module, s.attr, s.module._parameters[s.attr]))
                p = s.materialize(torch.device("cpu"))
                p.data = tensors[name]
                s.module._parameters[s.attr] = p
            yield
        finally:
            for module, attr, live in saved:
                module._parameters[attr] = live

    def trace(self, run_tensors: list) -> tuple:
        """Records the receiver map of the model's ``load_weights`` into the
        host tensors, with zero-filled tensors of the run (the live
        parameters are not touched). Returns (layout, residual names)."""
        weights = {t["name"]: torch.zeros(t["shape"], dtype=torch_dtype(t["dtype"])) for t in run_tensors}
        hosts = self.tensors
        with self.loading_into(hosts):
            return record_layout(hosts, self.model.load_weights, weights)

    def load(self, weights: Iterable) -> None:
        """The residual tensors' loader: ``model.load_weights`` into the host tensors."""
        with torch.no_grad(), self.loading_into(self.tensors):
            self.model.load_weights(weights)

    def refresh(self, names: Iterable[str], vllm_config: Any) -> None:
        """Makes the live parameters ``names`` hold their host copies, and
        the state each layer's post-load processing derives from them.

        A layer without processing (norms) is copied in place. A processed
        layer on CPU is rebuilt as at its first load: parameters in load
        form from the host copies, then its processing (which packs GEMM
        and MoE weights into the kernels' layouts; vLLM's own weight-update
        path skips the MoE prepack there). Elsewhere (GPU) parameters still
        in load form are copied in place, keeping their addresses (CUDA
        graphs), and the processing runs as vLLM's weight updates run it;
        a layer whose processing replaced its parameters is rebuilt."""
        from vllm.config import set_current_vllm_config
        from vllm.platforms import current_platform

        layers: dict = {}
        for name in names:
            s = self.slots[name]
            layers.setdefault(id(s.module), (s.module, []))[1].append(name)
        with torch.no_grad(), set_current_vllm_config(vllm_config):
            for module, changed in layers.values():
                qm = getattr(module, "quant_method", None)
                own = self.of_module[id(module)]
                if self.slots[own[0]].in_place:  # applied where it lives (place_live decides by layer)
                    tied = [m for n in changed for m, _ in self.slots[n].aliases]
                    for m in [module] + tied:
                        _process(m, False)
                    continue
                rebuild = qm is not None and (current_platform.is_cpu() or any(
                    not _same_form(getattr(module, self.slots[n].attr), self.slots[n].host) for n in own))
                # A block-FP8 layer's processing reads its weights and scales: all of its load form goes in.
                whole = rebuild or any(n in self.fp8_scales for n in own)
                tied = []
                for n in (own if whole else changed):
                    s = self.slots[n]
                    live = getattr(module, s.attr)
                    if rebuild:
                        device = live.device if live.device.type != "meta" else torch.device("cpu")
                        p = s.materialize(device)
                        p.data.copy_(s.host)
                        module._parameters[s.attr] = p
                        for m, attr in s.aliases:  # a tied lm_head gets the new parameter too
                            m._parameters[attr] = p
                    else:
                        live.data.copy_(s.host, non_blocking=False)
                    tied += [m for m, _ in s.aliases]
                for m in [module] + tied:  # tied modules derive their own state (the lm_head's GEMM)
                    _process(m, rebuild)
        self.check_in_place()

    def digests(self) -> dict:
        return {n: _sha256(s.host) for n, s in self.slots.items()}

    def fp8_targets(self, layout: dict) -> dict:
        """Receiver ``fp8``: each E4M3 weight's host copy -> its scales' host
        copy, after checking that the traced loader places every element of
        the weight from a BF16 box of a run tensor (a weight reached any
        other way would need a quantization dcr cannot see)."""
        placed: dict = {}
        for c in layout.get("copies", []):
            if c["buffer"] in self.fp8_scales:
                placed[c["buffer"]] = placed.get(c["buffer"], 0) + int(torch.Size(c["extent"]).numel())
        for name in self.fp8_scales:
            numel = self.slots[name].host.numel()
            if placed.get(name, 0) != numel:
                raise NotImplementedError(f"dcr: the loader places {placed.get(name, 0)} of the {numel} elements of "
                                          f"E4M3 weight '{name}' from BF16 run tensors; an FP8 engine needs them all")
        return {name: self.slots[scale].host for name, scale in self.fp8_scales.items()}


def _parameter_owner(model: torch.nn.Module, name: str) -> tuple:
    """(module, attribute) of parameter ``name`` of ``model``."""
    mod_name, _, attr = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr


def _process(module: torch.nn.Module, first_load: bool) -> None:
    """Runs ``module``'s post-load processing again (as at a first load:
    an MoE kernel is set up and prepacked anew)."""
    qm = getattr(module, "quant_method", None)
    if qm is None:
        return
    if first_load and getattr(qm, "moe_kernel", None) is not None:
        qm.moe_kernel = None
    qm.process_weights_after_loading(module)
    if hasattr(module, "update_param_tp_status"):
        module.update_param_tp_status()


def _count_replicas_once(layout: dict, rank: int, group: Any) -> None:
    """Elements placed on several ranks (norms and other replicated
    parameters, KV heads replicated when heads < ranks) count in the
    partial digest of the lowest rank only: the other ranks' copies of the
    same canonical box are marked non-primary, so the ranks' partials add
    up to the version's digest. Collective over the ranks of ``group``."""
    import torch.distributed as dist

    def boxes(copies):
        return [(c["tensor"], tuple(c["offset"]), tuple(c["extent"])) for c in copies if c.get("primary", True)]

    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, boxes(layout["copies"]), group=group)
    lower: dict = {}
    for theirs in every[:rank]:
        for t, off, ext in theirs:
            lower.setdefault(t, set()).add((off, ext))
    for c in layout["copies"]:
        held = lower.get(c["tensor"], ())
        off, ext = tuple(c["offset"]), tuple(c["extent"])
        if (off, ext) in held:
            c["primary"] = False
            continue
        for o2, e2 in held:
            if overlaps(off, ext, o2, e2):
                raise NotImplementedError(f"dcr: '{c['tensor']}' box {list(off)}+{list(ext)} on rank {rank} overlaps "
                                          f"another rank's box {list(o2)}+{list(e2)} without being the same box")


def _same_form(live: torch.Tensor, host: torch.Tensor) -> bool:
    return tuple(live.shape) == tuple(host.shape) and live.dtype == host.dtype and live.device.type != "meta"


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _default_engine_name() -> str:
    # The engine process: with several workers it is their parent; one
    # worker runs inside it. Same on every rank of one engine.
    import vllm.distributed.parallel_state as ps

    single = ps.get_tensor_model_parallel_world_size() == 1
    return f"vllm-{socket.gethostname()}-{os.getpid() if single else os.getppid()}"


class DcrWeightTransferEngine(WeightTransferEngine[DcrInitInfo, DcrUpdateInfo]):
    """The worker side of backend ``"dcr"``: a rank of an engine that
    follows a dcr run (module docstring; docs/vllm.md)."""

    init_info_cls = DcrInitInfo
    update_info_cls = DcrUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._info: Optional[DcrInitInfo] = None
        self._store = None
        self._form: Optional[_LoadForm] = None
        self._receiver: Optional[dcr.Receiver] = None
        self.version: Optional[int] = None

    # -- init: join the run ---------------------------------------------------------

    def init_transfer_engine(self, init_info: DcrInitInfo) -> None:
        import vllm.distributed.parallel_state as ps

        if self._receiver is not None:
            if init_info == self._info:
                return  # the same run again: already following
            raise RuntimeError("dcr: this engine already follows a run; start a new engine for another")
        if self.parallel_config.pipeline_parallel_size > 1:
            raise NotImplementedError("dcr: pipeline-parallel engines are not supported (tensor parallel is)")
        store, run = _open_run(init_info.store, init_info.run_id)
        latest = _latest_commit(store)
        if latest < 0:
            raise ValueError(f"dcr: the run at '{init_info.store}' has no committed version yet")
        rank, ranks = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        engine = init_info.engine or _default_engine_name()
        state_root = init_info.state_dir or os.path.join(tempfile.gettempdir(), "dcr-vllm", engine)
        state_dir = os.path.join(state_root, f"rank{rank}")
        os.makedirs(state_dir, exist_ok=True)

        form = _LoadForm(self.model)
        layout, residuals = form.trace(run["tensors"])
        if ranks > 1:
            _count_replicas_once(layout, rank, ps.get_tp_group().cpu_group)
        hosts = {n: torch.zeros(t["shape"], dtype=torch_dtype(t["dtype"]))
                 for t in run["tensors"] for n in [t["name"]] if n in residuals}
        fp8 = form.fp8_targets(layout)
        loaded, adoptable = self._load_own_checkpoint(form, hosts)
        form.place_live(compared=loaded)
        # Live parameters on a device are reached through torch (stage=None);
        # on CPU, in place directly, as are the host copies.
        metrics = None
        if init_info.metrics:
            host, port = init_info.metrics.rsplit(":", 1)
            metrics = f"{host}:{int(port) + rank if int(port) else 0}"
        if residuals:
            # Each rank keeps the residual tensors whole; rank 0's count.
            receiver = dcr.Receiver(form.tensors, layout, residuals=hosts, loader=form.load,
                                    post_update=self._on_version, residuals_primary=rank == 0, fp8=fp8 or None,
                                    metrics=metrics)
        else:
            receiver = dcr.Receiver(form.tensors, layout, post_update=self._on_version, fp8=fp8 or None,
                                    metrics=metrics)
        self._store, self._form, self._receiver = store, form, receiver
        self._buffers_of: dict = {}  # canonical tensor -> the parameters it is placed in
        for c in layout.get("copies", []):
            self._buffers_of.setdefault(c["tensor"], set()).add(c["buffer"])
        self._follow = dict(engine=engine, rank=rank, ranks=ranks, poll_s=init_info.poll_s,
                            relay=list(init_info.relay or ()), relay_key=init_info.relay_key or "",
                            relay_pub=init_info.relay_pub or "", relay_insecure=init_info.relay_insecure,
                            relay_poll_s=init_info.relay_poll_s, recheck=init_info.recheck)
        self._state_dir = state_dir
        try:
            self.adopted = None
            if fp8:  # its E4M3 checkpoint cannot give the BF16 master the run's digests count
                logger.info("dcr: this FP8 engine joins from the run's BF16 snapshot (its master starts there)")
            elif init_info.adopt_loaded:
                self.adopted = self._adopt_loaded(store, latest, engine, rank, ranks, adoptable)
            self._reach(latest, init_info.join_timeout_s)
        except BaseException:
            self._store = self._form = self._receiver = None
            raise
        self._info = init_info

    # -- one update ---------------------------------------------------------------

    def start_weight_update(self) -> None:
        self._check_init()

    def receive_weights(self, update_info: DcrUpdateInfo) -> None:
        self._check_init()
        v = update_info.version
        if v < self.version:
            raise ValueError(f"dcr: the engine holds version {self.version}; version {v} is behind it")
        if v == self.version:
            return
        self._reach(v, update_info.timeout_s)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronizes the accelerator after receive_weights;
        # refresh() copies synchronously, so this is the same contract.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        self._check_init()

    def shutdown(self) -> None:
        self._store = self._form = self._receiver = None
        self._info = None

    # -- internals ----------------------------------------------------------------

    def _check_init(self) -> None:
        if self._receiver is None:
            raise RuntimeError("dcr: init_weight_transfer_engine({'store': URL}) first")

    def _on_version(self, report: dict) -> None:
        # Called by Receiver.follow (inside update_weights or init, so no
        # forward pass runs) whenever the host tensors hold a whole version:
        # the live parameters move to it.
        changed = set()
        for t in report.get("tensors_changed", []):
            changed |= self._buffers_of.get(t, set())
        if report.get("residuals_loaded"):  # the loader wrote wherever the model's loader writes
            changed = set(self._form.slots)
        self._form.refresh(sorted(changed), self.vllm_config)
        self.version = report["version"]

    def _load_own_checkpoint(self, form: _LoadForm, residual_hosts: dict) -> tuple:
        """Loads the engine's own checkpoint (its model directory, what vLLM
        loaded the live parameters from) into the host copies in load form,
        and the residual tensors' canonical bits into ``residual_hosts``.
        Returns (loaded, adoptable): nothing is loaded when the model is not
        a local safetensors directory; it can be adopted only when it holds
        every residual tensor under its run name (its canonical bits are
        what the digest counts; transformers saves a Qwen3-MoE's fused
        experts per expert, so such an engine joins from a snapshot)."""
        from safetensors import safe_open

        path = self.vllm_config.model_config.model
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
        if not files:
            return False, False
        keys = set()
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt") as st:
                keys.update(st.keys())

        def weights():
            for f in files:
                with safe_open(os.path.join(path, f), framework="pt") as st:
                    for k in st.keys():
                        t = st.get_tensor(k)
                        if k in residual_hosts:
                            residual_hosts[k].copy_(t)
                        yield k, t

        form.load(weights())
        return True, set(residual_hosts) <= keys

    def _adopt_loaded(self, store: "dcr.Store", latest: int, engine: str, rank: int, ranks: int,
                      loaded: bool) -> Optional[int]:
        """When the engine's own checkpoint was ``loaded`` on every rank and
        the ranks' digests add up to a committed version's, records that
        version in the rank's journal (``Receiver.adopt``) and returns it.
        None (nothing recorded; the join downloads a snapshot) otherwise.
        Every rank takes part (an all-gather over the tensor-parallel group)."""
        import vllm.distributed.parallel_state as ps

        path = self.vllm_config.model_config.model
        partials = [self._receiver.digest() if loaded else None]
        if ranks > 1:
            partials = [None] * ranks
            torch.distributed.all_gather_object(partials, self._receiver.digest() if loaded else None,
                                                group=ps.get_tp_group().cpu_group)
        if any(p is None for p in partials):
            logger.info("dcr: the engine's checkpoint at %s cannot be compared with the run (not a local "
                        "safetensors directory holding every unplaced run tensor); joining from a snapshot", path)
            return None
        total = dcr.add_digests(partials)
        for v in sorted({latest, 0} | set(range(max(0, latest - ADOPT_CANDIDATES + 1), latest + 1)), reverse=True):
            try:
                commit = json.loads(store.get(f"commits/v{v:010}.json"))
            except dcr.NotFoundError:
                continue
            if commit.get("target_digest") == total:
                self._receiver.adopt(store, self._state_dir, v, total, engine=engine, rank=rank, ranks=ranks)
                logger.info("dcr: the engine's checkpoint at %s is committed version %d: joined from it", path, v)
                return v
        logger.info("dcr: the engine's checkpoint at %s (digest %s) is none of the run's newest committed versions; "
                    "joining from a snapshot", path, total)
        return None

    def _reach(self, version: int, timeout_s: float) -> None:
        """Follows the run until ``version`` is held whole in the host
        tensors, then moves the live parameters that changed."""
        try:
            self._receiver.follow(self._store, self._state_dir, until=version, timeout_s=timeout_s, **self._follow)
        except dcr.DeadlineExceededError as e:
            raise TimeoutError(f"dcr: version {version} was not reached within {timeout_s} s (is it being "
                               f"published?); the engine keeps version {self.version}: {e.message}") from e

    def load_form_digests(self) -> dict:
        """SHA-256 of each parameter's load-form bytes held by dcr."""
        self._check_init()
        return self._form.digests()

    def join_report(self) -> dict:
        """How this rank joined and where it applies versions: ``adopted`` is
        the committed version its loaded checkpoint held (None: it joined
        from a snapshot); ``in_place``: the parameters dcr writes where they
        live (``in_place_bytes``); ``host_layers``: the layers vLLM
        transformed after loading, whose load form dcr keeps in host memory
        (``host_bytes``, with the residual tensors' canonical copies), each
        with why it could not be written in place; ``outside_changes``: what
        the last update's recheck found changed outside dcr ("": nothing)."""
        self._check_init()
        report = {"adopted": self.adopted, **self._form.report()}
        report["host_bytes"] += sum(t.numel() * t.element_size() for t in self._receiver.residuals.values())
        report["fp8_weights"] = sorted(self._form.fp8_scales)
        report["fp8_master_bytes"] = self._receiver.fp8_master_bytes
        report["host_bytes"] += report["fp8_master_bytes"]
        report["residuals"] = sorted(self._receiver.residuals)
        report["metrics_url"] = self._receiver.metrics_url
        report["outside_changes"] = self._receiver.outside_changes
        return report


# ---- Checks the tests (and users) run through collective_rpc ----------------------

def load_form_digests(worker: Any) -> dict:
    """``llm.collective_rpc(load_form_digests)``: per rank, the SHA-256 of
    every parameter in load form as the dcr backend holds it."""
    return worker.weight_transfer_engine.load_form_digests()


def join_report(worker: Any) -> dict:
    """``llm.collective_rpc(join_report)``: per rank, how it joined the run
    and where it applies versions (in place, or host copies of which layers)."""
    return worker.weight_transfer_engine.join_report()


def param_addresses(worker: Any) -> dict:
    """``llm.collective_rpc(param_addresses)``: per rank, each live
    parameter's data address and element count (those dcr writes in place
    keep their address from version to version)."""
    model = worker.weight_transfer_engine.model
    return {n: [p.data_ptr(), p.numel()] for n, p in model.named_parameters()}


def fresh_load_form_digests(worker: Any, checkpoint_dir: str) -> dict:
    """``llm.collective_rpc(fresh_load_form_digests, args=(dir,))``: per
    rank, the SHA-256 of every parameter in load form after a fresh load of
    the safetensors checkpoint in ``checkpoint_dir`` through the model's own
    ``load_weights`` (into scratch tensors; the live parameters are not
    touched)."""
    from safetensors import safe_open

    model = worker.weight_transfer_engine.model
    form = _LoadForm(model)
    files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))

    def weights():
        for f in files:
            with safe_open(os.path.join(checkpoint_dir, f), framework="pt") as st:
                for k in st.keys():
                    yield k, st.get_tensor(k)

    form.load(weights())
    return form.digests()


# ---- The trainer side --------------------------------------------------------------

@dataclass
class DcrTrainerInitInfo(TrainerInitInfo):
    """``trainer_init`` info of backend ``"dcr"``.

    store: the run's store URL; the run is created (version 0, the
        snapshot of the source's tensors) when the store holds none.
    state_dir: the publisher's state (docs/python.md, ShardPublisher);
        None: in memory (``dcr.default_publisher_state_dir``).
    engine_init: further worker ``init_info`` (engine, state_dir, poll_s,
        join_timeout_s); ``store`` and ``run_id`` are filled in.
    engines: the engine names to wait for before each version's publish
        (every rank following in the store), so that they take part in its
        attempts; None: the engine this client drives (``engine_init``'s
        ``engine``, by default named after this host and process); []:
        publish at once (engines then apply the committed version when
        they reach it).
    relay, relay_key, relay_pub, relay_insecure: the trainer pushes every
        frame object into these relay roots as it uploads it (engines
        attached below them with ``engine_init``'s ``relay`` take it from
        the tree instead of the store); as :class:`dcr.ShardPublisher`'s.
    """

    backend: ClassVar[str] = BACKEND

    store: str
    state_dir: Optional[str] = None
    engine_init: dict = field(default_factory=dict)
    engines: Optional[list] = None
    max_attempts: int = 3
    ack_timeout_s: float = 120.0
    heartbeat_timeout_s: float = 30.0
    update_timeout_s: float = 600.0
    chunk_elements: int = dcr.DEFAULT_CHUNK_ELEMENTS  # the run's chunking, when this trainer creates the run
    # Also take a snapshot of every N-th version (every trainer process takes part); 0: only version 0.
    snapshot_every: int = 0
    # Push frame objects into the relay tree's roots (dcr.ShardPublisher's relay arguments).
    relay: list = field(default_factory=list)
    relay_key: str = ""
    relay_pub: str = ""
    relay_insecure: bool = False
    inject_failures: list = field(default_factory=list)  # tests of retries: ShardPublisher(inject_failures=)


@dataclass
class DcrSenders:
    """A trainer's own dcr senders as the ``source`` of :meth:`DcrTrainerWeightTransferEngine.trainer_init`,
    in place of a vLLM ``WeightSource``: no gather of full tensors, each
    trainer process publishes the shards it holds (``dcr.ShardPublisher``'s
    ``senders``, ``layouts``, ``placement``, ``conversions``, ``stage``;
    docs/python.md). With ``processes`` > 1, every trainer process calls
    ``trainer_init`` with its own senders and ``init_info.rank`` = its
    process index, and ``send_weights`` each round; process 0 (vLLM's
    sender) coordinates the attempt and drives the engines.

    snapshot: the run's version 0 as canonical tensors by name (a mapping,
        or a callable returning one), used by process 0 only when the store
        holds no run yet. Other processes wait for it.
    """

    senders: list
    layouts: Optional[list] = None
    processes: int = 1
    placement: Optional[list] = None
    conversions: Optional[dict] = None
    stage: Optional[bool] = None
    snapshot: Any = None


class DcrTrainerWeightTransferEngine(TrainerWeightTransferEngine[DcrTrainerInitInfo]):
    """The trainer side of backend ``"dcr"``: each :meth:`send_weights`
    publishes the source's current tensors as the next version and drives
    the engines' start / update / finish through the client. The source is
    a vLLM ``WeightSource`` (its tensors are copied into held tensors each
    round) or :class:`DcrSenders` (the trainer's shards, published in place,
    from one or several trainer processes)."""

    init_info_cls = DcrTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: DcrTrainerInitInfo, *, client, source=None) -> "DcrTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("dcr: trainer_init needs a source: a WeightSource (e.g. ModuleSource(model)) or "
                             "dcr.vllm.DcrSenders")
        shards = isinstance(source, DcrSenders)
        processes = source.processes if shards else 1
        if not 0 <= init_info.rank < processes:
            raise ValueError(f"dcr: trainer rank {init_info.rank} is not a process of {processes} "
                             "(DcrSenders.processes)")
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self.held = None if shards else {name: t.detach() for name, t in source}
        store = dcr.open_store(init_info.store)
        self.store = store
        options = dict(max_attempts=init_info.max_attempts, ack_timeout_s=init_info.ack_timeout_s,
                       heartbeat_timeout_s=init_info.heartbeat_timeout_s, chunk_elements=init_info.chunk_elements,
                       snapshot_every=init_info.snapshot_every,
                       inject_failures=init_info.inject_failures, relay=init_info.relay,
                       relay_key=init_info.relay_key, relay_pub=init_info.relay_pub,
                       relay_insecure=init_info.relay_insecure)
        if shards:
            self.publisher = dcr.ShardPublisher(store, init_info.state_dir, senders=source.senders,
                                                process=init_info.rank, processes=processes,
                                                layouts=source.layouts, placement=source.placement,
                                                conversions=source.conversions, stage=source.stage,
                                                peer_timeout_s=init_info.update_timeout_s, **options)
        elif self.is_sender:
            self.publisher = dcr.ShardPublisher(store, init_info.state_dir, senders=[self.held], **options)
        else:
            return self  # a WeightSource's other ranks only take part in its collectives
        self.version = _latest_commit(store)
        if self.version < 0 and self.is_sender:
            snapshot = source.snapshot if shards else self.held
            if callable(snapshot):
                snapshot = snapshot()
            if snapshot is None:
                raise ValueError(f"dcr: the store '{init_info.store}' holds no run yet; give DcrSenders.snapshot "
                                 "(the canonical tensors of version 0) to create it")
            self.publisher.publish_snapshot(snapshot)
            self.version = 0
        elif self.version < 0:
            self.version = self._await_run(store)
        if not self.is_sender:
            return self
        run = json.loads(store.get("run.json"))
        worker_info = dict(init_info.engine_init)
        worker_info.update(store=init_info.store, run_id=run["run_id"])
        worker_info.setdefault("engine", f"vllm-{socket.gethostname()}-{os.getpid()}")
        self.engines = list(init_info.engines) if init_info.engines is not None else [worker_info["engine"]]
        self.worker_info = worker_info
        client.init_weight_transfer_engine(worker_info)
        return self

    def _await_run(self, store: "dcr.Store") -> int:
        """A trainer process other than 0: waits until process 0 has created the run."""
        deadline = time.monotonic() + self.info.update_timeout_s
        while (v := _latest_commit(store)) < 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"dcr: trainer process {self.info.rank}: no run in '{self.info.store}' after "
                                   f"{self.info.update_timeout_s} s (process 0 creates it)")
            time.sleep(0.05)
        return v

    def _refresh_held(self) -> None:
        # A source may hand out new tensors each round (e.g. gathered
        # shards): their values go into the tensors the publisher holds.
        for name, t in self.source:
            h = self.held[name]
            if t.data_ptr() != h.data_ptr():
                h.copy_(t.detach())

    def send_weights(self, version: Optional[int] = None) -> dict:
        """Publishes the next version (or ``version``) and returns the
        publisher's report once it is committed and the engines hold it.
        Called on every trainer rank; with :class:`DcrSenders` in several
        processes each publishes its own senders, and only rank 0 (the
        coordinator) drives the engines."""
        if self.held is not None:
            self._refresh_held()  # a collective for a sharded WeightSource: every rank takes part
        if not hasattr(self, "publisher"):
            return {}
        v = self.version + 1 if version is None else version
        if not self.is_sender:
            report = self.publisher.publish(v)
            self.version = v
            return report
        since = time.time()
        self.client.start_weight_update()
        errors: list = []

        def update() -> None:
            try:
                self.client.update_weights({"version": v, "timeout_s": self.info.update_timeout_s})
            except BaseException as e:  # handed to the caller below
                errors.append(e)

        updater = threading.Thread(target=update, name="dcr-update-weights", daemon=True)
        updater.start()
        self._await_engines(since, updater)
        report = self.publisher.publish(v)
        updater.join()
        if errors:
            raise errors[0]
        self.client.finish_weight_update(weight_version=str(v))
        self.version = v
        return report

    def _await_engines(self, since: float, updater: threading.Thread) -> None:
        """Waits until every rank of each of ``engines`` is following in the
        store with a heartbeat after ``since`` (or the update call ended)."""
        want = set(self.engines)
        deadline = time.monotonic() + self.info.update_timeout_s
        while want and updater.is_alive() and time.monotonic() < deadline:
            live: dict = {}
            for key, _, _ in self.store.list("receivers/"):
                try:
                    r = json.loads(self.store.get(key))
                except (dcr.NotFoundError, ValueError):
                    continue
                e = r.get("engine") or {}
                if e.get("id") in want and r.get("state") in ("following", "applying") and r.get("heartbeat", 0) >= since:
                    live.setdefault(e["id"], set()).add(e.get("rank"))
                    if len(live[e["id"]]) == e.get("ranks"):
                        want.discard(e["id"])
            if want:
                time.sleep(0.02)


class LLMClient:
    """A ``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


# A trainer process is no vLLM engine, so vLLM's plugins are not loaded there:
# importing this module (for DcrTrainerInitInfo) registers the backend too.
register()
