// Fuzzes frame parsing and applying: any input must be rejected, or parse
// into a frame whose apply either fails leaving the target untouched, or
// succeeds with the digest the frame promises; its header parses alone to
// the same, and without its payload it never applies. Never a crash, never
// a read or write outside the chunk.
//
// Input: [flags][u32 LE words][frame]. `words`: the target chunk's size in
// the frame's words (what a receiver knows from its tensor table), at most
// 2^20. The checksum would stop almost every mutation at the door, so when
// the flags byte is odd the target re-seals the frame (recomputes its
// CRC32C) and the decoder itself gets fuzzed; even inputs fuzz the checks
// as they are.
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
  if (size < 5) return 0;
  const bool reseal = data[0] & 1;
  uint32_t words;
  std::memcpy(&words, data + 1, 4);
  words %= (1u << 20) + 1;
  std::vector<uint8_t> input(data + 5, data + size);
  if (reseal) {
    if (auto h = dcr::ParseFrameHeader(input); h.ok()) {
      const size_t crc_at = h->header_bytes - 4;
      const size_t payload = std::min<size_t>(h->payload_bytes, input.size() - h->header_bytes);
      uint32_t crc = dcr::Crc32c(input.data(), crc_at);
      crc = dcr::Crc32c(input.data() + h->header_bytes, payload, crc);
      std::memcpy(input.data() + crc_at, &crc, 4);
    }
  }
  auto frame = dcr::ParseFrame(input);
  auto header = dcr::ParseFrameHeader(input);  // what a receiver keeps of an applied frame
  if (frame.ok() && (!header.ok() || !(*header == frame->header))) std::abort();
  if (!frame.ok()) return 0;
  const auto& h = frame->header;
  const uint64_t wb = dcr::WordBytes(h.dtype);
  // A deterministic target chunk derived from the frame, with the digest the
  // receiver would track.
  std::vector<uint8_t> target(uint64_t{words} * wb);
  for (size_t i = 0; i < target.size(); ++i) target[i] = static_cast<uint8_t>(i * 131 + h.chunk);
  const std::vector<uint8_t> before = target;
  const dcr::DigestKey key = dcr::MakeDigestKey("fuzz");
  const uint64_t first_word = uint64_t{h.chunk} * words;  // any value: digests are position-keyed
  const dcr::Digest current = dcr::DigestBytes(key, first_word * wb, before);
  dcr::ChunkApplier applier;
  dcr::Digest after;
  auto outcome = applier.Apply(*frame, key, first_word, target, current, &after);
  if (!outcome.ok()) {
    if (target != before) std::abort();  // failed applies must not write
    return 0;
  }
  if (after != h.target_digest || dcr::DigestBytes(key, first_word * wb, target) != after) std::abort();
  // Without its payload (released) a frame never writes.
  if (*outcome == dcr::ApplyOutcome::kApplied) {
    std::vector<uint8_t> again = before;
    dcr::Digest unused;
    if (applier.Apply(dcr::FrameView{h, {}}, key, first_word, again, current, &unused).ok() || again != before)
      std::abort();
  }
  return 0;
}
