// Where a run's objects live in the store: the key of every object the refit protocol writes.
//
// The refit protocol (DESIGN section 5; docs/protocol.md): a publisher (a
// coordinator and its senders) moves a run from committed version v to v+1
// through a store, and receivers (dcr/receiver.h) apply every committed
// version in place. The store is the control plane: every decision is an
// object.
//
//   run.json                                  the run: id, format, chunking, tensors
//   snapshots/v<N>/snapshot.json, files/...   a full checkpoint (start, join, rejoin)
//   snapshots/v<N>/parts/...                  trainer processes' parts while they take one
//   attempts/v<N>/<attempt>/attempt.json      class, delta id, signing key, coordinator (created first)
//   attempts/v<N>/<attempt>/frames/s<K>-<NNNN>.bin  sender (or trainer process) K's frames, in segments
//   attempts/v<N>/<attempt>/contrib/p<F>-p<T>.bin  trainer process F's contributions for process T
//   attempts/v<N>/<attempt>/procs/p<P>.json   trainer process P's frames, chunk digests, partials
//   attempts/v<N>/<attempt>/manifest.bin      the delta manifest (written when every sender is done)
//   attempts/v<N>/<attempt>/acks/<R>.json     receiver R applied and verified it (or failed)
//   attempts/v<N>/<attempt>/fence             the attempt is obsolete
//   commits/v<N>.json                         written once, create-if-absent
//   receivers/<R>.json                        heartbeat: version, state, time
//
// <N> is zero-padded to 10 digits so listings sort by version; <attempt> is
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "dcr/delta.h"

namespace dcr {

namespace run_keys {
inline constexpr std::string_view kRun = "run.json";
std::string VersionDir(uint64_t v);  // "v0000000042"
std::string Commit(uint64_t v);
std::string Attempts(uint64_t v);  // prefix, ends in '/'
std::string Attempt(uint64_t v, std::string_view attempt);  // prefix, ends in '/'
std::string Acks(uint64_t v, std::string_view attempt);  // prefix, ends in '/'
std::string Ack(uint64_t v, std::string_view attempt, std::string_view receiver);
// Objects of attempt `attempt` of version v.
std::string AttemptRecord(uint64_t v, std::string_view attempt);  // attempt.json
std::string Manifest(uint64_t v, std::string_view attempt);  // manifest.bin
std::string Fence(uint64_t v, std::string_view attempt);
// A publishing process's timeline record (TimelineRecord) under an attempt.
std::string Timelines(uint64_t v, std::string_view attempt);  // prefix, ends in '/'
std::string Timeline(uint64_t v, std::string_view attempt, std::string_view process);
// Frame object `index` of sender `sender`, relative to its attempt (the
// name manifests list). A sender writes its frames in (tensor, chunk)
// order, so each object after its first is named by its first frame's
// chunk: frames/s<sender>-<NNNN>-t<T>c<C>.bin; the first is
// frames/s<sender>-<NNNN>.bin. Object i then holds chunks from its name's
// (the first: from the start) up to object i + 1's, which lets a rank of a
// sharded engine skip objects without its chunks before the manifest.
std::string FrameObject(uint32_t sender, size_t index, std::optional<ChunkId> first = std::nullopt);
// What a frame object's name (relative to its attempt) says; nullopt when it
// is not one of FrameObject's names.
struct FrameObjectName {
  uint32_t sender = 0;
  uint64_t index = 0;
  std::optional<ChunkId> first;  // nullopt: the sender's first object (or an older publisher's)
};
std::optional<FrameObjectName> ParseFrameObject(std::string_view name);
// Of an attempt of trainer processes: process p's record, its frame-object
// signing key (relative to the attempt: procs/p<P>.pub), and the
// contributions process `from` sends process `to`.
std::string Process(uint64_t v, std::string_view attempt, uint32_t p);
std::string ProcessSigner(uint32_t p);
std::string Contribution(uint64_t v, std::string_view attempt, uint32_t from, uint32_t to);
inline constexpr std::string_view kSnapshots = "snapshots/";  // prefix
std::string Snapshot(uint64_t v);  // prefix, ends in '/'
// Of a snapshot taken by trainer processes: the elements process `from`
// sends process `to` (the owner of their tensors), and process p's record
// of the file it wrote (a SnapshotRecord of its tensors).
std::string SnapshotPart(uint64_t v, uint32_t from, uint32_t to);
std::string SnapshotProcess(uint64_t v, uint32_t p);
inline constexpr std::string_view kReceivers = "receivers/";  // prefix
std::string Receiver(std::string_view id);
}  // namespace run_keys

}  // namespace dcr
