// Deltas: every frame of one attempt to move a checkpoint from a base
// version to a target version, plus the manifest that describes them
// (DESIGN section 4; docs/format.md). A delta is a manifest plus one or more
// frame objects (files in a directory, or objects in a store):
//   tensors.json    the tensor table: names, dtypes, shapes, chunking (what
//                   does not change between versions; a run states it once,
//                   in run.json)
//   manifest.bin    the version's digests, the frame objects, and the frames
//                   (chunk, object, size): binary, sized by the change
//   frames.bin      (`dcr delta make`) the frames, back to back, in (tensor,
//                   chunk) order; the protocol writes one object per sender
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/checkpoint.h"
#include "dcr/chunk_codec.h"
#include "dcr/digest.h"
#include "dcr/frame.h"
#include "dcr/mapped_file.h"
#include "dcr/status.h"

namespace dcr {

class Progress;
class ThreadPool;

inline constexpr uint64_t kDefaultChunkElements = 1ull << 20;
inline constexpr std::string_view kTableFileName = "tensors.json";
inline constexpr std::string_view kManifestFileName = "manifest.bin";
inline constexpr std::string_view kOldManifestFileName = "manifest.json";  // format version 1
inline constexpr uint8_t kDeltaFormatVersion = 2;
inline constexpr uint32_t kManifestMagic = 0x4D524344;  // "DCRM" little-endian
inline constexpr uint8_t kExplicitOffsets = 1;  // manifest flag: frame offsets are listed
inline constexpr size_t kManifestFixedBytes = 56;  // before the object list
inline constexpr std::string_view kFramesFileName = "frames.bin";

struct DeltaTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t elements = 0;
};

struct DeltaFrameEntry {
  uint32_t tensor = 0, chunk = 0;
  uint32_t object = 0;  // index into DeltaManifest::objects
  uint64_t offset = 0, bytes = 0;  // within that object, header included
  // From the frame's header (manifest.bin does not repeat them: DeltaReader
  // fills them in).
  Mode mode = Mode::kOverwrite;
  Codec codec = Codec::kRaw;
  uint32_t changed = 0;  // words
  uint32_t payload_bytes = 0;
};

struct DeltaManifest {
  uint64_t delta_id = 0;
  DeltaClass delta_class = DeltaClass::kXorClass;
  uint64_t chunk_elements = kDefaultChunkElements;
  Digest base_digest, target_digest;  // the whole checkpoint: sums over chunks
  // The tensor table: the run's (run.json), or the delta directory's.
  std::vector<DeltaTensor> tensors;  // sorted by name; a frame's tensor id indexes this
  // Names of the frame objects, relative to where the manifest lives
  // ('/'-separated, no '.' or '..' components).
  std::vector<std::string> objects;
  std::vector<DeltaFrameEntry> frames;  // sorted by (tensor, chunk), at most one per chunk
  // Each tensor's target digest, known where the delta was made (FinishDelta)
  // and carried by the JSON description; manifest.bin does not store them
  // (empty after Decode): receivers track chunk digests instead.
  std::vector<Digest> tensor_target_digests;
  // Totals.
  uint64_t total_elements = 0, total_bytes = 0, changed_words = 0, payload_bytes = 0, frame_bytes = 0;

  // manifest.bin (docs/format.md): the version's facts and its frame list;
  // the tensor table is named by TableId, not included. Frames must be
  // sorted, and their entries' mode, codec and changed are not stored (the
  // frames' headers hold them).
  std::string Encode() const;
  // Parses and validates manifest.bin against `table` (chunk_elements and
  // tensors; a manifest for another table is refused, kFailedPrecondition):
  // ids in range, frames sorted and unique, sizes possible, the checksum
  // (kDataLoss). A format version 1 manifest (JSON) is refused,
  // kUnimplemented. `where` names the object in errors.
  static Result<DeltaManifest> Decode(std::span<const uint8_t> bytes, const DeltaManifest& table,
                                      const std::string& where);

  // The tensor table alone as JSON (tensors.json), and back (a manifest
  // with no frames) from a document of that `format` (run.json holds the
  // same fields, and others); its 64-bit id (XXH3 of its canonical bytes).
  std::string TableJson() const;
  static Result<DeltaManifest> FromTableJson(std::string_view json, const std::string& where,
                                             const char* format = "dcr-tensors");
  uint64_t TableId() const;

  // Everything as one JSON document, for people and for Python (the table,
  // digests, objects and every frame entry): not a stored format.
  std::string ToJson() const;
  static Result<DeltaManifest> FromJson(std::string_view json, const std::string& where);

  // Appends a frame entry after checking it (ids in range, after the last,
  // possible sizes); adds its bytes to frame_bytes.
  Status AddFrame(uint64_t tensor, uint64_t chunk, uint64_t object, DeltaFrameEntry entry, const std::string& where);

  // Chunks of tensor t, and the word range of its chunk c.
  uint64_t ChunkCount(size_t t) const;
  void ChunkWords(size_t t, uint64_t c, uint64_t* first_word, uint64_t* words, uint32_t* elements) const;
};

struct DeltaOptions {
  EncodeOptions encode;  // delta_class selects xor-class or overwrite frames
  uint64_t chunk_elements = kDefaultChunkElements;  // a positive multiple of 8
  uint64_t delta_id = 0;  // 0: a random id
};

// A manifest for moving `base` to `next` with no frames yet: tensors (from
// `next`), chunking, class and id (random when options.delta_id is 0).
// Refuses (kFailedPrecondition) unless both hold the same tensors.
Result<DeltaManifest> StartDelta(const Checkpoint& base, const Checkpoint& next, const DeltaOptions& options);

// Where encoded frames go: called in (tensor, chunk) order, one call per
// frame, from one thread at a time (not necessarily the caller's: the sink's
// I/O overlaps the encoding of the next chunks).
using FrameSink = std::function<Status(std::string_view frame)>;

struct ChunkId {
  uint32_t tensor = 0, chunk = 0;
  friend bool operator==(const ChunkId&, const ChunkId&) = default;
  friend auto operator<=>(const ChunkId&, const ChunkId&) = default;
};

// Every chunk of the manifest's tensors, in (tensor, chunk) order.
std::vector<ChunkId> AllChunks(const DeltaManifest& manifest);

struct EncodedFrames {
  std::vector<DeltaFrameEntry> frames;  // object 0, offsets within what went to the sink
  // Per chunk encoded (same order as the input chunks): its base and target digests.
  std::vector<Digest> base_digests, target_digests;
  uint64_t bytes = 0;  // sent to the sink
};

// Encodes `chunks` (sorted) of `base` -> `next` in the manifest's chunking
// and class, in parallel, handing frames to `sink` in order (memory stays
// O(threads x chunk)). `base_digests`, when given, holds the base's tracked
// digest of each of `chunks` (no digest pass over the base).
Result<EncodedFrames> EncodeFrames(const Checkpoint& base, const Checkpoint& next, const DeltaManifest& manifest,
                                   std::span<const ChunkId> chunks, const EncodeOptions& options, const FrameSink& sink,
                                   const std::vector<Digest>* base_digests = nullptr, Progress* progress = nullptr,
                                   ThreadPool* pool = nullptr);

// Fills in the manifest's digests and totals from the chunk digests of
// every chunk (in AllChunks order) and its frames (which it sorts).
void FinishDelta(DeltaManifest& manifest, std::span<const Digest> base_digests, std::span<const Digest> target_digests);

// Diffs `next` against `base` (same tensor names, dtypes and shapes) and
// writes the delta into directory `out_dir` (created; must not hold a delta
// already). Chunks are encoded in parallel; memory stays O(threads x chunk).
// The manifest is written last, so a directory with a manifest is complete.
Result<DeltaManifest> MakeDelta(const Checkpoint& base, const Checkpoint& next, const DeltaOptions& options,
                                const std::string& out_dir, Progress* progress = nullptr, ThreadPool* pool = nullptr);

// Frames of a delta whose payloads a receiver dropped once it applied them,
// keeping their headers: frame index in the manifest -> the header's bytes.
using ReleasedFrames = std::map<size_t, std::array<uint8_t, kMaxFrameHeaderBytes>>;

// An opened delta: the manifest and its frame objects, read zero-copy.
class DeltaReader {
 public:
  // A delta directory (its frame objects are files in it, mapped).
  static Result<DeltaReader> Open(const std::string& dir);
  // A manifest and its frame objects' bytes (objects[i] for manifest.objects[i]),
  // kept alive by `owner`. `where` names the delta in errors. Frames in
  // `released` are read from their headers there, not from the objects (an
  // object whose frames are all released may be given empty).
  // `skipped` (by object, or empty): objects not fetched (a rank of a
  // sharded engine holds none of their chunks); their frames are not read,
  // so the manifest's totals are not checked against the frames either.
  static Result<DeltaReader> FromObjects(DeltaManifest manifest, std::vector<std::span<const uint8_t>> objects,
                                         std::shared_ptr<const void> owner, std::string where,
                                         ReleasedFrames released = {}, std::vector<bool> skipped = {});
  const DeltaManifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  // Frame i of the manifest, parsed and checked (checksums, and that its
  // header agrees with the manifest and the tensor). A released frame comes
  // without its payload (FrameView::PayloadHeld is false). Errors: kDataLoss;
  // kFailedPrecondition for a frame of a skipped object.
  Result<FrameView> Frame(size_t i) const;
  // Whether frame i's object was skipped (FromObjects).
  bool Skipped(size_t i) const { return !skipped_.empty() && skipped_[manifest_.frames[i].object]; }

 private:
  std::string dir_;
  DeltaManifest manifest_;
  std::vector<std::span<const uint8_t>> objects_;
  ReleasedFrames released_;
  std::vector<bool> skipped_;  // by object; empty: none
  std::shared_ptr<const void> owner_;
};

// Chunk digests of a checkpoint, result[t][c], in a manifest's chunking.
using ChunkDigestTable = std::vector<std::vector<Digest>>;

// Digest of every chunk of every tensor of `ckpt`, computed in parallel, in
// the chunking of `manifest`: result[t][c]. Precondition: the tensors match.
ChunkDigestTable ChunkDigests(const Checkpoint& ckpt, const DeltaManifest& manifest, Progress* progress = nullptr,
                              ThreadPool* pool = nullptr);

// Refuses (kFailedPrecondition, naming the tensor) unless `ckpt` has exactly
// the manifest's tensors (names, dtypes, shapes).
Status CheckSameTensors(const Checkpoint& ckpt, const DeltaManifest& manifest);

struct ApplyReport {
  uint64_t frames_applied = 0;
  uint64_t frames_already_applied = 0;  // found done (a resumed or repeated apply)
  uint64_t payload_bytes = 0;  // of the frames applied
  uint64_t changed_words = 0;
  uint64_t scratch_peak_bytes = 0;  // decoded changes held at once (engines whose buffers are on a device)
};

// Applies the delta to `target` (opened kReadWrite) in place. First checks,
// without writing, that the chunks no frame changes hold what the manifest
// says, and that every framed chunk is at its frame's target (done: an
// interrupted apply resumes, and no frame is applied twice) or turns into it
// when its frame is applied (the delta's base; for overwrite frames, any
// state the frame repairs, such as a half-written chunk); refuses otherwise
// (kFailedPrecondition, naming the chunk), as it refuses a frame whose
// payload was released (DeltaReader) on a chunk not at its target. Then
// applies the frames in parallel, each verified by digest before its bytes
// are written, syncs the files, and checks the resulting digest against the
// manifest's (kDataLoss). Errors name the tensor and chunk.
// `tracked`, when given and not empty, holds the target's chunk digests (no
// digest pass); when given it receives the chunk digests after the apply
// (unchanged on error, except chunks whose frames were applied).
// `sync`: flush the target's files to disk before returning (receivers that
// verify their digest at start-up may skip it: an OS crash is then detected
// and repaired, not prevented).
Result<ApplyReport> ApplyDelta(Checkpoint& target, const DeltaReader& delta, Progress* progress = nullptr,
                               ThreadPool* pool = nullptr, ChunkDigestTable* tracked = nullptr, bool sync = true);

struct VerifyReport {
  bool matches = false;  // the checkpoint's digest is the expected one
  // When not (against the target): the tensors holding a chunk the delta
  // changes whose digest is not its frame's target. A difference elsewhere
  // shows in `matches` alone (a manifest has no per-tensor digests).
  std::vector<std::string> differing;
};

// Is `ckpt` the delta's target (or, with against_base, its base)? A full
// digest pass; errors for mismatched tensor sets and unreadable frames.
Result<VerifyReport> VerifyDelta(const Checkpoint& ckpt, const DeltaReader& delta, bool against_base = false,
                                 Progress* progress = nullptr, ThreadPool* pool = nullptr);

}  // namespace dcr
