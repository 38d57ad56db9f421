#include "dcr/compare.h"
#include "testing/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace dcr {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();

// ----- a scalar reference -------------------------------------------------

// Element i of a densely packed little-endian bit stream, bit by bit.
uint64_t GetBits(const std::vector<uint8_t>& buf, uint64_t i, uint32_t bits) {
  uint64_t v = 0;
  for (uint32_t k = 0; k < bits; ++k) {
    const uint64_t bit = i * bits + k;
    v |= static_cast<uint64_t>((buf[bit / 8] >> (bit % 8)) & 1) << k;
  }
  return v;
}
void SetBits(std::vector<uint8_t>& buf, uint64_t i, uint32_t bits, uint64_t v) {
  for (uint32_t k = 0; k < bits; ++k) {
    const uint64_t bit = i * bits + k;
    const uint8_t m = static_cast<uint8_t>(1u << (bit % 8));
    if ((v >> k) & 1) buf[bit / 8] |= m;
    else buf[bit / 8] &= static_cast<uint8_t>(~m);
  }
}

uint64_t AbsDiff(uint64_t a, uint64_t b) { return a > b ? a - b : b - a; }

// Steps between two float patterns on the number line, where -0 sits just
// below +0 and NaNs lie beyond the infinities (their magnitudes are larger):
// same sign, the difference of magnitudes; opposite signs, the sum plus one.
uint64_t FloatSteps(uint64_t a, uint64_t b, uint32_t bits) {
  const uint64_t sign = 1ull << (bits - 1);
  const uint64_t ma = a & (sign - 1), mb = b & (sign - 1);
  if ((a & sign) == (b & sign)) return AbsDiff(ma, mb);
  return ma + mb + 1;
}
// |a - b| for two's complement `bits`-wide integers: same sign, the plain
// difference; opposite signs, |a| + |b|.
uint64_t SignedSteps(uint64_t a, uint64_t b, uint32_t bits) {
  const uint64_t sign = 1ull << (bits - 1);
  const uint64_t mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
  if ((a & sign) == (b & sign)) return AbsDiff(a, b);
  const uint64_t neg = (a & sign) ? a : b, pos = (a & sign) ? b : a;
  return pos + ((~neg + 1) & mask);
}

struct Lane {
  uint32_t bits;
  uint64_t sign, exponent, mantissa;
};

BitDiffStats ReferenceCompare(DType dtype, uint64_t n, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const DTypeInfo& info = Info(dtype);
  BitDiffStats s;
  s.elements = n;
  const bool complex = info.kind == DTypeKind::kComplex;
  const uint32_t lane_bits = complex ? 32 : info.bits;
  const uint32_t lanes = complex ? 2 : 1;
  for (uint64_t i = 0; i < n; ++i) {
    bool changed = false, sc = false, ec = false, mc = false;
    for (uint32_t l = 0; l < lanes; ++l) {
      const uint64_t va = GetBits(a, i * lanes + l, lane_bits), vb = GetBits(b, i * lanes + l, lane_bits);
      if (va == vb) continue;
      changed = true;
      uint64_t d;
      if (info.kind == DTypeKind::kFloat || complex) {
        // Fields from the top: sign, exponent, mantissa.
        const uint32_t m = info.mantissa_bits, e = info.exponent_bits;
        const uint64_t x = va ^ vb;
        mc |= (x & ((1ull << m) - 1)) != 0;
        ec |= ((x >> m) & ((1ull << e) - 1)) != 0;
        if (info.sign_bits) sc |= (x >> (lane_bits - 1)) != 0;
        d = info.sign_bits ? FloatSteps(va, vb, lane_bits) : AbsDiff(va, vb);
      } else if (info.kind == DTypeKind::kSigned) {
        d = SignedSteps(va, vb, lane_bits);
      } else {
        d = AbsDiff(va, vb);
      }
      s.max_ulp = std::max(s.max_ulp, d);
    }
    if (!changed) continue;
    if (s.first_changed == kNone) s.first_changed = i;
    ++s.changed;
    s.sign_changed += sc;
    s.exponent_changed += ec;
    s.mantissa_changed += mc;
  }
  return s;
}

// Interesting patterns for one lane of a dtype.
std::vector<uint64_t> SpecialPatterns(const DTypeInfo& info, uint32_t lane_bits) {
  const uint64_t mask = lane_bits == 64 ? ~0ull : (1ull << lane_bits) - 1;
  if (info.kind != DTypeKind::kFloat && info.kind != DTypeKind::kComplex)
    return {0, 1, mask, mask - 1, mask >> 1, (mask >> 1) + 1};
  const uint32_t m = info.mantissa_bits, e = info.exponent_bits;
  const uint64_t sign = info.sign_bits ? 1ull << (lane_bits - 1) : 0;
  const uint64_t exp_all = ((1ull << e) - 1) << m;
  const uint64_t mant_all = (1ull << m) - 1;
  std::vector<uint64_t> v = {0,
                             sign,  // +0, -0
                             exp_all,
                             exp_all | sign,  // inf (or NaN/max in some formats)
                             exp_all | 1,
                             exp_all | mant_all,  // NaN payloads
                             exp_all | sign | (mant_all >> 1),  // negative NaN
                             1,
                             sign | 1,  // smallest subnormals
                             mant_all,
                             sign | mant_all,  // largest subnormals
                             1ull << m,
                             (exp_all - (1ull << m)) | mant_all};  // min normal, max finite
  for (auto& x : v) x &= mask;
  return v;
}

// Random a, then b = a with changes planted at about `rate` of the elements
// (from index `from` on): random bit flips, and swaps between special
// patterns (+0 <-> -0, NaN payloads, infinities, subnormals).
void MakePair(DType dtype, uint64_t n, double rate, uint64_t from, uint32_t seed, std::vector<uint8_t>* a,
              std::vector<uint8_t>* b) {
  const DTypeInfo& info = Info(dtype);
  const bool complex = info.kind == DTypeKind::kComplex;
  const uint32_t lane_bits = complex ? 32 : info.bits;
  const uint32_t lanes = complex ? 2 : 1;
  std::mt19937_64 rng(seed);
  a->assign(*ByteSize(dtype, n), 0);
  for (auto& x : *a) x = static_cast<uint8_t>(rng());
  const auto special = SpecialPatterns(info, lane_bits);
  // Some elements of a start as special values too.
  for (uint64_t i = 0; i < n; ++i)
    if (rng() % 8 == 0)
      for (uint32_t l = 0; l < lanes; ++l) SetBits(*a, i * lanes + l, lane_bits, special[rng() % special.size()]);
  *b = *a;
  std::uniform_real_distribution<double> u(0, 1);
  // At least one change, at `from` exactly; random ones after it.
  if (rate > 0 && from < n) SetBits(*b, from * lanes, lane_bits, GetBits(*b, from * lanes, lane_bits) ^ 1);
  for (uint64_t i = from + 1; i < n; ++i) {
    if (u(rng) >= rate) continue;
    const uint32_t l = complex ? static_cast<uint32_t>(rng() % 2) : 0;
    const uint64_t idx = i * lanes + l;
    uint64_t v = GetBits(*b, idx, lane_bits);
    switch (rng() % 4) {
      case 0: v ^= 1ull << (rng() % lane_bits); break;  // one bit
      case 1: v = special[rng() % special.size()]; break;  // to a special value
      case 2: v ^= (rng() & ((lane_bits == 64 ? ~0ull : (1ull << lane_bits) - 1))); break;  // many bits
      case 3: v ^= 1ull << (lane_bits - 1); break;  // the top (sign) bit
    }
    SetBits(*b, idx, lane_bits, v);
  }
}

std::span<const uint8_t> S(const std::vector<uint8_t>& v) { return v; }

void ExpectStatsEq(const BitDiffStats& got, const BitDiffStats& want, const std::string& what) {
  EXPECT_EQ(got.elements, want.elements) << what;
  EXPECT_EQ(got.changed, want.changed) << what;
  EXPECT_EQ(got.sign_changed, want.sign_changed) << what;
  EXPECT_EQ(got.exponent_changed, want.exponent_changed) << what;
  EXPECT_EQ(got.mantissa_changed, want.mantissa_changed) << what;
  EXPECT_EQ(got.max_ulp, want.max_ulp) << what;
  EXPECT_EQ(got.first_changed, want.first_changed) << what;
}

// ----- CompareBits vs the reference ----------------------------------------

class CompareBitsAllDTypes : public ::testing::TestWithParam<int> {};

TEST_P(CompareBitsAllDTypes, MatchesReference) {
  const DType dtype = static_cast<DType>(GetParam());
  const uint32_t bits = BitsPerElement(dtype);
  struct Case {
    uint64_t n;
    double rate;
    uint64_t from;
  };
  // Sizes around the 4096-element block of the fast path; changes starting in
  // a later block; sparse and dense.
  const Case cases[] = {{0, 0.5, 0},       {2, 1.0, 0},      {8, 0.5, 0},          {16, 0.3, 5},    {4096, 0.01, 0},
                        {4104, 0.2, 4100}, {10000, 0.05, 0}, {10000, 0.001, 9000}, {12288, 1.0, 0}, {9000, 0.0, 0}};
  uint32_t seed = 100 + static_cast<uint32_t>(GetParam());
  for (const auto& c : cases) {
    if ((c.n * bits) % 8 != 0) continue;
    std::vector<uint8_t> a, b;
    MakePair(dtype, c.n, c.rate, c.from, seed++, &a, &b);
    const BitDiffStats want = ReferenceCompare(dtype, c.n, a, b);
    const BitDiffStats got = CompareBits(dtype, c.n, S(a), S(b));
    ExpectStatsEq(got, want,
                  std::string(Name(dtype)) + " n=" + std::to_string(c.n) + " rate=" + std::to_string(c.rate));
    if (c.rate > 0 && c.from < c.n) {
      // The case exercised something, from where it meant to.
      EXPECT_GT(want.changed, 0u);
      EXPECT_EQ(want.first_changed, c.from);
      if (c.rate * static_cast<double>(c.n - c.from) >= 50) {
        EXPECT_GT(want.changed, 10u);
      }
    } else if (c.rate == 0) {
      EXPECT_EQ(want.changed, 0u);
    }
    // Symmetric.
    ExpectStatsEq(CompareBits(dtype, c.n, S(b), S(a)), want, "swapped");
    // Identical inputs.
    const BitDiffStats same = CompareBits(dtype, c.n, S(a), S(a));
    EXPECT_EQ(same.changed, 0u);
    EXPECT_EQ(same.max_ulp, 0u);
    EXPECT_EQ(same.first_changed, kNone);
    EXPECT_EQ(same.elements, c.n);
  }
}

TEST_P(CompareBitsAllDTypes, UnalignedInputs) {
  // Tensors inside a safetensors file need not be aligned to their width.
  const DType dtype = static_cast<DType>(GetParam());
  const uint64_t n = 5000;
  std::vector<uint8_t> a, b;
  MakePair(dtype, n, 0.1, 0, 7, &a, &b);
  const BitDiffStats want = ReferenceCompare(dtype, n, a, b);
  for (size_t off : {1, 2, 3, 5, 7}) {
    std::vector<uint8_t> ba(a.size() + 16), bb(b.size() + 16);
    std::copy(a.begin(), a.end(), ba.begin() + static_cast<std::ptrdiff_t>(off));
    std::copy(b.begin(), b.end(), bb.begin() + static_cast<std::ptrdiff_t>((off * 3) % 8));
    const BitDiffStats got = CompareBits(dtype, n, std::span<const uint8_t>(ba).subspan(off, a.size()),
                                         std::span<const uint8_t>(bb).subspan((off * 3) % 8, b.size()));
    ExpectStatsEq(got, want, std::string(Name(dtype)) + " off=" + std::to_string(off));
  }
}

INSTANTIATE_TEST_SUITE_P(All, CompareBitsAllDTypes, ::testing::Range(0, kDTypeCount),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return std::string(Name(static_cast<DType>(param.param)));
                         });

// ----- hand-checked cases -------------------------------------------------

template <typename U>
std::vector<uint8_t> Bytes(std::initializer_list<U> values) {
  std::vector<uint8_t> out(values.size() * sizeof(U));
  std::memcpy(out.data(), values.begin(), out.size());
  return out;
}

TEST(CompareBitsTest, Bf16Fields) {
  // +0 -> -0: sign only, 1 ulp. 1.0 -> 2.0: exponent, 128 ulp (7-bit mantissa).
  // 1.0 -> 1.0078125: mantissa, 1 ulp. +inf -> NaN: mantissa only.
  const auto a = Bytes<uint16_t>({0x0000, 0x3F80, 0x3F80, 0x7F80, 0x1234});
  const auto b = Bytes<uint16_t>({0x8000, 0x4000, 0x3F81, 0x7FC0, 0x1234});
  const BitDiffStats s = CompareBits(DType::kBF16, 5, S(a), S(b));
  EXPECT_EQ(s.elements, 5u);
  EXPECT_EQ(s.changed, 4u);
  EXPECT_EQ(s.sign_changed, 1u);
  EXPECT_EQ(s.exponent_changed, 1u);  // 0x3F80 ^ 0x4000 = 0x7F80: exponent bits only
  EXPECT_EQ(s.mantissa_changed, 2u);
  EXPECT_EQ(s.max_ulp, 0x80u);  // 1.0 -> 2.0 is 128 steps; inf -> NaN only 0x40
  EXPECT_EQ(s.first_changed, 0u);
}

TEST(CompareBitsTest, F32UlpAcrossZero) {
  // -smallest subnormal -> +smallest subnormal: three steps (-d, -0, +0, +d).
  const auto a = Bytes<uint32_t>({0x80000001u, 0x3F800000u});
  const auto b = Bytes<uint32_t>({0x00000001u, 0x3F800000u});
  const BitDiffStats s = CompareBits(DType::kF32, 2, S(a), S(b));
  EXPECT_EQ(s.changed, 1u);
  EXPECT_EQ(s.max_ulp, 3u);
  EXPECT_EQ(s.sign_changed, 1u);
  EXPECT_EQ(s.exponent_changed, 0u);
  EXPECT_EQ(s.mantissa_changed, 0u);
}

TEST(CompareBitsTest, IntegersUseNumericDistance) {
  const auto a = Bytes<int8_t>({-128, 5, 0});
  const auto b = Bytes<int8_t>({127, 5, -1});
  const BitDiffStats s = CompareBits(DType::kI8, 3, S(a), S(b));
  EXPECT_EQ(s.changed, 2u);
  EXPECT_EQ(s.max_ulp, 255u);
  EXPECT_EQ(s.sign_changed, 0u);
  EXPECT_EQ(s.exponent_changed, 0u);
  EXPECT_EQ(s.mantissa_changed, 0u);
  EXPECT_EQ(s.first_changed, 0u);

  const auto ua = Bytes<uint64_t>({0, 10});
  const auto ub = Bytes<uint64_t>({~0ull, 10});
  EXPECT_EQ(CompareBits(DType::kU64, 2, S(ua), S(ub)).max_ulp, ~0ull);
  const auto ia = Bytes<int64_t>({std::numeric_limits<int64_t>::min()});
  const auto ib = Bytes<int64_t>({std::numeric_limits<int64_t>::max()});
  EXPECT_EQ(CompareBits(DType::kI64, 1, S(ia), S(ib)).max_ulp, ~0ull);
}

TEST(CompareBitsTest, F4Packing) {
  // Two elements per byte, element 0 in the low nibble.
  const std::vector<uint8_t> a = {0x21, 0x43, 0x00};
  const std::vector<uint8_t> b = {0x21, 0x4B, 0x80};  // element 2: 3 -> 0xB (sign flip); element 5: 0 -> 8 (-0)
  const BitDiffStats s = CompareBits(DType::kF4, 6, S(a), S(b));
  EXPECT_EQ(s.changed, 2u);
  EXPECT_EQ(s.first_changed, 2u);
  EXPECT_EQ(s.sign_changed, 2u);
  EXPECT_EQ(s.exponent_changed, 0u);
  EXPECT_EQ(s.mantissa_changed, 0u);
  EXPECT_EQ(s.max_ulp, 7u);  // 3 -> -3: images 11 and 4
}

TEST(CompareBitsTest, F6Packing) {
  // Four 6-bit elements in three bytes; change only element 1 (bits 6..11),
  // which straddles bytes 0 and 1.
  std::vector<uint8_t> a(3, 0), b(3, 0);
  SetBits(a, 1, 6, 0b000001);
  SetBits(b, 1, 6, 0b000010);
  SetBits(a, 3, 6, 0b101010);
  SetBits(b, 3, 6, 0b101010);
  const BitDiffStats s = CompareBits(DType::kF6_E2M3, 4, S(a), S(b));
  EXPECT_EQ(s.changed, 1u);
  EXPECT_EQ(s.first_changed, 1u);
  EXPECT_EQ(s.mantissa_changed, 1u);
  EXPECT_EQ(s.exponent_changed, 0u);
  EXPECT_EQ(s.max_ulp, 1u);
}

TEST(CompareBitsTest, ComplexLanes) {
  // Element 0: real lane +0 -> -0. Element 1: unchanged. Element 2: imaginary
  // lane 1.0 -> 2.0 (exponent).
  const auto a = Bytes<uint32_t>({0x00000000u, 0x3F800000u, 7u, 8u, 0x3F800000u, 0x3F800000u});
  const auto b = Bytes<uint32_t>({0x80000000u, 0x3F800000u, 7u, 8u, 0x3F800000u, 0x40000000u});
  const BitDiffStats s = CompareBits(DType::kC64, 3, S(a), S(b));
  EXPECT_EQ(s.elements, 3u);
  EXPECT_EQ(s.changed, 2u);
  EXPECT_EQ(s.sign_changed, 1u);
  EXPECT_EQ(s.exponent_changed, 1u);
  EXPECT_EQ(s.mantissa_changed, 0u);
  EXPECT_EQ(s.first_changed, 0u);
  EXPECT_EQ(s.max_ulp, 0x40000000u - 0x3F800000u);
}

// ----- Append -----------------------------------------------------------

TEST(BitDiffStatsTest, AppendOffsetsFirstChanged) {
  BitDiffStats a;
  a.elements = 100;
  BitDiffStats b;
  b.elements = 50;
  b.changed = 3;
  b.sign_changed = 1;
  b.exponent_changed = 2;
  b.mantissa_changed = 3;
  b.max_ulp = 9;
  b.first_changed = 7;
  a.Append(b);
  EXPECT_EQ(a.elements, 150u);
  EXPECT_EQ(a.changed, 3u);
  EXPECT_EQ(a.sign_changed, 1u);
  EXPECT_EQ(a.exponent_changed, 2u);
  EXPECT_EQ(a.mantissa_changed, 3u);
  EXPECT_EQ(a.max_ulp, 9u);
  EXPECT_EQ(a.first_changed, 107u);

  // An earlier change wins; max_ulp is a max, counts add.
  BitDiffStats c;
  c.elements = 10;
  c.changed = 1;
  c.max_ulp = 4;
  c.first_changed = 0;
  a.Append(c);
  EXPECT_EQ(a.first_changed, 107u);
  EXPECT_EQ(a.elements, 160u);
  EXPECT_EQ(a.changed, 4u);
  EXPECT_EQ(a.max_ulp, 9u);

  // Appending unchanged stats keeps first_changed unset.
  BitDiffStats d, e;
  d.elements = 5;
  e.elements = 6;
  d.Append(e);
  EXPECT_EQ(d.first_changed, kNone);
  EXPECT_EQ(d.elements, 11u);
  EXPECT_EQ(d, (BitDiffStats{11, 0, 0, 0, 0, 0, kNone}));
}

TEST(BitDiffStatsTest, AppendOfPiecesEqualsWhole) {
  for (DType dtype : {DType::kBF16, DType::kF32, DType::kF4, DType::kF6_E3M2, DType::kC64, DType::kI16}) {
    const uint64_t n = 9600;
    std::vector<uint8_t> a, b;
    MakePair(dtype, n, 0.002, 3000, 5, &a, &b);
    const BitDiffStats whole = CompareBits(dtype, n, S(a), S(b));
    ASSERT_GT(whole.changed, 0u);
    const uint32_t bits = BitsPerElement(dtype);
    for (uint64_t piece : {8ull, 800ull, 3000ull, 4096ull}) {
      BitDiffStats sum;
      for (uint64_t begin = 0; begin < n; begin += piece) {
        const uint64_t len = std::min(piece, n - begin);
        sum.Append(CompareBits(dtype, len, S(a).subspan(begin * bits / 8, len * bits / 8),
                               S(b).subspan(begin * bits / 8, len * bits / 8)));
      }
      ExpectStatsEq(sum, whole, std::string(Name(dtype)) + " piece=" + std::to_string(piece));
    }
  }
}

// ----- DiffCheckpoints ------------------------------------------------------

class DiffCheckpointsTest : public testing::TempDirTest {
 protected:
  static TensorInfo T(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
    return *MakeTensorInfo(name, dtype, std::move(shape));
  }
};

TEST_F(DiffCheckpointsTest, ReportsChangesAndStructuralDifferences) {
  // "big" spans several 2^20-element pieces; "packed" is sub-byte over pieces.
  const uint64_t big_n = (1ull << 21) + 1000;
  const uint64_t packed_n = (1ull << 21) + 64;
  const std::vector<TensorInfo> ta = {
      T("w", DType::kBF16, {64, 33}),      T("f", DType::kF32, {100}),   T("big", DType::kU8, {big_n}),
      T("packed", DType::kF4, {packed_n}), T("empty", DType::kF32, {0}), T("only_a", DType::kU8, {3}),
      T("shape", DType::kBF16, {2, 3}),    T("dtype", DType::kF32, {6}), T("same", DType::kI32, {50})};
  const std::vector<TensorInfo> tb = {
      T("w", DType::kBF16, {64, 33}),      T("f", DType::kF32, {100}),    T("big", DType::kU8, {big_n}),
      T("packed", DType::kF4, {packed_n}), T("empty", DType::kF32, {0}),  T("only_b", DType::kU8, {4}),
      T("shape", DType::kBF16, {3, 2}),    T("dtype", DType::kBF16, {6}), T("same", DType::kI32, {50})};
  auto ca = Checkpoint::Create(dir_ + "/a", ta);
  auto cb = Checkpoint::Create(dir_ + "/b.safetensors", tb);
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  ASSERT_TRUE(cb.ok()) << cb.status().ToString();

  // Same random content in both, then planted changes in b.
  std::mt19937_64 rng(21);
  std::map<std::string, BitDiffStats> expected;
  for (size_t i = 0; i < ca->size(); ++i) {
    const TensorInfo& t = ca->tensors()[i];
    const int64_t j = cb->Find(t.name);
    auto da = ca->MutableData(i);
    for (auto& x : da) x = static_cast<uint8_t>(rng());
    if (j < 0 || cb->tensors()[static_cast<size_t>(j)].nbytes != t.nbytes) continue;
    auto db = cb->MutableData(static_cast<size_t>(j));
    std::copy(da.begin(), da.end(), db.begin());
  }
  auto plant = [&](const std::string& name, uint64_t byte, uint8_t xor_mask) {
    auto d = cb->MutableData(static_cast<size_t>(cb->Find(name)));
    d[byte] ^= xor_mask;
  };
  plant("w", 10, 0x80);  // element 5, low byte
  plant("w", 4001, 0x80);  // element 2000: sign bit
  plant("f", 399, 0x01);  // element 99, top byte
  plant("big", (1ull << 21) + 5, 0x0F);  // in the third 2^20-element piece
  plant("big", big_n - 1, 0x01);  // the last element
  plant("packed", (1ull << 19) + 3, 0x10);  // element 2^20 + 7: high nibble of that byte
  for (const char* name_chars : {"w", "f", "big", "packed", "empty", "same"}) {
    const std::string name = name_chars;
    const TensorInfo& t = ca->tensors()[static_cast<size_t>(ca->Find(name))];
    const auto a = ca->Data(static_cast<size_t>(ca->Find(name)));
    const auto b = cb->Data(static_cast<size_t>(cb->Find(name)));
    expected[name] = ReferenceCompare(t.dtype, t.numel, std::vector<uint8_t>(a.begin(), a.end()),
                                      std::vector<uint8_t>(b.begin(), b.end()));
  }
  EXPECT_EQ(expected["w"].changed, 2u);
  EXPECT_EQ(expected["w"].first_changed, 5u);
  EXPECT_EQ(expected["big"].first_changed, (1ull << 21) + 5);
  EXPECT_EQ(expected["packed"].first_changed, (1ull << 20) + 7);
  EXPECT_EQ(expected["same"].changed, 0u);

  const CheckpointDiff diff = DiffCheckpoints(*ca, *cb);
  EXPECT_FALSE(diff.identical());
  EXPECT_EQ(diff.only_in_a, std::vector<std::string>{"only_a"});
  EXPECT_EQ(diff.only_in_b, std::vector<std::string>{"only_b"});
  EXPECT_THAT(diff.mismatched,
              ::testing::UnorderedElementsAre("dtype: F32[6] vs BF16[6]", "shape: BF16[2,3] vs BF16[3,2]"));
  std::vector<std::string> names;
  BitDiffStats total;
  for (const auto& td : diff.tensors) {
    names.push_back(td.name);
    ASSERT_TRUE(expected.count(td.name)) << td.name;
    EXPECT_EQ(td.dtype, ca->tensors()[static_cast<size_t>(ca->Find(td.name))].dtype);
    ExpectStatsEq(td.stats, expected[td.name], td.name);
    total.changed += td.stats.changed;
    total.elements += td.stats.elements;
    total.sign_changed += td.stats.sign_changed;
    total.max_ulp = std::max(total.max_ulp, td.stats.max_ulp);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"big", "empty", "f", "packed", "same", "w"}));
  EXPECT_EQ(diff.total.changed, total.changed);
  EXPECT_EQ(diff.total.elements, total.elements);
  EXPECT_EQ(diff.total.sign_changed, total.sign_changed);
  EXPECT_EQ(diff.total.max_ulp, total.max_ulp);
  EXPECT_EQ(diff.total.first_changed, kNone);
  EXPECT_EQ(diff.total.changed, 6u);

  // The reverse direction swaps only_in_a and only_in_b.
  const CheckpointDiff rev = DiffCheckpoints(*cb, *ca);
  EXPECT_EQ(rev.only_in_a, std::vector<std::string>{"only_b"});
  EXPECT_EQ(rev.only_in_b, std::vector<std::string>{"only_a"});
  EXPECT_EQ(rev.total.changed, diff.total.changed);
}

TEST_F(DiffCheckpointsTest, IdenticalCheckpoints) {
  const std::vector<TensorInfo> t = {T("x", DType::kBF16, {1000}), T("y", DType::kF6_E2M3, {8}),
                                     T("z", DType::kF32, {0})};
  auto a = Checkpoint::Create(dir_ + "/a.safetensors", t);
  auto b = Checkpoint::Create(dir_ + "/b.safetensors", t);
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t i = 0; i < a->size(); ++i) {
    auto da = a->MutableData(i);
    auto db = b->MutableData(i);
    for (size_t k = 0; k < da.size(); ++k) da[k] = db[k] = static_cast<uint8_t>(k * 7);
  }
  CheckpointDiff d = DiffCheckpoints(*a, *b);
  EXPECT_TRUE(d.identical());
  EXPECT_EQ(d.tensors.size(), 3u);
  EXPECT_EQ(d.total.elements, 1008u);
  EXPECT_EQ(d.total.changed, 0u);
  EXPECT_TRUE(DiffCheckpoints(*a, *a).identical());

  // One bit makes them differ; so does an extra tensor.
  b->MutableData(1)[2] ^= 0x40;
  d = DiffCheckpoints(*a, *b);
  EXPECT_FALSE(d.identical());
  EXPECT_EQ(d.total.changed, 1u);

  auto c = Checkpoint::Create(dir_ + "/c.safetensors", {T("x", DType::kBF16, {1000})});
  ASSERT_TRUE(c.ok());
  d = DiffCheckpoints(*c, *a);
  EXPECT_FALSE(d.identical());
  EXPECT_EQ(d.only_in_b, (std::vector<std::string>{"y", "z"}));
  EXPECT_TRUE(d.only_in_a.empty());
}

}  // namespace
}  // namespace dcr
