// The vectorised kernels of src/delta (bit comparison, digests, change
// scans, codes), one build per instruction set: kernels.inc is compiled into
// kernels_generic.cc and (x86-64) kernels_avx2.cc; Kernels() picks the best
// the CPU runs. Internal to src/delta.
#pragma once

#include <cstdint>

#include "bitstream.h"
#include "dcr/chunk_codec.h"
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
__extension__ typedef __int128 Int128;
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
static inline uint64_t LimbHash(uint64_t table_entry, uint64_t block_seed) {
  return ((table_entry ^ block_seed) >> 4) + 1;
}
// x mod (2^61 - 1) for any 128-bit x.
static inline uint64_t ModPrime(Uint128 x) {
  uint64_t lo = static_cast<uint64_t>(x & kPrime) + static_cast<uint64_t>((x >> 61) & kPrime);
  const uint64_t hi = static_cast<uint64_t>(x >> 122);  // at most 63
  lo = (lo & kPrime) + (lo >> 61) + hi;
  lo = (lo & kPrime) + (lo >> 61);
  return lo >= kPrime ? lo - kPrime : lo;
}
// x mod the prime, for any signed 128-bit x.
static inline uint64_t ModPrimeSigned(Int128 x) {
  if (x >= 0) return ModPrime(static_cast<Uint128>(x));
  const uint64_t r = ModPrime(static_cast<Uint128>(-x));
  return r == 0 ? 0 : kPrime - r;
}
// The two lanes' fixed tables of kDigestBlock random words, interleaved:
// entry 2j + lane is T_lane[j] (one cache line serves both lanes).
const uint64_t* DigestTable();

// Adds the digest terms of whole limbs [first, first + n) (4n bytes at
// `bytes`) to acc[0], acc[1] (residues mod the prime).
using DigestLimbsFn = void (*)(const uint64_t seed[2], uint64_t first, const uint8_t* bytes, uint64_t n,
                               uint64_t acc[2]);

// A changed word of a chunk: its index, and its bits before and after.
template <typename U>
using Change = WordChange<U>;

// Finds the words of `word_bytes` bytes that differ between a and b (n
// words each) and writes them, in increasing order, to `changes`, an array
// of Change<U> for U the unsigned type of that size, with room for n; returns
// how many. `positions` is scratch with room for n + 8.
using FindChangesFn = uint32_t (*)(uint32_t word_bytes, const uint8_t* a, const uint8_t* b, uint32_t n,
                                   uint32_t* positions, void* changes);

// The digest change (lanes 0 and 1, residues mod the prime) of n changes
// (`changes`: Change<U>[n] as for FindChangesFn, positions increasing) of a
// tensor with per-lane seeds `seed`: the word at first_word + position goes
// from its old to its new bits.
using DigestChangesFn = void (*)(uint32_t word_bytes, const uint64_t seed[2], uint64_t first_word, const void* changes,
                                 uint32_t n, uint64_t out[2]);

// The sparse codec's codes (chunk_encoder.cc) of add-mode changes of 16-bit
// words whose image is `image`, two changes at a time: for changes 2i and
// 2i+1 (n a multiple of 8), word i of `codes` holds their gap and value
// codes, the first change's lowest, in its low 56 bits and the number of
// those bits in its top 8; or is 0 when either change needs the general
// path (a code over 32 bits, or the pair over 56). `next` is the word after
// the change before changes[0] (0 if none); gap_k < 32, value_k <= 4.
using AddCodes16Fn = void (*)(const Change<uint16_t>* changes, uint32_t n, uint32_t next, uint32_t gap_k,
                              uint32_t value_k, Image image, uint64_t* codes);

// For n add-mode changes of 16-bit words of a chunk of `words` words at
// `target` (positions increasing, below `words`), whose new_word holds the
// frame's value: reads each old word from the target into old_word and
// sets new_word to the word the value gives (docs/format.md, mode add).
// Reads the target without prefetching: call it on changes whose lines
// were just prefetched (the sparse decoder runs it per batch).
using AddApply16Fn = void (*)(Change<uint16_t>* changes, uint32_t n, const uint8_t* target, uint32_t words,
                              Image image);

// The digest terms of 16-bit changes of one tensor (DigestChangesFn's sum),
// carried across calls: started by Digest16Start, added to by
// Digest16AddScalar (any changes, in increasing position order across
// calls) and AddPutDigest16, read by Digest16Finish.
struct Digest16Sum {
  int64_t lo[4], hi[4], sum[4];  // the vector accumulators (see kernels.inc)
  uint32_t steps;  // vector steps since lo and hi were emptied
  uint64_t seed[2], first_word;
  uint64_t block, s0, s1;  // the digest block of the last limb, its seeds
  Int128 acc0, acc1;
  int64_t scalar_sum;
};
void Digest16Start(Digest16Sum* s, const uint64_t seed[2], uint64_t first_word);
void Digest16AddScalar(Digest16Sum* s, const Change<uint16_t>* changes, uint32_t n);
void Digest16Finish(Digest16Sum* s, uint64_t out[2]);

// The add-mode 16-bit encoder's inner loop with the digest terms of the
// same changes, so that the vector digest work runs beside the bit writer's
// serial chain instead of after it. Group g < groups is changes 4g..4g+3
// with their codes codes[2g], codes[2g+1] (AddCodes16): while both codes of
// a group are nonzero, Puts them to *writer and adds the group's terms to
// *sum; returns the first group that has a zero code (neither done), or
// `groups`.
using AddPutDigest16Fn = uint32_t (*)(const uint64_t* codes, const Change<uint16_t>* changes, uint32_t groups,
                                      BitWriter* writer, Digest16Sum* sum);

struct KernelSet {
  CompareWholeBytesFn compare;
  DigestLimbsFn digest;
  FindChangesFn find_changes;
  DigestChangesFn digest_changes;
  AddCodes16Fn add_codes16;  // null where no vector version is built
  AddApply16Fn add_apply16;  // null where no vector version is built
  AddPutDigest16Fn add_put_digest16;  // null where no vector version is built
};

#define DCR_DECLARE_KERNELS                                                                                      \
  void CompareWholeBytes(uint32_t bits, Image image, const uint8_t* a, const uint8_t* b, uint64_t n,             \
                         uint64_t sign_mask, uint64_t exponent_mask, uint64_t mantissa_mask, BitDiffStats* out); \
  void DigestLimbs(const uint64_t seed[2], uint64_t first, const uint8_t* bytes, uint64_t n, uint64_t acc[2]);   \
  uint32_t FindChanges(uint32_t word_bytes, const uint8_t* a, const uint8_t* b, uint32_t n, uint32_t* positions, \
                       void* changes);                                                                           \
  void DigestChanges(uint32_t word_bytes, const uint64_t seed[2], uint64_t first_word, const void* changes,      \
                     uint32_t n, uint64_t out[2]);

namespace generic {
DCR_DECLARE_KERNELS
}
#if defined(__x86_64__)
namespace avx2 {  // built with -mavx2 -mbmi -mbmi2; call only where the CPU has them
DCR_DECLARE_KERNELS
void AddCodes16(const Change<uint16_t>* changes, uint32_t n, uint32_t next, uint32_t gap_k, uint32_t value_k,
                Image image, uint64_t* codes);
void AddApply16(Change<uint16_t>* changes, uint32_t n, const uint8_t* target, uint32_t words, Image image);
uint32_t AddPutDigest16(const uint64_t* codes, const Change<uint16_t>* changes, uint32_t groups, BitWriter* writer,
                        Digest16Sum* sum);
}  // namespace avx2
#endif
#undef DCR_DECLARE_KERNELS

// The best kernels this CPU runs: the baseline build when BaselineIsa().
const KernelSet& Kernels();

// True when the environment variable DCR_BASELINE_ISA is set (not to "0"):
// run the baseline x86-64 code paths even where the CPU has more, as a test
// of those paths does.
bool BaselineIsa();

}  // namespace dcr::kernels
