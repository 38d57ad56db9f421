#include "dcr/hash.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

// The reference implementation, compiled into this test (no library to link).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace dcr {
namespace {

// Bit-at-a-time CRC32C straight from the definition (reflected polynomial
// 0x82F63B78, init and final xor 0xFFFFFFFF), independent of the tables.
uint32_t Crc32cReference(const uint8_t* p, size_t n, uint32_t crc = 0) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(Crc32cTest, CheckValue) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xE3069283u);
}

TEST(Crc32cTest, EmptyInput) {
  EXPECT_EQ(Crc32c("", 0, 0), 0u);
  EXPECT_EQ(Crc32cPortable(nullptr, 0), 0u);
  // Extending by nothing keeps the value.
  EXPECT_EQ(Crc32c(nullptr, 0, 0xDEADBEEFu), 0xDEADBEEFu);
  EXPECT_EQ(Crc32cPortable(nullptr, 0, 0xDEADBEEFu), 0xDEADBEEFu);
}

// RFC 3720 (iSCSI), appendix B.4.
TEST(Crc32cTest, Rfc3720Vectors) {
  std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xFF), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
    down[static_cast<size_t>(i)] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(up.data(), up.size()), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(down.data(), down.size()), 0x113FDB5Cu);
  EXPECT_EQ(Crc32cPortable(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32cPortable(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(Crc32cPortable(up.data(), up.size()), 0x46DD794Eu);
  EXPECT_EQ(Crc32cPortable(down.data(), down.size()), 0x113FDB5Cu);

  // The iSCSI SCSI Read (10) command PDU from the same appendix.
  const uint8_t pdu[48] = {0x01, 0xC0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                           0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
                           0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
                           0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  EXPECT_EQ(Crc32c(pdu, sizeof(pdu)), 0xD9963A56u);
  EXPECT_EQ(Crc32cPortable(pdu, sizeof(pdu)), 0xD9963A56u);
}

TEST(Crc32cTest, PortableMatchesBitwiseReference) {
  const auto data = RandomBytes(4096 + 77, 1);
  for (size_t n : {0, 1, 2, 3, 7, 8, 9, 15, 16, 31, 32, 33, 63, 64, 65, 255, 1000, 4096 + 77}) {
    for (size_t off : {0, 1, 3, 5}) {
      if (off + n > data.size()) continue;
      EXPECT_EQ(Crc32cPortable(data.data() + off, n), Crc32cReference(data.data() + off, n))
          << "n=" << n << " off=" << off;
    }
  }
}

TEST(Crc32cTest, DispatchedMatchesPortableOnManyLengthsAndAlignments) {
  const auto data = RandomBytes(1 << 14, 2);
  std::mt19937 rng(3);
  for (size_t n = 0; n <= 300; ++n) {
    for (size_t off = 0; off < 16; ++off) {
      const uint8_t* p = data.data() + off;
      ASSERT_EQ(Crc32c(p, n), Crc32cPortable(p, n)) << "n=" << n << " off=" << off;
    }
  }
  for (int trial = 0; trial < 200; ++trial) {
    const size_t off = rng() % 64;
    const size_t n = rng() % (data.size() - off);
    const uint32_t seed_crc = static_cast<uint32_t>(rng());
    ASSERT_EQ(Crc32c(data.data() + off, n, seed_crc), Crc32cPortable(data.data() + off, n, seed_crc))
        << "n=" << n << " off=" << off;
  }
}

TEST(Crc32cTest, IncrementalExtension) {
  const auto data = RandomBytes(3000, 4);
  const uint32_t whole = Crc32c(data.data(), data.size());
  EXPECT_EQ(whole, Crc32cReference(data.data(), data.size()));
  for (size_t split : {0, 1, 7, 8, 9, 31, 32, 33, 1000, 2999, 3000}) {
    const uint32_t a = Crc32c(data.data(), split);
    EXPECT_EQ(Crc32c(data.data() + split, data.size() - split, a), whole) << split;
    const uint32_t pa = Crc32cPortable(data.data(), split);
    EXPECT_EQ(Crc32cPortable(data.data() + split, data.size() - split, pa), whole) << split;
  }
  // Many small pieces.
  uint32_t c = 0;
  for (size_t pos = 0, step = 1; pos < data.size(); pos += step, step = step % 13 + 1)
    c = Crc32c(data.data() + pos, std::min(step, data.size() - pos), c);
  EXPECT_EQ(c, whole);
  // String overload.
  EXPECT_EQ(Crc32c("56789", 5, Crc32c("1234", 4)), 0xE3069283u);
}

TEST(Crc32cTest, DetectsSingleBitFlips) {
  auto data = RandomBytes(257, 5);
  const uint32_t base = Crc32c(data.data(), data.size());
  for (size_t byte = 0; byte < data.size(); byte += 17) {
    for (int bit = 0; bit < 8; ++bit) {
      data[byte] ^= static_cast<uint8_t>(1u << bit);
      EXPECT_NE(Crc32c(data.data(), data.size()), base);
      data[byte] ^= static_cast<uint8_t>(1u << bit);
    }
  }
  EXPECT_EQ(Crc32c(data.data(), data.size()), base);
}

TEST(Xxh3Test, EmptyInputKnownValue) {
  EXPECT_EQ(Xxh3_64(nullptr, 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(Xxh3_64("", 0, 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(XXH3_64bits(nullptr, 0), 0x2D06800538D394C2ull);
}

TEST(Xxh3Test, MatchesLibraryAcrossLengthClassesAndSeeds) {
  // XXH3 has separate code paths for 0, 1-3, 4-8, 9-16, 17-128, 129-240 and
  // longer inputs (with a stripe/block loop); cover each boundary.
  const auto data = RandomBytes(5000, 6);
  for (size_t n : {0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 4999}) {
    for (uint64_t seed : {0ull, 1ull, 0x9E3779B97F4A7C15ull}) {
      const uint64_t expected = seed == 0 ? XXH3_64bits(data.data(), n) : XXH3_64bits_withSeed(data.data(), n, seed);
      EXPECT_EQ(Xxh3_64(data.data(), n, seed), expected) << "n=" << n << " seed=" << seed;
    }
    // Unaligned input hashes the same bytes the same way.
    std::vector<uint8_t> shifted(n + 3);
    std::copy(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(n), shifted.begin() + 3);
    EXPECT_EQ(Xxh3_64(shifted.data() + 3, n), Xxh3_64(data.data(), n)) << n;
  }
}

TEST(Xxh3Test, SeedAndContentMatter) {
  EXPECT_NE(Xxh3_64("abc", 3), Xxh3_64("abd", 3));
  EXPECT_NE(Xxh3_64("abc", 3, 0), Xxh3_64("abc", 3, 1));
  EXPECT_EQ(Xxh3_64("abc", 3, 5), Xxh3_64("abc", 3, 5));
  EXPECT_EQ(Xxh3_64("abc", 3, 5), XXH3_64bits_withSeed("abc", 3, 5));
  EXPECT_NE(Xxh3_64("\0", 1), Xxh3_64("", 0));
}

}  // namespace
}  // namespace dcr
