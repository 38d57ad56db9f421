// Moving deltas through layout maps (DESIGN sections 3 and 6).
//
// Receiver side (placement): an engine is a set of ranks, each a compiled
// map plus its local buffers (host memory, or a device's behind
// BufferMemory). Frames (xor, add, overwrite) are applied in place by the
// apply loop (include/dcr/apply.h) with ranks as its target (PlacedTarget):
// a frame's changes are decoded, their positions placed through the maps,
// the old words gathered from the copies that count, the new words checked
// and scattered to every copy (primary and replicas). Work is O(changed
// words); no canonical tensor, and no chunk, is ever materialised.
//
// The partial-chunk rule: a frame's digests cover its whole chunk, and a
// rank that holds only part of a chunk cannot check them alone. Every mode
// is elementwise, though, so a rank can *apply* its own elements of a chunk
// alone: ApplyRankFrames does, and returns the rank's partial digest of the
// chunk after it (its tracked partial plus the change of the elements its
// primary copies hold). The engine-level rule is that the partials of all
// ranks of one engine add up to the frame's target digest; that is checked
// where the partials meet (the coordinator's ack wait, docs/protocol.md).
// In one process, ApplyEngineDelta gets every rank and checks each chunk's
// digests before writing it.
// Digests are per rank over the canonical elements its primary copies hold
// (RankDigest, RankChunkDigests); the ranks' digests of one engine add up to
// the checkpoint's (ValidateEngine guarantees each element is counted once),
// which is how an engine proves it holds the version's bits. Tracked
// digests see only what the loop writes: bits changed behind a receiver's
// back are found by a pass over them (RankChunkDigests: at join, and when
// an attempt is retried).
//
// Sender side (projection): each sender keeps its shard buffers as its
// baseline (not canonical copies). ProjectSender diffs its current shards
// against that baseline through its map and returns, per canonical chunk
// its primary copies touch, a contribution record: what it covers, the
// digest of its baseline elements there, and its changed elements (old and
// new bits; in overwrite class, the new bits of everything it covers). The
// chunk's owner (ChunkOwner, a pure function of the maps) merges the
// contributions of every sender touching the chunk and encodes the chunk's
// one complete frame (EncodeOwnedChunks), exactly as a canonical encoder
// would from assembled tensors.
//
// Thread-safety: the functions are reentrant; a ChunkApplier/ChunkEncoder
// inside is per call. Buffers passed as mutable are written only by the call.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dcr/apply.h"
#include "dcr/checkpoint.h"
#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/digest.h"
#include "dcr/frame.h"
#include "dcr/layout.h"
#include "dcr/mapped_file.h"
#include "dcr/status.h"

namespace dcr {

// Where a rank's buffers live when the process does not address them
// directly (a device's memory): reached only by batched copies of words
// and of byte ranges. Calls come from one thread at a time.
struct WordRequest {
  uint32_t buffer = 0;  // index into the map's buffers
  uint32_t word_bytes = 0;
  std::span<const uint64_t> offsets;  // word offsets within the buffer
  std::span<uint8_t> words;  // offsets.size() * word_bytes bytes: read into (Gather) or written from (Scatter)
};
class BufferMemory {
 public:
  virtual ~BufferMemory() = default;
  // The buffer's size in bytes.
  virtual uint64_t Bytes(size_t buffer) const = 0;
  // Every request's words, from / into the buffers.
  virtual Status Gather(std::span<const WordRequest> requests) = 0;
  virtual Status Scatter(std::span<const WordRequest> requests) = 0;
  // Bytes [offset, offset + size) of a buffer (dense loads, digest passes).
  virtual Status Read(size_t buffer, uint64_t offset, std::span<uint8_t> out) = 0;
  virtual Status Write(size_t buffer, uint64_t offset, std::span<const uint8_t> bytes) = 0;
  // After a batch of writes (the end of an apply loop call, a dense load): a
  // memory that derives state from its buffers (Fp8EngineMemory) settles it.
  virtual Status Flush() { return Status::Ok(); }
  // Host bytes kept beside the buffers to reach them (an FP8 engine's BF16
  // master): what a following rank's record reports as `master_bytes`.
  virtual uint64_t MasterBytes() const { return 0; }
};

// One receiver rank: a compiled map and its buffers: in host memory
// (buffers[i] holds map().buffers[i], BufferBytes(i) bytes), or, with
// `memory`, elsewhere (buffers empty). Not owned.
struct PlacedRank {
  const CompiledLayout* layout = nullptr;
  std::vector<std::span<uint8_t>> buffers;
  BufferMemory* memory = nullptr;
};

// One rank's buffers as files in a directory: one file per buffer of the
// map, named by the buffer's id, holding its raw row-major bytes (what a
// serving rank would keep in /dev/shm, or a test compares), memory-mapped
// read-write and shared, so stores reach the files. Move-only; the layout
// must outlive it. Buffer ids must be usable as file names (no '/', not
// starting with '.'), or Open/Create refuse them (kInvalidArgument).
class RankBufferFiles {
 public:
  // Every buffer file present with the size the map declares; errors name
  // the file (kNotFound when missing, kInvalidArgument when its size differs).
  static Result<RankBufferFiles> Open(const CompiledLayout& layout, const std::string& dir);
  // Creates `dir` and every buffer file, zero-filled (replacing any there).
  static Result<RankBufferFiles> Create(const CompiledLayout& layout, const std::string& dir);
  PlacedRank placed();
  // Writes the dirty pages to the files (msync).
  Status Sync();

 private:
  const CompiledLayout* layout_ = nullptr;
  std::vector<MappedFile> files_;
};

// Checks that `rank`'s buffers (host spans, or its memory's) have the sizes
// its map declares.
Status CheckRankBuffers(const PlacedRank& rank);

// Source of canonical tensor bytes by name (for dense loads); null when the
// tensor is unknown.
using TensorBytes = std::function<const uint8_t*(const std::string& name, uint64_t* bytes)>;
TensorBytes CheckpointBytes(const Checkpoint& ckpt);

// A dense load: every copy of the rank's map, from `source`. Buffer bytes no
// copy writes (padding) are left as they are. A rank in BufferMemory is
// loaded a piece of a buffer at a time (at most 64 MiB of host memory).
// Errors: kNotFound (a mapped tensor missing from the source),
// kInvalidArgument (its size differs), the memory's.
Status LoadDense(const TensorBytes& source, PlacedRank& rank);

// The digest of the canonical elements rank's primary copies hold, over all
// its tensors (each with its own DigestKey), or over the tensors named in
// `only` when it is not empty. Parallel on the default pool (not to be called
// from inside a ParallelFor); a rank in BufferMemory is read a piece at a
// time (kDataLoss-free: a memory read error is returned).
Result<Digest> RankDigest(const PlacedRank& rank, std::span<const std::string> only = {});

// The rank's partial digest of every chunk of the manifest's tensors (those
// it does not map, or holds none of: zero), over its primary copies; indexed
// [tensor][chunk] like ChunkDigests. One pass over the rank's elements (at
// start, join or an audit; afterwards the apply loop's results keep it
// current), in pieces as RankDigest.
Result<ChunkDigestTable> RankChunkDigests(const PlacedRank& rank, const DeltaManifest& manifest);

// The chunks of the manifest's tensors that any copy of the rank's map
// (primary or replica) holds an element of: by tensor, sorted disjoint
// [first, end) chunk ranges. A frame of any other chunk leaves the rank's
// buffers and partial digests as they are, so the rank needs only these
// chunks' frames.
using ChunkRanges = std::vector<std::vector<std::pair<uint64_t, uint64_t>>>;
ChunkRanges RankHeldChunks(const CompiledLayout& layout, const DeltaManifest& manifest);

// Ranks as a target of the apply loop (include/dcr/apply.h): frames are
// placed through their maps, old words gathered from the copies that count
// (primary; a replica where no copy of the ranks is primary), new words
// scattered to every copy. A chunk whose elements the ranks hold all as
// primaries is kWhole (checked against the frame's digests); one they hold
// some of is kPartial when `partial` (one rank of an engine whose other
// ranks apply elsewhere: its partial digests add up where they meet), and
// refused otherwise (an engine's ranks applying together must hold each
// chunk whole; kFailedPrecondition). A chunk one host rank holds whole in
// one run is applied in place directly. Ranks in BufferMemory are gathered
// and scattered in windows (Batched). Sub-byte dtypes cannot be placed
// (kUnimplemented). The ranks must outlive the target.
namespace placement {
struct Segment;  // one frame's words in one buffer of a rank in BufferMemory (placed_target.cc)
}
class PlacedTarget final : public ApplyTarget {
 public:
  PlacedTarget(std::span<PlacedRank* const> ranks, const DeltaManifest& manifest, bool partial);
  Result<Holding> Holds(uint32_t tensor, uint32_t chunk) const override;
  std::span<uint8_t> Direct(uint32_t tensor, uint32_t chunk) const override;
  Status Gather(std::span<ApplyItem* const> items) override;
  Status Scatter(std::span<ApplyItem* const> items) override;
  bool Batched() const override { return batched_; }
  // Ranks in host memory audit every chunk a frame touches (as dcr always
  // has there); ranks in BufferMemory do not (a pass over a device's chunk
  // costs its transfer: they are audited at join and before a retry).
  bool Audits() const override { return !batched_; }
  Result<Digest> ChunkDigest(uint32_t tensor, uint32_t chunk) const override;
  Status Finish() override;  // flushes every rank's BufferMemory

 private:
  struct Run;  // a copy's run of a chunk, in words
  std::vector<Run> Runs(uint32_t tensor, uint32_t chunk) const;
  void Place(ApplyItem& item, bool gather, std::vector<placement::Segment>* segs, std::vector<uint8_t>* held) const;
  void ForItems(size_t n, const std::function<void(size_t)>& fn) const;

  std::vector<PlacedRank*> ranks_;
  const DeltaManifest& manifest_;
  const bool partial_;
  bool batched_ = false;
  std::vector<std::vector<int64_t>> local_;  // [rank][manifest tensor]: the map's tensor index, or -1
};

// Applies `frames` (of distinct chunks) to one rank of an engine (the
// partial PlacedTarget); `current[i]` is the rank's tracked partial digest
// of frame i's chunk. Result i is frame i's (its `after`: the partial to
// track next). The partials of all ranks of an engine add up to the frames'
// target digests where the rank held the chunks' bases: the coordinator
// checks that at the ack.
std::vector<FrameApplied> ApplyRankFrames(PlacedRank& rank, const DeltaManifest& manifest,
                                          std::span<const FrameView> frames, std::span<const Digest> current);

// Every frame of `delta` applied to the engine formed by `ranks` (the whole
// PlacedTarget), each chunk checked against its frame before it is written;
// frames already applied are counted, not re-applied. Then the ranks'
// digests are checked against the manifest's target over its tensors
// (kDataLoss otherwise): from `tracked` (the engine's chunk digests,
// [tensor][chunk] of the manifest, kept current here), O(changed) in all;
// without it (null or empty) they are computed first (RankChunkDigests) and
// `*tracked` (when given) gets them. Frames of `residuals` (tensors this
// engine converts on load, see layout_residual.h) are skipped, and those
// tensors left out of the digest check. A chunk is checked before it is
// written, so an error (the first by frame order is returned) leaves other
// chunks applied: an overwrite attempt repairs them (DESIGN section 5).
Result<ApplyReport> ApplyEngineDelta(std::span<PlacedRank* const> ranks, const DeltaReader& delta,
                                     std::span<const std::string> residuals = {}, ChunkDigestTable* tracked = nullptr);

// --- Sender side -----------------------------------------------------------

// One sender: a compiled trainer map, its baseline shards (the committed
// version) and its current shards, both indexed like map().buffers.
struct SenderRank {
  const CompiledLayout* layout = nullptr;
  std::vector<std::span<const uint8_t>> baseline, current;
  // When set, called before current[b] is first read (blocking until the
  // buffer is there, e.g. staged from a device); an error fails the projection.
  std::function<Status(size_t buffer)> await_current;
};

// What one sender knows about one canonical chunk.
struct ChunkContribution {
  uint32_t tensor = 0, chunk = 0;  // manifest tensor index and chunk
  uint32_t from = 0;  // sender index
  // The chunk-relative element ranges [first, first + length) its primary
  // copies cover, and the digest of those elements in its baseline.
  std::vector<std::pair<uint32_t, uint32_t>> covered;
  Digest base_digest;
  // Changed elements (chunk-relative), with old and new bits (element bytes each).
  std::vector<uint32_t> positions;
  std::vector<uint8_t> old_bits, new_bits;
  // Overwrite class only: the new bits of every covered element, range by range.
  std::vector<uint8_t> covered_bits;
  // A direct contribution (ProjectSender's `direct`): the sender's primary
  // copy holds the whole chunk in one run, and these are its bytes in the
  // baseline and current shards; `covered` is the whole chunk and nothing
  // else is set (no digest, no change lists: the owner encodes the spans as
  // a canonical encoder would). Local to the process: never serialized.
  std::span<const uint8_t> direct_base, direct_next;
  std::function<Status()> direct_ready;  // the sender's await_current for the spans' buffer, if any
  bool direct() const { return !direct_next.empty(); }
};

// The sender owning chunk `chunk` of manifest tensor `tensor`: the one whose
// primary copy holds the chunk's first element. kNotFound when no sender maps it.
Result<uint32_t> ChunkOwner(std::span<const CompiledLayout* const> senders, const DeltaManifest& manifest,
                            uint32_t tensor, uint32_t chunk);

// Sender `index`'s contributions to every chunk of the manifest's tensors
// its primary copies touch, in (tensor, chunk) order; mapped tensors the
// manifest does not hold are skipped (a residual delta holds a few tensors;
// ValidateEngine checks maps against the checkpoint). Errors:
// kInvalidArgument (buffer sizes differ from the map, or a tensor's dtype or
// shape differs from the manifest's). Chunks for which `direct(tensor,
// chunk)` holds (the caller merges them in this process, with the shards
// alive until then) and which one run of the sender holds whole come as
// direct contributions: no pass over them here.
Result<std::vector<ChunkContribution>> ProjectSender(
    const SenderRank& sender, uint32_t index, const DeltaManifest& manifest,
    const std::function<bool(uint32_t tensor, uint32_t chunk)>& direct = {});

struct OwnedFrames {
  std::vector<ChunkId> chunks;  // the chunks merged, in order
  std::vector<Digest> base_digests, target_digests;  // per chunk
  std::vector<int64_t> frame_of;  // per chunk: index into frames, -1 when it did not change
  std::vector<std::string> frames;  // encoded frames of the chunks that changed
};

// Merges `contributions` (from every sender, for the chunks one owner
// owns; any order) into each chunk's frame, encoded in the manifest's
// class and delta id. Refuses (kFailedPrecondition, naming tensor and
// chunk) unless each chunk's contributions cover its elements exactly once.
Result<OwnedFrames> EncodeOwnedChunks(const DeltaManifest& manifest, std::span<const ChunkContribution> contributions,
                                      const EncodeOptions& options);

// A delta's manifest for `tensors` (the checkpoint's, as every sender knows
// them from the model), without frames: what StartDelta builds from two
// canonical checkpoints, for senders that hold only shards. delta_id 0 in
// the options: a random id.
DeltaManifest StartLayoutDelta(std::span<const TensorInfo> tensors, const DeltaOptions& options);

// Completes `manifest` from every owner's frames (each chunk of the manifest
// merged by exactly one owner): the frame list (one object, frames back to
// back in (tensor, chunk) order), chunk digests and totals. Returns the frame
// object's bytes. kFailedPrecondition, naming the chunk, when a chunk is
// missing or merged twice.
Result<std::string> AssembleLayoutDelta(DeltaManifest& manifest, std::span<const OwnedFrames> owners);

}  // namespace dcr
