// The apply loop: how every receiver applies frames (DESIGN section 3:
// decode -> place -> apply in place -> verify). A checkpoint's files, one
// rank's buffers, a whole engine's ranks, buffers on a device, an FP8
// engine's BF16 master: each is an ApplyTarget, and ApplyFrames is the one
// loop over them.
//
// For each frame the loop
//  1. checks that it is a frame of the manifest (tensor, chunk, dtype) and
//     asks the target what it holds of the chunk (nothing: passed over);
//  2. decodes it on the host into the chunk's changes (positions, values);
//  3. has the target gather the old words at those positions (dropping
//     changes it does not hold) and computes the new words;
//  4. computes the digest change from the changed words alone and, where
//     the target holds the whole chunk, checks that its tracked digest plus
//     that change is the frame's target digest: the chunk was the frame's
//     base (a chunk already at the target is left alone);
//  5. has the target scatter the new words, to every copy it keeps.
// Nothing of a chunk is written before its check passed. Work and memory
// are O(changed words): no chunk is read or hashed whole. A target that
// holds a chunk whole in one span of host memory takes a fused path (the
// decoder reads the old words in place, ChunkApplier::Apply).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/digest.h"
#include "dcr/frame.h"
#include "dcr/status.h"

namespace dcr {

class Progress;
class ThreadPool;

// What a target holds of one chunk.
enum class Holding : uint8_t {
  kNone,  // no element: the chunk's frames change nothing here
  kWhole,  // every element, each counted once in its digest: frames are checked against their target digest
  kPartial,  // some elements (a rank of a sharded engine): its digest of them is partial, checked where the
             // ranks' partials meet (the coordinator's ack wait)
};

// One frame on its way through the loop, as the target sees it.
struct ApplyItem {
  uint32_t tensor = 0, chunk = 0;  // manifest indices
  uint64_t first_word = 0;  // the chunk's first word within its tensor
  uint32_t words = 0;  // words in the chunk
  // The decoded changes: positions, and new_word holding the frame's value.
  // Gather fills in old_word and drops (compacting, order kept) the changes
  // the target does not hold; the loop then computes the new words, which
  // Scatter writes.
  ChunkChanges changes;
  // Set by Gather when some changes it kept are of elements the target's
  // digest does not count (replicas of another rank's primary): per change,
  // 1 when counted. Empty: every change counts.
  std::vector<uint8_t> counted;
};

// Where a receiver's bits live, for the loop. Holds and Direct are called
// from the pool's threads, concurrently; Gather and Scatter from the loop's
// calling thread when Batched, else from the pool's threads, concurrently
// for distinct items.
class ApplyTarget {
 public:
  virtual ~ApplyTarget() = default;
  // What it holds of the chunk; an error refuses the chunk's frame (the
  // target cannot apply it, e.g. ranks holding part of a chunk that must be
  // checked whole).
  virtual Result<Holding> Holds(uint32_t tensor, uint32_t chunk) const = 0;
  // The chunk's bytes when the target keeps all of it (kWhole), in host
  // memory, in one span and nowhere else: the loop applies there directly.
  // Empty otherwise.
  virtual std::span<uint8_t> Direct(uint32_t tensor, uint32_t chunk) const = 0;
  // For each item (not Direct): keeps the changes of elements the target
  // holds, with their old words (a copy the digest counts, else a replica),
  // and sets `counted` where some kept changes are not counted. Errors
  // (the target's I/O) fail the window's items.
  virtual Status Gather(std::span<ApplyItem* const> items) = 0;
  // Writes the new words of `items` (gathered by the last Gather) to every
  // copy of their elements the target keeps.
  virtual Status Scatter(std::span<ApplyItem* const> items) = 0;
  // Whether gathers and scatters cost per call (a device): the loop then
  // gathers and scatters a window of frames at once, bounded by the frames'
  // own bytes; otherwise frame by frame on the pool.
  virtual bool Batched() const { return false; }
  // Whether the loop audits each chunk a frame touches: its digest computed
  // from the bits (ChunkDigest) before the frame is applied. Tracked digests
  // follow only what the loop writes; an audited chunk changed behind the
  // target's back is caught at its next frame (whole: the frame's check
  // fails unless it repairs it; partial: xor and add frames are refused).
  // O(chunk) per frame: worth it where the bits are in host memory.
  virtual bool Audits() const { return false; }
  // The digest of the chunk's elements the target counts, from its bits
  // (targets that audit; the default is kUnimplemented).
  virtual Result<Digest> ChunkDigest(uint32_t tensor, uint32_t chunk) const;
  // Called once at the end of an ApplyFrames call in which some frame wrote:
  // a target whose memory derives state from its bits (an FP8 engine's
  // requantization, BufferMemory::Flush) settles it here, before the caller
  // reports the frames applied. An error marks every frame that wrote torn,
  // with that error.
  virtual Status Finish() { return Status::Ok(); }
};

// The loop's outcome for one frame.
struct FrameApplied {
  Status status;  // kInvalidArgument (not a frame of the manifest), kDataLoss (corrupt payload),
                  // kFailedPrecondition (a whole chunk not at the frame's base), the target's errors
  Holding holding = Holding::kNone;
  ApplyOutcome outcome = ApplyOutcome::kAlreadyApplied;  // kAlreadyApplied: whole chunks at the target, and kNone
  Digest after;  // the target's digest of the chunk's elements it counts, after (as `current` when nothing changed)
  // Changed words written (each to every copy): the frame's count for a
  // whole chunk, the changes of held elements for a partial one; 0 in a
  // dry run.
  uint64_t written = 0;
  // The target's scatter failed part way: some of the chunk's words may
  // hold new bits (with any other error nothing of the chunk was written).
  bool torn = false;
};

struct ApplyLoopOptions {
  bool write = true;  // false: decode, gather and check only (a dry run)
  ThreadPool* pool = nullptr;  // null: DefaultPool()
  // Peak bytes of decoded changes held at once (set by the loop when not null).
  uint64_t* scratch_peak = nullptr;
  Progress* progress = nullptr;  // gets each frame's chunk bytes once it is done
};

// Applies `frames` (parsed, checksums checked; each of a distinct chunk of
// `manifest`, so they write disjoint elements) to `target`. `current[i]` is
// the target's digest of the elements it counts of frame i's chunk (tracked
// by the caller); result i is frame i's, and `after` what to track next. A
// frame's error leaves its chunk untouched and the others applied (the
// caller decides: an overwrite attempt repairs, DESIGN section 5). Not to be
// called from inside a ParallelFor of the same pool.
std::vector<FrameApplied> ApplyFrames(ApplyTarget& target, const DeltaManifest& manifest,
                                      std::span<const FrameView> frames, std::span<const Digest> current,
                                      const ApplyLoopOptions& options = {});

// A checkpoint opened read-write as a target: every chunk whole and direct.
class CheckpointApplyTarget final : public ApplyTarget {
 public:
  // `index[t]`: manifest tensor t's index in `ckpt` (both must outlive this).
  CheckpointApplyTarget(Checkpoint& ckpt, const DeltaManifest& manifest, std::vector<size_t> index)
      : ckpt_(ckpt), manifest_(manifest), index_(std::move(index)) {}
  Result<Holding> Holds(uint32_t, uint32_t) const override { return Holding::kWhole; }
  std::span<uint8_t> Direct(uint32_t tensor, uint32_t chunk) const override;
  Status Gather(std::span<ApplyItem* const>) override;
  Status Scatter(std::span<ApplyItem* const>) override;

 private:
  Checkpoint& ckpt_;
  const DeltaManifest& manifest_;
  const std::vector<size_t> index_;
};

}  // namespace dcr
