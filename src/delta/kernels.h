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

// The digest's limb hash (include/dcr/digest.h): limb m of a tensor with
// per-lane seed s has H(m) = LimbHash(table[m % kDigestBlock], BlockSeed(s, m / kDigestBlock)).
inline constexpr uint64_t kDigestBlock = 4096;
inline constexpr uint64_t kPrime = (1ull << 61) - 1;
__extension__ typedef unsigned __int128 Uint128;  // GCC and clang; __extension__ keeps -Wpedantic quiet
// `static`: every kernel build keeps its own copy (no shared inline symbol
// compiled for AVX2 reaching a generic caller).
static inline uint64_t DigestMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
static inline uint64_t BlockSeed(uint64_t seed, uint64_t block) { return DigestMix(seed ^ DigestMix(block)); }
// In [1, 2^60]: never 0 mod the prime.
static inline uint64_t LimbHash(uint64_t table_entry, uint64_t block_seed) { return ((table_entry ^ block_seed) >> 4) + 1; }
// x mod (2^61 - 1) for any 128-bit x.
static inline uint64_t ModPrime(Uint128 x) {
  uint64_t lo = static_cast<uint64_t>(x & kPrime) + static_cast<uint64_t>((x >> 61) & kPrime);
  const uint64_t hi = static_cast<uint64_t>(x >> 122);  // at most 63
  lo = (lo & kPrime) + (lo >> 61) + hi;
  lo = (lo & kPrime) + (lo >> 61);
  return lo >= kPrime ? lo - kPrime : lo;
}
// The two lanes' fixed tables of kDigestBlock odd-or-even random words.
const uint64_t* DigestTable(int lane);

// Adds the digest terms of whole limbs [first, first + n) (4n bytes at
// `bytes`) to acc[0], acc[1] (residues mod the prime).
using DigestLimbsFn = void (*)(const uint64_t seed[2], uint64_t first, const uint8_t* bytes, uint64_t n,
                               uint64_t acc[2]);

// Writes the indices j < n where the words of a and b differ into
// `positions`, and those words of a and b into `olds` and `news` (each with
// room for n), and returns how many there are.
using FindChangesFn = uint32_t (*)(uint32_t word_bytes, const uint8_t* a, const uint8_t* b, uint32_t n,
                                   uint32_t* positions, uint64_t* olds, uint64_t* news);

struct KernelSet {
  CompareWholeBytesFn compare;
  DigestLimbsFn digest;
  FindChangesFn find_changes;
};

#define DCR_DECLARE_KERNELS                                                                                     \
  void CompareWholeBytes(uint32_t bits, Image image, const uint8_t* a, const uint8_t* b, uint64_t n,            \
                         uint64_t sign_mask, uint64_t exponent_mask, uint64_t mantissa_mask, BitDiffStats* out); \
  void DigestLimbs(const uint64_t seed[2], uint64_t first, const uint8_t* bytes, uint64_t n, uint64_t acc[2]);     \
  uint32_t FindChanges(uint32_t word_bytes, const uint8_t* a, const uint8_t* b, uint32_t n, uint32_t* positions, \
                       uint64_t* olds, uint64_t* news);

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
