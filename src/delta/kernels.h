// The vectorised kernels of src/delta (bit comparison, digests, change
// scans), one build per instruction set: kernels.inc is compiled into
// kernels_generic.cc and (x86-64) kernels_avx2.cc; Kernels() picks the best
// the CPU runs. Internal to src/delta.
#pragma once

#include <cstdint>

#include "dcr/compare.h"

namespace dcr::kernels {

// How an element's bits map to an ordered integer (for ULP distances).
enum class Image { kFloat, kSigned, kUnsigned };

// Compares n elements of `bits` (8, 16, 32 or 64) width stored in a and b,
// adding to *out (changed counts, fields under the masks, max distance,
// first change).
using CompareWholeBytesFn = void (*)(uint32_t bits, Image image, const uint8_t* a, const uint8_t* b, uint64_t n,
                                     uint64_t sign_mask, uint64_t exponent_mask, uint64_t mantissa_mask,
                                     BitDiffStats* out);

// The digest's position hash (include/dcr/digest.h): word i of a tensor
// with per-lane seed s has H(i) = (table[i % kDigestBlock] ^ BlockSeed(s, i / kDigestBlock)) | 1.
inline constexpr uint64_t kDigestBlock = 4096;
// `static`: every kernel build keeps its own copy (no shared inline symbol
// compiled for AVX2 reaching a generic caller).
static inline uint64_t DigestMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
static inline uint64_t BlockSeed(uint64_t seed, uint64_t block) { return DigestMix(seed ^ DigestMix(block)); }
// The two lanes' fixed tables of kDigestBlock odd-or-even random words.
const uint64_t* DigestTable(int lane);

// Adds the digest terms of words [first, first + n) (little-endian words of
// `word_bytes` at `bytes`) to acc[0], acc[1].
using DigestWordsFn = void (*)(uint32_t word_bytes, const uint64_t seed[2], uint64_t first, const uint8_t* bytes,
                               uint64_t n, uint64_t acc[2]);

// Writes the indices j < n where the words of a and b differ into
// `positions` (room for n) and returns how many there are.
using FindChangesFn = uint32_t (*)(uint32_t word_bytes, const uint8_t* a, const uint8_t* b, uint32_t n,
                                   uint32_t* positions);

struct KernelSet {
  CompareWholeBytesFn compare;
  DigestWordsFn digest;
  FindChangesFn find_changes;
};

#define DCR_DECLARE_KERNELS                                                                                     \
  void CompareWholeBytes(uint32_t bits, Image image, const uint8_t* a, const uint8_t* b, uint64_t n,            \
                         uint64_t sign_mask, uint64_t exponent_mask, uint64_t mantissa_mask, BitDiffStats* out); \
  void DigestWords(uint32_t word_bytes, const uint64_t seed[2], uint64_t first, const uint8_t* bytes, uint64_t n,  \
                   uint64_t acc[2]);                                                                             \
  uint32_t FindChanges(uint32_t word_bytes, const uint8_t* a, const uint8_t* b, uint32_t n, uint32_t* positions);

namespace generic {
DCR_DECLARE_KERNELS
}
#if defined(__x86_64__)
namespace avx2 {  // built with -mavx2; call only where the CPU has AVX2
DCR_DECLARE_KERNELS
}
#endif
#undef DCR_DECLARE_KERNELS

// The best kernels this CPU runs.
const KernelSet& Kernels();

}  // namespace dcr::kernels
