// Moving deltas through layout maps (DESIGN sections 3 and 6).
//
// Receiver side (placement): an engine is a set of ranks, each a compiled
// map plus its local buffers. Frames (xor, add, overwrite) are applied
// through the maps in place: for one chunk, the elements the engine holds
// are gathered from their primary copies into a chunk-sized scratch, the
// frame is applied there by ChunkApplier (with all its checks: the chunk is
// the frame's base, the decode reaches the frame's target digest), and only
// the runs whose bytes changed are written back, to every copy (primary and
// replicas). No canonical tensor is ever materialised.
//
// The partial-chunk rule: a frame's digests cover its whole chunk, and a
// rank that holds only part of a chunk cannot check them alone (an xor or
// add value needs the old bits of every changed element to be verified).
// Every mode is elementwise, though, so a rank can *apply* its own elements
// of a chunk alone: ApplyRankFrame does, and returns the rank's partial base
// and target digests of the chunk (over the canonical elements its primary
// copies hold). The engine-level rule is that the partials of all ranks of
// one engine add up to the frame's base and target digests; that is checked
// where the partials meet (the coordinator's ack wait, docs/protocol.md).
// In one process, ApplyEngineFrame gets every rank and checks the chunk's
// digests before writing anything.
// Digests are per rank over the canonical elements its primary copies hold
// (RankDigest, RankChunkDigests); the ranks' digests of one engine add up to
// the checkpoint's (ValidateEngine guarantees each element is counted once),
// which is how an engine proves it holds the version's bits.
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

#include "dcr/checkpoint.h"
#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/digest.h"
#include "dcr/frame.h"
#include "dcr/layout.h"
#include "dcr/mapped_file.h"
#include "dcr/status.h"

namespace dcr {

// One receiver rank: a compiled map and its buffers (buffers[i] holds
// map().buffers[i], BufferBytes(i) bytes). Not owned.
struct PlacedRank {
  const CompiledLayout* layout = nullptr;
  std::vector<std::span<uint8_t>> buffers;
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

// Checks that `rank`'s buffers have the sizes its map declares.
Status CheckRankBuffers(const CompiledLayout& layout, std::span<const std::span<uint8_t>> buffers);

// Source of canonical tensor bytes by name (for dense loads); null when the
// tensor is unknown.
using TensorBytes = std::function<const uint8_t*(const std::string& name, uint64_t* bytes)>;
TensorBytes CheckpointBytes(const Checkpoint& ckpt);

// A dense load: every copy of the rank's map, from `source`. Buffer bytes no
// copy writes (padding) are left as they are. Errors: kNotFound (a mapped
// tensor missing from the source), kInvalidArgument (its size differs).
Status LoadDense(const TensorBytes& source, PlacedRank& rank);

// The digest of the canonical elements rank's primary copies hold, over all
// its tensors (each with its own DigestKey), or over the tensors named in
// `only` when it is not empty. Parallel on the default pool (not to be called
// from inside a ParallelFor).
Digest RankDigest(const PlacedRank& rank, std::span<const std::string> only = {});

// The rank's partial digest of every chunk of the manifest's tensors (those
// it does not map, or holds none of: zero), over its primary copies; indexed
// [tensor][chunk] like ChunkDigests. One pass over the rank's elements (at
// start or join; afterwards ApplyRankFrame's results keep it current).
ChunkDigestTable RankChunkDigests(const PlacedRank& rank, const DeltaManifest& manifest);

// The chunks of the manifest's tensors that any copy of the rank's map
// (primary or replica) holds an element of: by tensor, sorted disjoint
// [first, end) chunk ranges. A frame of any other chunk leaves the rank's
// buffers and partial digests as they are (ApplyRankFrame), so the rank
// needs only these chunks' frames.
using ChunkRanges = std::vector<std::vector<std::pair<uint64_t, uint64_t>>>;
ChunkRanges RankHeldChunks(const CompiledLayout& layout, const DeltaManifest& manifest);

// What ApplyRankFrame did to one rank's elements of a chunk.
struct RankFrameResult {
  Digest base, target;  // the rank's partial digests of the chunk, before and after
  uint64_t held = 0;  // chunk elements its primary copies hold
  uint64_t written = 0;  // elements written, over all copies (primaries and replicas)
};

// Applies one frame of `manifest` to the elements of its chunk that `rank`
// holds (primary copies and replicas), without the other ranks. Checks
// before writing anything: the frame fits the manifest (tensor, chunk,
// element and word counts, dtype, delta id) and the rank's map (shape), its
// payload decodes in full (ChunkApplier::ApplyUnverified; the checksum was
// checked by ParseFrame), and, for xor/add frames when `expected_base` is
// given (the rank's tracked partial of the chunk), that the rank's elements
// are at that digest. Replica-only elements are updated from their own old
// bits. A rank that maps the tensor but none of the chunk gets held == 0 and
// nothing written. The partial digests cannot be checked here: the caller
// adds them up over the engine's ranks (the sum must be the frame's target
// digest). Cost: O(changes + elements the rank holds of the chunk); scratch
// grows to one chunk. Errors: kInvalidArgument (the frame does not fit),
// kDataLoss (corrupt payload), kFailedPrecondition (xor/add frame on
// elements that are not at `expected_base`; they need an overwrite).
Result<RankFrameResult> ApplyRankFrame(PlacedRank& rank, const DeltaManifest& manifest, const FrameView& frame,
                                       std::vector<uint8_t>* scratch, const Digest* expected_base = nullptr);

// ApplyRankFrame over `frames`, which must be of distinct chunks (so they
// write disjoint elements), chunk-parallel on the default pool (not to be
// called from inside a ParallelFor); expected_bases is empty (no checks) or
// has one entry per frame (null: none). Result i is frame i's, and the
// buffers end byte-identical to applying the frames one by one in order.
std::vector<Result<RankFrameResult>> ApplyRankFrames(PlacedRank& rank, const DeltaManifest& manifest,
                                                     std::span<const FrameView> frames,
                                                     std::span<const Digest* const> expected_bases = {});

// Applies one frame of `manifest` to the engine formed by `ranks`; `scratch`
// is reused between calls (one per thread; it grows to twice a chunk's
// bytes). On error nothing was written.
// Errors: those of ChunkApplier::Apply (kFailedPrecondition when the engine's
// chunk is neither base nor target, kDataLoss for a corrupt payload), and
// kFailedPrecondition when `ranks` hold only part of the chunk (apply it with
// all ranks of the engine), or none of it.
Result<ApplyOutcome> ApplyEngineFrame(std::span<PlacedRank* const> ranks, const DeltaManifest& manifest,
                                      const FrameView& frame, std::vector<uint8_t>* scratch);

// Every frame of `delta` through ApplyEngineFrame, in parallel on the
// default pool (one frame per chunk, so frames write disjoint elements; not
// to be called from inside a ParallelFor); then checks that the ranks'
// digests add up to the manifest's target digest over its tensors
// (kDataLoss otherwise). Frames already applied are counted, not re-applied.
// Frames of `residuals` (tensors this engine converts on load, see
// layout_residual.h) are skipped, and those tensors left out of the digest
// check. A chunk is checked before it is written, so an error (the first by
// frame order is returned) leaves other chunks applied: an overwrite attempt
// repairs them (DESIGN section 5).
Result<ApplyReport> ApplyEngineDelta(std::span<PlacedRank* const> ranks, const DeltaReader& delta,
                                     std::span<const std::string> residuals = {});

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
