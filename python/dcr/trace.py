"""Receiver layout maps recorded from a runtime's own loader (DESIGN section 6).

:func:`record_layout` runs a ``load_weights``-style loader once, under a
``TorchDispatchMode``, and records every ``copy_`` of a checkpoint tensor (or
a box of one) into a box of a parameter's storage. Anything else is flagged:
a checkpoint tensor that reaches a parameter through arithmetic, a dtype
conversion, a broadcast, a strided (non-box) view, or into a region that a
non-copy op later writes, is a *residual* (applied as overwrites through the
real loader, not by dcr's placement). One conversion is placed: a BF16 box
copied into an ``float8_e4m3fn`` parameter (a block-FP8 engine's weight),
which an FP8 receiver requantizes from its BF16 master. The loader really runs: the parameters
end loaded with ``weights``.

Tracking is by storage: a view of a checkpoint tensor (narrow, select,
reshape of a contiguous tensor) shares its storage, so its box is read off
its storage offset and strides; tensors computed from checkpoint tensors are
tainted with their names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ._tensors import dtype_name

_COPY = torch.ops.aten.copy_.default


def _contiguous_strides(shape) -> list:
    strides, acc = [], 1
    for d in reversed(list(shape)):
        strides.append(acc)
        acc *= int(d)
    return list(reversed(strides))


def overlaps(offset_a, extent_a, offset_b, extent_b) -> bool:
    """Whether two boxes (offset and extent per dimension) share an element."""
    return all(a < b + m and b < a + n for a, n, b, m in zip(offset_a, extent_a, offset_b, extent_b))


def _box(view: torch.Tensor, base: torch.Tensor):
    """The offset (one entry per base dimension) of ``view`` inside ``base``
    (same storage, base contiguous) when ``view`` is a box of it, with its
    shape left-padded by 1s; else None."""
    rank, base_rank = view.dim(), base.dim()
    if rank > base_rank or not base.is_contiguous():
        return None
    base_strides = _contiguous_strides(base.shape)
    for d in range(rank):
        if view.shape[d] != 1 and view.stride(d) != base_strides[base_rank - rank + d]:
            return None
    rem = view.storage_offset() - base.storage_offset()
    if rem < 0:
        return None
    offset = []
    for s in base_strides:
        offset.append(rem // s)
        rem %= s
    extent = [1] * (base_rank - rank) + [int(x) for x in view.shape]
    if any(o + e > int(b) for o, e, b in zip(offset, extent, base.shape)):
        return None
    return offset


class _Recorder(TorchDispatchMode):
    def __init__(self, params: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr(): (n, p) for n, p in params.items()}
        self.weights = {w.untyped_storage().data_ptr(): (n, w) for n, w in weights.items()}
        self.taint: dict = {}  # storage pointer -> names of the checkpoint tensors it was computed from
        self.copies: list = []
        self.residual: set = set()
        # Regions of parameters written by something other than a recorded
        # copy, in op order: (parameter, offset, extent, sequence number).
        self.writes: list = []
        self.seq = 0

    def _names(self, t: torch.Tensor) -> set:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.weights:
            return {self.weights[ptr][0]}
        return set(self.taint.get(ptr, ()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _COPY and isinstance(args[0], torch.Tensor) and args[0].untyped_storage().data_ptr() in self.params:
            self._copy(args[0], args[1])
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        names = set().union(*(self._names(a) for a in inputs)) if inputs else set()
        # Ops writing a parameter (in place or out=): its recorded copies are not the final bits.
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    a = args[i] if i < len(args) else kwargs.get(arg.name)
                    if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.params:
                        if a.numel() > 0:  # writing nothing (an empty padding slice) clobbers nothing
                            self._write(a)
                            self.residual |= names
        if names:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    ptr = o.untyped_storage().data_ptr()
                    if ptr not in self.weights and ptr not in self.params:
                        self.taint.setdefault(ptr, set()).update(names)
        return out

    def _write(self, dst: torch.Tensor) -> None:
        """Records a write of ``dst`` (a view of a parameter) that is not a
        recorded copy: its box, or the whole parameter when it is not one."""
        pname, param = self.params[dst.untyped_storage().data_ptr()]
        self.seq += 1
        box = _box(dst, param)
        if box is None:
            offset, extent = [0] * param.dim(), [int(d) for d in param.shape]
        else:
            offset, extent = box, [1] * (param.dim() - dst.dim()) + [int(d) for d in dst.shape]
        self.writes.append((pname, offset, extent, self.seq))

    def _copy(self, dst: torch.Tensor, src: Any) -> None:
        pname, param = self.params[dst.untyped_storage().data_ptr()]
        if not isinstance(src, torch.Tensor):
            if dst.numel() > 0:
                self._write(dst)
            return
        names = self._names(src)
        sptr = src.untyped_storage().data_ptr()
        if sptr not in self.weights:  # computed: every checkpoint tensor it came from is residual
            self.residual |= names
            if not names and dst.numel() > 0:
                self._write(dst)
            return
        wname, w = self.weights[sptr]
        src_box = _box(src, w) if src.dim() == w.dim() else None
        dst_box = _box(dst, param)
        # A BF16 box cast into an FP8 parameter is placed: the parameter is
        # declared F8_E4M3, and an FP8 receiver (Receiver(fp8=...)) keeps its
        # BF16 master and requantizes it; any other conversion is residual.
        placed_fp8 = dst.dtype == torch.float8_e4m3fn and src.dtype == torch.bfloat16
        if (src.dtype != w.dtype or (dst.dtype != src.dtype and not placed_fp8)
                or tuple(dst.shape) != tuple(src.shape) or src_box is None or dst_box is None):
            self.residual.add(wname)
            return
        self.seq += 1
        self.copies.append({"tensor": wname, "offset": src_box, "extent": [int(x) for x in src.shape],
                            "buffer": pname, "buffer_offset": dst_box, "seq": self.seq})


def record_layout(params: Mapping[str, torch.Tensor], loader: Callable[[Iterable], Any],
                  weights: Mapping[str, torch.Tensor]) -> tuple:
    """Runs ``loader(weights.items())`` (which loads ``weights`` into the
    tensors of ``params``) and returns ``(layout, residuals)``: the receiver
    layout map (a dict in the JSON form of docs/layouts.md) of every pure box
    copy it made, and the sorted names of the checkpoint tensors that reached
    the parameters any other way (or not at all)."""
    rec = _Recorder(params, weights)
    with torch.no_grad(), rec:
        loader(weights.items())
    residual = set(rec.residual)
    for c in rec.copies:  # a copy that a later write overlaps does not hold the final bits
        rank = len(c["buffer_offset"])
        lo = c["buffer_offset"]
        ext = [1] * (rank - len(c["extent"])) + c["extent"]
        for pname, offset, extent, seq in rec.writes:
            if pname == c["buffer"] and seq > c["seq"] and overlaps(lo, ext, offset, extent):
                residual.add(c["tensor"])
                break
    copied = {c["tensor"] for c in rec.copies}
    residual |= set(weights) - copied
    copies, seen = [], set()
    for c in rec.copies:
        if c["tensor"] in residual:
            continue
        key = (c["tensor"], tuple(c["offset"]), tuple(c["extent"]))
        c = dict(c)
        del c["seq"]
        if key in seen:
            c["primary"] = False  # the same canonical box again: a replica
        seen.add(key)
        copies.append(c)
    mapped = sorted({c["tensor"] for c in copies})
    layout = {
        "format": "dcr-layout", "format_version": 1,
        "tensors": [{"name": n, "dtype": dtype_name(weights[n]), "shape": [int(d) for d in weights[n].shape]}
                    for n in mapped],
        "buffers": [{"id": n, "dtype": dtype_name(p), "shape": [int(d) for d in p.shape]} for n, p in params.items()],
        "copies": copies,
    }
    return layout, sorted(residual)
