"""The scale model (bench/scale/model.py): each stage's arithmetic, the bound it
names and the fill, on configurations whose answer is worked out by hand."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "scale"))
from model import Config, Params, predict, tree_depth  # noqa: E402

MB = 1e6
FAST = Params(encode_rate=math.inf, apply_rate=math.inf, latency=0.0)


def test_cross_cluster_time_divides_by_the_trainer_nodes():
    one = Config(dense=1e9, payload=40 * MB, trainers=1, receivers=1, cross_link=10 * MB, in_link=1e12,
                 segment=1 * MB)
    eight = Config(**{**one.__dict__, "trainers": 8})
    a, b = predict(one, FAST), predict(eight, FAST)
    assert a.bound == b.bound == "cross"
    assert a.stages["cross"] == pytest.approx(4.0)
    assert b.stages["cross"] == pytest.approx(0.5)
    # Fill: one segment over the in-cluster hop (and the tree's), the cross link being the bound.
    assert a.fill == pytest.approx(1 * MB / 1e12)
    # An unbalanced trainer: the largest share sets the time.
    c = predict(Config(**{**eight.__dict__, "share": 0.25}), FAST)
    assert c.stages["cross"] == pytest.approx(1.0)


def test_the_roots_egress_bounds_a_tree_on_slow_in_cluster_links():
    c = Config(dense=1e9, payload=8 * MB, trainers=4, receivers=16, cross_link=100 * MB, in_link=8 * MB, fanout=2,
               per_relay=2, segment=1 * MB)
    r = predict(c, FAST)
    # 8 relays: the root sends to 2 child relays and its 2 receivers.
    assert r.bound == "tree"
    assert r.stages["tree"] == pytest.approx(4 * 8 / 8)
    assert tree_depth(16, 2, 2) == 3  # 1 + 2 + 4 < 8 relays: as `dcr relay plan` places them
    # Fill: the cross link, then three tree hops and the receiver's, each at the
    # relay's link over its four copies, less the bounding one.
    assert r.fill == pytest.approx(1 * MB / (100 * MB) + 4 * 1 * MB / (8 * MB) * 3)


def test_on_a_shared_machine_the_refit_takes_at_least_every_process_cpu_over_the_cores():
    p = Params(encode_rate=1e9, apply_rate=2e9, latency=0.1, process_cpu=0.05, poll_cpu=0.1)
    c = Config(dense=1e9, payload=1 * MB, trainers=4, receivers=4, cross_link=1e12, in_link=1e12, cpu_pool=2)
    r = predict(c, p)
    assert r.bound == "cpu"
    # (4 x 0.05 s starting + 1 s encode + 4 x 0.5 s apply) over 2 - 4 x 0.1 cores.
    assert r.seconds == r.stages["cpu"] == pytest.approx(3.2 / 1.6)
    # Four trainer processes start on two cores: 2 x 0.05 s before the stream.
    assert r.startup == pytest.approx(0.1)
    # Slow links: the pipeline is longer, the CPU's waits overlap it.
    slow = predict(Config(**{**c.__dict__, "cross_link": 0.05 * MB}), p)
    assert slow.bound == "cross"
    assert slow.seconds == pytest.approx(0.1 + 0.05 + 0.1 + 0.25 / 0.05 + slow.fill)


def test_through_s3_every_receiver_downloads_from_the_store_fetch_ahead_objects_at_once():
    p = Params(encode_rate=math.inf, apply_rate=math.inf, latency=0.1, store_rate=50 * MB, s3_latency=0.2,
               s3_request_seconds=0.01, link_efficiency=0.5)
    c = Config(dense=1e9, payload=10 * MB, trainers=2, receivers=16, cross_link=1e12, in_link=10 * MB,
               transport="s3", segment=1 * MB)
    r = predict(c, p)
    assert "tree" not in r.stages
    # 11 objects (10 MB in 1 MB segments from two processes) in two rounds of at most
    # 8 requests at once, at half the link's rate.
    assert r.stages["receive"] == pytest.approx(10 / 5 + 2 * 0.01)
    one_at_a_time = predict(Config(**{**c.__dict__, "fetch_ahead": 1}), p)
    assert one_at_a_time.stages["receive"] == pytest.approx(10 / 5 + 11 * 0.01)
    assert r.bound == "store_out"
    assert r.stages["store_out"] == pytest.approx(16 * 10 / 50)
    # Two trainer processes: a poll each way, three requests and one (and the answers).
    assert r.seconds == pytest.approx(0.3 + (0.05 + 6 * 0.01) + 3.2 + r.fill)
    assert r.fill == pytest.approx(1 * MB / 0.5e12 + 1 * MB / (5 * MB) + 0.01)  # one segment, one request


def test_on_s3_waiting_trainer_processes_poll_the_stores_cores_away():
    p = Params(encode_rate=1e9, apply_rate=1e9, latency=0.0, s3_peer_poll_cpu=0.2)
    c = Config(dense=1e9, payload=1 * MB, trainers=4, receivers=1, cross_link=1e12, in_link=1e12, cpu_pool=2,
               transport="s3")
    # 2 s of CPU over 2 - 3 x 0.2 cores; a file store's polls cost the store nothing.
    assert predict(c, p).stages["cpu"] == pytest.approx(2 / 1.4)
    assert predict(Config(**{**c.__dict__, "transport": "relay"}), p).stages["cpu"] == pytest.approx(1.0)


def test_rank_fetch_counts_the_objects_and_frames_each_rank_needs():
    """bench/scale/rank_fetch.py on shapes worked out by hand: 8 column-parallel
    tensors of 4 chunks each split over 2 ranks (each rank holds 2 chunks of
    each), one replicated 1-chunk tensor, and 8 trainer processes."""
    import rank_fetch as rf
    chunk = rf.CHUNK
    col = [rf.Tensor(f"t{i}", 4, chunk, "col") for i in range(8)]
    rep = [rf.Tensor("z.norm", chunk, 1, "rep")]
    assert rf.held_chunks(col[0], 0, 2, 0) == (0, 2) and rf.held_chunks(col[0], 1, 2, 0) == (2, 4)
    assert rf.held_chunks(rf.Tensor("r", 2, chunk, "row"), 1, 2, 0) == (0, 2)  # every row: every chunk
    assert rf.held_chunks(rf.Tensor("e", 1, chunk, "expert", expert=5), 1, 2, 8) == (0, 1)
    assert rf.held_chunks(rf.Tensor("e", 1, chunk, "expert", expert=3), 1, 2, 8) is None
    # One frame per object: each rank needs half the column frames and the norm's.
    one = rf.analyse(col + rep, ranks=2, experts=0, rate=0.03, segment=1)
    assert one["segments"] == 33
    frame = int(chunk * 0.03 * rf.BYTES_PER_CHANGED[0.03]) + rf.HEADER
    assert one["payload_gb"] == pytest.approx(33 * frame / 1e9)
    for share in one["objects"] + one["frames"]:
        assert share == pytest.approx(17 / 33)
    # Objects of a whole process's share (4 chunks: one tensor each, the last also the norm): every rank needs each.
    whole = rf.analyse(col + rep, ranks=2, experts=0, rate=0.03, segment=1 << 40)
    assert whole["segments"] == 8
    assert whole["objects"] == [pytest.approx(1.0)] * 2
    assert whole["frames"] == [pytest.approx(17 / 33)] * 2
    # Tensors in dcr's name order: numbers by value, leading zeros aside, then bytes.
    names = ["e.10.w", "e.9.w", "e.100.w", "e.2.w", "e.02.w", "e.2", "e.a", "d"]
    assert sorted(names, key=rf.name_key) == ["d", "e.2", "e.02.w", "e.2.w", "e.9.w", "e.10.w", "e.100.w", "e.a"]
