// Publishing versions from trainer shards: the senders' buffers, their processes, and the ShardPublisher.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dcr/publisher.h"
#include "dcr/status.h"

namespace dcr {

class CompiledLayout;
class Store;
namespace protocol_internal {
struct ShardsMemo;
class ShardCall;
}  // namespace protocol_internal

// One sender of a trainer: its map (a sender map, docs/layouts.md) and its
// current shard buffers, indexed like map().buffers. Not owned.
struct ShardSource {
  const CompiledLayout* layout = nullptr;
  std::vector<std::span<const uint8_t>> current;
  // Staging (device tensors): when set, `current` is host memory that
  // stage(b) fills for buffer b (a device -> host copy, returning once it is
  // done). Each publish runs it buffer by buffer, in order, on a copy thread
  // from its start, and reads a buffer only once it is staged: the copies
  // overlap the encode of the buffers staged before. Called once per buffer
  // per publish; an error fails the publish.
  std::function<Status(size_t buffer)> stage;
};

// Where the senders of a trainer live: this process's index among
// `processes` (0 is the coordinator), and the process holding each global
// sender (one entry per sender map; empty: contiguous blocks, sender k in
// process k * processes / senders). Every process must be given the same.
struct ShardProcesses {
  uint32_t process = 0, processes = 1;
  std::vector<uint32_t> sender_process;
};

// Publishes versions v > 0 of a run from trainer shards: every sender
// projects its shards against its own baseline shards (ProjectSender), each
// chunk's owner (ChunkOwner) merges the contributions and encodes the chunk's
// frame (EncodeOwnedChunks); the attempts, acks and commit are the
// Publisher's. Senders may be spread over several processes (each runs its
// own ShardPublisher; contributions travel as contribution objects through
// the store, docs/protocol.md "Trainer ranks in separate processes"). Each
// process's baseline is its own senders' shards (not canonical copies), kept
// as buffer files in `state_dir` (as Publisher's: empty for the default,
// locked while publishing)/shards/s<K>/ (K global) with shards.json
// naming the run, version, senders and their partial digest; when it is
// missing, damaged or not at v-1 it is caught up from the committed deltas or
// rebuilt from the newest snapshot through the maps (ApplyRankFrame on the
// sender maps). The coordinator checks that the processes' baseline partials
// add up to v-1's digest. Version 0 (the snapshot, a canonical checkpoint) is
// published by Publisher. The senders' maps must cover every tensor of the
// run exactly once (no residuals yet).
class ShardPublisher {
 public:
  ShardPublisher(Store& store, std::string state_dir, PublishOptions options);

  // Every sender in this process. Errors: as Publisher::Publish;
  // kInvalidArgument when the maps do not cover the run's tensors exactly
  // once or the buffers do not fit them.
  Result<PublishReport> Publish(uint64_t version, std::span<const ShardSource> senders);

  // One process of several: `maps` are every sender's map (global order),
  // `local` this process's senders (those `procs` places here, ascending,
  // each with its map's layout). The coordinator returns once v is
  // committed; a worker once it saw the commit of an attempt it took part
  // in (or caught its baseline up to a commit it missed). Errors as above,
  // and kUnavailable when a worker's peers stay silent (peer_timeout).
  Result<PublishReport> Publish(uint64_t version, std::span<const CompiledLayout* const> maps,
                                std::span<const ShardSource> local, const ShardProcesses& procs);

  // The senders' current shards hold committed version `version` (the run's
  // snapshot, just published from the same tensors): they become the
  // baseline, without a download from the store. Every sender must be in
  // this process; kFailedPrecondition unless their digest is the commit's
  // (the state is not touched then).
  Status Adopt(uint64_t version, std::span<const ShardSource> senders);

  ~ShardPublisher();

 private:
  friend class protocol_internal::ShardCall;
  Store& store_;
  std::string state_dir_;
  PublishOptions options_;
  std::unique_ptr<protocol_internal::ShardsMemo> memo_;  // what the last publish left
};

}  // namespace dcr
