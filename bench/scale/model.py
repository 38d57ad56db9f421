"""The scale model of one refit (docs/scale.md): the time from the trainer's publish
to the commit, as a pipeline of resources that the delta streams through.

A version's delta streams: each trainer process encodes its own chunks into
segments, pushes them over its own cross-cluster link into the destination
cluster's relay root (or into S3), the tree (or S3) carries them to every
receiver over in-cluster links, and each receiver applies them as they come.
Every stage runs at once, so the refit takes the slowest stage's time, plus the
time for the first segment to reach the last stage (the pipeline's fill), plus
the protocol's fixed cost (attempt record, manifest, acks, commit, polls):

    T = latency + discovery + startup + max(stage times) + fill

Stage times, for a model of `dense` bytes and a payload of `payload` bytes:
    encode    share * dense / (trainer_cores * encode_rate)
    cross     share * payload / cross_link           each process over its own link
    tree      sends * payload / in_link              a relay's link, shared by the copies it sends
    receive   payload / in_link                      S3: + a request's time per fetch_ahead objects
    store_out R * payload / store_rate               S3: the store's egress
    apply     dense / (rollout_cores * apply_rate)

`share` is the largest trainer process's part of the chunks (1/P when balanced);
`sends` a relay's child relays and attached receivers. Links carry payload at
link_efficiency of their rate. The fill is one segment's time over every hop on its
way but the bounding stage's. `discovery`, with several trainer processes: a worker
finds the coordinator's attempt, and the coordinator the last process record, by
polling the store every peer_poll (each poll a few requests). `startup`: what a
trainer process does before its first frame (start, maps, baseline).

`cpu_pool`: where every process shares one machine's cores (the validation runs on
this machine), encode and apply leave the pipeline: the refit takes at least all
the CPU seconds of every process over the cores the receivers' polling leaves, and
waits overlap with other processes' work:

    T = max(pipeline as above, CPU seconds / (cores - polling))

Rates are bytes per second; cores count whole cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Config:
    dense: float               # model bytes (BF16 weights as stored)
    payload: float             # bytes a receiver downloads per version (frames, manifest, records)
    trainers: int              # P: trainer processes (nodes), each with its own cross-cluster link
    receivers: int             # R: receivers (rollout nodes; one engine each)
    cross_link: float          # bytes/s per trainer node, out of the trainer cluster
    in_link: float             # bytes/s per node inside the rollout cluster
    transport: str = "relay"   # relay or s3: where receivers take the frames
    store: str = "file"        # where the records are: file (a local directory) or s3 (implied by transport s3)
    fanout: int = 2            # relay tree fanout
    per_relay: int = 2         # receivers attached to each leaf relay
    segment: float = 256 << 10  # bytes per frame object
    fetch_ahead: int = 8       # frame objects a receiver downloads from S3 at once (FollowOptions::fetch_ahead)
    trainer_cores: float = 1.0
    rollout_cores: float = 1.0
    cpu_pool: float | None = None  # all processes on one machine of this many cores
    share: float | None = None  # the largest trainer process's part of the payload (None: 1/trainers)


@dataclass(frozen=True)
class Params:
    encode_rate: float         # dense bytes/s per core (projection from shards included)
    apply_rate: float          # dense bytes/s per core (decode, apply, verify)
    latency: float             # seconds: the protocol's fixed cost per version
    process_cpu: float = 0.0   # CPU seconds per trainer process per version, whatever its share
    store_rate: float = math.inf  # bytes/s the store serves in all (S3 egress)
    relay_cpu: float = 0.0     # CPU seconds each relay spends per payload byte (cpu_pool only)
    s3_latency: float = 0.0    # added through S3: receivers poll it for frame objects
    link_efficiency: float = 1.0  # payload bytes a link carries per byte of its rate (TCP/IP, framing)
    s3_request_seconds: float = 0.0  # per round of fetch_ahead frame objects a receiver gets from S3 at once
    peer_poll: float = 0.05    # trainer processes poll the store this often (PublishOptions::peer_poll)
    store_cpu: float = 0.0     # CPU seconds the store spends per byte in or out (cpu_pool only)
    poll_cpu: float = 0.0      # cores a following receiver keeps busy polling the store (cpu_pool only)
    s3_poll_cpu: float = 0.0   # added through S3: its own and the store's, per receiver
    s3_peer_poll_cpu: float = 0.0  # cores of the store's a waiting trainer process's peer polls keep busy


@dataclass
class Prediction:
    seconds: float
    stages: dict = field(default_factory=dict)
    fill: float = 0.0
    bound: str = ""
    startup: float = 0.0


def tree_depth(receivers: int, per_relay: int, fanout: int) -> int:
    """Relay hops from the root to a receiver's relay (the root is depth 0)."""
    relays = max(1, math.ceil(receivers / per_relay))
    depth, level, covered = 0, 1, 1
    while covered < relays:
        level *= fanout
        covered += level
        depth += 1
    return depth


def request_rounds(c: Config) -> int:
    """Rounds of at most fetch_ahead concurrent requests in which a receiver gets a
    version's frame objects from S3: the segments, one more per further trainer process."""
    return math.ceil((math.ceil(c.payload / c.segment) + c.trainers - 1) / c.fetch_ahead)


def predict(c: Config, p: Params) -> Prediction:
    share = c.share if c.share is not None else 1 / c.trainers
    cross, inner = c.cross_link * p.link_efficiency, c.in_link * p.link_efficiency
    on_s3 = c.transport == "s3" or c.store == "s3"
    request = p.s3_request_seconds if on_s3 else 0.0
    stages = {"cross": share * c.payload / cross, "receive": c.payload / inner}
    segment = min(c.segment, share * c.payload)
    hops = [segment / cross]  # one segment's way: trainer -> root or store -> ... -> receiver
    if c.transport == "relay":
        relays = max(1, math.ceil(c.receivers / c.per_relay))
        sends = min(c.fanout, relays - 1) + min(c.per_relay, c.receivers)  # the root sends the most
        stages["tree"] = sends * c.payload / inner
        hops += [segment * sends / inner] * (tree_depth(c.receivers, c.per_relay, c.fanout) + 1)
    else:
        relays = 0
        stages["receive"] += request_rounds(c) * request
        stages["store_out"] = c.receivers * c.payload / p.store_rate
        hops.append(segment / inner + request)
    if not c.cpu_pool:
        stages["encode"] = share * c.dense / (c.trainer_cores * p.encode_rate)
        stages["apply"] = c.dense / (c.rollout_cores * p.apply_rate)
    bound = max(stages, key=stages.get)
    # The bounding stage carries every segment; the others add one segment's time.
    fill = sum(hops) - {"cross": hops[0], "tree": hops[-1], "receive": hops[-1]}.get(bound, 0.0)
    latency = p.latency + (p.s3_latency if on_s3 else 0.0)
    # A worker's poll: commit, attempt list, attempt record; the coordinator's: one record.
    discovery = p.peer_poll + 6 * request if c.trainers > 1 else 0.0
    startup = p.process_cpu * (max(1.0, c.trainers / c.cpu_pool) if c.cpu_pool else 1.0)
    seconds = latency + discovery + startup + stages[bound] + fill
    if c.cpu_pool:
        cpu = c.trainers * p.process_cpu + c.dense / p.encode_rate + c.receivers * c.dense / p.apply_rate
        cpu += relays * c.payload * p.relay_cpu
        if c.transport == "s3":
            cpu += (1 + c.receivers) * c.payload * p.store_cpu
        polling = c.receivers * (p.poll_cpu + (p.s3_poll_cpu if c.transport == "s3" else 0.0))
        if on_s3:
            polling += (c.trainers - 1) * p.s3_peer_poll_cpu
        stages["cpu"] = cpu / max(c.cpu_pool - polling, 0.05 * c.cpu_pool)
        if stages["cpu"] > seconds:
            seconds, bound = stages["cpu"], "cpu"
    return Prediction(seconds, stages, fill, bound, startup)

