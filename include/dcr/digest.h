// The additive digest (DESIGN section 4): for a tensor's words x_i,
//   D = ( sum_i H0(t, i) * x_i  mod 2^64,  sum_i H1(t, i) * x_i  mod 2^64 )
// with H_k(t, i) odd and pseudo-random per (tensor name, word index).
// Properties the protocol relies on:
//   - additive: the digest of a region is the sum of its parts' digests, so
//     shards and chunks add up to the whole, in any order;
//   - incremental: changing word i from a to b adds H_k(t, i) * (b - a), so a
//     digest is updated from the changed words alone;
//   - every single-word change is detected with certainty (H is odd, hence
//     invertible mod 2^64); other corruptions escape with probability ~2^-128.
// A *word* is the unit dcr diffs and applies (see WordBytes): an element for
// 1-, 2-, 4- and 8-byte dtypes, a 4-byte lane of C64, a byte of packed F4/F6.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dcr/dtype.h"

namespace dcr {

struct Digest {
  uint64_t lane[2] = {0, 0};

  Digest& operator+=(const Digest& o) {
    lane[0] += o.lane[0];
    lane[1] += o.lane[1];
    return *this;
  }
  Digest& operator-=(const Digest& o) {
    lane[0] -= o.lane[0];
    lane[1] -= o.lane[1];
    return *this;
  }
  friend Digest operator+(Digest a, const Digest& b) { return a += b; }
  friend Digest operator-(Digest a, const Digest& b) { return a -= b; }
  friend bool operator==(const Digest&, const Digest&) = default;

  std::string ToHex() const;  // 32 hex digits, lane 0 first
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

// H_k(key, i) for one word index; what the incremental update multiplies by.
void PositionHashes(const DigestKey& key, uint64_t index, uint64_t out[2]);

// Digest of words [first_word, first_word + n) of a tensor, whose bytes are
// `bytes` (n * word_bytes long, little-endian words). Vectorised.
Digest DigestWords(const DigestKey& key, uint32_t word_bytes, uint64_t first_word, std::span<const uint8_t> bytes);

// The change in digest when word `index` goes from `old_word` to `new_word`.
inline Digest DigestDelta(const DigestKey& key, uint64_t index, uint64_t old_word, uint64_t new_word) {
  uint64_t h[2];
  PositionHashes(key, index, h);
  Digest d;
  d.lane[0] = h[0] * (new_word - old_word);
  d.lane[1] = h[1] * (new_word - old_word);
  return d;
}

}  // namespace dcr
