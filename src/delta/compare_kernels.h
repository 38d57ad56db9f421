// The comparison kernels behind CompareBits, one build per instruction set.
// Internal to src/delta.
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

namespace generic {
void CompareWholeBytes(uint32_t bits, Image image, const uint8_t* a, const uint8_t* b, uint64_t n,
                       uint64_t sign_mask, uint64_t exponent_mask, uint64_t mantissa_mask, BitDiffStats* out);
}
#if defined(__x86_64__)
namespace avx2 {  // built with -mavx2; call only where the CPU has AVX2
void CompareWholeBytes(uint32_t bits, Image image, const uint8_t* a, const uint8_t* b, uint64_t n,
                       uint64_t sign_mask, uint64_t exponent_mask, uint64_t mantissa_mask, BitDiffStats* out);
}
#endif

}  // namespace dcr::kernels
