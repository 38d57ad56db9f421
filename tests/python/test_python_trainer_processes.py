"""dcr.ShardPublisher with its senders in two real trainer processes. Both
processes build the same tiny transformers Llama (same seed) and take the
same AdamW steps, as data-parallel replicas would; each holds one sender
(half of the parameters, by an identity map) and publishes it with
``process=p, processes=2`` and both senders' maps. Process 0 also creates
the run (version 0). A receiver process follows with dcr.Receiver into its
own live tensors from other random weights; after every commit its
parameters must be byte-identical to the trainer's (saved by process 0 after
the commit). Nothing here trusts dcr's digests. The processes take the
snapshot of version 2 together: the safetensors package reads its files,
which must hold the trainer's version 2 bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import dcr  # noqa: E402,F401

HERE = str(Path(__file__).resolve().parent)
VERSIONS = 2

TRAINER = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, dcr
from safetensors.torch import save_file
from test_python_refit_models import tiny_llama
url, state, out, p, versions = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
torch.manual_seed(0)
model, cfg = tiny_llama()
live = {n: t.data for n, t in model.named_parameters()}
names = sorted(live)
halves = [{n: live[n] for n in names[0::2]}, {n: live[n] for n in names[1::2]}]
layouts = [dcr.identity_layout(h) for h in halves]
store = dcr.open_store(url)
pub = dcr.ShardPublisher(store, state, [(halves[p], layouts[p])], ack_timeout_s=120, heartbeat_timeout_s=120,
                         chunk_elements=512, process=p, processes=2, layouts=layouts, peer_timeout_s=120,
                         snapshot_every=2)
if p == 0:
    pub.publish_snapshot(live)
    print("committed 0", flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
gen = torch.Generator().manual_seed(1)
for v in range(1, versions + 1):
    sys.stdin.readline()  # the test says when
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    report = pub.publish(v)
    if p == 0:
        assert report["acked"] == ["hf-r0"] and report["attempts"] == 1, report
        save_file({n: t.clone() for n, t in live.items()}, f"{out}/trainer-v{v}.safetensors")
    print("committed", v, flush=True)
"""

RECEIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, dcr
from safetensors.torch import save_file
from test_python_refit_models import tiny_llama
url, state, out, until = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
model, cfg = tiny_llama()
gen = torch.Generator().manual_seed(5)
with torch.no_grad():
    for t in model.parameters():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
params = {n: t.data for n, t in model.named_parameters()}
def dump(report):
    save_file({n: t.clone() for n, t in params.items()}, f"{out}/hf-v{report['version']}.safetensors")
    print("version", report["version"], flush=True)
receiver = dcr.Receiver(params, None, post_update=dump)
assert receiver.follow(dcr.open_store(url), state, engine="hf", until=until, timeout_s=60, poll_s=0.02) == until
"""


def test_senders_in_two_torch_processes(tmp_path):
    url = f"file://{tmp_path}/store"
    out = tmp_path / "out"
    out.mkdir()
    procs = []

    def spawn(script, *args, stdin=None, log=None):
        p = subprocess.Popen([sys.executable, "-c", script, HERE, url, *map(str, args)], stdin=stdin,
                             stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append(p)
        return p

    def logs():
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("*.log")))

    try:
        trainers = [spawn(TRAINER, tmp_path / f"trainer-p{p}", out, p, VERSIONS, stdin=subprocess.PIPE,
                          log=tmp_path / f"trainer-p{p}.log") for p in range(2)]
        assert trainers[0].stdout.readline().strip() == "committed 0", logs()
        receiver = spawn(RECEIVER, tmp_path / "receiver", out, VERSIONS, log=tmp_path / "receiver.log")
        assert receiver.stdout.readline().strip() == "version 0", logs()
        for v in range(1, VERSIONS + 1):
            for t in trainers:
                t.stdin.write("go\n")
                t.stdin.flush()
            for t in trainers:
                assert t.stdout.readline().strip() == f"committed {v}", logs()
            assert receiver.stdout.readline().strip() == f"version {v}", logs()
            want = safetensors_torch.load_file(out / f"trainer-v{v}.safetensors")
            got = safetensors_torch.load_file(out / f"hf-v{v}.safetensors")
            assert got.keys() == want.keys()
            for n in want:
                assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), f"version {v}: {n} differs"
        for p in procs:
            assert p.wait(timeout=60) == 0, logs()
        # The snapshot of version 2: one file per process and the index.
        files = tmp_path / "store" / "snapshots" / f"v{VERSIONS:010d}" / "files"
        index = json.loads((files / "model.safetensors.index.json").read_text())
        shards = sorted(x.name for x in files.glob("*.safetensors"))
        assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        snapshot = {}
        for name in shards:
            part = safetensors_torch.load_file(files / name)
            assert all(index["weight_map"][n] == name for n in part)
            snapshot.update(part)
        want = safetensors_torch.load_file(out / f"trainer-v{VERSIONS}.safetensors")
        assert snapshot.keys() == want.keys() == index["weight_map"].keys()
        for n in want:
            assert torch.equal(snapshot[n].view(torch.uint8), want[n].view(torch.uint8)), f"snapshot: {n} differs"
        # Each trainer process keeps only its own sender's baseline shards.
        assert sorted(x.name for x in (tmp_path / "trainer-p0" / "shards").iterdir()) == ["s0"]
        assert sorted(x.name for x in (tmp_path / "trainer-p1" / "shards").iterdir()) == ["s1"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
