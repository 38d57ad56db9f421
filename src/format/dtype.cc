#include "dcr/dtype.h"

#include <array>

namespace dcr {
namespace {

using K = DTypeKind;
constexpr std::array<DTypeInfo, kDTypeCount> kInfos = {{
    {DType::kBool, "BOOL", 8, K::kBool, 0, 0, 0},
    {DType::kU8, "U8", 8, K::kUnsigned, 0, 0, 0},
    {DType::kI8, "I8", 8, K::kSigned, 0, 0, 0},
    {DType::kI16, "I16", 16, K::kSigned, 0, 0, 0},
    {DType::kU16, "U16", 16, K::kUnsigned, 0, 0, 0},
    {DType::kF16, "F16", 16, K::kFloat, 1, 5, 10},
    {DType::kBF16, "BF16", 16, K::kFloat, 1, 8, 7},
    {DType::kI32, "I32", 32, K::kSigned, 0, 0, 0},
    {DType::kU32, "U32", 32, K::kUnsigned, 0, 0, 0},
    {DType::kF32, "F32", 32, K::kFloat, 1, 8, 23},
    {DType::kF64, "F64", 64, K::kFloat, 1, 11, 52},
    {DType::kI64, "I64", 64, K::kSigned, 0, 0, 0},
    {DType::kU64, "U64", 64, K::kUnsigned, 0, 0, 0},
    {DType::kC64, "C64", 64, K::kComplex, 1, 8, 23},
    {DType::kF8_E4M3, "F8_E4M3", 8, K::kFloat, 1, 4, 3},
    {DType::kF8_E5M2, "F8_E5M2", 8, K::kFloat, 1, 5, 2},
    {DType::kF8_E8M0, "F8_E8M0", 8, K::kFloat, 0, 8, 0},
    {DType::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8, K::kFloat, 1, 4, 3},
    {DType::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8, K::kFloat, 1, 5, 2},
    {DType::kF4, "F4", 4, K::kFloat, 1, 2, 1},
    {DType::kF6_E2M3, "F6_E2M3", 6, K::kFloat, 1, 2, 3},
    {DType::kF6_E3M2, "F6_E3M2", 6, K::kFloat, 1, 3, 2},
}};

constexpr bool TableIsIndexedByEnum() {
  for (int i = 0; i < kDTypeCount; ++i)
    if (static_cast<int>(kInfos[i].dtype) != i) return false;
  return true;
}
static_assert(TableIsIndexedByEnum());

}  // namespace

const DTypeInfo& Info(DType dtype) { return kInfos[static_cast<size_t>(dtype)]; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kInfos)
    if (info.name == name) return info.dtype;
  return std::nullopt;
}

std::optional<uint64_t> ByteSize(DType dtype, uint64_t numel) {
  uint64_t bits;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(BitsPerElement(dtype)), &bits)) return std::nullopt;
  if (bits % 8 != 0) return std::nullopt;
  return bits / 8;
}

}  // namespace dcr
