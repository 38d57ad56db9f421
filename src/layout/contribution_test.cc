// Contribution objects: records survive the round trip bit for bit (and
// merge into the same frames), and hostile objects are refused with errors
// that say what is wrong, without allocating what their counts claim.
#include "dcr/contribution.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>

#include "dcr/hash.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = 16;

// "a" [12, 10] F32 split by columns over 2 senders (sender 0: columns 0..4
// in two buffers, columns 5..9 first so its ranges come out of order;
// sender 1: columns 5..9); "b" [20] BF16 held by sender 0 alone.
LayoutMap SenderMap(uint32_t s) {
  LayoutMap m;
  if (s == 0) {
    m.tensors = {{"a", DType::kF32, {12, 10}}, {"b", DType::kBF16, {20}}};
    m.buffers = {{"a_hi", DType::kF32, {12, 2}}, {"a_lo", DType::kF32, {12, 3}}, {"b", DType::kBF16, {20}}};
    m.copies.push_back({"a", {0, 3}, {12, 2}, "a_hi", {0, 0}, true});
    m.copies.push_back({"a", {0, 0}, {12, 3}, "a_lo", {0, 0}, true});
    m.copies.push_back({"b", {0}, {20}, "b", {0}, true});
  } else {
    m.tensors = {{"a", DType::kF32, {12, 10}}};
    m.buffers = {{"a_r", DType::kF32, {12, 5}}};
    m.copies.push_back({"a", {0, 5}, {12, 5}, "a_r", {0, 0}, true});
  }
  return m;
}

class ContributionTest : public ::testing::TestWithParam<DeltaClass> {
 protected:
  void SetUp() override {
    for (uint32_t s = 0; s < 2; ++s) {
      auto c = CompiledLayout::Compile(SenderMap(s));
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      layouts_.push_back(std::move(*c));
    }
    std::vector<TensorInfo> tensors = {{"a", DType::kF32, {12, 10}, 120, 480}, {"b", DType::kBF16, {20}, 20, 40}};
    DeltaOptions opt;
    opt.chunk_elements = kChunk;
    opt.delta_id = 0x1234;
    opt.encode.delta_class = GetParam();
    m_ = StartLayoutDelta(tensors, opt);
    std::mt19937 rng(7);
    for (uint32_t s = 0; s < 2; ++s) {
      base_.emplace_back();
      cur_.emplace_back();
      for (size_t b = 0; b < layouts_[s].map().buffers.size(); ++b) {
        std::vector<uint8_t> x(layouts_[s].BufferBytes(b));
        for (auto& byte : x) byte = static_cast<uint8_t>(rng());
        std::vector<uint8_t> y = x;
        for (size_t i = 0; i < y.size(); i += 7) y[i] ^= static_cast<uint8_t>(1 + rng() % 255);
        base_.back().push_back(std::move(x));
        cur_.back().push_back(std::move(y));
      }
    }
    for (uint32_t s = 0; s < 2; ++s) {
      SenderRank r{&layouts_[s], {}, {}};
      for (auto& v : base_[s]) r.baseline.emplace_back(v);
      for (auto& v : cur_[s]) r.current.emplace_back(v);
      auto c = ProjectSender(r, s, m_);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      records_.push_back(std::move(*c));
    }
    header_ = {m_.delta_id, m_.delta_class, 1, 0};
    auto bytes = WriteContributions(header_, m_, records_[0]);
    ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    object_ = *bytes;
  }

  Result<std::vector<ChunkContribution>> Parse(const std::string& bytes, std::vector<uint32_t> senders = {0}) {
    return ParseContributions({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, header_, m_, senders,
                              "p1-p0.bin");
  }
  // The object with `edit` applied and its checksum recomputed.
  std::string Resealed(const std::function<void(std::string&)>& edit) {
    std::string b = object_;
    edit(b);
    const uint64_t sum = Xxh3_64(b.data(), b.size() - 8);
    std::memcpy(b.data() + b.size() - 8, &sum, 8);
    return b;
  }
  static void Set32(std::string& b, size_t at, uint32_t v) { std::memcpy(b.data() + at, &v, 4); }
  static void Set64(std::string& b, size_t at, uint64_t v) { std::memcpy(b.data() + at, &v, 8); }
  static uint32_t Get32(const std::string& b, size_t at) {
    uint32_t v;
    std::memcpy(&v, b.data() + at, 4);
    return v;
  }
  // Offsets of record 0's fields.
  static constexpr size_t kRec = kContributionHeaderBytes;
  size_t Ranges0() const { return kRec + 40; }
  size_t Positions0() const { return Ranges0() + 8 * Get32(object_, kRec + 12); }

  void ExpectRefused(const std::string& bytes, Code code, const std::string& what) {
    auto r = Parse(bytes);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_THAT(r.status().message(), HasSubstr(what));
    EXPECT_THAT(r.status().message(), HasSubstr("p1-p0.bin: contribution object"));
  }

  std::vector<CompiledLayout> layouts_;
  std::vector<std::vector<std::vector<uint8_t>>> base_, cur_;
  DeltaManifest m_;
  std::vector<std::vector<ChunkContribution>> records_;
  ContributionHeader header_;
  std::string object_;
};

TEST_P(ContributionTest, RecordsRoundTripAndMergeIntoTheSameFrames) {
  // Sender 0's records of "a" have ranges out of order: the writer sorts them.
  bool unsorted = false;
  for (const auto& c : records_[0])
    unsorted |=
        !std::is_sorted(c.covered.begin(), c.covered.end()) || !std::is_sorted(c.positions.begin(), c.positions.end());
  ASSERT_TRUE(unsorted) << "the test map should produce unsorted ranges";
  auto parsed = Parse(object_);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->size(), records_[0].size());
  for (size_t i = 0; i < parsed->size(); ++i) {
    const ChunkContribution &a = (*parsed)[i], &b = records_[0][i];
    EXPECT_EQ(std::tie(a.tensor, a.chunk, a.from), std::tie(b.tensor, b.chunk, b.from));
    EXPECT_EQ(a.base_digest, b.base_digest);
    EXPECT_TRUE(std::is_sorted(a.covered.begin(), a.covered.end()));
    EXPECT_TRUE(std::is_sorted(a.positions.begin(), a.positions.end()));
    EXPECT_EQ(a.positions.size(), b.positions.size());
  }
  // Written again, the canonical records give the same bytes.
  auto again = WriteContributions(header_, m_, *parsed);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, object_);
  // Merged with sender 1's records, the frames are those of the originals.
  auto merge = [&](std::vector<ChunkContribution> from0) {
    from0.insert(from0.end(), records_[1].begin(), records_[1].end());
    auto f = EncodeOwnedChunks(m_, from0, EncodeOptions{});
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? *f : OwnedFrames{};
  };
  const OwnedFrames want = merge(records_[0]), got = merge(*parsed);
  EXPECT_EQ(got.frames, want.frames);
  EXPECT_EQ(got.target_digests, want.target_digests);
  EXPECT_FALSE(want.frames.empty());
  // An empty object (no records for that process) parses to nothing.
  auto empty = WriteContributions(header_, m_, {});
  ASSERT_TRUE(empty.ok());
  auto none = Parse(*empty);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST_P(ContributionTest, TruncatedOrPaddedObjectsAreRefused) {
  for (size_t n = 0; n < object_.size(); ++n) {
    auto r = Parse(object_.substr(0, n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << n << ": " << r.status().ToString();
  }
  ExpectRefused(object_ + "x", Code::kDataLoss, "body bytes");
  // Truncated but resealed (body length and checksum fixed): the record is short.
  std::string cut = object_.substr(0, object_.size() - 20);
  Set64(cut, 40, cut.size() - 8 - kContributionHeaderBytes);
  const uint64_t sum = Xxh3_64(cut.data(), cut.size() - 8);
  std::memcpy(cut.data() + cut.size() - 8, &sum, 8);
  auto r = Parse(cut);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("truncated"));
}

TEST_P(ContributionTest, HostileHeadersAreRefused) {
  std::string magic = object_;
  magic[0] = 'X';
  ExpectRefused(magic, Code::kDataLoss, "bad magic");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, 8, 2); }), Code::kInvalidArgument, "format version 2");
  std::string flipped = object_;
  flipped[kRec + 2] ^= 1;
  ExpectRefused(flipped, Code::kDataLoss, "checksum mismatch");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, 12, 9); }), Code::kInvalidArgument, "unknown class 9");
  ExpectRefused(Resealed([&](std::string& b) { Set32(b, 12, GetParam() == DeltaClass::kXorClass ? 2 : 1); }),
                Code::kInvalidArgument, "this attempt is 0000000000001234");
  ExpectRefused(Resealed([](std::string& b) { Set64(b, 16, 99); }), Code::kInvalidArgument, "written for delta");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, 24, 2); }), Code::kInvalidArgument, "written by process 2");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, 28, 1); }), Code::kInvalidArgument, "for process 1");
  // Counts far beyond the object: refused before anything is allocated.
  ExpectRefused(Resealed([](std::string& b) { Set64(b, 32, ~0ull); }), Code::kInvalidArgument, "records cannot fit");
  ExpectRefused(Resealed([](std::string& b) { Set64(b, 32, 1); }), Code::kInvalidArgument, "follow the last record");
}

TEST_P(ContributionTest, HostileRecordsAreRefused) {
  ExpectRefused(Resealed([](std::string& b) { Set32(b, kRec, 7); }), Code::kInvalidArgument,
                "tensor 7 is outside the delta's 2 tensors");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, kRec + 4, 100); }), Code::kInvalidArgument,
                "has 8 chunks, not chunk 100");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, kRec + 8, 1); }), Code::kInvalidArgument,
                "sender 1 is not one of process 1's senders");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, kRec + 12, 0); }), Code::kInvalidArgument, "covers no elements");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, kRec + 12, 0xffffffffu); }), Code::kInvalidArgument,
                "ranges and");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, kRec + 16, 0xffffffffu); }), Code::kInvalidArgument,
                "changes in a chunk of 16 elements");
  ExpectRefused(Resealed([](std::string& b) { Set32(b, kRec + 20, 1); }), Code::kInvalidArgument, "reserved");
  ExpectRefused(Resealed([](std::string& b) { Set64(b, kRec + 24, ~0ull); }), Code::kInvalidArgument,
                "digest lane out of range");
  ExpectRefused(Resealed([&](std::string& b) { Set32(b, Ranges0() + 4, 0); }), Code::kInvalidArgument,
                "is empty, past the chunk's");
  ExpectRefused(Resealed([&](std::string& b) { Set32(b, Ranges0(), 15); }), Code::kInvalidArgument,
                "past the chunk's 16 elements");
  ASSERT_GE(Get32(object_, kRec + 12), 2u) << "record 0 should cover two ranges";
  ExpectRefused(Resealed([&](std::string& b) { Set32(b, Ranges0() + 8, 0); }), Code::kInvalidArgument,
                "not after the previous range");
  ASSERT_GE(Get32(object_, kRec + 16), 2u) << "record 0 should change two elements";
  ExpectRefused(Resealed([&](std::string& b) { Set32(b, Positions0() + 4, Get32(object_, Positions0())); }),
                Code::kInvalidArgument, "is not increasing");
  // Record 0 (tensor "a" chunk 0) covers columns 0..4 of rows 0 and 1
  // (elements 0..4, 10..14): element 7 is sender 1's.
  ASSERT_LT(Get32(object_, Positions0()), 7u);
  ExpectRefused(Resealed([&](std::string& b) { Set32(b, Positions0(), 7); }), Code::kInvalidArgument,
                "outside the covered ranges");
  // Records out of order: record 1's header swapped with record 0's tensor/chunk.
  ExpectRefused(Resealed([&](std::string& b) { Set32(b, kRec + 4, 5); }), Code::kInvalidArgument,
                "increasing (tensor, chunk, sender) order");
}

TEST_P(ContributionTest, TheWriterRefusesRecordsThatDoNotFit) {
  std::vector<ChunkContribution> bad = {records_[0][0]};
  bad[0].tensor = 9;
  EXPECT_EQ(WriteContributions(header_, m_, bad).status().code(), Code::kInvalidArgument);
  bad = {records_[0][0]};
  bad[0].old_bits.pop_back();
  EXPECT_THAT(WriteContributions(header_, m_, bad).status().message(), HasSubstr("wrong length"));
  ContributionHeader other = header_;
  other.delta_id = 5;
  EXPECT_EQ(WriteContributions(other, m_, records_[0]).status().code(), Code::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Classes, ContributionTest, ::testing::Values(DeltaClass::kXorClass, DeltaClass::kOverwrite),
                         [](const auto& param_info) {
                           return param_info.param == DeltaClass::kXorClass ? "xor" : "overwrite";
                         });

}  // namespace
}  // namespace dcr
