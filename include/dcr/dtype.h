// Element types of safetensors checkpoints and how their stored bits are laid
// out. dcr never does float arithmetic on weights: it compares, XORs and
// orders the stored bit patterns, so every dtype here is supported whatever
// its numeric meaning.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace dcr {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
  kC64,
  kF8_E4M3,
  kF8_E5M2,
  kF8_E8M0,
  kF8_E4M3FNUZ,
  kF8_E5M2FNUZ,
  kF4,
  kF6_E2M3,
  kF6_E3M2,
};
inline constexpr int kDTypeCount = 22;

enum class DTypeKind : uint8_t { kBool, kUnsigned, kSigned, kFloat, kComplex };

// Bit layout of one element. Sub-byte types (F4, F6_*) are packed densely,
// element i occupying bits [i*bits, (i+1)*bits) of the little-endian bit
// stream of the tensor's bytes. C64 is two F32 lanes (real, imaginary).
struct DTypeInfo {
  DType dtype;
  std::string_view name;  // as in safetensors headers, e.g. "BF16"
  uint8_t bits;  // storage bits per element: 1..64
  DTypeKind kind;
  // For floats: field widths. sign_bits is 0 for unsigned formats (E8M0).
  uint8_t sign_bits, exponent_bits, mantissa_bits;
};

const DTypeInfo& Info(DType dtype);
inline std::string_view Name(DType dtype) { return Info(dtype).name; }
inline uint32_t BitsPerElement(DType dtype) { return Info(dtype).bits; }
// Parses a safetensors dtype name; nullopt if unknown.
std::optional<DType> ParseDType(std::string_view name);

// Bytes occupied by `numel` elements, or nullopt when numel * bits overflows
// 64 bits or is not a whole number of bytes (sub-byte types).
std::optional<uint64_t> ByteSize(DType dtype, uint64_t numel);

// Order-preserving image of a float's bit pattern (width `bits`, sign in the
// top bit): integer order of images follows the float order, -0 sits just
// below +0, and NaNs sort beyond the infinities. A bijection on `bits`-wide
// patterns, so differences of images are exact for every pattern.
// Branch-free (signs of real data are random): negative patterns flip every
// bit, others only the sign bit.
inline uint64_t OrderedImage(uint64_t pattern, uint32_t bits) {
  const uint64_t mask = bits >= 64 ? ~0ull : (1ull << bits) - 1;
  const uint64_t sign = 1ull << (bits - 1);
  const uint64_t negative = 0 - ((pattern >> (bits - 1)) & 1);
  return pattern ^ ((negative & mask) | sign);
}
inline uint64_t FromOrderedImage(uint64_t image, uint32_t bits) {
  const uint64_t mask = bits >= 64 ? ~0ull : (1ull << bits) - 1;
  const uint64_t sign = 1ull << (bits - 1);
  const uint64_t was_negative = ((image >> (bits - 1)) & 1) - 1;  // all ones when the image's top bit is 0
  return image ^ ((was_negative & mask) | sign);
}

// Rounds an FP32 value's bits to BF16 bits, round-to-nearest-even; NaNs stay
// NaN (quietened).
inline uint16_t Fp32BitsToBf16Bits(uint32_t f) {
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((f >> 16) | 0x40);
  const uint32_t rounding = ((f >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((f + rounding) >> 16);
}

}  // namespace dcr
