// Test helpers: the digest API (include/dcr/digest.h) in terms of words of a
// chunk (index, word size), as the codec tests think of them.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "dcr/digest.h"

namespace dcr::testing {

// Little-endian words of `wb` bytes (1, 2, 4 or 8) in a byte buffer.
inline uint64_t LoadWord(const uint8_t* p, uint32_t wb) {
  uint64_t v = 0;
  std::memcpy(&v, p, wb);
  return v;
}
inline void StoreWord(uint8_t* p, uint32_t wb, uint64_t v) { std::memcpy(p, &v, wb); }
inline uint64_t WordMask(uint32_t wb) { return wb == 8 ? ~0ull : (1ull << (8 * wb)) - 1; }

// Digest of words [first_word, first_word + bytes.size() / wb) of a tensor.
inline Digest ChunkDigest(const DigestKey& key, uint32_t wb, uint64_t first_word, std::span<const uint8_t> bytes) {
  return DigestBytes(key, first_word * wb, bytes);
}

// The pair of limb hashes for limb `index`.
inline void Hashes(const DigestKey& key, uint64_t index, uint64_t out[2]) { LimbHashes(key, index, out); }

// The digest terms of word `index` (of `wb` bytes) holding `value`: what a
// scalar reference sums.
inline Digest WordTerm(const DigestKey& key, uint32_t wb, uint64_t index, uint64_t value) {
  return dcr::WordTerm(key, index * wb, wb, value);
}

// DigestDelta for word `index` of `wb` bytes going from old_word to new_word.
inline Digest WordDelta(const DigestKey& key, uint32_t wb, uint64_t index, uint64_t old_word, uint64_t new_word) {
  return DigestDelta(key, index * wb, wb, old_word, new_word);
}

// (a * b) mod the digest prime, independently of the library's reduction.
inline uint64_t MulModPrime(uint64_t a, uint64_t b) {
  __extension__ typedef unsigned __int128 U128;
  return static_cast<uint64_t>((static_cast<U128>(a) * b) % kDigestPrime);
}

}  // namespace dcr::testing
