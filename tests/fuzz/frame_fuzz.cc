// Fuzzes frame parsing and applying: any input must be rejected, or parse
// into a frame whose apply either fails leaving the target untouched, or
// succeeds with the digest the frame promises; its header parses alone to
// the same, and without its payload it never applies. Never a crash, never
// a read or write outside the chunk.
//
// Checksums would stop almost every mutation at the door, so when the first
// input byte is odd the target re-seals the frame (recomputes both CRC32Cs)
// and the decoder itself gets fuzzed; even inputs fuzz the checks as they are.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dcr/chunk_codec.h"
#include "dcr/digest.h"
#include "dcr/frame.h"
#include "dcr/hash.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> input(data, data + size);
  if (size >= dcr::kFrameHeaderBytes && (data[0] & 1)) {
    input[0] &= 0xFE;  // the magic's first byte is even
    uint32_t payload_bytes;
    std::memcpy(&payload_bytes, input.data() + 40, 4);
    const size_t available = size - dcr::kFrameHeaderBytes;
    const uint32_t crc = dcr::Crc32c(input.data() + dcr::kFrameHeaderBytes, std::min<size_t>(payload_bytes, available));
    std::memcpy(input.data() + 44, &crc, 4);
    const uint32_t header_crc = dcr::Crc32c(input.data(), 92);
    std::memcpy(input.data() + 92, &header_crc, 4);
  }
  auto frame = dcr::ParseFrame(input);
  auto header = dcr::ParseFrameHeader(input);  // what a receiver keeps of an applied frame
  if (frame.ok() && (!header.ok() || !(*header == frame->header))) std::abort();
  if (!frame.ok()) return 0;
  const auto& h = frame->header;
  const uint64_t bytes = uint64_t{h.words} * h.word_bytes;
  if (bytes > (64u << 20)) return 0;  // keep memory bounded; sizes are checked elsewhere
  // A deterministic target chunk derived from the frame, with the digest the
  // receiver would track; pretend it is the frame's base so decoding runs.
  std::vector<uint8_t> target(bytes);
  for (size_t i = 0; i < target.size(); ++i) target[i] = static_cast<uint8_t>(i * 131 + h.chunk);
  const std::vector<uint8_t> before = target;
  const dcr::DigestKey key = dcr::MakeDigestKey("fuzz");
  const uint64_t first_word = h.first_element;  // any value: digests are position-keyed
  dcr::ChunkApplier applier;
  dcr::Digest after;
  auto outcome = applier.Apply(*frame, key, first_word, target, h.base_digest, &after);
  if (!outcome.ok()) {
    if (target != before) std::abort();  // failed applies must not write
    return 0;
  }
  if (after != h.target_digest) std::abort();
  // Without its payload (released) a frame never writes.
  if (h.payload_bytes > 0 && *outcome == dcr::ApplyOutcome::kApplied) {
    std::vector<uint8_t> again = before;
    dcr::Digest unused;
    if (applier.Apply(dcr::FrameView{h, {}}, key, first_word, again, h.base_digest, &unused).ok() || again != before)
      std::abort();
  }
  if (*outcome == dcr::ApplyOutcome::kApplied && dcr::DigestBytes(key, first_word * h.word_bytes, target) -
                                                         dcr::DigestBytes(key, first_word * h.word_bytes, before) !=
                                                     h.target_digest - h.base_digest)
    std::abort();
  return 0;
}
