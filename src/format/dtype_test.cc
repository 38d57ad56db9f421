#include "dcr/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace dcr {
namespace {

DType AllDTypes(int i) { return static_cast<DType>(i); }

struct Expected {
  DType dtype;
  const char* name;
  uint32_t bits;
  DTypeKind kind;
};

// The safetensors dtype names and their storage widths.
const Expected kExpected[] = {
    {DType::kBool, "BOOL", 8, DTypeKind::kBool},
    {DType::kU8, "U8", 8, DTypeKind::kUnsigned},
    {DType::kI8, "I8", 8, DTypeKind::kSigned},
    {DType::kI16, "I16", 16, DTypeKind::kSigned},
    {DType::kU16, "U16", 16, DTypeKind::kUnsigned},
    {DType::kF16, "F16", 16, DTypeKind::kFloat},
    {DType::kBF16, "BF16", 16, DTypeKind::kFloat},
    {DType::kI32, "I32", 32, DTypeKind::kSigned},
    {DType::kU32, "U32", 32, DTypeKind::kUnsigned},
    {DType::kF32, "F32", 32, DTypeKind::kFloat},
    {DType::kF64, "F64", 64, DTypeKind::kFloat},
    {DType::kI64, "I64", 64, DTypeKind::kSigned},
    {DType::kU64, "U64", 64, DTypeKind::kUnsigned},
    {DType::kC64, "C64", 64, DTypeKind::kComplex},
    {DType::kF8_E4M3, "F8_E4M3", 8, DTypeKind::kFloat},
    {DType::kF8_E5M2, "F8_E5M2", 8, DTypeKind::kFloat},
    {DType::kF8_E8M0, "F8_E8M0", 8, DTypeKind::kFloat},
    {DType::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8, DTypeKind::kFloat},
    {DType::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8, DTypeKind::kFloat},
    {DType::kF4, "F4", 4, DTypeKind::kFloat},
    {DType::kF6_E2M3, "F6_E2M3", 6, DTypeKind::kFloat},
    {DType::kF6_E3M2, "F6_E3M2", 6, DTypeKind::kFloat},
};
static_assert(std::size(kExpected) == kDTypeCount);

TEST(DTypeTest, TableMatchesSafetensorsNamesAndWidths) {
  for (const auto& e : kExpected) {
    const DTypeInfo& info = Info(e.dtype);
    EXPECT_EQ(info.dtype, e.dtype);
    EXPECT_EQ(info.name, e.name);
    EXPECT_EQ(Name(e.dtype), e.name);
    EXPECT_EQ(info.bits, e.bits) << e.name;
    EXPECT_EQ(BitsPerElement(e.dtype), e.bits) << e.name;
    EXPECT_EQ(info.kind, e.kind) << e.name;
  }
}

TEST(DTypeTest, FloatFieldWidthsFillTheElement) {
  for (int i = 0; i < kDTypeCount; ++i) {
    const DTypeInfo& info = Info(AllDTypes(i));
    if (info.kind == DTypeKind::kFloat) {
      EXPECT_EQ(info.sign_bits + info.exponent_bits + info.mantissa_bits, info.bits) << info.name;
    } else if (info.kind == DTypeKind::kComplex) {
      // Two F32 lanes.
      EXPECT_EQ(2 * (info.sign_bits + info.exponent_bits + info.mantissa_bits), info.bits) << info.name;
    } else {
      EXPECT_EQ(info.sign_bits + info.exponent_bits + info.mantissa_bits, 0) << info.name;
    }
  }
  EXPECT_EQ(Info(DType::kBF16).exponent_bits, 8);
  EXPECT_EQ(Info(DType::kBF16).mantissa_bits, 7);
  EXPECT_EQ(Info(DType::kF16).exponent_bits, 5);
  EXPECT_EQ(Info(DType::kF16).mantissa_bits, 10);
  EXPECT_EQ(Info(DType::kF32).mantissa_bits, 23);
  EXPECT_EQ(Info(DType::kF64).exponent_bits, 11);
  EXPECT_EQ(Info(DType::kF8_E4M3).exponent_bits, 4);
  EXPECT_EQ(Info(DType::kF8_E5M2).mantissa_bits, 2);
  EXPECT_EQ(Info(DType::kF8_E8M0).sign_bits, 0);
  EXPECT_EQ(Info(DType::kF8_E8M0).exponent_bits, 8);
  EXPECT_EQ(Info(DType::kF4).exponent_bits, 2);
  EXPECT_EQ(Info(DType::kF4).mantissa_bits, 1);
  EXPECT_EQ(Info(DType::kF6_E2M3).mantissa_bits, 3);
  EXPECT_EQ(Info(DType::kF6_E3M2).exponent_bits, 3);
}

TEST(DTypeTest, ParseRoundTripsEveryName) {
  std::set<std::string_view> names;
  for (int i = 0; i < kDTypeCount; ++i) {
    const DType d = AllDTypes(i);
    const auto parsed = ParseDType(Name(d));
    ASSERT_TRUE(parsed.has_value()) << Name(d);
    EXPECT_EQ(*parsed, d);
    names.insert(Name(d));
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kDTypeCount));
}

TEST(DTypeTest, ParseRejectsUnknownNames) {
  for (const char* bad : {"", "bf16", "Bf16", "F8", "F128", "C128", "BF16 ", " F32", "F4_E2M1", "BOOLEAN", "I4"})
    EXPECT_FALSE(ParseDType(bad).has_value()) << "'" << bad << "'";
  EXPECT_FALSE(ParseDType(std::string_view("F32\0", 4)).has_value());
}

TEST(DTypeTest, ByteSize) {
  EXPECT_EQ(ByteSize(DType::kBF16, 0), 0u);
  EXPECT_EQ(ByteSize(DType::kBF16, 3), 6u);
  EXPECT_EQ(ByteSize(DType::kF32, 5), 20u);
  EXPECT_EQ(ByteSize(DType::kC64, 5), 40u);
  EXPECT_EQ(ByteSize(DType::kBool, 9), 9u);
  EXPECT_EQ(ByteSize(DType::kU64, 1), 8u);
  for (int i = 0; i < kDTypeCount; ++i) {
    const DType d = AllDTypes(i);
    const uint32_t bits = BitsPerElement(d);
    for (uint64_t n : {0ull, 1ull, 2ull, 3ull, 4ull, 8ull, 1000ull, 1001ull}) {
      const auto b = ByteSize(d, n);
      if ((n * bits) % 8 == 0) {
        ASSERT_TRUE(b.has_value()) << Name(d) << " n=" << n;
        EXPECT_EQ(*b, n * bits / 8);
      } else {
        EXPECT_FALSE(b.has_value()) << Name(d) << " n=" << n;
      }
    }
  }
}

TEST(DTypeTest, ByteSizeSubByteNeedsWholeBytes) {
  EXPECT_EQ(ByteSize(DType::kF4, 2), 1u);
  EXPECT_EQ(ByteSize(DType::kF4, 4), 2u);
  EXPECT_FALSE(ByteSize(DType::kF4, 1).has_value());
  EXPECT_FALSE(ByteSize(DType::kF4, 3).has_value());
  EXPECT_EQ(ByteSize(DType::kF6_E2M3, 4), 3u);
  EXPECT_EQ(ByteSize(DType::kF6_E3M2, 8), 6u);
  for (uint64_t n : {1, 2, 3, 5, 6, 7, 9}) EXPECT_FALSE(ByteSize(DType::kF6_E2M3, n).has_value()) << n;
}

TEST(DTypeTest, ByteSizeOverflow) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_FALSE(ByteSize(DType::kF32, max).has_value());
  EXPECT_FALSE(ByteSize(DType::kU8, max / 4).has_value());  // bits = 8 * n overflows
  EXPECT_FALSE(ByteSize(DType::kU8, (max >> 3) + 1).has_value());
  // The largest count whose bit count fits.
  EXPECT_EQ(ByteSize(DType::kU8, max >> 3), max >> 3);
  EXPECT_EQ(ByteSize(DType::kF64, max >> 6), (max >> 6) * 8);
  EXPECT_FALSE(ByteSize(DType::kF64, (max >> 6) + 1).has_value());
  EXPECT_EQ(ByteSize(DType::kF4, (max >> 2) - 1), ((max >> 2) - 1) / 2);
}

// ----- OrderedImage -------------------------------------------------------

uint64_t Mask(uint32_t bits) { return bits >= 64 ? ~0ull : (1ull << bits) - 1; }

TEST(OrderedImageTest, ExhaustiveBijectionForNarrowWidths) {
  for (uint32_t bits : {4u, 6u, 8u, 16u}) {
    const uint64_t count = 1ull << bits;
    std::vector<uint8_t> seen(count, 0);
    for (uint64_t p = 0; p < count; ++p) {
      const uint64_t img = OrderedImage(p, bits);
      ASSERT_LE(img, Mask(bits)) << "bits=" << bits << " p=" << p;
      ASSERT_EQ(FromOrderedImage(img, bits), p) << "bits=" << bits << " p=" << p;
      ASSERT_EQ(seen[img], 0) << "image " << img << " hit twice, bits=" << bits;
      seen[img] = 1;
      ASSERT_EQ(OrderedImage(FromOrderedImage(p, bits), bits), p);
    }
  }
}

TEST(OrderedImageTest, RandomWideWidths) {
  std::mt19937_64 rng(7);
  for (uint32_t bits : {32u, 64u}) {
    for (int i = 0; i < 200000; ++i) {
      const uint64_t p = rng() & Mask(bits);
      const uint64_t img = OrderedImage(p, bits);
      ASSERT_LE(img, Mask(bits));
      ASSERT_EQ(FromOrderedImage(img, bits), p) << std::hex << p;
      ASSERT_EQ(OrderedImage(FromOrderedImage(p, bits), bits), p) << std::hex << p;
    }
    // Edge patterns.
    const uint64_t sign = 1ull << (bits - 1);
    for (uint64_t p : {uint64_t{0}, uint64_t{1}, sign, sign - 1, sign + 1, Mask(bits), Mask(bits) - 1})
      EXPECT_EQ(FromOrderedImage(OrderedImage(p, bits), bits), p) << std::hex << p;
  }
}

TEST(OrderedImageTest, ZerosAreAdjacentAndSignOrdersHalves) {
  for (uint32_t bits : {4u, 6u, 8u, 16u, 32u, 64u}) {
    const uint64_t sign = 1ull << (bits - 1);
    const uint64_t pos_zero = OrderedImage(0, bits), neg_zero = OrderedImage(sign, bits);
    EXPECT_EQ(pos_zero, neg_zero + 1) << bits;  // -0 sits just below +0
    // All-ones pattern (the "most negative", e.g. -NaN) maps to 0; largest positive to the top.
    EXPECT_EQ(OrderedImage(Mask(bits), bits), 0u) << bits;
    EXPECT_EQ(OrderedImage(sign - 1, bits), Mask(bits)) << bits;
  }
}

uint32_t F32Bits(float f) { return std::bit_cast<uint32_t>(f); }

// For non-NaN floats, float order (with -0 < +0) equals image order.
bool FloatLess(float a, float b) {
  if (a == 0 && b == 0) return std::signbit(a) && !std::signbit(b);
  return a < b;
}

TEST(OrderedImageTest, MatchesFloatOrderForAllBf16) {
  std::vector<std::pair<float, uint64_t>> values;  // (value, image)
  for (uint32_t p = 0; p < 0x10000; ++p) {
    const float f = std::bit_cast<float>(p << 16);
    if (std::isnan(f)) {
      // NaNs order beyond the infinities, on their sign's side.
      const uint64_t img = OrderedImage(p, 16);
      if (p & 0x8000) EXPECT_LT(img, OrderedImage(0xFF80, 16)) << std::hex << p;
      else EXPECT_GT(img, OrderedImage(0x7F80, 16)) << std::hex << p;
      continue;
    }
    values.push_back({f, OrderedImage(p, 16)});
  }
  ASSERT_EQ(values.size(), 0x10000u - 2 * 127);  // 2 * (2^7 - 1) NaN patterns
  std::sort(values.begin(), values.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  for (size_t i = 1; i < values.size(); ++i) {
    ASSERT_TRUE(FloatLess(values[i - 1].first, values[i].first))
        << values[i - 1].first << " vs " << values[i].first << " at " << i;
    // Adjacent representable values have consecutive images.
    ASSERT_EQ(values[i].second, values[i - 1].second + 1);
  }
}

TEST(OrderedImageTest, MatchesFloatOrderForRandomF32) {
  std::mt19937 rng(11);
  std::vector<uint32_t> patterns = {0x00000000u, 0x80000000u, 0x00000001u,   0x80000001u,   0x007FFFFFu,
                                    0x807FFFFFu, 0x00800000u, 0x80800000u,   0x7F7FFFFFu,   0xFF7FFFFFu,
                                    0x7F800000u, 0xFF800000u, F32Bits(1.0f), F32Bits(-1.0f)};
  for (int i = 0; i < 4000; ++i) patterns.push_back(static_cast<uint32_t>(rng()));
  std::vector<uint32_t> finite;
  for (uint32_t p : patterns)
    if (!std::isnan(std::bit_cast<float>(p))) finite.push_back(p);
  for (size_t i = 0; i < finite.size(); ++i) {
    for (size_t j = i % 7; j < finite.size(); j += 7) {
      const float a = std::bit_cast<float>(finite[i]), b = std::bit_cast<float>(finite[j]);
      const bool image_less = OrderedImage(finite[i], 32) < OrderedImage(finite[j], 32);
      ASSERT_EQ(image_less, FloatLess(a, b)) << std::hex << finite[i] << " vs " << finite[j];
    }
  }
  // Differences of images count representable steps: nextafter is one step.
  for (int i = 0; i < 2000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (!std::isfinite(f) || f == std::numeric_limits<float>::max()) continue;
    const float g = std::nextafter(f, std::numeric_limits<float>::infinity());
    uint64_t fi = OrderedImage(F32Bits(f), 32), gi = OrderedImage(F32Bits(g), 32);
    if (f == 0 && std::signbit(f)) {
      // nextafter(-0, +inf) is the smallest positive subnormal: two steps (via +0).
      EXPECT_EQ(gi - fi, 2u);
    } else {
      EXPECT_EQ(gi - fi, 1u) << f;
    }
  }
}

TEST(OrderedImageTest, MatchesDoubleOrderForRandomF64) {
  std::mt19937_64 rng(13);
  for (int i = 0; i < 50000; ++i) {
    const uint64_t pa = rng(), pb = (i % 3 == 0) ? pa ^ (1ull << (rng() % 64)) : rng();
    const double a = std::bit_cast<double>(pa), b = std::bit_cast<double>(pb);
    if (std::isnan(a) || std::isnan(b)) continue;
    const bool fl = (a == 0 && b == 0) ? (std::signbit(a) && !std::signbit(b)) : a < b;
    ASSERT_EQ(OrderedImage(pa, 64) < OrderedImage(pb, 64), fl) << std::hex << pa << " " << pb;
  }
}

}  // namespace
}  // namespace dcr
