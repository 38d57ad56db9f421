// The additive digest (include/dcr/digest.h): additivity over any split and
// any order, incremental updates, certain detection of single-word changes,
// per-tensor keys, word sizes, and the hex form. The vectorised kernel is
// checked against a scalar sum built from the limb hashes alone.
#include "dcr/digest.h"

#include "testing/digest_words.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace dcr {
namespace {

using testing::ChunkDigest;
using testing::Hashes;
using testing::MulModPrime;
using testing::WordDelta;
using testing::WordTerm;

constexpr uint32_t kWordSizes[] = {1, 2, 4, 8};

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

using testing::LoadWord;
using testing::StoreWord;
using testing::WordMask;

// The sum of the words' terms, one word at a time.
Digest ScalarDigest(const DigestKey& key, uint32_t wb, uint64_t first, const std::vector<uint8_t>& bytes) {
  Digest d;
  for (size_t i = 0; i < bytes.size() / wb; ++i) d += WordTerm(key, wb, first + i, LoadWord(bytes.data() + i * wb, wb));
  return d;
}

Digest Of(const DigestKey& key, uint32_t wb, uint64_t first, const std::vector<uint8_t>& bytes, size_t from_word,
          size_t to_word) {
  return ChunkDigest(key, wb, first + from_word,
                     std::span<const uint8_t>(bytes).subspan(from_word * wb, (to_word - from_word) * wb));
}

TEST(DigestTest, KernelMatchesScalarSumOfPositionHashes) {
  std::mt19937_64 rng(1);
  const DigestKey key = MakeDigestKey("model.layers.0.mlp.up_proj.weight");
  // Starts and lengths around the 4096-word hash blocks, and an unaligned
  // buffer start.
  for (uint32_t wb : kWordSizes) {
    for (uint64_t first : {0ull, 1ull, 4095ull, 4096ull, 12345ull, (1ull << 33) + 7}) {
      for (size_t n : {0u, 1u, 3u, 31u, 4097u, 9000u}) {
        std::vector<uint8_t> storage = RandomBytes(n * wb + 1, rng);
        std::vector<uint8_t> bytes(storage.begin() + 1, storage.end());
        const Digest got = ChunkDigest(key, wb, first, std::span<const uint8_t>(storage).subspan(1, n * wb));
        EXPECT_EQ(got, ScalarDigest(key, wb, first, bytes)) << "wb " << wb << " first " << first << " n " << n;
      }
    }
  }
}

// Any byte range digests like a byte-at-a-time reference (each byte b at
// offset o adds H(o / 4) * b * 256^(o % 4) mod p), at any offset and
// length, and splits anywhere (inside limbs too) add up.
void CheckByteRanges(const DigestKey& key) {
  std::mt19937_64 rng(11);
  auto byte_term = [&](uint64_t offset, uint8_t b) {
    uint64_t h[2];
    Hashes(key, offset / 4, h);
    const uint64_t y = static_cast<uint64_t>(b) << (8 * (offset % 4));
    Digest d;
    d.lane[0] = MulModPrime(h[0], y);
    d.lane[1] = MulModPrime(h[1], y);
    return d;
  };
  for (uint64_t offset : {0ull, 1ull, 3ull, 7ull, 8ull, 4095ull * 4 + 2, 4096ull * 4 - 1, (1ull << 35) + 3}) {
    for (size_t n : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 8u, 9u, 15u, 16u, 17u, 1000u, 40000u}) {
      const auto bytes = RandomBytes(n, rng);
      Digest want;
      for (size_t i = 0; i < n; ++i) want += byte_term(offset + i, bytes[i]);
      const Digest got = DigestBytes(key, offset, bytes);
      ASSERT_EQ(got, want) << "offset " << offset << " n " << n;
      if (n < 2) continue;
      const size_t cut = 1 + rng() % (n - 1);
      const auto span = std::span<const uint8_t>(bytes);
      EXPECT_EQ(DigestBytes(key, offset, span.first(cut)) + DigestBytes(key, offset + cut, span.subspan(cut)), got)
          << "offset " << offset << " n " << n << " cut " << cut;
    }
  }
  // Word size does not enter: the same bytes digest the same as any dtype.
  const auto bytes = RandomBytes(8 * 100, rng);
  for (uint32_t wb : kWordSizes) EXPECT_EQ(ChunkDigest(key, wb, 800 / wb, bytes), DigestBytes(key, 800, bytes));
}

TEST(DigestTest, ByteRangesAddUp) { CheckByteRanges(MakeDigestKey("bytes")); }

TEST(DigestTest, LimbHashesAreNonzeroAndVary) {
  const DigestKey key = MakeDigestKey("t");
  uint64_t prev[2] = {0, 0};
  for (uint64_t i = 0; i < 10000; ++i) {
    uint64_t h[2];
    Hashes(key, i, h);
    EXPECT_GE(h[0], 1u);  // nonzero mod the prime: single-limb changes always show
    EXPECT_GE(h[1], 1u);
    EXPECT_LE(h[0], 1ull << 60);
    EXPECT_LE(h[1], 1ull << 60);
    EXPECT_NE(h[0], h[1]);
    EXPECT_FALSE(h[0] == prev[0] && h[1] == prev[1]);
    prev[0] = h[0];
    prev[1] = h[1];
  }
}

TEST(DigestTest, EmptyAndZeroBuffersDigestToZero) {
  const DigestKey key = MakeDigestKey("zeros");
  EXPECT_EQ(ChunkDigest(key, 2, 17, {}), Digest{});
  std::vector<uint8_t> zeros(8 * 5000, 0);
  for (uint32_t wb : kWordSizes) EXPECT_EQ(ChunkDigest(key, wb, 3, zeros), Digest{}) << wb;
}

TEST(DigestTest, AdditiveOverAnySplitInAnyOrder) {
  std::mt19937_64 rng(2);
  const DigestKey key = MakeDigestKey("model.embed_tokens.weight");
  for (uint32_t wb : kWordSizes) {
    const size_t n = 10007;
    const uint64_t first = 4000;  // crosses hash blocks
    const auto bytes = RandomBytes(n * wb, rng);
    const Digest whole = Of(key, wb, first, bytes, 0, n);
    EXPECT_NE(whole, Digest{});
    for (int trial = 0; trial < 50; ++trial) {
      // Random cut points (possibly empty pieces), summed in a random order.
      std::vector<size_t> cuts = {0, n};
      const int pieces = 1 + static_cast<int>(rng() % 20);
      for (int i = 0; i < pieces; ++i) cuts.push_back(rng() % (n + 1));
      std::sort(cuts.begin(), cuts.end());
      std::vector<Digest> parts;
      for (size_t i = 0; i + 1 < cuts.size(); ++i) parts.push_back(Of(key, wb, first, bytes, cuts[i], cuts[i + 1]));
      std::shuffle(parts.begin(), parts.end(), rng);
      Digest sum;
      for (const auto& p : parts) sum += p;
      EXPECT_EQ(sum, whole) << "wb " << wb << " trial " << trial;
      // Subtraction undoes addition: whole minus all but one part is that part.
      Digest rest = whole;
      for (size_t i = 1; i < parts.size(); ++i) rest -= parts[i];
      EXPECT_EQ(rest, parts[0]);
    }
  }
}

TEST(DigestTest, ShardsAddUpToTheWhole) {
  // Ranks each holding an interleaved set of slices, as a sharded receiver
  // would: their partial digests add up to the whole tensor's.
  std::mt19937_64 rng(3);
  const DigestKey key = MakeDigestKey("experts.3.down_proj.weight");
  const uint32_t wb = 2;
  const size_t n = 3 * 4096 + 123;
  const auto bytes = RandomBytes(n * wb, rng);
  const Digest whole = Of(key, wb, 0, bytes, 0, n);
  for (size_t ranks : {2u, 3u, 8u}) {
    for (size_t slice : {1u, 7u, 1000u}) {
      std::vector<Digest> rank_digest(ranks);
      for (size_t s = 0, r = 0; s < n; s += slice, r = (r + 1) % ranks)
        rank_digest[r] += Of(key, wb, 0, bytes, s, std::min(n, s + slice));
      Digest sum;
      for (const auto& d : rank_digest) sum += d;
      EXPECT_EQ(sum, whole) << ranks << " ranks, slices of " << slice;
    }
  }
}

TEST(DigestTest, IncrementalUpdateEqualsRecomputing) {
  std::mt19937_64 rng(4);
  const DigestKey key = MakeDigestKey("lm_head.weight");
  for (uint32_t wb : kWordSizes) {
    const size_t n = 9000;
    const uint64_t first = 4096 * 5 + 11;
    auto bytes = RandomBytes(n * wb, rng);
    Digest d = Of(key, wb, first, bytes, 0, n);
    for (int step = 0; step < 200; ++step) {
      const size_t i = rng() % n;
      const uint64_t old_word = LoadWord(bytes.data() + i * wb, wb);
      uint64_t new_word = rng() & WordMask(wb);
      if (step % 3 == 0) new_word = old_word ^ (1ull << (rng() % (8 * wb)));  // one bit
      if (step % 7 == 0) new_word = old_word;  // no change
      StoreWord(bytes.data() + i * wb, wb, new_word);
      d += WordDelta(key, wb, first + i, old_word, new_word);
      if (step % 20 == 0) {
        ASSERT_EQ(d, Of(key, wb, first, bytes, 0, n)) << "wb " << wb << " step " << step;
      }
    }
    EXPECT_EQ(d, Of(key, wb, first, bytes, 0, n)) << "wb " << wb;
  }
}

TEST(DigestTest, DigestDeltaOfNoChangeIsZero) {
  const DigestKey key = MakeDigestKey("x");
  for (uint32_t wb : kWordSizes) {
    EXPECT_EQ(WordDelta(key, wb, 5, 0x12, 0x12), Digest{});
    EXPECT_EQ(WordDelta(key, wb, 5, 1, 2) + WordDelta(key, wb, 5, 2, 1), Digest{});
    EXPECT_NE(WordDelta(key, wb, 5, 1, 2), Digest{});
  }
}

TEST(DigestTest, EverySingleWordChangeChangesBothLanes) {
  std::mt19937_64 rng(5);
  const DigestKey key = MakeDigestKey("model.norm.weight");
  for (uint32_t wb : kWordSizes) {
    const size_t n = 300;
    for (uint64_t first : {0ull, 4096ull - 150}) {
      const auto bytes = RandomBytes(n * wb, rng);
      const Digest d0 = Of(key, wb, first, bytes, 0, n);
      // Exhaustive over positions: every single-bit flip of every word, plus
      // the extreme changes (to 0, to all ones, top bit only).
      for (size_t i = 0; i < n; ++i) {
        const uint64_t old_word = LoadWord(bytes.data() + i * wb, wb);
        std::vector<uint64_t> news;
        for (uint32_t b = 0; b < 8 * wb; ++b) news.push_back(old_word ^ (1ull << b));
        news.push_back(0);
        news.push_back(WordMask(wb));
        news.push_back(1ull << (8 * wb - 1));
        news.push_back(old_word + 1);
        for (uint64_t nw : news) {
          nw &= WordMask(wb);
          if (nw == old_word) continue;
          auto changed = bytes;
          StoreWord(changed.data() + i * wb, wb, nw);
          const Digest d1 = Of(key, wb, first, changed, 0, n);
          ASSERT_NE(d1.lane[0], d0.lane[0]) << "wb " << wb << " word " << i << " -> " << nw;
          ASSERT_NE(d1.lane[1], d0.lane[1]) << "wb " << wb << " word " << i << " -> " << nw;
          ASSERT_EQ(d1 - d0, WordDelta(key, wb, first + i, old_word, nw));
        }
      }
      // Random bit flips of a larger buffer, anywhere.
      const size_t big = 20000;
      const auto big_bytes = RandomBytes(big * wb, rng);
      const Digest b0 = Of(key, wb, first, big_bytes, 0, big);
      for (int t = 0; t < 200; ++t) {
        auto changed = big_bytes;
        const size_t bit = rng() % (changed.size() * 8);
        changed[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
        const Digest b1 = Of(key, wb, first, changed, 0, big);
        EXPECT_NE(b1.lane[0], b0.lane[0]) << "bit " << bit;
        EXPECT_NE(b1.lane[1], b0.lane[1]) << "bit " << bit;
      }
    }
  }
}

TEST(DigestTest, SameChangeAtAnotherPositionIsDetected) {
  // A corruption that applies the right change to the wrong word (a decoder
  // or layout bug moving a sign flip, say) must change the digest like any
  // other multi-word corruption: with probability ~2^-128 of escaping. The
  // term of a change is H(i) * delta mod 2^64; for delta = 2^(bits-1) (the
  // top bit: a float's sign) that is 2^(bits-1) * (H(i) mod 2^(65-bits)),
  // which for a 64-bit term is 2^63 whatever H(i) is: every position gives
  // the same digest change.
  std::mt19937_64 rng(12);
  const DigestKey key = MakeDigestKey("model.layers.0.mlp.gate_proj.weight");
  for (uint32_t wb : kWordSizes) {
    const size_t n = 64;
    const auto bytes = RandomBytes(n * wb, rng);
    const uint64_t top = 1ull << (8 * wb - 1);
    std::vector<Digest> moved(n);
    for (size_t i = 0; i < n; ++i) {
      auto b = bytes;
      StoreWord(b.data() + i * wb, wb, LoadWord(b.data() + i * wb, wb) ^ top);
      moved[i] = Of(key, wb, 0, b, 0, n);
    }
    int collisions = 0;
    std::string first;
    for (size_t i = 0; i < n; ++i)
      for (size_t j = i + 1; j < n; ++j)
        if (moved[i] == moved[j] && collisions++ == 0)
          first = "words " + std::to_string(i) + " and " + std::to_string(j);
    EXPECT_EQ(collisions, 0) << wb
                             << "-byte words: flipping the top bit of word i or of word j gives the same digest for "
                             << collisions << " of " << n * (n - 1) / 2 << " pairs (first: " << first << ")";
  }
}

TEST(DigestTest, SwappingTwoWordsIsDetected) {
  // Not a single-word change, but the commonest layout bug (a permutation):
  // the position hashes differ, so the digest does.
  std::mt19937_64 rng(6);
  const DigestKey key = MakeDigestKey("swap");
  const auto bytes = RandomBytes(2 * 500, rng);
  const Digest d0 = Of(key, 2, 0, bytes, 0, 500);
  for (size_t i = 0; i + 1 < 500; i += 7) {
    auto s = bytes;
    std::swap(s[2 * i], s[2 * i + 2]);
    std::swap(s[2 * i + 1], s[2 * i + 3]);
    if (s == bytes) continue;
    EXPECT_NE(Of(key, 2, 0, s, 0, 500), d0) << i;
  }
}

TEST(DigestTest, DigestsDifferAcrossTensorNames) {
  std::mt19937_64 rng(7);
  const auto bytes = RandomBytes(2 * 1000, rng);
  const std::vector<std::string> names = {
      "a", "b", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight", "", "A"};
  std::vector<Digest> digests;
  for (const auto& name : names) {
    const DigestKey k = MakeDigestKey(name);
    EXPECT_NE(k.seed[0], k.seed[1]) << name;
    // Deterministic per name.
    const DigestKey again = MakeDigestKey(name);
    EXPECT_EQ(k.seed[0], again.seed[0]);
    EXPECT_EQ(k.seed[1], again.seed[1]);
    digests.push_back(ChunkDigest(k, 2, 0, bytes));
  }
  for (size_t i = 0; i < digests.size(); ++i)
    for (size_t j = i + 1; j < digests.size(); ++j) {
      EXPECT_NE(digests[i].lane[0], digests[j].lane[0]) << names[i] << " vs " << names[j];
      EXPECT_NE(digests[i].lane[1], digests[j].lane[1]) << names[i] << " vs " << names[j];
    }
}

TEST(DigestTest, DigestsDependOnPosition) {
  // The same bytes at another offset within the tensor digest differently.
  std::mt19937_64 rng(8);
  const DigestKey key = MakeDigestKey("pos");
  const auto bytes = RandomBytes(4 * 100, rng);
  EXPECT_NE(ChunkDigest(key, 4, 0, bytes), ChunkDigest(key, 4, 100, bytes));
  EXPECT_NE(ChunkDigest(key, 4, 0, bytes), ChunkDigest(key, 4, 4096, bytes));
  EXPECT_NE(ChunkDigest(key, 4, 0, bytes), ChunkDigest(key, 4, 1, bytes));
}

TEST(DigestTest, WordBytesForEveryDtype) {
  const std::pair<DType, uint32_t> expected[] = {
      {DType::kBool, 1},    {DType::kU8, 1},          {DType::kI8, 1},          {DType::kI16, 2},
      {DType::kU16, 2},     {DType::kF16, 2},         {DType::kBF16, 2},        {DType::kI32, 4},
      {DType::kU32, 4},     {DType::kF32, 4},         {DType::kF64, 8},         {DType::kI64, 8},
      {DType::kU64, 8},     {DType::kC64, 4},         {DType::kF8_E4M3, 1},     {DType::kF8_E5M2, 1},
      {DType::kF8_E8M0, 1}, {DType::kF8_E4M3FNUZ, 1}, {DType::kF8_E5M2FNUZ, 1}, {DType::kF4, 1},
      {DType::kF6_E2M3, 1}, {DType::kF6_E3M2, 1},
  };
  static_assert(std::size(expected) == kDTypeCount);
  std::vector<bool> seen(kDTypeCount, false);
  for (const auto& [dtype, wb] : expected) {
    EXPECT_EQ(WordBytes(dtype), wb) << Name(dtype);
    seen[static_cast<size_t>(dtype)] = true;
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](bool b) { return b; }));
}

TEST(DigestTest, HexRoundTrip) {
  std::mt19937_64 rng(9);
  for (int i = 0; i < 100; ++i) {
    Digest d;
    d.lane[0] = rng() % kDigestPrime;
    d.lane[1] = rng() % kDigestPrime;
    if (i == 0) d = Digest{};
    if (i == 1) d.lane[0] = d.lane[1] = kDigestPrime - 1;
    const std::string hex = d.ToHex();
    ASSERT_EQ(hex.size(), 32u);
    EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos) << hex;
    Digest back;
    ASSERT_TRUE(Digest::FromHex(hex, &back)) << hex;
    EXPECT_EQ(back, d);
  }
  Digest d;
  d.lane[0] = 0x0123456789abcdefull;
  d.lane[1] = 0x1edcba9876543210ull;
  EXPECT_EQ(d.ToHex(), "0123456789abcdef1edcba9876543210");  // lane 0 first, big-endian digits
  // Lanes are residues mod the prime: anything at or above it is refused.
  Digest out;
  EXPECT_FALSE(Digest::FromHex("1fffffffffffffff0000000000000000", &out));
  EXPECT_FALSE(Digest::FromHex("0000000000000000ffffffffffffffff", &out));
  EXPECT_TRUE(Digest::FromHex("1ffffffffffffffe0000000000000000", &out));
}

TEST(DigestTest, FromHexRejectsBadHex) {
  const std::string good = "0123456789abcdef1edcba9876543210";
  Digest sentinel;
  sentinel.lane[0] = 42;
  sentinel.lane[1] = 43;
  std::vector<std::string> bad = {
      "",
      good.substr(0, 31),
      good + "0",
      good.substr(0, 16),
      "0123456789ABCDEF1edcba9876543210",  // uppercase
      "0123456789abcdeg" + good.substr(16),
      " 123456789abcdef1edcba9876543210",
      "0x23456789abcdef1edcba9876543210",
      "-123456789abcdef1edcba9876543210",
      std::string("0123456789abcdef\0edcba9876543210", 32),
  };
  for (int i = 0; i < 32; ++i) {  // one bad character at each place
    std::string s = good;
    s[static_cast<size_t>(i)] = 'z';
    bad.push_back(s);
  }
  for (const auto& s : bad) {
    Digest out = sentinel;
    EXPECT_FALSE(Digest::FromHex(s, &out)) << "'" << s << "'";
    EXPECT_EQ(out, sentinel) << "FromHex wrote its output on failure: '" << s << "'";
  }
}

}  // namespace
}  // namespace dcr
