"""dcr: bit-exact delta-compressed refit of policy weights.

A thin layer over the C++ core (the extension ``dcr._dcr``): checkpoints as
zero-copy numpy/torch views, file deltas, stores, the refit protocol
(:class:`Publisher`, :class:`Follower`), and in-memory deltas over live
tensors through layout maps (:class:`Sender`, :class:`Receiver`). Every
failure is a :class:`DcrError` subclass named after its status code
(:mod:`dcr.errors`). See docs/python.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

from . import _dcr, errors
from ._tensors import Staging, TensorMemory, _off_host, as_torch, byte_view, copy_into, dtype_name, torch_dtype
from .errors import (AbortedError, AlreadyExistsError, CorruptFrameError, DataLossError, DcrError,
                     DeadlineExceededError, FailedPreconditionError, FencedAttemptError, InternalError,
                     InvalidArgumentError, NotFoundError, OutOfRangeError, PermissionDeniedError,
                     StoreUnavailableError, UnavailableError, UnimplementedError, WrongBaseError)

Delta = _dcr.Delta
Store = _dcr.Store

DEFAULT_CHUNK_ELEMENTS = 1 << 20

PathLike = Union[str, "os.PathLike[str]"]


class TensorInfo(NamedTuple):
    name: str
    dtype: str  # safetensors name: "BF16", "F32", "F8_E4M3", ...
    shape: tuple
    nbytes: int


class Checkpoint:
    """A safetensors checkpoint (a file, or a directory of shards), memory-mapped.

    :meth:`array` and :meth:`tensor` are views of the mapped bytes: no copy,
    and, for a checkpoint opened ``writable=True``, writes through them (or
    through :func:`apply_delta`) land in the files."""

    def __init__(self, impl: "_dcr.Checkpoint"):
        self._c = impl
        self._infos = {t[0]: TensorInfo(t[0], t[1], tuple(t[2]), t[3]) for t in impl.tensors()}

    @classmethod
    def open(cls, path: PathLike, writable: bool = False) -> "Checkpoint":
        return cls(_dcr.Checkpoint.open(os.fspath(path), writable))

    @classmethod
    def create(cls, path: PathLike, tensors: Mapping[str, tuple], max_shard_bytes: int = 0) -> "Checkpoint":
        """Creates a zero-filled checkpoint of ``{name: (dtype, shape)}`` and opens it writable."""
        specs = [(name, dtype, [int(d) for d in shape]) for name, (dtype, shape) in tensors.items()]
        return cls(_dcr.Checkpoint.create(os.fspath(path), specs, max_shard_bytes))

    @property
    def path(self) -> str:
        return self._c.path

    @property
    def writable(self) -> bool:
        return self._c.writable

    @property
    def total_bytes(self) -> int:
        return self._c.total_bytes

    @property
    def files(self) -> list:
        return self._c.files

    def tensors(self) -> list:
        """Every tensor, in dcr's name order (numbers by value), as :class:`TensorInfo`."""
        return list(self._infos.values())

    def names(self) -> list:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise NotFoundError(f"{self.path}: no tensor '{name}'") from None

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def array(self, name: str):
        """A numpy view of the tensor (read-only unless writable). Dtypes numpy
        lacks come as unsigned integers of their width (BF16: uint16, FP8: uint8)."""
        return self._c.array(name)

    def tensor(self, name: str):
        """A torch view of the tensor with its real dtype (torch.bfloat16, torch.float8_e4m3fn, ...)."""
        return as_torch(self._c.array(name), self.info(name).dtype)

    def sync(self) -> None:
        """Flushes writes to the files."""
        self._c.sync()


def _ckpt(c: Union[Checkpoint, PathLike], writable: bool = False) -> "_dcr.Checkpoint":
    if isinstance(c, Checkpoint):
        return c._c
    return _dcr.Checkpoint.open(os.fspath(c), writable)


class VerifyResult(NamedTuple):
    matches: bool
    differing: list


def make_delta(base: Union[Checkpoint, PathLike], next: Union[Checkpoint, PathLike], out_dir: PathLike,
               mode: str = "xor", chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, delta_id: int = 0) -> dict:
    """Writes the delta base -> next into directory ``out_dir``; returns its manifest.
    ``mode``: "xor" (xor/add frames, need the base bits) or "overwrite"."""
    return json.loads(_dcr.make_delta(_ckpt(base), _ckpt(next), os.fspath(out_dir), mode, chunk_elements, delta_id))


def apply_delta(target: Union[Checkpoint, PathLike], delta_dir: PathLike) -> dict:
    """Applies a delta directory in place. :class:`WrongBaseError` unless the
    target is the delta's base (or partly applied); :class:`CorruptFrameError`
    for a corrupt frame."""
    return _dcr.apply_delta(_ckpt(target, writable=True), os.fspath(delta_dir))


def verify_delta(checkpoint: Union[Checkpoint, PathLike], delta_dir: PathLike, against_base: bool = False) -> VerifyResult:
    """Is the checkpoint the delta's target (or base)? A full digest pass."""
    return VerifyResult(*_dcr.verify_delta(_ckpt(checkpoint), os.fspath(delta_dir), against_base))


def inspect_delta(delta_dir: PathLike) -> dict:
    """The manifest of a delta directory, after checking every frame."""
    return json.loads(_dcr.inspect_delta(os.fspath(delta_dir)))


def describe_manifest(manifest: bytes, table_json: str) -> dict:
    """A stored manifest (``manifest.bin``: a delta directory's, or an attempt's
    in a store) as a dict, decoded against its tensor table: the text of the
    delta's ``tensors.json`` or of the run's ``run.json``. Frame entries carry
    no mode, codec or changed count (the frames' headers hold them)."""
    return json.loads(_dcr.describe_manifest(manifest, table_json))


def read_delta(delta_dir: PathLike) -> Delta:
    """Loads a delta directory (one frame object) into memory."""
    return Delta.read(os.fspath(delta_dir))


def open_store(url: str, create_root: bool = True) -> Store:
    """``file:///abs/path``, a plain directory, ``s3://bucket/prefix?...`` or ``mem://name``."""
    return _dcr.open_store(url, create_root)


def default_publisher_state_dir(store: Store) -> str:
    """Where a publisher of ``store`` keeps its state unless told: ``$DCR_STATE_DIR``,
    else in memory, ``/dev/shm/dcr-<uid>/publish/<store>`` (docs/protocol.md)."""
    return _dcr.default_publisher_state_dir(store.url)


class Publisher:
    """Publishes checkpoints as versions of a run in a store (C++ dcr::Publisher);
    :meth:`publish` returns once the version is committed. ``state_dir`` holds
    the baseline, owned by one publisher at a time; it is a cache of the store
    (rebuilt from it when missing). None: :func:`default_publisher_state_dir`,
    in memory."""

    def __init__(self, store: Store, state_dir: Optional[PathLike] = None, senders: int = 1, max_attempts: int = 3,
                 ack_timeout_s: float = 60.0, heartbeat_timeout_s: float = 10.0, snapshot_every: int = 0,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):
        self.store = store
        self.state_dir = default_publisher_state_dir(store) if state_dir is None else os.fspath(state_dir)
        self._p = _dcr.Publisher(store, self.state_dir, senders, max_attempts, ack_timeout_s,
                                 heartbeat_timeout_s, snapshot_every, chunk_elements)

    def publish(self, version: int, checkpoint: Union[Checkpoint, PathLike]) -> dict:
        return self._p.publish(version, _ckpt(checkpoint))


class Follower:
    """A receiver keeping checkpoint directory ``target`` at the newest committed
    version, in place (C++ dcr::Follower); an empty directory joins from a snapshot.
    ``relay``: relay addresses (its relay, then ancestors; ``dcr relay``) to take
    frame objects from, what none delivers coming from the store; ``relay_key`` and
    ``relay_pub``: CURVE key files (``dcr relay keygen``), as ``dcr follow``'s
    ``--relay-key`` and ``--relay-pub``; required with ``relay`` unless
    ``relay_insecure`` (plain TCP to relays run with ``--insecure``, trusted
    networks only; ``--relay-insecure``). ``relay_poll_s``: in a tree that carries
    the publisher's notices, the store is looked at on a notice and otherwise
    only this often (a lost notice costs at most this; ``--relay-poll``)."""

    def __init__(self, store: Store, target: PathLike, id: str = "", poll_s: float = 0.1, quiet: bool = True,
                 relay: Sequence[str] = (), relay_key: PathLike = "", relay_pub: PathLike = "",
                 relay_insecure: bool = False, relay_poll_s: float = 1.0):
        self.store = store
        self._f = _dcr.Follower(store, os.fspath(target), id, poll_s, quiet, list(relay), os.fspath(relay_key),
                                os.fspath(relay_pub), relay_insecure, relay_poll_s)

    def run(self, until: Optional[int] = None, timeout_s: Optional[float] = None,
            on_version: Optional[Callable[[int], Any]] = None) -> int:
        """Follows until version ``until`` is applied (forever when None);
        :class:`DeadlineExceededError` after ``timeout_s``. Returns the version held.

        ``on_version(version)``, the post-update hook, is called (with the
        GIL, from the loop) after each version the target reaches, e.g. to
        re-derive state from the new weights. Ctrl-C (KeyboardInterrupt)
        and an exception from the hook stop the loop cleanly (the receiver
        records its stop, the target stays a consistent version) and are
        re-raised."""
        return self._f.run(until, timeout_s, on_version)

    @property
    def version(self) -> int:
        return self._f.version


# ---- Layout maps over live tensors ---------------------------------------------

def _layout_json(layout: Union[str, Mapping[str, Any]]) -> str:
    return layout if isinstance(layout, str) else json.dumps(layout)


def identity_layout(tensors: Mapping[str, Any]) -> str:
    """The layout map of buffers that are the canonical tensors themselves
    (same names, dtypes and shapes), as JSON."""
    ts, bufs, copies = [], [], []
    for name, t in tensors.items():
        shape = [int(d) for d in t.shape]
        ts.append({"name": name, "dtype": dtype_name(t), "shape": shape})
        bufs.append({"id": name, "dtype": dtype_name(t), "shape": shape})
        copies.append({"tensor": name, "offset": [0] * len(shape), "extent": shape, "buffer": name,
                       "buffer_offset": [0] * len(shape)})
    return json.dumps({"format": "dcr-layout", "format_version": 1, "tensors": ts, "buffers": bufs, "copies": copies})


def _buffers_for(layout_json: str, tensors: Mapping[str, Any], who: str, views: bool = True) -> list:
    """The byte views of ``tensors`` in the layout's buffer order (the tensors
    themselves with ``views=False``), each checked against its declared
    dtype and shape."""
    doc = json.loads(layout_json)
    out = []
    for b in doc.get("buffers", []):
        bid = b["id"]
        if bid not in tensors:
            raise InvalidArgumentError(f"{who}: the layout declares buffer '{bid}', which is not among the tensors given")
        t = tensors[bid]
        got = dtype_name(t)
        if got != b["dtype"]:
            raise InvalidArgumentError(f"{who}: buffer '{bid}' is {got}, the layout declares {b['dtype']}")
        if [int(d) for d in t.shape] != [int(d) for d in b["shape"]]:
            raise InvalidArgumentError(f"{who}: buffer '{bid}' has shape {list(t.shape)}, the layout declares {b['shape']}")
        out.append(byte_view(t, f"{who}: buffer '{bid}'") if views else t)
    return out


def _fp8_scale_shape(shape: Sequence[int], block: int = 128) -> list:
    """The shape of the block scales of an FP8 tensor of ``shape``: one per
    ``block`` x ``block`` block of its last two dimensions (edge blocks
    partial), the leading dimensions (an expert stack) as they are."""
    return [int(d) for d in shape[:-2]] + [(int(d) + block - 1) // block for d in shape[-2:]]


def _fp8_memory(layout_json: str, tensors: Mapping[str, Any], scales: Mapping[str, Any], staged: bool) -> tuple:
    """An FP8 receiver's layout (its FP8 buffers, and the tensors copied into
    them, declared in the run's dtype: F8_E4M3 read as BF16) and its memory
    (``_dcr.Fp8Memory``), after checking each FP8 tensor and scale. ``staged``
    (tensors on a device, or ``stage=True``): the other buffers are reached
    through :class:`TensorMemory`, and the requantized E4M3 bytes and scales
    are written to host copies, copied to the FP8 tensors at every flush that
    wrote them (before an apply returns or the rank acks)."""
    doc = json.loads(layout_json)
    index = {b["id"]: i for i, b in enumerate(doc.get("buffers", []))}
    fp8_tensors = set()
    for bid in scales:
        if bid not in index:
            raise InvalidArgumentError(f"Receiver: fp8 names buffer '{bid}', which the layout does not declare")
        b = doc["buffers"][index[bid]]
        if b["dtype"] == "F8_E4M3":
            b["dtype"] = "BF16"
        fp8_tensors |= {c["tensor"] for c in doc.get("copies", []) if c["buffer"] == bid}
    for t in doc.get("tensors", []):
        if t["name"] in fp8_tensors and t["dtype"] == "F8_E4M3":
            t["dtype"] = "BF16"
    layout_json = json.dumps(doc)
    fp8, plain, ordered, copies = [], {}, [], {}
    for bid, i in index.items():
        t = tensors.get(bid)
        if t is None:
            raise InvalidArgumentError(f"Receiver: the layout declares buffer '{bid}', which is not among the tensors given")
        ordered.append(t)  # TensorMemory's view (an FP8 buffer's slot is never reached through it)
        if bid not in scales:
            if staged:
                _buffers_for(json.dumps({"buffers": [doc["buffers"][i]]}), {bid: t}, "Receiver", views=False)
            else:
                plain[i] = _buffers_for(json.dumps({"buffers": [doc["buffers"][i]]}), {bid: t}, "Receiver")[0]
            continue
        shape = [int(d) for d in doc["buffers"][i]["shape"]]
        if dtype_name(t) != "F8_E4M3" or [int(d) for d in t.shape] != shape:
            raise InvalidArgumentError(f"Receiver: FP8 buffer '{bid}' is {dtype_name(t)} {list(t.shape)}; expected "
                                       f"F8_E4M3 {shape}")
        s = scales[bid]
        want = _fp8_scale_shape(shape)
        if dtype_name(s) != "F32" or [int(d) for d in s.shape] != want:
            raise InvalidArgumentError(f"Receiver: the scales of FP8 buffer '{bid}' are {dtype_name(s)} "
                                       f"{list(s.shape)}; expected F32 {want} (a scale per 128 x 128 block)")
        if staged:
            import torch

            host_t, host_s = torch.empty(t.shape, dtype=t.dtype), torch.empty(s.shape, dtype=s.dtype)
            copies[i] = (t, s, host_t, host_s)
            t, s = host_t, host_s
        fp8.append((i, byte_view(t, f"Receiver: FP8 buffer '{bid}'"), byte_view(s, f"Receiver: scales of '{bid}'")))
    if not staged:
        return layout_json, _dcr.Fp8Memory(layout_json, fp8, plain)

    def copy_to_tensors(buffers):
        for i in buffers:
            t, s, host_t, host_s = copies[i]
            t.copy_(host_t)
            s.copy_(host_s)
    return layout_json, _dcr.Fp8Memory(layout_json, fp8, {}, TensorMemory(ordered, "Receiver"), copy_to_tensors)


def _buffers_of_tensors(layout_json: str) -> dict:
    """Canonical tensor name -> the ids of the buffers its copies write."""
    out: dict = {}
    for c in json.loads(layout_json).get("copies", []):
        out.setdefault(c["tensor"], set()).add(c["buffer"])
    return out


def _touched(delta: Delta) -> set:
    """The names of the tensors a delta's frames change."""
    manifest = json.loads(delta.manifest_json)
    names = [t["name"] for t in manifest.get("tensors", [])]
    return {names[f["tensor"]] for f in manifest.get("frames", [])}


class Sender:
    """The trainer side over live tensors: ``tensors`` maps names to the
    trainer's tensors (canonical names, or shard buffers with a sender
    ``layout`` map, JSON or dict). The current values are copied once as the
    baseline; :meth:`make_delta` diffs the live tensors against it (no
    assembly: shards are projected through the map) and :meth:`commit` moves
    the baseline to a committed delta's target (touching only its changes).

    ``stage``: tensors not on the CPU (CUDA) are read through host mirrors
    (:class:`dcr._tensors.Staging`), copied device -> host before each
    :meth:`make_delta`; ``True`` mirrors every tensor, ``False`` none."""

    def __init__(self, tensors: Mapping[str, Any], layout: Union[str, Mapping[str, Any], None] = None,
                 stage: Optional[bool] = None):
        self.layout_json = identity_layout(tensors) if layout is None else _layout_json(layout)
        self._tensors = dict(tensors)
        self._staging = Staging(self._tensors, stage, "Sender")
        self._views = _buffers_for(self.layout_json, self._staging.host(), "Sender")
        self._s = _dcr.Sender(self.layout_json, self._views)

    def make_delta(self, mode: str = "xor", chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, delta_id: int = 0) -> Delta:
        """The delta from the baseline to the tensors' current bits."""
        self._staging.to_host()
        return self._s.make_delta(self._views, mode, chunk_elements, delta_id)

    def commit(self, delta: Delta) -> dict:
        """Adopts ``delta``'s target as the baseline (after the version is committed)."""
        return self._s.commit(delta)

    def baseline_digest(self) -> str:
        return self._s.baseline_digest()


class Receiver:
    """The receiver side over live tensors (e.g. a model's parameters, by
    name): applies deltas in place through a receiver ``layout`` map (JSON or
    dict; None for canonical tensors) and verifies the digest.

    ``residuals``: canonical tensors this receiver converts on load instead
    of mapping (e.g. as flagged by :func:`dcr.trace.record_layout`). Without
    a ``loader`` their frames are skipped (and left out of the digest check).
    With ``loader`` (the runtime's own ``load_weights``-style loader, called
    with an iterable of ``(name, tensor)``), ``residuals`` maps each name to
    its current canonical tensor: the receiver keeps a canonical copy of each
    (their memory), applies every frame to those copies as well (so the whole
    delta is verified, the digest covers every tensor), and hands the new
    full values of each residual tensor the delta changed to ``loader``, which
    overwrites the parameters derived from them.

    ``residuals_primary=False``: the residual copies do not count in this
    receiver's digest (a rank of an engine whose residual tensors another
    rank counts).

    ``post_update(report)``, if given, is called after each applied delta
    (after the loader), e.g. to re-derive absorbed weights or FP8 scales.

    ``metrics="HOST:PORT"``: serve this process's Prometheus metrics there
    (:func:`serve_metrics`; the URL is ``metrics_url``).

    ``stage``: how the tensors are reached. Tensors not on the CPU (CUDA)
    are written where they live (:class:`dcr._tensors.TensorMemory`): frames
    are decoded on the host, the old words at the changed positions are
    gathered from the device and the new ones scattered into it in place, so
    the work, host memory and host <-> device traffic of a delta follow its
    changes, not the model, and no host mirror is kept. ``True`` takes that
    path for every tensor (CPU ones too, through torch's index copies);
    ``False`` none (non-CPU tensors are refused); None (default): when any
    tensor is off the CPU. Otherwise CPU tensors are read and written in
    place, directly.

    ``fp8``: the buffers this rank serves as block FP8, by buffer name, each
    with its F32 scale tensor (``weight_scale_inv``: [ceil(rows / 128),
    ceil(cols / 128)], or [n, ...] for a [n, rows, cols] expert stack). Their
    tensors are ``torch.float8_e4m3fn``; the layout declares them, and the
    tensors copied into them, in the run's dtype (a declared F8_E4M3 is read
    as BF16). The receiver keeps a BF16 master of those buffers (host memory,
    ``fp8_master_bytes``), applies the ordinary frames to it, and requantizes
    every 128 x 128 block holding a changed element into the FP8 tensor and
    its scale (:func:`quantize_fp8_blocks`' scheme) before an apply returns
    or a version is acked (docs/layouts.md, "FP8 engines"). The master starts
    empty: :meth:`load` the BF16 tensors of the version the engine holds, or
    :meth:`follow`, which joins from the run's snapshot. With tensors on a
    device (or ``stage=True``) the other buffers are reached as ``stage``
    says, the requantization writes host copies of the FP8 tensors and
    scales, and every flush copies those it wrote to the device.

    The receiver tracks the digest of every chunk it holds (computed at the
    first :meth:`apply` or :meth:`follow`, then updated from the changed words
    alone). Bits changed outside dcr are not seen by those digests: call
    :meth:`forget_digests` after changing the tensors yourself."""

    _SHADOW = "dcr.residual:"

    def __init__(self, tensors: Mapping[str, Any], layout: Union[str, Mapping[str, Any], None] = None,
                 residuals: Union[Iterable[str], Mapping[str, Any]] = (),
                 loader: Optional[Callable[[Iterable], Any]] = None,
                 post_update: Optional[Callable[[dict], Any]] = None, stage: Optional[bool] = None,
                 residuals_primary: bool = True, fp8: Optional[Mapping[str, Any]] = None,
                 metrics: Optional[str] = None):
        self.metrics_url = serve_metrics(metrics) if metrics else None
        self.layout_json = identity_layout(tensors) if layout is None else _layout_json(layout)
        self._residuals_primary = residuals_primary
        self._tensors = dict(tensors)
        self._loader, self._post_update = loader, post_update
        self._shadow: dict = {}
        skipped = list(residuals)
        if loader is not None:
            if not isinstance(residuals, Mapping):
                raise InvalidArgumentError("Receiver: with a loader, residuals maps each residual tensor's name "
                                           "to its current canonical tensor")
            self.layout_json = self._with_shadows(self.layout_json, residuals)
            skipped = []
        bufs = dict(self._tensors)
        bufs.update({self._SHADOW + n: t for n, t in self._shadow.items()})
        self._skipped, self._follower = skipped, None
        self._fp8 = None
        if fp8:
            staged = bool(stage) or (stage is None and any(_off_host(t) for t in [*bufs.values(), *fp8.values()]))
            self.layout_json, self._fp8 = _fp8_memory(self.layout_json, bufs, fp8, staged)
            self._buffers, self._memory = [], self._fp8
        elif stage or (stage is None and any(_off_host(t) for t in bufs.values())):
            checked = _buffers_for(self.layout_json, bufs, "Receiver", views=False)
            self._buffers, self._memory = [], TensorMemory(checked, "Receiver")
        else:
            self._buffers, self._memory = _buffers_for(self.layout_json, bufs, "Receiver"), None
        self._r = _dcr.Receiver(self.layout_json, self._buffers, skipped, self._memory)

    def _with_shadows(self, layout_json: str, residuals: Mapping[str, Any]) -> str:
        """The layout plus one canonical copy per residual tensor (a buffer of its own)."""
        doc = json.loads(layout_json)
        declared = {t["name"]: t for t in doc.get("tensors", [])}
        for name, t in residuals.items():
            if any(c["tensor"] == name for c in doc.get("copies", [])):
                raise InvalidArgumentError(f"Receiver: residual tensor '{name}' is also mapped by the layout")
            if self._SHADOW + name in self._tensors:
                raise InvalidArgumentError(f"Receiver: buffer name '{self._SHADOW + name}' is taken")
            shadow = t.detach().to("cpu", copy=True).contiguous() if hasattr(t, "detach") else t.copy()
            shape = [int(d) for d in shadow.shape]
            spec = {"name": name, "dtype": dtype_name(shadow), "shape": shape}
            if name in declared and (declared[name]["dtype"], list(declared[name]["shape"])) != (spec["dtype"], shape):
                raise InvalidArgumentError(f"Receiver: residual tensor '{name}' is {spec['dtype']} {shape}, the layout "
                                           f"declares {declared[name]['dtype']} {declared[name]['shape']}")
            if name not in declared:
                doc.setdefault("tensors", []).append(spec)
            bid = self._SHADOW + name
            doc.setdefault("buffers", []).append({"id": bid, "dtype": spec["dtype"], "shape": shape})
            doc.setdefault("copies", []).append({"tensor": name, "offset": [0] * len(shape), "extent": shape,
                                                 "buffer": bid, "buffer_offset": [0] * len(shape),
                                                 "primary": self._residuals_primary})
            self._shadow[name] = shadow
        return json.dumps(doc)

    def apply(self, delta: Delta) -> dict:
        """Applies every frame in place (each chunk verified before it is
        written); then checks the tracked digests against the delta's target
        (:class:`CorruptFrameError`); then hands changed residual tensors to
        the loader and calls the post-update hook. The report gains
        ``residuals_loaded`` (names); ``scratch_peak_bytes`` is the most
        decoded changes held at once (tensors reached through
        :class:`dcr._tensors.TensorMemory`)."""
        touched = _touched(delta)
        before = self._fp8.blocks_requantized if self._fp8 is not None else 0
        report = dict(self._r.apply(delta))
        if self._fp8 is not None:
            report["fp8_blocks_requantized"] = self._fp8.blocks_requantized - before
            report["fp8_master_bytes"] = self._fp8.master_bytes
        loaded = [n for n in self._shadow if n in touched]
        if loaded:
            self._loader([(n, self._shadow[n]) for n in loaded])
        report = dict(report)
        report["residuals_loaded"] = loaded
        if self._post_update is not None:
            self._post_update(report)
        return report

    def load(self, tensors: Mapping[str, Any]) -> None:
        """A dense load of canonical tensors (by name, CPU; e.g. the BF16
        checkpoint of the version the engine holds) through the layout into
        every buffer it maps: an FP8 rank's master, whose blocks are all
        requantized. The digests are computed again at the next apply."""
        self._r.load({n: byte_view(t, f"Receiver.load: tensor '{n}'") for n, t in tensors.items()})

    def forget_digests(self) -> None:
        """The tensors were changed outside dcr: the next :meth:`apply`
        computes their digests again from the bits (a pass over them)."""
        self._r.forget_digests()

    @property
    def residuals(self) -> dict:
        """The receiver's canonical copy of each residual tensor, by name (what
        :meth:`digest` counts of them; written in place to load them)."""
        return dict(self._shadow)

    @property
    def fp8_master_bytes(self) -> int:
        """Host bytes of the BF16 master of the ``fp8`` buffers (0 without them)."""
        return self._fp8.master_bytes if self._fp8 is not None else 0

    def digest(self) -> str:
        """The digest of the canonical elements this receiver holds (with a
        loader: residual tensors included, from their canonical copies)."""
        return self._r.digest()

    def adopt(self, store: Store, state_dir: PathLike, version: int, engine_digest: str, *, engine: str,
              rank: int = 0, ranks: int = 1, id: str = "") -> None:
        """Before :meth:`follow`: these tensors were loaded elsewhere (a serving
        engine reading the checkpoint from disk) and hold committed
        ``version``. ``engine_digest`` is the sum (:func:`add_digests`) of
        :meth:`digest` over the engine's ranks. Records the version in the
        rank's journal in ``state_dir`` (replacing any), so that
        :meth:`follow` continues from it through the deltas instead of
        downloading a snapshot. :class:`FailedPreconditionError`, nothing
        written, unless the version is committed with exactly that digest
        (and, for an engine of one rank, it is this rank's);
        :class:`NotFoundError` when the version is not committed."""
        f = _dcr.RankFollower(store, self.layout_json, self._buffers, os.fspath(state_dir), engine, rank, ranks, id,
                              0.1, True, [], "", "", False, 1.0, memory=self._memory)
        f.adopt(version, engine_digest)
        self._follower = None  # follow starts from the journal

    def follow(self, store: Store, state_dir: PathLike, *, engine: str, rank: int = 0, ranks: int = 1,
               until: Optional[int] = None, timeout_s: Optional[float] = None, id: str = "", poll_s: float = 0.1,
               quiet: bool = True, relay: Sequence[str] = (), relay_key: PathLike = "",
               relay_pub: PathLike = "", relay_insecure: bool = False, relay_poll_s: float = 1.0,
               recheck: bool = True) -> int:
        """Follows the run in ``store`` into these live tensors, in place, as
        rank ``rank`` of ``ranks`` of engine ``engine`` (C++ dcr::RankFollower
        over in-memory buffers): every attempt's frames are applied through
        the receiver's map and acked with this rank's partial digest; the
        coordinator commits once every rank of the engine has acked and the
        partials add up. ``state_dir`` holds the rank's journal: a restarted
        process following with the same directory continues from it when the
        tensors still hold the journal's version, and otherwise rejoins from
        the newest snapshot (loaded into the tensors through the map) and
        catches up. A new directory joins from the snapshot.

        Returns the version held once ``until`` is applied (forever when
        None); :class:`DeadlineExceededError` after ``timeout_s``. The GIL is
        released while it follows; Ctrl-C stops it cleanly
        (KeyboardInterrupt). After each version reached (the newest, when
        several arrive between two polls), the residual tensors (with a
        loader) that changed since the last one (all of them after a join
        from a snapshot or a reopen) are handed to the loader, staged buffers
        that changed are copied back to the device, then ``post_update`` gets
        ``{"version": v, "residuals_loaded": names, "tensors_changed": names}``
        (the canonical tensors changed since the previous call). ``relay``,
        ``relay_key``, ``relay_pub``, ``relay_insecure``, ``relay_poll_s``: frame objects from a relay tree, as for
        :class:`Follower` (acks go through the store). Calling it
        again with the same arguments continues where the last call stopped
        (after one that raised, from the journal and a digest pass). Residuals without a
        loader cannot be followed: the rank's partial digest would lack them.

        ``recheck`` (default): a call that continues first reads the tensors
        again and compares each chunk's digest with the one dcr tracked
        through its own writes (a pass over the rank's bytes). Bits changed
        outside dcr since the last call are named in
        :attr:`outside_changes` (and a warning logged), and the rank rejoins
        from the newest snapshot instead of applying, acking or returning a
        version on top of them. ``recheck=False``: O(changed elements) per
        version, trusting that nothing else writes the tensors."""
        if self._skipped:
            raise InvalidArgumentError(f"Receiver.follow: residual tensor '{self._skipped[0]}' is not mapped and has "
                                       "no loader; the engine's partial digests would never add up (give a loader)")
        # The same run followed again (the next version) continues where the
        # last call stopped (after a recheck, unless recheck=False).
        args = (store, os.fspath(state_dir), engine, rank, ranks, id, poll_s, quiet, list(relay), os.fspath(relay_key),
                os.fspath(relay_pub), relay_insecure, relay_poll_s, recheck)
        if self._follower is None or self._follow_args[0] is not store or self._follow_args[1:] != args[1:]:
            self._follower = _dcr.RankFollower(store, self.layout_json, self._buffers, *args[1:], memory=self._memory)
            self._follow_args = args

        def on_version(v: int) -> None:
            changed = self._follower.take_changed()
            loaded = [n for n in self._shadow if n in set(changed)]
            if loaded:
                self._loader([(n, self._shadow[n]) for n in loaded])
            if self._post_update is not None:
                self._post_update({"version": v, "residuals_loaded": loaded, "tensors_changed": changed})

        hook = on_version if (self._shadow or self._post_update is not None) else None
        try:
            return self._follower.run(until, timeout_s, hook)
        finally:
            if self._follower.outside_changes:
                logging.getLogger("dcr").warning("dcr: %s rank %d: bits changed outside dcr since the last version "
                                                 "(%s); the rank rejoined from a snapshot", engine, rank,
                                                 self._follower.outside_changes)

    @property
    def outside_changes(self) -> str:
        """What :meth:`follow`'s last recheck found changed outside dcr (the
        chunks, by tensor and element range); "" when it found nothing."""
        return "" if self._follower is None else self._follower.outside_changes

    @property
    def version(self) -> Optional[int]:
        """The version :meth:`follow` holds (None before it ran)."""
        return None if self._follower is None else self._follower.version


class ShardPublisher:
    """The trainer side through a store: publishes the live parameters of
    one or more senders (C++ dcr::ShardPublisher). ``senders``: each a
    mapping of canonical names to tensors, or ``(tensors, layout)`` with a
    sender layout map (JSON or dict) over shard buffers. Each :meth:`publish`
    projects the tensors' current bits against the senders' baseline shards
    (kept in ``state_dir``, rebuilt from the store when missing; None: in
    memory, :func:`default_publisher_state_dir`), runs the
    attempts, waits for the acks and commits; it returns the report once
    committed. Version 0 (the run's snapshot) is a canonical checkpoint:
    :meth:`publish_snapshot`.

    ``conversions``: canonical tensors that are not a copy of shards (a norm
    held as weight - 1, a dtype cast of master weights, a fused tensor that
    needs arithmetic), each ``name: callable`` returning the canonical tensor
    (the run's dtype and shape) computed from the live parameters. They are
    called at construction and before each publish, and their outputs
    (copied into buffers the publisher holds) go as one more sender whose
    map is the identity over them, so the receivers get exactly the
    canonical bits. Together the senders' maps and the conversions cover
    every tensor of the run exactly once. The report gains
    ``converted_bytes`` (the converted tensors' size), ``projected_bytes``
    (the rest) and ``converted_changed_bytes`` (converted bytes that differ
    from the previous publish's outputs).

    Senders in several processes (docs/protocol.md, "Trainer ranks in
    separate processes"): each process makes its own ShardPublisher with
    ``process=p, processes=P``, ``layouts`` every sender's map (JSON or dict,
    global order, the same everywhere), ``senders`` only its own senders (in
    ascending global order), and optionally ``placement`` (the process of
    each sender; default contiguous blocks). Process 0 coordinates; all
    call :meth:`publish` for each version. ``conversions`` are for one
    process only: with several, give converted tensors as an ordinary sender
    over buffers you refresh before each publish, with the map
    ``identity_layout(buffers)`` in every process's ``layouts``.

    ``metrics="HOST:PORT"``: serve this process's Prometheus metrics there
    (:func:`serve_metrics`; the URL is ``metrics_url``).

    ``stage``: tensors not on the CPU (CUDA) are read through host mirrors,
    pinned, copied device -> host in each publish; ``True`` mirrors every
    tensor, ``False`` none. The copies run buffer by buffer on the
    publisher's copy thread, in the order the encode reads the buffers,
    while the encode works on those already copied; the report's
    ``staging_seconds`` is the time until the last one was copied.
    ``copy_engine(dst, src)`` replaces ``dst.copy_(src)`` for the copies
    (tests: a copy engine that delays).

    The GIL is released while publishing; Ctrl-C while the coordinator waits
    for acks raises KeyboardInterrupt within some 20 ms, the attempt fenced
    and nothing committed (the next :meth:`publish` of the version starts a
    new attempt); elsewhere it is seen once the call returns.

    ``relay``: the addresses of the relay tree's roots; every frame object and
    fence is also pushed to them (receivers below take it from the tree), and
    acks that come up the tree are counted (the report's ``relay_acks``).
    ``relay_key`` (this publisher's CURVE key pair, admitted by the roots as a
    sender) and ``relay_pub`` (the roots' public key), or ``relay_insecure``,
    as ``dcr publish``'s ``--relay-key``, ``--relay-pub``, ``--relay-insecure``.
    With several trainer processes each pushes its own frame objects.

    ``inject_failures`` (tests of retries): ``"POINT:N"`` makes the N-th
    time the publisher reaches fault point POINT (``frames-written``,
    ``manifest-written``, ``acked``, ``before-commit``) fail as a store
    outage would, so that attempt is fenced and retried as an overwrite."""

    def __init__(self, store: Store, state_dir: Optional[PathLike], senders: Sequence[Any], max_attempts: int = 3,
                 ack_timeout_s: float = 60.0, heartbeat_timeout_s: float = 10.0, snapshot_every: int = 0,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                 conversions: Optional[Mapping[str, Callable[[], Any]]] = None, stage: Optional[bool] = None,
                 process: int = 0, processes: int = 1, layouts: Optional[Sequence[Any]] = None,
                 placement: Optional[Sequence[int]] = None, peer_timeout_s: float = 60.0,
                 inject_failures: Sequence[str] = (), copy_engine: Optional[Callable[[Any, Any], None]] = None,
                 relay: Sequence[str] = (), relay_key: PathLike = "", relay_pub: PathLike = "",
                 relay_insecure: bool = False, metrics: Optional[str] = None):
        self.metrics_url = serve_metrics(metrics) if metrics else None
        self.store = store
        self.state_dir = default_publisher_state_dir(store) if state_dir is None else os.fspath(state_dir)
        self._processes = processes
        self._options = dict(max_attempts=max_attempts, ack_timeout_s=ack_timeout_s,
                             heartbeat_timeout_s=heartbeat_timeout_s, snapshot_every=snapshot_every,
                             chunk_elements=chunk_elements)
        self._layouts, self._views, self._staging = [], [], []
        mapped: set = set()
        for k, s in enumerate(senders):
            tensors, layout = (s, None) if isinstance(s, Mapping) else s
            layout_json = identity_layout(tensors) if layout is None else _layout_json(layout)
            staging = Staging(tensors, stage, f"ShardPublisher: sender {k}", copy_engine)
            self._layouts.append(layout_json)
            self._staging.append(staging)
            self._views.append(_buffers_for(layout_json, staging.host(), f"ShardPublisher: sender {k}"))
            mapped.update(_buffers_of_tensors(layout_json))
        if not self._layouts:
            raise InvalidArgumentError("ShardPublisher: no senders given")
        if processes > 1 and layouts is None:
            raise InvalidArgumentError("ShardPublisher: processes > 1 needs layouts (every sender's map)")
        if processes > 1 and conversions:
            raise InvalidArgumentError("ShardPublisher: conversions are for a single trainer process; with several, "
                                       "give converted tensors as a sender with an identity map in every process's "
                                       "layouts")
        self._conversions = dict(conversions or {})
        self._converted: dict = {}  # name -> the held CPU buffer of its output
        for name in self._conversions:
            if name in mapped:
                raise InvalidArgumentError(f"ShardPublisher: conversion '{name}' names a tensor a sender's map already "
                                           "maps; a canonical tensor is either projected from shards or converted")
            self._converted[name] = self._convert(name, None)
        if self._converted:
            self._layouts.append(identity_layout(self._converted))
            self._views.append(_buffers_for(self._layouts[-1], self._converted, "ShardPublisher: conversions"))
        self._p = _dcr.ShardPublisher(store, self.state_dir, self._layouts, 1, max_attempts, ack_timeout_s,
                                      heartbeat_timeout_s, snapshot_every, chunk_elements, process, processes,
                                      [_layout_json(m) for m in (layouts or [])], list(placement or []),
                                      peer_timeout_s, list(inject_failures), list(relay), os.fspath(relay_key),
                                      os.fspath(relay_pub), relay_insecure)

    def _convert(self, name: str, held: Any) -> Any:
        """Conversion ``name``'s output now: a new CPU buffer (``held`` None),
        or copied into ``held`` after checking its dtype and shape."""
        out = self._conversions[name]()
        if hasattr(out, "detach"):
            out = out.detach()
        who = f"ShardPublisher: conversion '{name}'"
        if held is None:
            dtype_name(out)  # a torch tensor or numpy array with a safetensors dtype
            return out.to("cpu", copy=True).contiguous() if hasattr(out, "to") else out.copy(order="C")
        got = (dtype_name(out), [int(d) for d in out.shape])
        want = (dtype_name(held), [int(d) for d in held.shape])
        if got != want:
            raise InvalidArgumentError(f"{who}: returned {got[0]} {got[1]}, the run's tensor is {want[0]} {want[1]}")
        copy_into(held, out)
        return held

    def canonical(self, name: str) -> Any:
        """Conversion ``name``'s output as of the last publish (or construction)."""
        return self._converted[name]

    def publish(self, version: int) -> dict:
        """Publishes the senders' current bits as ``version`` (> 0; v-1 committed)."""
        stagers = self._stagers()
        changed = 0
        for name, held in self._converted.items():
            before = byte_view(held, name).clone() if hasattr(held, "clone") else byte_view(held, name).copy()
            self._convert(name, held)
            changed += int((byte_view(held, name) != before).sum())
        try:
            report = self._p.publish(version, self._views, stagers)
        except InvalidArgumentError as e:
            if not self._converted:
                raise
            raise InvalidArgumentError(f"{e.message} (sender {len(self._layouts) - 1} holds the conversions: "
                                       f"{sorted(self._converted)})") from e
        report = dict(report)
        report["converted_bytes"] = sum(byte_view(t, n).shape[0] for n, t in self._converted.items())
        report["projected_bytes"] = report["total_bytes"] - report["converted_bytes"]
        report["converted_changed_bytes"] = changed
        return report

    def publish_snapshot(self, tensors: Mapping[str, Any]) -> dict:
        """Creates the run: version 0 from ``tensors``, the canonical tensors by
        name (written as a checkpoint in ``state_dir``/snapshot-v0, then
        published by :class:`Publisher` with ``state_dir``/snapshot as its
        state); converted tensors missing from ``tensors`` are taken from
        the conversions; both are removed once it is committed (later
        versions are published from the senders' own baseline). Calling it
        again (a trainer restarted while creating the run) publishes version
        0 again, which finishes an interrupted snapshot."""
        tensors = dict(tensors)
        for name, held in self._converted.items():
            tensors.setdefault(name, self._convert(name, held))
        path = os.path.join(self.state_dir, "snapshot-v0")
        shutil.rmtree(path, ignore_errors=True)  # ours: left by an earlier try
        ckpt = Checkpoint.create(path, {n: (dtype_name(t), tuple(t.shape)) for n, t in tensors.items()})
        for n, t in tensors.items():
            ckpt.tensor(n).copy_(t.detach() if hasattr(t, "detach") else as_torch(t, dtype_name(t)))
        ckpt.sync()
        o = self._options
        state = os.path.join(self.state_dir, "snapshot")
        publisher = Publisher(self.store, state, 1, o["max_attempts"], o["ack_timeout_s"], o["heartbeat_timeout_s"],
                              o["snapshot_every"], o["chunk_elements"])
        report = publisher.publish(0, ckpt)
        del ckpt
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
        if self._processes == 1:
            try:
                self.adopt(0)  # the senders' baseline from the tensors, not downloaded at version 1
            except FailedPreconditionError:
                pass  # the senders do not hold these tensors: version 1 rebuilds the baseline from the store
        return report

    def adopt(self, version: int) -> None:
        """The senders' current tensors hold committed ``version`` (for instance
        the snapshot :meth:`publish_snapshot` just published from them): they
        become the baseline, without a download from the store.
        :class:`FailedPreconditionError` when their bits are not that version's,
        or when the senders are spread over several processes."""
        self._p.adopt(version, self._views, self._stagers())

    def _stagers(self) -> list:
        """Per sender, the copy of its mirrors for the publisher's copy thread (None: nothing staged)."""
        stagers = [st.stager(layout) for st, layout in zip(self._staging, self._layouts)]
        return stagers + [None] * (len(self._layouts) - len(stagers))  # the conversions' sender


def serve_metrics(address: str = "127.0.0.1:0") -> str:
    """Serves this process's Prometheus metrics (every publisher, receiver
    and relay in it; docs/metrics.md) at ``http://HOST:PORT/metrics`` until
    the process exits, and returns that URL (port 0: a free port, in the
    URL). The same fixed address twice returns the endpoint already there.
    ``Receiver`` and ``ShardPublisher`` take ``metrics="HOST:PORT"`` to call
    this for you (their ``metrics_url``)."""
    return _dcr.serve_metrics(address)


def metrics_text() -> str:
    """This process's metrics in the Prometheus text format, as a scrape of
    :func:`serve_metrics`'s endpoint returns them."""
    return _dcr.metrics_text()


def add_digests(digests: Iterable[str]) -> str:
    """The sum of digests (32 hex digits each, docs/format.md section 2): the
    digest of the union of the disjoint element sets they cover, e.g. an
    engine's from its ranks' :meth:`Receiver.digest`."""
    digests = list(digests)
    for d in digests:
        if not isinstance(d, str):
            raise InvalidArgumentError(f"add_digests: {d!r} is not a digest (32 lowercase hex digits)")
    return _dcr.add_digests(digests)


def validate_layout(layout: Union[str, Mapping[str, Any]]) -> str:
    """Validates a layout map; returns its canonical JSON (InvalidArgumentError otherwise)."""
    return _dcr.validate_layout(_layout_json(layout))


def quantize_fp8_blocks(tensor: Any, block: int = 128) -> tuple:
    """Block FP8 quantization as dcr's FP8 engines requantize (docs/layouts.md,
    "FP8 engines"): a 2-D BF16 or F32 CPU tensor [rows, cols] -> (E4M3 tensor
    [rows, cols], F32 scales [ceil(rows / block), ceil(cols / block)]), the
    ``weight`` and ``weight_scale_inv`` of a block-FP8 checkpoint
    (DeepSeek-V3's convention: weight ~= e4m3 * scale). Each block's scale is
    its largest finite magnitude / 448 (1 when it has none); each element is
    x / scale rounded to nearest even, as torch's cast to float8_e4m3fn
    rounds; NaN stays NaN (torch writes 0x7F for every NaN, dcr keeps the
    sign); infinities saturate to +-448, as torch's cast does. Use it to make the FP8 checkpoint an FP8 engine loads, so that its
    weights and a refit's agree bit for bit."""
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.dtype not in (torch.bfloat16, torch.float32):
        raise InvalidArgumentError("quantize_fp8_blocks: expected a 2-D BF16 or F32 torch tensor")
    if block <= 0:
        raise InvalidArgumentError(f"quantize_fp8_blocks: block {block} is not positive")
    src = tensor.detach().cpu().contiguous()
    rows, cols = src.shape
    fp8 = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scales = torch.empty(_fp8_scale_shape((rows, cols), block), dtype=torch.float32)
    _dcr.quantize_fp8_blocks(byte_view(src, "tensor"), dtype_name(src), rows, cols, block, byte_view(fp8, "fp8"),
                             byte_view(scales, "scales"))
    return fp8, scales


__all__ = [
    "Checkpoint", "TensorInfo", "Delta", "Store", "Publisher", "Follower", "Sender", "Receiver", "ShardPublisher", "VerifyResult",
    "make_delta", "apply_delta", "verify_delta", "inspect_delta", "describe_manifest", "read_delta", "open_store", "identity_layout",
    "validate_layout", "quantize_fp8_blocks", "add_digests", "serve_metrics", "metrics_text", "default_publisher_state_dir", "torch_dtype", "dtype_name", "byte_view", "errors", "DEFAULT_CHUNK_ELEMENTS",
    *errors.__all__,
]
