// Per-rank apply (ApplyRankFrame): each rank of an engine applies its own
// elements of a frame alone; the ranks' partial digests of every chunk add
// up to the frame's base and target digests, and every rank's buffers end
// equal to a dense load of the new tensors. Property tests over random
// changes with special bit patterns (+0/-0, NaN payloads, subnormals,
// infinities), frames applied in random order, all three classes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/layout_apply.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = 16;  // elements: chunks straddle every box below

// Two tensors: "a" [12, 10] split by rows over 3 ranks, "b" [10, 12] split
// by columns; rank 0 also holds a replica of rows 4..5 of "a" (rank 1's),
// and rank 2 a replica of all of "b"'s columns 0..3 (rank 0's).
LayoutMap RankMap(uint32_t r, DType dtype) {
  LayoutMap m;
  m.tensors = {{"a", dtype, {12, 10}}, {"b", dtype, {10, 12}}};
  m.buffers = {{"a_shard", dtype, {4, 10}}, {"b_shard", dtype, {10, 4}}};
  m.copies.push_back({"a", {4 * r, 0}, {4, 10}, "a_shard", {0, 0}, true});
  m.copies.push_back({"b", {0, 4 * r}, {10, 4}, "b_shard", {0, 0}, true});
  if (r == 0) {
    m.buffers.push_back({"a_replica", dtype, {3, 10}});  // one padding row
    m.copies.push_back({"a", {4, 0}, {2, 10}, "a_replica", {1, 0}, false});
  }
  if (r == 2) {
    m.buffers.push_back({"b_replica", dtype, {10, 4}});
    m.copies.push_back({"b", {0, 0}, {10, 4}, "b_replica", {0, 0}, false});
  }
  return m;
}

struct Rank {
  CompiledLayout layout;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::span<uint8_t>> spans;
  PlacedRank placed() { return {&layout, spans}; }
};

std::vector<Rank> MakeEngine(DType dtype) {
  std::vector<Rank> out;
  for (uint32_t r = 0; r < 3; ++r) {
    auto c = CompiledLayout::Compile(RankMap(r, dtype));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    out.push_back({std::move(*c), {}, {}});
  }
  for (Rank& r : out) {
    for (size_t b = 0; b < r.layout.map().buffers.size(); ++b) r.bytes.emplace_back(r.layout.BufferBytes(b), 0xA5);
    for (auto& v : r.bytes) r.spans.emplace_back(v);
  }
  return out;
}

// Canonical tensors by name.
using Tensors = std::map<std::string, std::vector<uint8_t>>;

void Load(std::vector<Rank>& engine, const Tensors& t) {
  for (Rank& r : engine) {
    PlacedRank p = r.placed();
    ASSERT_TRUE(LoadDense(
                    [&](const std::string& name, uint64_t* bytes) -> const uint8_t* {
                      auto it = t.find(name);
                      if (it == t.end()) return nullptr;
                      *bytes = it->second.size();
                      return it->second.data();
                    },
                    p)
                    .ok());
  }
}

// A word with a special pattern, or random bits.
uint64_t RandomWord(std::mt19937_64& rng, uint32_t wb) {
  const uint64_t specials2[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x8001, 0x007F};
  const uint64_t specials4[] = {0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                                0x7FC00001, 0xFFFFFFFF, 0x00000001, 0x807FFFFF, 0x3F800000};
  if (rng() % 3 == 0) return wb == 2 ? specials2[rng() % 10] : specials4[rng() % 10];
  return wb == 2 ? rng() & 0xFFFF : rng() & 0xFFFFFFFF;
}

struct Delta {
  DeltaManifest manifest;
  std::vector<std::string> frames;
};

// Frames moving `base` to `next` in class `cls`, encoded canonically.
Delta Encode(const Tensors& base, const Tensors& next, DType dtype, const EncodeOptions& options) {
  std::vector<TensorInfo> infos = {{"a", dtype, {12, 10}, 120, 120 * BitsPerElement(dtype) / 8},
                                   {"b", dtype, {10, 12}, 120, 120 * BitsPerElement(dtype) / 8}};
  DeltaOptions o;
  o.encode = options;
  o.chunk_elements = kChunk;
  o.delta_id = 0x1234;
  Delta d;
  d.manifest = StartLayoutDelta(infos, o);
  ChunkEncoder encoder;
  const uint32_t wb = BitsPerElement(dtype) / 8;
  for (uint32_t t = 0; t < d.manifest.tensors.size(); ++t)
    for (uint32_t c = 0; c < d.manifest.ChunkCount(t); ++c) {
      uint64_t first_word, words;
      uint32_t elements;
      d.manifest.ChunkWords(t, c, &first_word, &words, &elements);
      const std::string& name = d.manifest.tensors[t].name;
      ChunkInput in{dtype,
                    MakeDigestKey(name),
                    first_word,
                    elements,
                    {base.at(name).data() + first_word * wb, words * wb},
                    {next.at(name).data() + first_word * wb, words * wb}};
      EncodedChunk out;
      auto changed = encoder.Encode(in, options, &out);
      EXPECT_TRUE(changed.ok()) << changed.status().ToString();
      if (!*changed) continue;
      out.header.tensor = t;
      out.header.chunk = c;
      d.frames.push_back(EncodeFrame(out.header, out.payload));
    }
  return d;
}

FrameView Parse(const std::string& f) {
  auto v = ParseFrame({reinterpret_cast<const uint8_t*>(f.data()), f.size()});
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  return *v;
}

Tensors RandomTensors(std::mt19937_64& rng, uint32_t wb) {
  Tensors t;
  for (const char* name : {"a", "b"}) {
    std::vector<uint8_t> v(120 * wb);
    for (size_t i = 0; i < 120; ++i) {
      const uint64_t w = RandomWord(rng, wb);
      std::memcpy(v.data() + i * wb, &w, wb);
    }
    t[name] = std::move(v);
  }
  return t;
}

Tensors Change(std::mt19937_64& rng, Tensors t, uint32_t wb, double rate) {
  for (auto& [name, v] : t)
    for (size_t i = 0; i < 120; ++i)
      if (std::uniform_real_distribution<double>(0, 1)(rng) < rate) {
        const uint64_t w = RandomWord(rng, wb);
        std::memcpy(v.data() + i * wb, &w, wb);
      }
  return t;
}

void ExpectEqualsDenseLoad(std::vector<Rank>& engine, const Tensors& t, DType dtype, const std::string& what) {
  std::vector<Rank> want = MakeEngine(dtype);
  Load(want, t);
  for (size_t r = 0; r < engine.size(); ++r)
    for (size_t b = 0; b < engine[r].bytes.size(); ++b)
      EXPECT_TRUE(engine[r].bytes[b] == want[r].bytes[b])
          << what << ": rank " << r << " buffer " << engine[r].layout.map().buffers[b].id;
}

// RankHeldChunks: every chunk with an element of any of the rank's copies,
// replicas included, and no other; here from the boxes, element by element.
TEST(RankApplyTest, HeldChunksAreThoseAnyCopyTouches) {
  const Delta d = Encode({{"a", std::vector<uint8_t>(240)}, {"b", std::vector<uint8_t>(240)}},
                         {{"a", std::vector<uint8_t>(240)}, {"b", std::vector<uint8_t>(240)}}, DType::kBF16, {});
  for (uint32_t r = 0; r < 3; ++r) {
    const LayoutMap map = RankMap(r, DType::kBF16);
    auto layout = CompiledLayout::Compile(map);
    ASSERT_TRUE(layout.ok());
    std::vector<std::set<uint64_t>> want(2);
    for (const BoxCopy& c : map.copies) {
      const size_t t = c.tensor == "a" ? 0 : 1;
      const uint64_t cols = d.manifest.tensors[t].shape[1];
      for (uint64_t i = c.offset[0]; i < c.offset[0] + c.extent[0]; ++i)
        for (uint64_t j = c.offset[1]; j < c.offset[1] + c.extent[1]; ++j) want[t].insert((i * cols + j) / kChunk);
    }
    const ChunkRanges held = RankHeldChunks(*layout, d.manifest);
    ASSERT_EQ(held.size(), 2u);
    for (size_t t = 0; t < 2; ++t) {
      std::set<uint64_t> got;
      for (size_t k = 0; k < held[t].size(); ++k) {
        if (k > 0) {
          EXPECT_LT(held[t][k - 1].second, held[t][k].first) << "ranges not sorted and merged";
        }
        for (uint64_t c = held[t][k].first; c < held[t][k].second; ++c) got.insert(c);
      }
      EXPECT_EQ(got, want[t]) << "rank " << r << " tensor " << t;
    }
  }
  // Rank 0 holds rows 0..5 of "a" (its shard and a replica): chunks 0..3 of 8.
  auto r0 = CompiledLayout::Compile(RankMap(0, DType::kBF16));
  EXPECT_EQ(RankHeldChunks(*r0, d.manifest)[0], (std::vector<std::pair<uint64_t, uint64_t>>{{0, 4}}));
}

TEST(RankApplyTest, PartialsAddUpAndRanksEndAtADenseLoad) {
  std::mt19937_64 rng(7);
  int frames_seen = 0;
  for (int round = 0; round < 60; ++round) {
    const DType dtype = round % 2 ? DType::kF32 : DType::kBF16;
    const uint32_t wb = BitsPerElement(dtype) / 8;
    EncodeOptions options;
    options.delta_class = round % 3 == 2 ? DeltaClass::kOverwrite : DeltaClass::kXorClass;
    options.allow_add = round % 3 != 1;  // round % 3 == 1: xor frames only
    const Tensors base = RandomTensors(rng, wb);
    const Tensors next = Change(rng, base, wb, round % 5 == 0 ? 0.9 : 0.1);
    std::vector<Rank> engine = MakeEngine(dtype);
    Load(engine, base);
    const Delta d = Encode(base, next, dtype, options);
    // Tracked partials, as a rank follower keeps them.
    std::vector<ChunkDigestTable> tracked;
    for (Rank& r : engine) tracked.push_back(RankChunkDigests(r.placed(), d.manifest));
    // Every (rank, frame) pair, in random order, some twice.
    std::vector<std::pair<size_t, size_t>> order;
    for (size_t r = 0; r < engine.size(); ++r)
      for (size_t f = 0; f < d.frames.size(); ++f) order.emplace_back(r, f);
    std::shuffle(order.begin(), order.end(), rng);
    std::map<size_t, Digest> target_sum;
    std::vector<uint8_t> scratch;
    for (auto [r, f] : order) {
      const FrameView frame = Parse(d.frames[f]);
      PlacedRank p = engine[r].placed();
      Digest& t = tracked[r][frame.header.tensor][frame.header.chunk];
      auto res = ApplyRankFrame(p, d.manifest, frame, &scratch, &t);
      ASSERT_TRUE(res.ok()) << res.status().ToString();
      EXPECT_EQ(res->base, t);
      t = res->target;
      target_sum[f] += res->target;
      ++frames_seen;
    }
    for (size_t f = 0; f < d.frames.size(); ++f) {
      const FrameView frame = Parse(d.frames[f]);
      EXPECT_EQ(target_sum[f], frame.header.target_digest) << "round " << round << " frame " << f;
    }
    ExpectEqualsDenseLoad(engine, next, dtype, "round " + std::to_string(round));
    // The tracked tables are what a fresh pass computes, and add up to the target.
    Digest total;
    for (size_t r = 0; r < engine.size(); ++r) {
      EXPECT_EQ(tracked[r], RankChunkDigests(engine[r].placed(), d.manifest)) << "rank " << r;
      for (const auto& row : tracked[r])
        for (const Digest& x : row) total += x;
    }
    Digest want;
    for (const char* name : {"a", "b"})
      want += DigestBytes(MakeDigestKey(name), 0, {next.at(name).data(), next.at(name).size()});
    EXPECT_EQ(total, want);
  }
  EXPECT_GT(frames_seen, 500);
}

TEST(RankApplyTest, CorruptionIsRefusedByXorAndRepairedByOverwrite) {
  std::mt19937_64 rng(11);
  const DType dtype = DType::kBF16;
  const Tensors base = RandomTensors(rng, 2);
  Tensors next = base;
  // Element 45 of "a" (row 4: rank 1's primary, rank 0's replica) changes.
  next["a"][90] ^= 0x55;
  std::vector<Rank> engine = MakeEngine(dtype);
  Load(engine, base);
  EncodeOptions xo;
  const Delta x = Encode(base, next, dtype, xo);
  ASSERT_EQ(x.frames.size(), 1u);
  std::vector<ChunkDigestTable> tracked;
  for (Rank& r : engine) tracked.push_back(RankChunkDigests(r.placed(), x.manifest));
  // Corrupt rank 1's copy of element 45 behind its back.
  engine[1].bytes[0][(45 - 40) * 2] ^= 0x01;
  const std::vector<std::vector<uint8_t>> before = engine[1].bytes;
  const FrameView xf = Parse(x.frames[0]);
  std::vector<uint8_t> scratch;
  PlacedRank p1 = engine[1].placed();
  auto refused = ApplyRankFrame(p1, x.manifest, xf, &scratch, &tracked[1][0][2]);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("tensor 'a' chunk 2"));
  EXPECT_TRUE(engine[1].bytes == before) << "nothing written";
  // Without the tracked digest the rank applies, and the engine's partials do
  // not add up to the target: the coordinator's check catches it.
  Digest sum;
  for (Rank& r : engine) {
    PlacedRank p = r.placed();
    auto res = ApplyRankFrame(p, x.manifest, xf, &scratch);
    ASSERT_TRUE(res.ok());
    sum += res->target;
  }
  EXPECT_NE(sum, xf.header.target_digest);
  // The overwrite retry repairs it.
  EncodeOptions oo;
  oo.delta_class = DeltaClass::kOverwrite;
  const Delta o = Encode(base, next, dtype, oo);
  ASSERT_EQ(o.frames.size(), 1u);
  const FrameView of = Parse(o.frames[0]);
  sum = Digest{};
  for (size_t r = 0; r < engine.size(); ++r) {
    PlacedRank p = engine[r].placed();
    auto res = ApplyRankFrame(p, o.manifest, of, &scratch, &tracked[r][0][2]);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    sum += res->target;
  }
  EXPECT_EQ(sum, of.header.target_digest);
  ExpectEqualsDenseLoad(engine, next, dtype, "after the overwrite");
}

TEST(RankApplyTest, BadFramesWriteNothing) {
  std::mt19937_64 rng(3);
  const DType dtype = DType::kBF16;
  const Tensors base = RandomTensors(rng, 2);
  const Tensors next = Change(rng, base, 2, 0.1);
  std::vector<Rank> engine = MakeEngine(dtype);
  Load(engine, base);
  const Delta d = Encode(base, next, dtype, EncodeOptions{});
  // A sparse frame of a chunk rank 0 holds.
  size_t pick = d.frames.size();
  for (size_t i = 0; i < d.frames.size() && pick == d.frames.size(); ++i) {
    const FrameView v = Parse(d.frames[i]);
    if (v.header.codec == Codec::kSparse && v.header.tensor == 0 && v.header.chunk < 2) pick = i;
  }
  ASSERT_LT(pick, d.frames.size());
  const std::vector<std::vector<uint8_t>> before = engine[0].bytes;
  std::vector<uint8_t> scratch;
  PlacedRank p = engine[0].placed();
  FrameView f = Parse(d.frames[pick]);
  // A frame of another dtype than its tensor's.
  FrameView other = f;
  other.header.dtype = other.header.dtype == DType::kBF16 ? DType::kF16 : DType::kBF16;
  EXPECT_EQ(ApplyRankFrame(p, d.manifest, other, &scratch).status().code(), Code::kInvalidArgument);
  // A chunk the tensor does not have.
  FrameView g = f;
  g.header.chunk = 100;
  EXPECT_EQ(ApplyRankFrame(p, d.manifest, g, &scratch).status().code(), Code::kInvalidArgument);
  // A payload that does not decode (its checksum recomputed, as a buggy
  // sender would): the decode is checked before a byte is written.
  FrameHeader h = f.header;
  std::vector<uint8_t> payload(f.payload.begin(), f.payload.end());
  for (size_t i = 4; i < payload.size(); ++i) payload[i] = 0xFF;
  const std::string bad = EncodeFrame(h, payload);
  auto parsed = ParseFrame({reinterpret_cast<const uint8_t*>(bad.data()), bad.size()});
  ASSERT_TRUE(parsed.ok());
  auto r = ApplyRankFrame(p, d.manifest, *parsed, &scratch);
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().ToString();
  EXPECT_TRUE(engine[0].bytes == before);
}

}  // namespace
}  // namespace dcr
