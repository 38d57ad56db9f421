// The vector kernels (kernels.h) against the baseline build and against
// references written from docs/format.md: identical results for every word
// size, density, chunk length (vector tails) and position in a tensor
// (digest block boundaries).
#include "kernels.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "dcr/digest.h"

namespace dcr::kernels {
namespace {

#if defined(__x86_64__)

bool HaveAvx2() { return !BaselineIsa() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2"); }

template <typename U>
std::vector<uint8_t> RandomWords(std::mt19937_64& rng, uint32_t n) {
  std::vector<uint8_t> w(size_t{n} * sizeof(U));
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  return w;
}

// b = a with about `rate` of the words changed (and runs of changes).
template <typename U>
std::vector<uint8_t> Mutate(std::mt19937_64& rng, const std::vector<uint8_t>& a, double rate) {
  std::vector<uint8_t> b = a;
  std::uniform_real_distribution<double> u(0, 1);
  const uint32_t n = static_cast<uint32_t>(a.size() / sizeof(U));
  for (uint32_t i = 0; i < n; ++i) {
    if (u(rng) >= rate) continue;
    const uint32_t run = rng() % 8 == 0 ? 1 + static_cast<uint32_t>(rng() % 40) : 1;
    for (uint32_t k = 0; k < run && i < n; ++k, ++i) {
      U w;
      std::memcpy(&w, &b[size_t{i} * sizeof(U)], sizeof(U));
      w = static_cast<U>(w ^ (1 + rng() % 0xFFFF));
      std::memcpy(&b[size_t{i} * sizeof(U)], &w, sizeof(U));
    }
  }
  return b;
}

template <typename U>
void CheckFindAndDigest(std::mt19937_64& rng) {
  const DigestKey key = MakeDigestKey("kernels");
  for (uint32_t n : {1u, 31u, 32u, 33u, 100u, 4095u, 4096u, 4097u, 20000u}) {
    for (double rate : {0.0, 0.01, 0.03, 0.3, 1.0}) {
      SCOPED_TRACE(testing::Message() << sizeof(U) << "-byte words, n " << n << ", rate " << rate);
      const auto a = RandomWords<U>(rng, n);
      const auto b = Mutate<U>(rng, a, rate);
      std::vector<uint32_t> pv(n + 8), pg(n + 8);
      std::vector<Change<U>> cv(n), cg(n);
      const uint32_t count = avx2::FindChanges(sizeof(U), a.data(), b.data(), n, pv.data(), cv.data());
      ASSERT_EQ(count, generic::FindChanges(sizeof(U), a.data(), b.data(), n, pg.data(), cg.data()));
      for (uint32_t i = 0; i < count; ++i) {
        ASSERT_EQ(cv[i].position, cg[i].position);
        ASSERT_EQ(cv[i].old_word, cg[i].old_word);
        ASSERT_EQ(cv[i].new_word, cg[i].new_word);
      }
      // The digest change, at offsets that cross 4096-limb blocks, equals
      // the difference of the two chunks' digests.
      for (uint64_t first : {uint64_t{0}, uint64_t{4090}, uint64_t{3} << 20}) {
        const uint64_t first_word = first * 4 / sizeof(U);
        uint64_t dv[2], dg[2];
        avx2::DigestChanges(sizeof(U), key.seed, first_word, cv.data(), count, dv);
        generic::DigestChanges(sizeof(U), key.seed, first_word, cg.data(), count, dg);
        const Digest want = DigestBytes(key, first_word * sizeof(U), b) - DigestBytes(key, first_word * sizeof(U), a);
        EXPECT_EQ(dv[0], want.lane[0]);
        EXPECT_EQ(dv[1], want.lane[1]);
        EXPECT_EQ(dg[0], want.lane[0]);
        EXPECT_EQ(dg[1], want.lane[1]);
      }
    }
  }
}

TEST(KernelsTest, FindChangesAndDigestChangesMatchTheBaselineBuild) {
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2 here";
  std::mt19937_64 rng(1);
  CheckFindAndDigest<uint8_t>(rng);
  CheckFindAndDigest<uint16_t>(rng);
  CheckFindAndDigest<uint32_t>(rng);
  CheckFindAndDigest<uint64_t>(rng);
}

TEST(KernelsTest, DigestLimbsMatchesTheBaselineBuild) {
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2 here";
  std::mt19937_64 rng(3);
  const DigestKey key = MakeDigestKey("digest-limbs");
  // Extreme words (all ones: the largest products) and random ones; starts
  // and lengths that cross digest blocks and leave vector tails.
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t n = trial < 20 ? static_cast<uint64_t>(trial) : rng() % (3 * kDigestBlock);
    const uint64_t first = trial % 3 == 0 ? kDigestBlock - rng() % 16 : rng() % (1ull << 40);
    std::vector<uint8_t> bytes(n * 4);
    for (auto& b : bytes) b = trial % 4 == 1 ? 0xFF : static_cast<uint8_t>(rng());
    uint64_t got[2] = {rng() % kPrime, rng() % kPrime}, want[2] = {got[0], got[1]};
    avx2::DigestLimbs(key.seed, first, bytes.data(), n, got);
    generic::DigestLimbs(key.seed, first, bytes.data(), n, want);
    ASSERT_EQ(got[0], want[0]) << "trial " << trial << ", n " << n << ", first " << first;
    ASSERT_EQ(got[1], want[1]) << "trial " << trial << ", n " << n << ", first " << first;
  }
}

// The add-mode code of one 16-bit change, from docs/format.md: Rice(gap_k)
// of the gap, a sign bit, Exp-Golomb(value_k) of |d| - 1 (no escapes:
// returns 0 bits when a code would need one). Bits LSB first.
uint32_t ReferenceCode(uint64_t gap, uint16_t old_word, uint16_t new_word, uint32_t gap_k, uint32_t value_k,
                       Image image, Uint128* code) {
  auto image_of = [&](uint16_t x) -> uint16_t {
    if (image == Image::kFloat) return static_cast<uint16_t>(x & 0x8000 ? ~x : x | 0x8000);
    if (image == Image::kSigned) return static_cast<uint16_t>(x ^ 0x8000);
    return x;
  };
  uint32_t bits = 0;
  *code = 0;
  auto put = [&](uint64_t v, uint32_t n) {
    *code |= static_cast<Uint128>(v) << bits;
    bits += n;
  };
  const uint64_t q = gap >> gap_k;
  if (q >= 32) return 0;
  put(uint64_t{1} << q, static_cast<uint32_t>(q) + 1);
  put(gap & ((uint64_t{1} << gap_k) - 1), gap_k);
  const uint16_t d = static_cast<uint16_t>(image_of(new_word) - image_of(old_word));
  const bool negative = d & 0x8000;
  const uint64_t magnitude = negative ? static_cast<uint16_t>(0 - d) : d;
  put(negative, 1);
  const uint64_t u = magnitude - 1 + (uint64_t{1} << value_k);
  uint32_t len = 0;
  while ((u >> len) != 0) ++len;
  const uint32_t zeros = len - 1 - value_k;
  if (zeros >= 32) return 0;
  put(uint64_t{1} << zeros, zeros + 1);
  put(u & ((uint64_t{1} << (len - 1)) - 1), len - 1);
  return bits;
}

TEST(KernelsTest, AddCodes16MatchesTheFormat) {
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2 here";
  std::mt19937_64 rng(2);
  for (Image image : {Image::kFloat, Image::kSigned, Image::kUnsigned}) {
    for (uint32_t gap_k : {0u, 1u, 4u, 9u, 20u, 31u}) {
      for (uint32_t value_k = 0; value_k <= 4; ++value_k) {
        SCOPED_TRACE(testing::Message() << "image " << static_cast<int>(image) << ", gap_k " << gap_k << ", value_k "
                                        << value_k);
        // Gaps and values from tiny to huge, so that every limit is met.
        std::vector<Change<uint16_t>> c;
        uint32_t pos = static_cast<uint32_t>(rng() % 100);
        for (int i = 0; i < 512; ++i) {
          const uint16_t o = static_cast<uint16_t>(rng());
          uint16_t step = static_cast<uint16_t>(rng() % 4 == 0 ? rng() : 1 + rng() % 8);
          if (rng() % 2) step = static_cast<uint16_t>(0 - step);
          if (step == 0) step = 1;
          c.push_back({pos, o, static_cast<uint16_t>(o + step)});
          const int kind = static_cast<int>(rng() % 10);
          pos += 1 + static_cast<uint32_t>(kind == 0 ? rng() % (1u << 26) : kind < 3 ? 0 : rng() % 64);
        }
        const uint32_t next = c[0].position == 0 ? 0 : static_cast<uint32_t>(rng() % c[0].position);
        std::vector<uint64_t> codes(c.size() / 2);
        avx2::AddCodes16(c.data(), static_cast<uint32_t>(c.size()), next, gap_k, value_k, image, codes.data());
        uint64_t after = next;
        size_t fast = 0;
        for (size_t i = 0; i < c.size(); i += 2) {
          Uint128 a, b;
          const uint32_t abits =
              ReferenceCode(c[i].position - after, c[i].old_word, c[i].new_word, gap_k, value_k, image, &a);
          const uint32_t bbits = ReferenceCode(c[i + 1].position - c[i].position - 1, c[i + 1].old_word,
                                               c[i + 1].new_word, gap_k, value_k, image, &b);
          after = c[i + 1].position + 1;
          const uint64_t got = codes[i / 2];
          if (got == 0) continue;  // the general path: always allowed
          ++fast;
          ASSERT_TRUE(abits != 0 && bbits != 0) << "pair " << i / 2 << " needs an escape";
          ASSERT_EQ(got >> 56, abits + bbits) << "pair " << i / 2;
          ASSERT_EQ(got & ((uint64_t{1} << 56) - 1), static_cast<uint64_t>(a | (b << abits))) << "pair " << i / 2;
        }
        if (gap_k <= 20) {  // (31-bit gap codes never pair within 56 bits)
          EXPECT_GT(fast, 0u);
        }
      }
    }
  }
}

TEST(KernelsTest, AddApply16MatchesTheFormat) {
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2 here";
  std::mt19937_64 rng(4);
  auto image_of = [](Image image, uint16_t x) -> uint16_t {
    if (image == Image::kFloat) return static_cast<uint16_t>(x & 0x8000 ? ~x : x | 0x8000);
    if (image == Image::kSigned) return static_cast<uint16_t>(x ^ 0x8000);
    return x;
  };
  for (Image image : {Image::kFloat, Image::kSigned, Image::kUnsigned}) {
    for (uint32_t words : {1u, 7u, 8u, 9u, 64u, 1000u, 4099u}) {
      for (double rate : {0.05, 0.5, 1.0}) {
        SCOPED_TRACE(testing::Message() << "image " << static_cast<int>(image) << ", words " << words << ", rate "
                                        << rate);
        const auto target = RandomWords<uint16_t>(rng, words);
        std::vector<Change<uint16_t>> c, want;
        for (uint32_t p = 0; p < words; ++p) {
          // Always the chunk's last word when it is reached: the gather
          // must not read past it.
          if (p + 1 != words && static_cast<double>(rng() % 1000) >= rate * 1000) continue;
          uint16_t old;
          std::memcpy(&old, &target[size_t{p} * 2], 2);
          const uint16_t v = static_cast<uint16_t>(rng() % 3 == 0 ? rng() : 1 + rng() % 4);
          const uint16_t y = static_cast<uint16_t>(image_of(image, old) + v);
          // The word whose image is y.
          const uint16_t nw = image == Image::kFloat    ? static_cast<uint16_t>(y & 0x8000 ? y ^ 0x8000 : ~y)
                              : image == Image::kSigned ? static_cast<uint16_t>(y ^ 0x8000)
                                                        : y;
          ASSERT_EQ(image_of(image, nw), y);
          c.push_back({p, 0xDEAD, v});
          want.push_back({p, old, nw});
        }
        avx2::AddApply16(c.data(), static_cast<uint32_t>(c.size()), target.data(), words, image);
        for (size_t i = 0; i < c.size(); ++i) {
          ASSERT_EQ(c[i].position, want[i].position) << i;
          ASSERT_EQ(c[i].old_word, want[i].old_word) << i;
          ASSERT_EQ(c[i].new_word, want[i].new_word) << i;
        }
      }
    }
  }
}

TEST(KernelsTest, DigestChanges16OfManyLargeChangesMatchesTheBaselineBuild) {
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2 here";
  // Every word of a long chunk changed by the largest steps: the vector
  // sums run longest between reductions with the largest products.
  std::mt19937_64 rng(5);
  const DigestKey key = MakeDigestKey("many-changes");
  const uint32_t n = 300000;
  std::vector<Change<uint16_t>> c(n);
  for (uint32_t i = 0; i < n; ++i) {
    const bool up = rng() % 2;
    c[i] = {i, static_cast<uint16_t>(up ? 0 : 0xFFFF), static_cast<uint16_t>(up ? 0xFFFF : 0)};
  }
  for (uint64_t first_word : {uint64_t{0}, uint64_t{1} << 21}) {
    uint64_t dv[2], dg[2];
    avx2::DigestChanges(2, key.seed, first_word, c.data(), n, dv);
    generic::DigestChanges(2, key.seed, first_word, c.data(), n, dg);
    EXPECT_EQ(dv[0], dg[0]);
    EXPECT_EQ(dv[1], dg[1]);
  }
}

TEST(KernelsTest, AddPutDigest16WritesTheCodesAndSumsTheDigestAcrossCalls) {
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2 here";
  // Changes whose gaps cross digest blocks at any place in a group, codes
  // with zeros (the caller's general path) at random groups; the kernel and
  // the caller's loop (as chunk_encoder.cc runs it) against the scalar sum and
  // plain Puts.
  std::mt19937_64 rng(11);
  const DigestKey key = MakeDigestKey("fused");
  for (uint32_t density : {2u, 40u, 9000u}) {
    const uint32_t groups = 3000;
    std::vector<Change<uint16_t>> c(4 * groups);
    uint32_t p = 0;
    for (auto& ch : c) {
      p += 1 + static_cast<uint32_t>(rng() % density);
      ch = {p, static_cast<uint16_t>(rng()), static_cast<uint16_t>(rng())};
    }
    std::vector<uint64_t> codes(2 * groups);
    for (auto& code : codes) {
      const uint32_t bits = 1 + static_cast<uint32_t>(rng() % 56);
      code = rng() % 7 == 0 ? 0 : (uint64_t{bits} << 56) | (rng() & ((1ull << bits) - 1));
    }
    std::vector<uint8_t> want_bytes(groups * 16 * 8 + 64), got_bytes(want_bytes.size());
    BitWriter want(want_bytes.data()), got(got_bytes.data());
    for (uint64_t code : codes)
      if (code != 0) want.Put(code & ((1ull << 56) - 1), static_cast<uint32_t>(code >> 56));
    for (uint64_t first_word : {uint64_t{0}, uint64_t{3} << 20}) {
      Digest16Sum sum;
      Digest16Start(&sum, key.seed, first_word);
      got = BitWriter(got_bytes.data());
      for (uint32_t g = 0; g < groups; ++g) {
        g += avx2::AddPutDigest16(codes.data() + 2 * g, c.data() + 4 * g, groups - g, &got, &sum);
        if (g == groups) break;
        for (uint32_t k = 2 * g; k < 2 * g + 2; ++k)
          if (codes[k] != 0) got.Put(codes[k] & ((1ull << 56) - 1), static_cast<uint32_t>(codes[k] >> 56));
        Digest16AddScalar(&sum, c.data() + 4 * g, 4);
      }
      uint64_t dv[2], dg[2];
      Digest16Finish(&sum, dv);
      generic::DigestChanges(2, key.seed, first_word, c.data(), 4 * groups, dg);
      EXPECT_EQ(dv[0], dg[0]) << density;
      EXPECT_EQ(dv[1], dg[1]) << density;
      ASSERT_EQ(got.Bits(), want.Bits());
      const size_t bytes = got.Finish();
      EXPECT_EQ(0, std::memcmp(got_bytes.data(), want_bytes.data(), bytes));
    }
    want.Finish();
  }
}

#endif  // __x86_64__

}  // namespace
}  // namespace dcr::kernels
