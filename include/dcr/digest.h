// The additive digest (DESIGN section 4). A tensor's bytes are read as
// 4-byte little-endian limbs Y_m (a partial last limb is zero-extended), and
//   D_k = sum_m H_k(t, m) * Y_m  mod p,   p = 2^61 - 1 (prime),  k = 0, 1
// with H_k(t, m) in [1, 2^60], pseudo-random per (tensor name, limb index).
// Properties the protocol relies on:
//   - additive and linear in the bytes (Y_m = sum_j b_{4m+j} 256^j), so the
//     digests of any partition of a tensor's bytes (chunks, shards, even a
//     split limb) add up to the whole, in any order;
//   - incremental: changing a limb from a to b adds H_k * (b - a) mod p, so a
//     digest is updated from the changed words alone;
//   - a change inside one limb (any change to a word of at most 4 bytes) is
//     detected with certainty: 0 < |b - a| < 2^32 < p and H != 0, so the
//     product is nonzero mod the prime. Any other difference escapes with
//     probability about 2^-61 per lane (2^-122 for both), whatever the bits
//     involved: unlike a sum mod 2^64, no bit position is weaker than another.
// A *word* is the unit dcr diffs and applies (see WordBytes): an element for
// 1-, 2-, 4- and 8-byte dtypes, a 4-byte lane of C64, a byte of packed F4/F6.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dcr/dtype.h"

namespace dcr {

inline constexpr uint64_t kDigestPrime = (1ull << 61) - 1;

// Two residues mod kDigestPrime; arithmetic is mod the prime.
struct Digest {
  uint64_t lane[2] = {0, 0};  // each < kDigestPrime

  Digest& operator+=(const Digest& o) {
    for (int k = 0; k < 2; ++k) {
      lane[k] += o.lane[k];
      if (lane[k] >= kDigestPrime) lane[k] -= kDigestPrime;
    }
    return *this;
  }
  Digest& operator-=(const Digest& o) {
    for (int k = 0; k < 2; ++k)
      lane[k] = lane[k] >= o.lane[k] ? lane[k] - o.lane[k] : lane[k] + kDigestPrime - o.lane[k];
    return *this;
  }
  friend Digest operator+(Digest a, const Digest& b) { return a += b; }
  friend Digest operator-(Digest a, const Digest& b) { return a -= b; }
  friend bool operator==(const Digest&, const Digest&) = default;

  std::string ToHex() const;  // 32 hex digits, lane 0 first
  // False unless 32 lowercase hex digits whose lanes are below the prime.
  static bool FromHex(std::string_view hex, Digest* out);
};

// Bytes per word for `dtype`: 1, 2, 4 or 8.
uint32_t WordBytes(DType dtype);

// Per-tensor key of the position hash, derived from the tensor's name (so
// digests do not depend on tensor order or count).
struct DigestKey {
  uint64_t seed[2];
};
DigestKey MakeDigestKey(std::string_view tensor_name);

// H_k(key, m) for one limb index; what the incremental update multiplies by.
void LimbHashes(const DigestKey& key, uint64_t limb, uint64_t out[2]);

// Digest of bytes [offset, offset + bytes.size()) of a tensor. Any offset.
Digest DigestBytes(const DigestKey& key, uint64_t offset, std::span<const uint8_t> bytes);

// The digest terms of a word of `word_bytes` (1, 2, 4 or 8) at byte `offset`
// of a tensor (a multiple of the word size) holding `word`.
Digest WordTerm(const DigestKey& key, uint64_t offset, uint32_t word_bytes, uint64_t word);

// The change in digest when that word goes from `old_word` to `new_word`.
inline Digest DigestDelta(const DigestKey& key, uint64_t offset, uint32_t word_bytes, uint64_t old_word,
                          uint64_t new_word) {
  return WordTerm(key, offset, word_bytes, new_word) - WordTerm(key, offset, word_bytes, old_word);
}

}  // namespace dcr
