#!/usr/bin/env python3
"""What each rank of a sharded serving engine downloads of a refit, at the
reference sizes: the frame objects that hold a frame of one of its chunks
(what `dcr follow --rank` downloads, docs/protocol.md "Engines of several
ranks"), against the frames of its chunks alone (what reading byte ranges
would give) and the whole payload (what every rank downloaded before).

  bench/scale/rank_fetch.py [--rate 0.03] [--segments 16M,1M]

A computation over model shapes, not a run: the run's tensors in dcr's name
order (numbers by value, `name_key`), chunks of 2^20 elements, every chunk
framed (at 1-5% of 2^20 elements no chunk is unchanged) with frame bytes in
proportion to its elements (`BYTES_PER_CHANGED` of project.py), 8 trainer
processes owning contiguous byte shares (PlanOwnership), each cutting its
stream into segments as SegmentedFrameWriter does, and vLLM's sharding:
column-parallel weights split by rows, row-parallel by columns, embeddings by
vocabulary rows, norms and small projections replicated, routed experts whole
per rank with expert parallelism or split like the dense MLP without it.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from project import BYTES_PER_CHANGED  # noqa: E402

CHUNK = 1 << 20  # elements (kDefaultChunkElements)
HEADER = 43  # bytes a frame's header takes at most
PROCESSES = 8


@dataclass
class Tensor:
    name: str
    rows: int
    cols: int  # 1 for vectors
    split: str  # col, row, rep, expert
    expert: int = -1  # routed expert index, for split == expert

    @property
    def elements(self) -> int:
        return self.rows * self.cols


def outer_tensors(vocab: int, h: int) -> list[Tensor]:
    """Embeddings and the LM head (split by vocabulary rows), the final norm."""
    return [Tensor("model.embed_tokens.weight", vocab, h, "col"), Tensor("lm_head.weight", vocab, h, "col"),
            Tensor("model.norm.weight", h, 1, "rep")]


def layer_norms(p: str, h: int) -> list[Tensor]:
    return [Tensor(p + "input_layernorm.weight", h, 1, "rep"), Tensor(p + "post_attention_layernorm.weight", h, 1, "rep")]


def mistral_large_123b() -> list[Tensor]:
    """Mistral-Large-Instruct-2407 (123B, 247 GB in BF16): the reference's 120B size."""
    h, inter, heads, kv, hd, vocab = 12288, 28672, 96, 8, 128, 32768
    out = outer_tensors(vocab, h)
    for i in range(88):
        p = f"model.layers.{i}."
        out += layer_norms(p, h) + [
                Tensor(p + "self_attn.q_proj.weight", heads * hd, h, "col"),
                Tensor(p + "self_attn.k_proj.weight", kv * hd, h, "col"),
                Tensor(p + "self_attn.v_proj.weight", kv * hd, h, "col"),
                Tensor(p + "self_attn.o_proj.weight", h, heads * hd, "row"),
                Tensor(p + "mlp.gate_proj.weight", inter, h, "col"),
                Tensor(p + "mlp.up_proj.weight", inter, h, "col"),
                Tensor(p + "mlp.down_proj.weight", h, inter, "row")]
    return out


def kimi_k2_1t(expert_parallel: bool) -> list[Tensor]:
    """Kimi K2 (DeepSeek-V3 architecture, 384 routed experts, about 1T parameters)."""
    h, inter, moe, experts, vocab = 7168, 18432, 2048, 384, 163840
    q_lora, kv_lora, heads, nope, rope, v = 1536, 512, 64, 128, 64, 128
    routed = "expert" if expert_parallel else None
    out = outer_tensors(vocab, h)
    for i in range(61):
        p = f"model.layers.{i}."
        out += layer_norms(p, h) + [
                Tensor(p + "self_attn.q_a_proj.weight", q_lora, h, "rep"),
                Tensor(p + "self_attn.q_a_layernorm.weight", q_lora, 1, "rep"),
                Tensor(p + "self_attn.q_b_proj.weight", heads * (nope + rope), q_lora, "col"),
                Tensor(p + "self_attn.kv_a_proj_with_mqa.weight", kv_lora + rope, h, "rep"),
                Tensor(p + "self_attn.kv_a_layernorm.weight", kv_lora, 1, "rep"),
                Tensor(p + "self_attn.kv_b_proj.weight", heads * (nope + v), kv_lora, "col"),
                Tensor(p + "self_attn.o_proj.weight", h, heads * v, "row")]
        if i == 0:
            out += [Tensor(p + "mlp.gate_proj.weight", inter, h, "col"), Tensor(p + "mlp.up_proj.weight", inter, h, "col"),
                    Tensor(p + "mlp.down_proj.weight", h, inter, "row")]
            continue
        out += [Tensor(p + "mlp.gate.weight", experts, h, "rep"),
                Tensor(p + "mlp.shared_experts.gate_proj.weight", moe, h, "col"),
                Tensor(p + "mlp.shared_experts.up_proj.weight", moe, h, "col"),
                Tensor(p + "mlp.shared_experts.down_proj.weight", h, moe, "row")]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [Tensor(q + "gate_proj.weight", moe, h, routed or "col", e),
                    Tensor(q + "up_proj.weight", moe, h, routed or "col", e),
                    Tensor(q + "down_proj.weight", h, moe, routed or "row", e)]
    return out


def held_chunks(t: Tensor, rank: int, ranks: int, experts: int) -> tuple[int, int] | None:
    """The [first, end) chunk range of t that `rank` holds an element of (None: none).
    Ranges are contiguous here: a row-parallel slice touches every row, and a
    chunk spans more than a row, so it touches every chunk from its first to its last."""
    chunks = -(-t.elements // CHUNK)
    if t.split == "rep":
        return (0, chunks)
    if t.split == "expert":
        per = experts // ranks
        return (0, chunks) if t.expert // per == rank else None
    if t.split == "col":
        r0, r1 = t.rows * rank // ranks, t.rows * (rank + 1) // ranks
        return (r0 * t.cols // CHUNK, -(-(r1 * t.cols) // CHUNK)) if r1 > r0 else None
    assert t.split == "row" and t.cols <= CHUNK
    c0, c1 = t.cols * rank // ranks, t.cols * (rank + 1) // ranks
    first, last = c0, (t.rows - 1) * t.cols + c1 - 1
    return (first // CHUNK, last // CHUNK + 1)


def name_key(name: str) -> tuple[str, str]:
    """dcr's tensor name order (TensorNameLess, include/dcr/text.h): digit runs
    by value (padded to one width), then the bytes."""
    return re.sub(r"[0-9]+", lambda m: m.group().lstrip("0").rjust(24, "0"), name), name


def analyse(tensors: list[Tensor], ranks: int, experts: int, rate: float, segment: int) -> dict:
    tensors = sorted(tensors, key=lambda t: name_key(t.name))
    per_changed = BYTES_PER_CHANGED[rate]
    # Every chunk in run order: (tensor index, chunk, elements, frame bytes).
    chunks = []
    for i, t in enumerate(tensors):
        for c in range(-(-t.elements // CHUNK)):
            n = min(CHUNK, t.elements - c * CHUNK)
            chunks.append((i, c, n, int(n * rate * per_changed) + HEADER))
    dense = sum(n for _, _, n, _ in chunks) * 2
    # PlanOwnership: the owner is the process whose share holds the chunk's midpoint.
    owner, running = [], 0
    for _, _, n, _ in chunks:
        owner.append(min(PROCESSES - 1, (running + n) * PROCESSES // dense))  # midpoint: running + 2n / 2
        running += 2 * n
    # Segments: a process rotates when its open one reached `segment` bytes.
    segment_of, size = [], []
    open_seg, filled = {}, {}
    for k, (_, _, _, fb) in enumerate(chunks):
        p = owner[k]
        if p not in open_seg or filled[p] >= segment:
            open_seg[p], filled[p] = len(size), 0
            size.append(0)
        segment_of.append(open_seg[p])
        size[open_seg[p]] += fb
        filled[p] += fb
    payload = sum(size)
    held = [[held_chunks(t, r, ranks, experts) for t in tensors] for r in range(ranks)]
    objects, frames = [], []
    for r in range(ranks):
        need_seg, need_bytes = set(), 0
        for k, (i, c, _, fb) in enumerate(chunks):
            h = held[r][i]
            if h and h[0] <= c < h[1]:
                need_seg.add(segment_of[k])
                need_bytes += fb
        objects.append(sum(size[s] for s in need_seg) / payload)
        frames.append(need_bytes / payload)
    return {"dense_gb": dense / 1e9, "payload_gb": payload / 1e9, "segments": len(size),
            "objects": objects, "frames": frames}


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.03, choices=sorted(BYTES_PER_CHANGED))
    ap.add_argument("--segments", default="16M,1M", help="segment sizes to compare (16M: the default above 64 GB)")
    ap.add_argument("--ranks", type=int, default=8)
    a = ap.parse_args()
    cases = [("120B dense (Mistral Large 2), TP", mistral_large_123b(), 0),
             ("1T MoE (Kimi K2), TP, experts split", kimi_k2_1t(False), 384),
             ("1T MoE (Kimi K2), TP + expert parallel", kimi_k2_1t(True), 384)]
    print(f"Each rank's download as a share of the payload, {a.ranks} ranks per engine, {a.rate:.0%} changed; "
          "mean (max) over ranks; node: the engine's ranks together, in payloads")
    print()
    print("| model, sharding | segment | payload | objects: a rank | objects: node | frames only: a rank |")
    print("|---|---|---|---|---|---|")
    for name, tensors, experts in cases:
        for seg in a.segments.split(","):
            r = analyse(tensors, a.ranks, experts, a.rate, parse_size(seg))
            o, f = r["objects"], r["frames"]
            print(f"| {name} | {seg}iB ({r['segments']} objects) | {r['payload_gb']:.1f} GB of {r['dense_gb']:.0f} GB | "
                  f"{sum(o) / len(o):.2f} ({max(o):.2f}) | {sum(o):.1f} | {sum(f) / len(f):.2f} ({max(f):.2f}) |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
