// Deltas: every frame of one attempt to move a checkpoint from a base
// version to a target version, plus the manifest that describes them
// (DESIGN section 4; docs/format.md). On disk a delta is a directory:
//   manifest.json   tensors, chunking, digests, the frame list, totals
//   frames.bin      the frames, back to back, in (tensor, chunk) order
#pragma once

#include <cstdint>
#include <memory>
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
inline constexpr std::string_view kManifestFileName = "manifest.json";
inline constexpr std::string_view kFramesFileName = "frames.bin";

struct DeltaTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t elements = 0;
  Digest base_digest, target_digest;
};

struct DeltaFrameEntry {
  uint32_t tensor = 0, chunk = 0;
  uint64_t offset = 0, bytes = 0;  // within frames.bin, header included
  Mode mode = Mode::kOverwrite;
  Codec codec = Codec::kRaw;
  uint32_t changed = 0;  // words
};

struct DeltaManifest {
  uint64_t delta_id = 0;
  DeltaClass delta_class = DeltaClass::kXorClass;
  uint64_t chunk_elements = kDefaultChunkElements;
  Digest base_digest, target_digest;  // the whole checkpoint: sums over tensors
  std::vector<DeltaTensor> tensors;   // sorted by name; a frame's tensor id indexes this
  std::vector<DeltaFrameEntry> frames;  // sorted by (tensor, chunk), at most one per chunk
  // Totals.
  uint64_t total_elements = 0, total_bytes = 0, changed_words = 0, payload_bytes = 0, frame_bytes = 0;

  std::string ToJson() const;
  // Parses and validates (tensor ids in range, chunks inside tensors, frames
  // sorted and unique, digests well-formed). `where` names the file in errors.
  static Result<DeltaManifest> FromJson(std::string_view json, const std::string& where);

  // Chunks of tensor t, and the word range of its chunk c.
  uint64_t ChunkCount(size_t t) const;
  void ChunkWords(size_t t, uint64_t c, uint64_t* first_word, uint64_t* words, uint32_t* elements) const;
};

struct DeltaOptions {
  EncodeOptions encode;  // delta_class selects xor-class or overwrite frames
  uint64_t chunk_elements = kDefaultChunkElements;  // a positive multiple of 8
  uint64_t delta_id = 0;  // 0: a random id
};

// Diffs `next` against `base` (same tensor names, dtypes and shapes) and
// writes the delta into directory `out_dir` (created; must not hold a delta
// already). Chunks are encoded in parallel; memory stays O(threads x chunk).
// The manifest is written last, so a directory with a manifest is complete.
Result<DeltaManifest> MakeDelta(const Checkpoint& base, const Checkpoint& next, const DeltaOptions& options,
                                const std::string& out_dir, Progress* progress = nullptr, ThreadPool* pool = nullptr);

// An opened delta directory; frames are read zero-copy from a mapping.
class DeltaReader {
 public:
  static Result<DeltaReader> Open(const std::string& dir);
  const DeltaManifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  // Frame i of the manifest, parsed and checked (checksums, and that its
  // header agrees with the manifest and the tensor). Errors: kDataLoss.
  Result<FrameView> Frame(size_t i) const;

 private:
  std::string dir_;
  DeltaManifest manifest_;
  std::shared_ptr<MappedFile> frames_;
};

// Digest of every chunk of every tensor of `ckpt`, computed in parallel, in
// the chunking of `manifest`: result[t][c]. Precondition: the tensors match.
std::vector<std::vector<Digest>> ChunkDigests(const Checkpoint& ckpt, const DeltaManifest& manifest,
                                              Progress* progress = nullptr, ThreadPool* pool = nullptr);

// Refuses (kFailedPrecondition, naming the tensor) unless `ckpt` has exactly
// the manifest's tensors (names, dtypes, shapes).
Status CheckSameTensors(const Checkpoint& ckpt, const DeltaManifest& manifest);

struct ApplyReport {
  uint64_t frames_applied = 0;
  uint64_t frames_already_applied = 0;  // found done (a resumed or repeated apply)
  uint64_t payload_bytes = 0;           // of the frames applied
  uint64_t changed_words = 0;
};

// Applies the delta to `target` (opened kReadWrite) in place. First checks,
// without writing, that every tensor is the delta's base, with any chunks
// already at their target counted as done (so an interrupted apply resumes,
// and no frame is applied twice), and, for overwrite frames, chunks in any
// state the frame still turns into its target (a half-written chunk);
// refuses otherwise (kFailedPrecondition). Then applies the frames
// in parallel, each verified by digest before its bytes are written, and
// syncs the files. Errors name the tensor and chunk.
Result<ApplyReport> ApplyDelta(Checkpoint& target, const DeltaReader& delta, Progress* progress = nullptr,
                               ThreadPool* pool = nullptr);

struct VerifyReport {
  bool matches = false;
  std::vector<std::string> differing;  // tensors whose digest is not the expected one
};

// Is `ckpt` the delta's target (or, with against_base, its base)? A full
// digest pass; errors only for mismatched tensor sets.
Result<VerifyReport> VerifyDelta(const Checkpoint& ckpt, const DeltaManifest& manifest, bool against_base = false,
                                 Progress* progress = nullptr, ThreadPool* pool = nullptr);

}  // namespace dcr
