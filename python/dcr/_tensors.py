"""Conversions between torch / numpy arrays and the flat byte views the
extension takes (no copies), and between torch dtypes and safetensors names."""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from .errors import InvalidArgumentError

try:  # torch is optional: numpy arrays work without it
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None

# safetensors dtype name -> torch dtype attribute name (those this torch has).
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64", "I64": "int64",
    "U64": "uint64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
_NUMPY = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "F16": np.float16,
    "I32": np.int32, "U32": np.uint32, "F32": np.float32, "F64": np.float64, "I64": np.int64, "U64": np.uint64,
    "C64": np.complex64,
}


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (e.g. "BF16" -> torch.bfloat16)."""
    attr = _TORCH_NAMES.get(name)
    dt = getattr(torch, attr, None) if (torch is not None and attr) else None
    if dt is None:
        raise InvalidArgumentError(f"dtype {name} has no torch dtype here")
    return dt


def dtype_name(x: Any) -> str:
    """The safetensors dtype name of a torch tensor or numpy array."""
    if torch is not None and isinstance(x, torch.Tensor):
        for name, attr in _TORCH_NAMES.items():
            if getattr(torch, attr, None) == x.dtype:
                return name
        raise InvalidArgumentError(f"torch dtype {x.dtype} has no safetensors name")
    if isinstance(x, np.ndarray):
        for name, t in _NUMPY.items():
            if x.dtype == np.dtype(t):
                return name
        raise InvalidArgumentError(f"numpy dtype {x.dtype} has no safetensors name (BF16/FP8: use torch tensors)")
    raise InvalidArgumentError(f"expected a torch tensor or a numpy array, got {type(x).__name__}")


def byte_view(x: Any, what: str):
    """A flat uint8 view of the bytes of a CPU, C-contiguous torch tensor or
    numpy array: the same memory, never a copy. Refuses anything else."""
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise InvalidArgumentError(f"{what}: on {x.device}; dcr reads and writes host memory (stage=None, the "
                                       "default, mirrors non-CPU tensors on the host)")
        if not x.is_contiguous():
            raise InvalidArgumentError(f"{what}: not contiguous (strides {tuple(x.stride())}); pass .contiguous() "
                                       "storage, which dcr reads and writes in place")
        flat = x.detach().reshape(-1)
        return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise InvalidArgumentError(f"{what}: numpy array is not C-contiguous")
        return x.reshape(-1).view(np.uint8)
    raise InvalidArgumentError(f"{what}: expected a torch tensor or a numpy array, got {type(x).__name__}")


def as_torch(array: np.ndarray, name: str):
    """A torch tensor over a checkpoint's numpy view (same memory), with the
    tensor's real dtype (uint16 -> bfloat16, uint8 -> float8_*)."""
    if torch is None:  # pragma: no cover
        raise InvalidArgumentError("torch is not installed")
    with warnings.catch_warnings():
        # A read-only mapping gives a read-only array; torch warns that it
        # cannot enforce that. The tensor is the same memory either way.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    if name in ("F4", "F6_E2M3", "F6_E3M2"):
        return t  # packed bytes
    want = torch_dtype(name)
    return t if t.dtype == want else t.view(want)


def _off_host(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor) and x.device.type != "cpu"


class Staging:
    """Host mirrors of live tensors that dcr cannot read and write in place:
    those not on the CPU (CUDA), or every tensor with ``stage=True`` (forced,
    e.g. to test the path without a GPU); ``stage=False`` stages none (a
    non-CPU tensor is then refused). Each mirror is contiguous host memory,
    pinned when CUDA exists; dcr reads and writes only the mirrors, which
    :meth:`to_host` fills from the live tensors (device -> host) and
    :meth:`to_device` copies back (host -> device)."""

    def __init__(self, tensors: Mapping[str, Any], stage: Optional[bool], who: str,
                 copy: Optional[Callable[[Any, Any], None]] = None):
        self.live = dict(tensors)
        self.mirrors: dict = {}
        self.copy = copy or copy_into
        for name, t in self.live.items():
            if stage is False or not (stage or _off_host(t)):
                continue
            if torch is not None and isinstance(t, torch.Tensor):
                pin = torch.cuda.is_available()
                self.mirrors[name] = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", pin_memory=pin)
            elif isinstance(t, np.ndarray):
                self.mirrors[name] = np.empty(t.shape, dtype=t.dtype)
            else:
                raise InvalidArgumentError(f"{who}: '{name}' is a {type(t).__name__}, not a torch tensor or numpy array")
        self.to_host()

    def host(self) -> dict:
        """The tensors dcr uses, by name: the mirror where there is one, else the live tensor."""
        return {n: self.mirrors.get(n, t) for n, t in self.live.items()}

    def to_host(self, names: Optional[Iterable[str]] = None) -> None:
        for n in (self.mirrors if names is None else names):
            if n in self.mirrors:
                self.copy(self.mirrors[n], self.live[n])

    def stager(self, layout_json: str) -> Optional[Callable[[int], None]]:
        """For a publisher's copy thread: ``stage(b)`` fills the mirror of the
        layout's buffer b; None when nothing is mirrored."""
        if not self.mirrors:
            return None
        ids = [b["id"] for b in json.loads(layout_json).get("buffers", [])]
        return lambda b: self.to_host([ids[b]])

    def to_device(self, names: Iterable[str]) -> None:
        for n in names:
            if n in self.mirrors:
                copy_into(self.live[n], self.mirrors[n])


# Word width in bytes -> the torch dtype whose elements are such words.
_WORDS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class TensorMemory:
    """Live torch tensors on any device (a GPU's, or the CPU's with
    ``stage=True``) as dcr's buffer memory: dcr never addresses them. The
    apply loop decodes frames on the host and reaches the tensors only
    through torch: a gather of the old words at the changed positions (one
    device -> host copy of those words per window of frames) and a scatter
    of the new ones (``index_copy_``, in place: the tensors keep their
    storage and addresses, strided views included). Joins and audits read
    and write byte ranges of at most 64 MiB. ``tensors`` are in the
    layout's buffer order."""

    def __init__(self, tensors: list, who: str):
        self.tensors = []
        for i, t in enumerate(tensors):
            if torch is None or not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{who}: buffer {i} is a {type(t).__name__}, not a torch tensor")
            if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
                raise InvalidArgumentError(f"{who}: buffer {i} overlaps itself (strides {tuple(t.stride())}); give "
                                           "dcr tensors whose elements have storage of their own")
            self.tensors.append(t.detach())

    def sizes(self) -> list:
        return [t.numel() * t.element_size() for t in self.tensors]

    def _words(self, b: int, word_bytes: int):
        """Buffer b's storage from its first element, as words (contiguous
        tensors: exactly the tensor's)."""
        t = self.tensors[b]
        flat = t.reshape(-1) if t.is_contiguous() else t.as_strided((_span(t),), (1,), t.storage_offset())
        return flat.view(torch.uint8).view(getattr(torch, _WORDS[word_bytes]))

    def _index(self, b: int, word_bytes: int, words):
        """Word offsets in row-major order -> offsets into _words(b) (the same
        for a contiguous tensor; through the strides otherwise)."""
        t = self.tensors[b]
        if t.is_contiguous():
            return words
        per = t.element_size() // word_bytes
        element, within = words // per, words % per
        out = torch.zeros_like(element)
        for size, stride in reversed(list(zip(t.shape, t.stride()))):
            out += (element % size) * stride
            element = element // size
        return out * per + within

    def _groups(self, requests: list) -> dict:
        """Requests by (device, word width): each group moves its offsets and
        words in one copy each way."""
        groups: dict = {}
        for r in requests:
            groups.setdefault((self.tensors[r[0]].device, r[1]), []).append(r)
        return groups

    def gather(self, requests: list) -> None:
        """Each request (buffer, word_bytes, offsets, out): out <- the words at offsets."""
        for (device, wb), group in self._groups(requests).items():
            index = torch.from_numpy(np.concatenate([r[2] for r in group]).view(np.int64)).to(device)
            parts, at = [], 0
            for b, _, offsets, _ in group:
                parts.append(self._words(b, wb).index_select(0, self._index(b, wb, index[at:at + len(offsets)])))
                at += len(offsets)
            got = torch.cat(parts).view(torch.uint8).cpu().numpy()
            at = 0
            for _, _, _, out in group:
                out[:] = got[at:at + len(out)]
                at += len(out)

    def scatter(self, requests: list) -> None:
        """Each request (buffer, word_bytes, offsets, words): the words at offsets <- words."""
        for (device, wb), group in self._groups(requests).items():
            index = torch.from_numpy(np.concatenate([r[2] for r in group]).view(np.int64)).to(device)
            words = torch.from_numpy(np.concatenate([r[3] for r in group])).to(device)
            word_dtype = getattr(torch, _WORDS[wb])
            at = 0
            for b, _, offsets, _ in group:
                n = len(offsets)
                self._words(b, wb).index_copy_(0, self._index(b, wb, index[at:at + n]),
                                               words[at * wb:(at + n) * wb].view(word_dtype))
                at += n

    def read(self, b: int, offset: int, out) -> None:
        """Bytes [offset, offset + len(out)) of buffer b in row-major order."""
        out[:] = self._bytes(b, offset, len(out)).cpu().numpy()

    def write(self, b: int, offset: int, data) -> None:
        t = self.tensors[b]
        src = torch.from_numpy(data.copy()).to(t.device)
        if t.is_contiguous():
            t.reshape(-1).view(torch.uint8)[offset:offset + len(data)].copy_(src)
        else:
            self._words(b, 1).index_copy_(0, self._byte_index(b, offset, len(data)), src)

    def _bytes(self, b: int, offset: int, n: int):
        t = self.tensors[b]
        if t.is_contiguous():
            return t.reshape(-1).view(torch.uint8)[offset:offset + n]
        return self._words(b, 1).index_select(0, self._byte_index(b, offset, n))

    def _byte_index(self, b: int, offset: int, n: int):
        return self._index(b, 1, torch.arange(offset, offset + n, device=self.tensors[b].device))


def _span(t) -> int:
    """Elements of t's storage from its first element to its last, inclusive."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0) if t.numel() else 0


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src, across devices (torch) or in numpy."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        with torch.no_grad():
            dst.copy_(src.detach())
