// Encoding one chunk's change into a frame, and applying a frame to the
// receiver's bytes of that chunk. Everything above (deltas, the protocol,
// relays, layouts) moves frames produced and consumed here.
//
// A chunk is words [first_word, first_word + words) of one tensor (a word is
// the unit of WordBytes(dtype)). Thread-safety: an encoder or applier object
// holds scratch buffers and is used by one thread at a time; make one per
// thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "dcr/digest.h"
#include "dcr/frame.h"
#include "dcr/status.h"

namespace dcr {

// What the receiver may be assumed to hold.
enum class DeltaClass {
  kXorClass,  // the base bits: frames use xor or add, whichever is smaller
  kOverwrite,  // nothing: frames carry new bits (idempotent)
};

struct EncodeOptions {
  DeltaClass delta_class = DeltaClass::kXorClass;
  bool allow_add = true;  // xor class: consider add-mode frames
  bool allow_xor = true;  // xor class: consider xor-mode frames
  int zstd_level = 1;
  // zstd of the dense layout is tried only when the best sparse payload is
  // larger than this fraction of the dense size (it costs a pass at zstd speed).
  double zstd_when_sparse_above = 0.25;
  // For benchmarks only: leave the frame's target digest at the base digest
  // (the frame then fails every apply), to measure what the digest costs.
  bool skip_target_digest = false;
};

struct ChunkInput {
  DType dtype;
  DigestKey key;  // of the tensor
  uint64_t first_word;  // the chunk's first word within the tensor
  uint32_t elements;  // elements in the chunk
  std::span<const uint8_t> base, next;  // the chunk's bytes, equal length
  // The base chunk's digest when the caller tracks it (a sender updates its
  // baseline's chunk digests from each delta); null: computed here.
  const Digest* base_digest = nullptr;
};

struct EncodedChunk {
  FrameHeader header;  // tensor, chunk, first_element, delta_id left 0
  std::vector<uint8_t> payload;  // owned by the encoder; valid until the next call
  Digest base_digest;  // of the chunk, whether or not it changed
};

class ChunkEncoder {
 public:
  // Diffs base and next and encodes the smallest frame within the class.
  // Returns false when nothing changed (no frame; base_digest still set).
  // Errors: kInvalidArgument (sizes inconsistent with the dtype).
  Result<bool> Encode(const ChunkInput& in, const EncodeOptions& options, EncodedChunk* out);

 private:
  // Scratch, grown only and never zeroed: changed word positions, the
  // changes (position, base and next word), the sparse bit stream.
  std::unique_ptr<uint32_t[]> positions_;
  size_t positions_capacity_ = 0;
  std::unique_ptr<uint8_t[]> changes_;
  size_t changes_capacity_ = 0;  // bytes
  std::unique_ptr<uint8_t[]> bits_buffer_;
  size_t bits_capacity_ = 0;
  std::vector<uint8_t> scratch_;  // a dense layout, for zstd
};

// A changed word of a chunk: its position (word index within the chunk)
// and its bits before and after. The unit the apply loop moves between the
// decoder, a target's gather and scatter, and the digest.
template <typename U>
struct WordChange {
  uint32_t position;
  U old_word, new_word;
};

// Decoded changes of one chunk: `count` WordChange<U> records at `records`,
// U the unsigned type of `word_bytes` bytes, positions increasing. Not owned.
struct ChunkChanges {
  uint32_t word_bytes = 0;
  uint32_t count = 0;
  void* records = nullptr;
  // Calls f(WordChange<U>* records) with U the word type.
  template <typename F>
  void Visit(F&& f) const {
    switch (word_bytes) {
      case 1: f(static_cast<WordChange<uint8_t>*>(records)); break;
      case 2: f(static_cast<WordChange<uint16_t>*>(records)); break;
      case 4: f(static_cast<WordChange<uint32_t>*>(records)); break;
      default: f(static_cast<WordChange<uint64_t>*>(records)); break;
    }
  }
};

// The digest change of `changes` of the chunk starting at word `first_word`
// of the tensor keyed `key`: each word going from its old to its new bits
// (docs/format.md section 2: computed from the changed words alone).
Digest ChangesDigest(const DigestKey& key, uint64_t first_word, const ChunkChanges& changes);

enum class ApplyOutcome {
  kApplied,  // the chunk was the base and is now the target
  kAlreadyApplied,  // the chunk already held the target (duplicate frame); untouched
};

class ChunkApplier {
 public:
  // Applies `frame` to `target` (the chunk's bytes, whole words of the
  // frame's dtype), whose digest is `current` (computed by the caller, or
  // tracked). Decodes and checks everything before writing a byte: on any
  // error the target is unchanged. A chunk at the frame's target digest is
  // left alone (already applied); otherwise the digest after the change,
  // computed from the chunk's own old and new words, must be the frame's
  // target digest, which it is only when the chunk was the frame's base
  // (or, for an overwrite frame, differs from it only where the frame
  // writes). On success `*after` holds the chunk's new digest. With `write`
  // false nothing is written whatever the outcome (a dry run).
  // Errors: kFailedPrecondition (the chunk is neither the frame's base nor
  // its target), kDataLoss (the payload does not decode), kInvalidArgument
  // (frame and target disagree).
  Result<ApplyOutcome> Apply(const FrameView& frame, const DigestKey& key, uint64_t first_word,
                             std::span<uint8_t> target, const Digest& current, Digest* after, bool write = true);

  // For a chunk the caller holds elsewhere than one span of host memory (a
  // rank's share of it, a device): decodes `frame`'s changes to a chunk of
  // `words` words without reading it. Each record gets its position and, in
  // new_word, the frame's value there; the caller fills in old_word (its
  // gather) and calls Resolve. Sparse frames list their changes; dense ones
  // every word their value changes (xor, add: a nonzero value) or, for
  // overwrite, every word. The payload is decoded and checked in full.
  // The records live in this applier until its next call.
  // Errors: kDataLoss (the payload does not decode, or lists more changes
  // than the chunk has words), kFailedPrecondition (its payload was dropped).
  // With `storage` (DecodedBytes(frame.header, words) bytes, 8-aligned) the
  // records go there instead, owned by the caller.
  Result<ChunkChanges> DecodeValues(const FrameView& frame, uint32_t words, uint8_t* storage = nullptr);
  // The most bytes DecodeValues' records of such a frame take.
  static uint64_t DecodedBytes(const FrameHeader& header, uint32_t words);
  // Turns the values of `changes` (decoded by DecodeValues from a frame with
  // `header`, old words filled in) into their new words.
  static void Resolve(const FrameHeader& header, const ChunkChanges& changes);

 private:
  // Decodes the frame's changes to a chunk of `words` words into `records`
  // (DecodedBytes of room; null: changes_); `*count` gets their number.
  // With a `target` (the chunk's bytes) each change gets its old word from
  // it and its new word; without (null), its value in new_word, as
  // DecodeValues says. Writes nothing.
  Status Decode(const FrameView& frame, const uint8_t* target, uint32_t words, const std::string& where,
                uint8_t* records, uint32_t* count);
  // Decode's two codec families: the sparse bit stream (frame.header.changed
  // records), and the dense layouts (raw, zstd; `*count` records).
  Status DecodeSparse(const FrameView& frame, const uint8_t* target, uint32_t words, const std::string& where,
                      uint8_t* changes);
  Status DecodeDense(const FrameView& frame, const uint8_t* target, uint32_t words, const std::string& where,
                     uint8_t* changes, uint32_t* count);
  // Stores the new words of the first n decoded changes into `target`.
  void WriteChanges(uint32_t word_bytes, uint32_t n, std::span<uint8_t> target) const;

  // Scratch, grown only and never zeroed: the changes (position, old and
  // new word).
  std::unique_ptr<uint8_t[]> changes_;
  size_t changes_capacity_ = 0;  // bytes
  std::vector<uint8_t> payload_;  // a sparse payload's bit stream, zero-padded
  std::vector<uint8_t> dense_;  // a zstd payload, decompressed
  // The sparse decoder's table for the last add frame's code parameters
  // (decode_table_key_: word bytes, gap and value parameters; 0: none).
  std::unique_ptr<uint32_t[]> decode_table_;
  uint32_t decode_table_key_ = 0;
};

}  // namespace dcr
