// Which frame objects a receiver that holds only some chunks (a rank of a
// sharded engine) downloads (docs/protocol.md, "Engines of several ranks").
// Not public API.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dcr/delta.h"
#include "dcr/layout_apply.h"

namespace dcr::receiver_internal {

// A set of chunks of the run's tensors, queried by (tensor, chunk) ranges.
class HeldChunks {
 public:
  // `ranges` by tensor of `shape` (RankHeldChunks).
  HeldChunks(const DeltaManifest& shape, const ChunkRanges& ranges);
  bool Holds(ChunkId c) const { return AnyIn(c, Next(c)); }
  // Whether a held chunk lies in [from, to) in (tensor, chunk) order (to:
  // nullopt for the end). Chunks past a tensor's last count as its end.
  bool AnyIn(ChunkId from, std::optional<ChunkId> to) const;

 private:
  static ChunkId Next(ChunkId c) { return {c.tensor, c.chunk + 1}; }
  // Chunk `chunk` of tensor `tensor`'s index among all chunks of the run
  // (past a tensor's chunks: its end; past the tensors: the total).
  uint64_t Global(uint32_t tensor, uint64_t chunk) const;
  std::vector<uint64_t> first_;  // by tensor: the global index of its chunk 0; then the total
  std::vector<std::pair<uint64_t, uint64_t>> held_;  // sorted disjoint [first, end) global indices
};

// Before the manifest, from the names of an attempt's frame objects alone
// (full keys after `prefix`; run_keys::FrameObject), what to do with each.
// A sender's object holds chunks from its name's (its first: from the
// start) up to its next object's. kFetch: a held chunk lies in that range,
// or is the object's first; kSkip: none does; kWait: its next object is not
// listed yet, so its range is open (the next listing, or the manifest,
// decides). A name that says nothing about its chunks is fetched.
enum class ObjectChoice { kFetch, kSkip, kWait };
std::vector<ObjectChoice> ChooseByNames(const std::vector<std::string>& keys, const std::string& prefix,
                                        const HeldChunks& held);

// From the manifest: by object, whether no frame there is of a held chunk.
std::vector<bool> ObjectsWithoutHeldChunks(const DeltaManifest& m, const HeldChunks& held);

}  // namespace dcr::receiver_internal
