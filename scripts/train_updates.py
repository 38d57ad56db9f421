#!/usr/bin/env python3
"""Real training updates for dcr's benchmarks (issue 8, item 6).

Trains a tiny Qwen3-MoE-like transformers model (built from a config, no
downloads) on real text: the CPython standard library's own sources (the
``*.py`` files of the running interpreter's ``Lib``, i.e. the directory of
``os.py``), read as bytes, one token per byte (vocabulary 256, so no
tokenizer is needed). The weights are published in BF16 while AdamW updates
FP32 master weights (the forward runs in BF16 under autocast), as mixed-
precision trainers do; after every step the BF16 cast of the masters is saved
with the ``safetensors`` package as ``OUT/step-NNN/model.safetensors``
(step-000 is the initial model), a checkpoint directory dcr reads.

For every step it reports the fraction of BF16 elements that changed and
dcr's bytes per changed element (``dcr.make_delta`` of step-(k-1) ->
step-k, xor class), next to dcr's synthetic training model
(``dcr gen --update training``) at the same rate and about the same size.

  .venv/bin/python scripts/train_updates.py --out /tmp/dcr-real [--steps 40] [--lr 1e-6]
  build/bench/dcr_codec_bench --real /tmp/dcr-real --sets real-1,real-20,real-40

The model is first pretrained (``--warmup-steps`` at ``--warmup-lr``, not
saved), then the saved steps run at RL fine-tuning's learning rate (1e-6 by
default): the rate of changed BF16 elements follows from the optimizer, not
from a knob of dcr's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

import dcr

ROOT = Path(__file__).resolve().parent.parent


def corpus() -> tuple:
    """The bytes of the standard library's sources, in a fixed order, and where they came from."""
    lib = Path(os.__file__).resolve().parent
    files = sorted(p for p in lib.glob("*.py") if p.is_file())
    data = b"".join(p.read_bytes() for p in files)
    if len(data) < 1 << 20:
        raise SystemExit(f"train_updates: only {len(data)} bytes of Python sources under {lib}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), f"{len(files)} files, {len(data)} bytes of {lib}/*.py"


def tiny_qwen3_moe(seed: int):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=False)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg), cfg


def save_step(model, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(path / "model.safetensors"))


def dcr_bin() -> str:
    for cand in (os.environ.get("DCR_BIN"), ROOT / "build/tools/dcr/dcr", shutil.which("dcr")):
        if cand and Path(cand).is_file():
            return str(cand)
    raise SystemExit("train_updates: no dcr binary (build it: cmake --build build --target dcr, or set DCR_BIN)")


def delta_stats(base: Path, nxt: Path, out: Path) -> dict:
    """The totals of dcr's delta base -> next (xor class, default chunks)."""
    m = dcr.make_delta(base, nxt, out)
    shutil.rmtree(out)
    return m["totals"]


def synthetic(dcr_exe: str, size: int, rate: float, work: Path, cache: dict) -> float:
    """dcr's bytes per changed word on the synthetic training model at ``rate``."""
    key = round(rate, 5)
    if key not in cache:
        d = work / "synth"
        shutil.rmtree(d, ignore_errors=True)
        subprocess.run([dcr_exe, "gen", "--family", "qwen3-moe", "--size", str(size), "--versions", "1",
                        "--update", "training", "--rate", repr(max(rate, 1e-6)), "--seed", "1", "-o", str(d)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        m = delta_stats(d / "v0", d / "v1", work / "synth-delta")
        cache[key] = (m["payload_bytes"] / max(m["changed_words"], 1), m["changed_words"] / m["elements"])
        shutil.rmtree(d)
    return cache[key]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory (step-NNN subdirectories)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of the saved steps")
    ap.add_argument("--warmup-steps", type=int, default=100, help="steps before step-000, not saved")
    ap.add_argument("--warmup-lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path, help="also write the per-step figures here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    tokens, source = corpus()
    model, cfg = tiny_qwen3_moe(a.seed)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed + 1)

    def train_step():
        starts = torch.randint(0, tokens.numel() - a.seq - 1, (a.batch,), generator=gen)
        ids = torch.stack([tokens[s:s + a.seq] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    # Pretraining first (at a pretraining rate, not saved), so that the saved
    # steps start from a model that has learnt something, with warm moments.
    t0 = time.monotonic()
    for g in opt.param_groups:
        g["lr"] = a.warmup_lr
    warm_loss = [train_step() for _ in range(a.warmup_steps)]
    for g in opt.param_groups:
        g["lr"] = a.lr
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("step-*"):
        shutil.rmtree(old)
    save_step(model, a.out / "step-000")
    size = (a.out / "step-000" / "model.safetensors").stat().st_size
    print(f"model: Qwen3-MoE-like, {params} parameters ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts "
          f"of {cfg.moe_intermediate_size}, hidden {cfg.hidden_size}), BF16 checkpoint {size} bytes")
    print(f"text: {source}; byte tokens, batches of {a.batch} x {a.seq}")
    print(f"optimizer: AdamW over FP32 master weights, BF16 autocast forward; {a.warmup_steps} steps at lr "
          f"{a.warmup_lr:g} (loss {warm_loss[0] if warm_loss else float('nan'):.3f} -> "
          f"{warm_loss[-1] if warm_loss else float('nan'):.3f}, not saved), then {a.steps} saved steps at lr {a.lr:g}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")

    dcr_exe = dcr_bin()
    cache: dict = {}
    rows = []
    print(f"\n{'step':>4} {'loss':>7} {'changed %':>10} {'dcr B/changed':>14} {'synthetic B/changed':>20} {'(synth %)':>10}")
    with tempfile.TemporaryDirectory(prefix="dcr-train-") as tmp:
        work = Path(tmp)
        for step in range(1, a.steps + 1):
            loss = train_step()
            save_step(model, a.out / f"step-{step:03d}")
            m = delta_stats(a.out / f"step-{step - 1:03d}", a.out / f"step-{step:03d}", work / "delta")
            rate = m["changed_words"] / m["elements"]
            per = m["payload_bytes"] / max(m["changed_words"], 1)
            s_per, s_rate = synthetic(dcr_exe, size, rate, work, cache)
            rows.append({"step": step, "loss": loss, "changed_fraction": rate, "changed": m["changed_words"],
                         "elements": m["elements"], "payload_bytes": m["payload_bytes"],
                         "bytes_per_changed": per, "synthetic_bytes_per_changed": s_per,
                         "synthetic_changed_fraction": s_rate})
            print(f"{step:>4} {loss:>7.3f} {100 * rate:>9.3f}% {per:>14.3f} {s_per:>20.3f} {100 * s_rate:>9.3f}%",
                  flush=True)
    total_changed = sum(r["changed"] for r in rows)
    total_payload = sum(r["payload_bytes"] for r in rows)
    mean_synth = sum(r["synthetic_bytes_per_changed"] * r["changed"] for r in rows) / max(total_changed, 1)
    print(f"\nover {a.steps} steps: {100 * total_changed / (a.steps * rows[0]['elements']):.3f}% changed on average; "
          f"dcr {total_payload / max(total_changed, 1):.3f} B/changed on the real updates, "
          f"{mean_synth:.3f} on the synthetic model at the same rates; {time.monotonic() - t0:.0f} s")
    if a.json:
        a.json.write_text(json.dumps({"source": source, "parameters": params, "lr": a.lr, "warmup_steps": a.warmup_steps,
                                      "warmup_lr": a.warmup_lr, "steps": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
