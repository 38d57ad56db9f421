// Per-rank apply (ApplyRankFrames): each rank of an engine applies its own
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
#include <memory>
#include <random>
#include <set>

#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/layout_apply.h"
#include "testing/fake_memory.h"
#include "testing/tensor_delta.h"

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
using testing::Tensors;

void Load(std::vector<Rank>& engine, const Tensors& t) {
  for (Rank& r : engine) {
    PlacedRank p = r.placed();
    ASSERT_TRUE(LoadDense(testing::TensorSource(t), p).ok());
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

using Delta = testing::TensorDelta;

// Frames moving `base` to `next` in class `cls`, encoded canonically.
Delta Encode(const Tensors& base, const Tensors& next, DType dtype, const EncodeOptions& options) {
  const std::vector<TensorInfo> infos = {{"a", dtype, {12, 10}, 120, 120 * BitsPerElement(dtype) / 8},
                                         {"b", dtype, {10, 12}, 120, 120 * BitsPerElement(dtype) / 8}};
  DeltaOptions o;
  o.encode = options;
  o.chunk_elements = kChunk;
  o.delta_id = 0x1234;
  return testing::EncodeTensorDelta(infos, base, next, o);
}

FrameView Parse(const std::string& f) { return testing::ParseTestFrame(f); }

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

// One frame through ApplyRankFrames, from the rank's tracked partial `current`.
FrameApplied ApplyOne(PlacedRank& rank, const DeltaManifest& m, const FrameView& frame, const Digest& current) {
  const FrameView frames[] = {frame};
  const Digest now[] = {current};
  return ApplyRankFrames(rank, m, frames, now)[0];
}

ChunkDigestTable Partials(Rank& r, const DeltaManifest& m) {
  auto table = RankChunkDigests(r.placed(), m);
  EXPECT_TRUE(table.ok()) << table.status().ToString();
  return *table;
}

TEST(RankApplyTest, PartialsAddUpAndRanksEndAtADenseLoad) {
  std::mt19937_64 rng(7);
  int frames_seen = 0, whole_seen = 0;
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
    for (Rank& r : engine) tracked.push_back(Partials(r, d.manifest));
    // Every (rank, frame) pair, in random order.
    std::vector<std::pair<size_t, size_t>> order;
    for (size_t r = 0; r < engine.size(); ++r)
      for (size_t f = 0; f < d.frames.size(); ++f) order.emplace_back(r, f);
    std::shuffle(order.begin(), order.end(), rng);
    std::map<size_t, Digest> target_sum;
    for (auto [r, f] : order) {
      const FrameView frame = Parse(d.frames[f]);
      PlacedRank p = engine[r].placed();
      Digest& t = tracked[r][frame.header.tensor][frame.header.chunk];
      const FrameApplied res = ApplyOne(p, d.manifest, frame, t);
      ASSERT_TRUE(res.status.ok()) << res.status.ToString();
      whole_seen += res.holding == Holding::kWhole;
      t = res.after;
      target_sum[f] += res.after;
      ++frames_seen;
    }
    for (size_t f = 0; f < d.frames.size(); ++f) {
      const FrameView frame = Parse(d.frames[f]);
      EXPECT_EQ(target_sum[f], frame.header.target_digest) << "round " << round << " frame " << f;
    }
    ExpectEqualsDenseLoad(engine, next, dtype, "round " + std::to_string(round));
    // The partials updated from the changed words alone are what a fresh
    // pass over the buffers computes, and add up to the target.
    Digest total;
    for (size_t r = 0; r < engine.size(); ++r) {
      EXPECT_EQ(tracked[r], Partials(engine[r], d.manifest)) << "rank " << r;
      for (const auto& row : tracked[r])
        for (const Digest& x : row) total += x;
    }
    Digest want;
    for (const char* name : {"a", "b"})
      want += DigestBytes(MakeDigestKey(name), 0, {next.at(name).data(), next.at(name).size()});
    EXPECT_EQ(total, want);
  }
  EXPECT_GT(frames_seen, 500);
  EXPECT_GT(whole_seen, 50);  // chunks 0 and 1 of "a" lie whole in rank 0's rows
}

using testing::FakeMemory;

// The same engine as MakeEngine, its buffers in FakeMemory.
struct MemoryEngine {
  std::vector<CompiledLayout> layouts;
  std::vector<std::unique_ptr<FakeMemory>> memory;
  std::vector<PlacedRank> placed;
  explicit MemoryEngine(std::vector<Rank>& like) {
    for (Rank& r : like) {
      layouts.push_back(r.layout);
      memory.push_back(std::make_unique<FakeMemory>(r.bytes));
    }
    for (size_t k = 0; k < like.size(); ++k) placed.push_back({&layouts[k], {}, memory[k].get()});
  }
};

// Base and next of "a" differing at element 45 (row 4: rank 1's primary,
// rank 0's replica; chunk 2, which rank 1 holds half of) and element 3
// (chunk 0, whole in rank 0); and the same two elements flipped in the
// ranks' buffers behind their backs.
std::pair<Tensors, Tensors> TwoChanges() {
  std::mt19937_64 rng(11);
  const Tensors base = RandomTensors(rng, 2);
  Tensors next = base;
  next["a"][90] ^= 0x55;
  next["a"][6] ^= 0x21;
  return {base, next};
}
void CorruptTheChangedElements(std::vector<Rank>& engine) {
  engine[1].bytes[0][(45 - 40) * 2] ^= 0x01;
  engine[0].bytes[0][3 * 2] ^= 0x01;
}

// Ranks in host memory audit each chunk a frame touches: an element
// corrupted behind a rank's back is caught at the next frame of its chunk,
// nothing written, and the overwrite retry repairs it.
TEST(RankApplyTest, HostRanksAuditTheChunksTheyApplyTo) {
  const DType dtype = DType::kBF16;
  const auto [base, next] = TwoChanges();
  std::vector<Rank> engine = MakeEngine(dtype);
  Load(engine, base);
  const Delta x = Encode(base, next, dtype, EncodeOptions{});
  ASSERT_EQ(x.frames.size(), 2u);
  std::vector<ChunkDigestTable> tracked;
  for (Rank& r : engine) tracked.push_back(Partials(r, x.manifest));
  CorruptTheChangedElements(engine);
  const FrameView chunk0 = Parse(x.frames[0]), chunk2 = Parse(x.frames[1]);
  ASSERT_EQ(chunk0.header.chunk, 0u);
  ASSERT_EQ(chunk2.header.chunk, 2u);
  const auto before0 = engine[0].bytes, before1 = engine[1].bytes;
  PlacedRank p0 = engine[0].placed(), p1 = engine[1].placed();
  // Whole in rank 0: checked from its bits, not its base.
  const FrameApplied whole = ApplyOne(p0, x.manifest, chunk0, tracked[0][0][0]);
  EXPECT_EQ(whole.status.code(), Code::kFailedPrecondition) << whole.status.ToString();
  EXPECT_THAT(whole.status.message(), HasSubstr("tensor 'a' chunk 0"));
  EXPECT_TRUE(engine[0].bytes == before0) << "nothing written";
  // Half in rank 1: its elements are not at its tracked partial.
  const FrameApplied half = ApplyOne(p1, x.manifest, chunk2, tracked[1][0][2]);
  EXPECT_EQ(half.status.code(), Code::kFailedPrecondition) << half.status.ToString();
  EXPECT_THAT(half.status.message(), HasSubstr("changed behind its back"));
  EXPECT_TRUE(engine[1].bytes == before1) << "nothing written";
  // The overwrite retry repairs both, from the bits.
  EncodeOptions oo;
  oo.delta_class = DeltaClass::kOverwrite;
  const Delta o = Encode(base, next, dtype, oo);
  ASSERT_EQ(o.frames.size(), 2u);
  Digest sum;
  for (size_t r = 0; r < engine.size(); ++r) {
    PlacedRank p = engine[r].placed();
    for (const std::string& f : o.frames) {
      const FrameView of = Parse(f);
      const FrameApplied res = ApplyOne(p, o.manifest, of, tracked[r][of.header.tensor][of.header.chunk]);
      ASSERT_TRUE(res.status.ok()) << res.status.ToString();
      if (of.header.chunk == 2) sum += res.after;
    }
  }
  EXPECT_EQ(sum, Parse(o.frames[1]).header.target_digest);
  ExpectEqualsDenseLoad(engine, next, dtype, "after the overwrite");
  // An element no frame changes, corrupted in a chunk rank 0 holds whole:
  // an overwrite cannot reach the chunk's target and is refused, naming the
  // chunk, with nothing written (the rank rejoins from a snapshot).
  engine[0].bytes[0][10 * 2] ^= 0x04;
  const auto before = engine[0].bytes;
  const FrameApplied stuck = ApplyOne(p0, o.manifest, Parse(o.frames[0]), Partials(engine[0], o.manifest)[0][0]);
  EXPECT_EQ(stuck.status.code(), Code::kFailedPrecondition) << stuck.status.ToString();
  EXPECT_THAT(stuck.status.message(), HasSubstr("tensor 'a' chunk 0"));
  EXPECT_TRUE(engine[0].bytes == before);
}

// Ranks in BufferMemory (a device's) do not audit: their tracked partials
// follow what the loop writes, O(changed), and bits changed behind a rank's
// back show only in a pass over its buffers (an audit), which a rank
// follower runs at join and before an overwrite retry; the retry from the
// audited partials repairs them.
TEST(RankApplyTest, DeviceRanksTrackWhatTheyWriteAndAreRepairedAfterAnAudit) {
  const DType dtype = DType::kBF16;
  const auto [base, next] = TwoChanges();
  std::vector<Rank> host = MakeEngine(dtype);
  Load(host, base);
  CorruptTheChangedElements(host);
  const Delta x = Encode(base, next, dtype, EncodeOptions{});
  std::vector<ChunkDigestTable> tracked;
  std::vector<Rank> clean = MakeEngine(dtype);
  Load(clean, base);
  for (Rank& r : clean) tracked.push_back(Partials(r, x.manifest));  // what they tracked before
  MemoryEngine device(host);
  for (size_t r = 0; r < host.size(); ++r)
    for (const std::string& f : x.frames) {
      const FrameView frame = Parse(f);
      Digest& t = tracked[r][frame.header.tensor][frame.header.chunk];
      const FrameApplied res = ApplyOne(device.placed[r], x.manifest, frame, t);
      if (res.status.ok()) t = res.after;
    }
  for (size_t r = 0; r < 2; ++r) {
    auto audited = RankChunkDigests(device.placed[r], x.manifest);
    ASSERT_TRUE(audited.ok());
    EXPECT_NE(*audited, tracked[r]) << "rank " << r << ": the audit sees what tracking does not";
  }
  EncodeOptions oo;
  oo.delta_class = DeltaClass::kOverwrite;
  const Delta o = Encode(base, next, dtype, oo);
  for (size_t r = 0; r < host.size(); ++r) {
    auto audited = RankChunkDigests(device.placed[r], o.manifest);
    ASSERT_TRUE(audited.ok());
    for (const std::string& f : o.frames) {
      const FrameView of = Parse(f);
      const FrameApplied res =
          ApplyOne(device.placed[r], o.manifest, of, (*audited)[of.header.tensor][of.header.chunk]);
      ASSERT_TRUE(res.status.ok()) << res.status.ToString();
    }
  }
  Load(clean, next);
  for (size_t r = 0; r < host.size(); ++r) EXPECT_TRUE(device.memory[r]->bytes() == clean[r].bytes) << "rank " << r;
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
  PlacedRank p = engine[0].placed();
  const ChunkDigestTable tracked = Partials(engine[0], d.manifest);
  FrameView f = Parse(d.frames[pick]);
  const Digest& now = tracked[f.header.tensor][f.header.chunk];
  // A frame of another dtype than its tensor's.
  FrameView other = f;
  other.header.dtype = other.header.dtype == DType::kBF16 ? DType::kF16 : DType::kBF16;
  EXPECT_EQ(ApplyOne(p, d.manifest, other, now).status.code(), Code::kInvalidArgument);
  // A chunk the tensor does not have.
  FrameView g = f;
  g.header.chunk = 100;
  EXPECT_EQ(ApplyOne(p, d.manifest, g, now).status.code(), Code::kInvalidArgument);
  // A payload that does not decode (its checksum recomputed, as a buggy
  // sender would): the decode is checked before a byte is written.
  FrameHeader h = f.header;
  std::vector<uint8_t> payload(f.payload.begin(), f.payload.end());
  for (size_t i = 4; i < payload.size(); ++i) payload[i] = 0xFF;
  const std::string bad = EncodeFrame(h, payload);
  auto parsed = ParseFrame({reinterpret_cast<const uint8_t*>(bad.data()), bad.size()});
  ASSERT_TRUE(parsed.ok());
  const FrameApplied r = ApplyOne(p, d.manifest, *parsed, now);
  EXPECT_EQ(r.status.code(), Code::kDataLoss) << r.status.ToString();
  EXPECT_TRUE(engine[0].bytes == before);
  // Two frames of one chunk in one apply: the second is refused.
  const FrameView twice[] = {f, f};
  const Digest nows[] = {now, now};
  const auto both = ApplyRankFrames(p, d.manifest, twice, nows);
  EXPECT_EQ(both[1].status.code(), Code::kInvalidArgument);
  EXPECT_THAT(both[1].status.message(), HasSubstr("two frames of tensor 0"));
  EXPECT_TRUE(both[0].status.ok()) << both[0].status.ToString();
}

// Every mode, chunk edges, replicas and partial chunks: ranks whose buffers
// are reached only through BufferMemory end with the bits, partial digests
// and results of ranks in host memory, rank by rank and as one engine.
TEST(RankApplyTest, RanksInBufferMemoryMatchRanksInHostMemory) {
  std::mt19937_64 rng(19);
  for (int round = 0; round < 30; ++round) {
    const DType dtype = round % 2 ? DType::kF32 : DType::kBF16;
    const uint32_t wb = BitsPerElement(dtype) / 8;
    EncodeOptions options;
    options.delta_class = round % 3 == 2 ? DeltaClass::kOverwrite : DeltaClass::kXorClass;
    options.allow_add = round % 3 != 1;
    const Tensors base = RandomTensors(rng, wb);
    const Tensors next = Change(rng, base, wb, round % 5 == 0 ? 0.9 : 0.2);
    std::vector<Rank> host = MakeEngine(dtype);
    Load(host, base);
    MemoryEngine device(host);
    const Delta d = Encode(base, next, dtype, options);
    std::vector<FrameView> frames;
    for (const std::string& f : d.frames) frames.push_back(Parse(f));
    for (size_t r = 0; r < host.size(); ++r) {
      const ChunkDigestTable tracked = Partials(host[r], d.manifest);
      auto on_device = RankChunkDigests(device.placed[r], d.manifest);
      ASSERT_TRUE(on_device.ok());
      EXPECT_EQ(*on_device, tracked) << "digests read through the memory";
      std::vector<Digest> current;
      for (const FrameView& f : frames) current.push_back(tracked[f.header.tensor][f.header.chunk]);
      PlacedRank p = host[r].placed();
      const auto want = ApplyRankFrames(p, d.manifest, frames, current);
      const auto got = ApplyRankFrames(device.placed[r], d.manifest, frames, current);
      for (size_t i = 0; i < frames.size(); ++i) {
        EXPECT_EQ(got[i].status.code(), want[i].status.code()) << got[i].status.ToString();
        EXPECT_EQ(got[i].after, want[i].after) << "round " << round << " rank " << r << " frame " << i;
        EXPECT_EQ(got[i].holding, want[i].holding);
        EXPECT_EQ(got[i].written, want[i].written);
      }
      EXPECT_TRUE(device.memory[r]->bytes() == host[r].bytes) << "round " << round << " rank " << r;
      // Gathers and scatters by window, never by change.
      EXPECT_LE(device.memory[r]->gathers, static_cast<int>(frames.size()));
    }
    ExpectEqualsDenseLoad(host, next, dtype, "host round " + std::to_string(round));
  }
}

TEST(RankApplyTest, AnEngineInBufferMemoryIsCheckedChunkByChunkAndLoadsDense) {
  std::mt19937_64 rng(23);
  const DType dtype = DType::kBF16;
  const Tensors base = RandomTensors(rng, 2);
  const Tensors next = Change(rng, base, 2, 0.3);
  std::vector<Rank> host = MakeEngine(dtype);
  MemoryEngine device(host);
  // A dense load through the memory, then the delta applied to the whole
  // engine: every chunk whole across the ranks, checked before written.
  for (PlacedRank& p : device.placed)
    ASSERT_TRUE(LoadDense(
                    [&](const std::string& name, uint64_t* bytes) -> const uint8_t* {
                      *bytes = base.at(name).size();
                      return base.at(name).data();
                    },
                    p)
                    .ok());
  Load(host, base);
  for (size_t r = 0; r < host.size(); ++r) EXPECT_TRUE(device.memory[r]->bytes() == host[r].bytes) << "rank " << r;
  const Delta d = Encode(base, next, dtype, EncodeOptions{});
  std::vector<PlacedRank*> ranks;
  for (PlacedRank& p : device.placed) ranks.push_back(&p);
  ChunkDigestTable engine(d.manifest.tensors.size());
  for (size_t t = 0; t < engine.size(); ++t) engine[t].assign(d.manifest.ChunkCount(t), Digest{});
  for (PlacedRank* p : ranks) {
    auto mine = RankChunkDigests(*p, d.manifest);
    ASSERT_TRUE(mine.ok());
    for (size_t t = 0; t < engine.size(); ++t)
      for (size_t c = 0; c < engine[t].size(); ++c) engine[t][c] += (*mine)[t][c];
  }
  std::vector<FrameView> frames;
  std::vector<Digest> current;
  for (const std::string& f : d.frames) {
    frames.push_back(Parse(f));
    current.push_back(engine[frames.back().header.tensor][frames.back().header.chunk]);
  }
  PlacedTarget target(ranks, d.manifest, /*partial=*/false);
  EXPECT_TRUE(target.Batched());
  const auto applied = ApplyFrames(target, d.manifest, frames, current);
  for (size_t i = 0; i < frames.size(); ++i) {
    ASSERT_TRUE(applied[i].status.ok()) << applied[i].status.ToString();
    EXPECT_EQ(applied[i].holding, Holding::kWhole);
    EXPECT_EQ(applied[i].after, frames[i].header.target_digest);
  }
  Load(host, next);
  for (size_t r = 0; r < host.size(); ++r) EXPECT_TRUE(device.memory[r]->bytes() == host[r].bytes) << "rank " << r;
  Digest sum;
  for (PlacedRank* p : ranks) {
    auto digest = RankDigest(*p);
    ASSERT_TRUE(digest.ok());
    sum += *digest;
  }
  Digest want;
  for (const char* name : {"a", "b"})
    want += DigestBytes(MakeDigestKey(name), 0, {next.at(name).data(), next.at(name).size()});
  EXPECT_EQ(sum, want);
}

// A scatter that fails part way marks its frames torn: their chunks may hold
// some new words, which the caller must not take for the base (a rank
// follower keeps them in its frame log; an overwrite repairs them).
TEST(RankApplyTest, AScatterThatFailsPartWayIsReportedTorn) {
  std::mt19937_64 rng(29);
  const DType dtype = DType::kBF16;
  const Tensors base = RandomTensors(rng, 2);
  const Tensors next = Change(rng, base, 2, 0.5);
  std::vector<Rank> host = MakeEngine(dtype);
  Load(host, base);
  MemoryEngine device(host);
  const Delta d = Encode(base, next, dtype, EncodeOptions{});
  std::vector<FrameView> frames;
  for (const std::string& f : d.frames) frames.push_back(Parse(f));
  const ChunkDigestTable tracked = Partials(host[0], d.manifest);
  std::vector<Digest> current;
  for (const FrameView& f : frames) current.push_back(tracked[f.header.tensor][f.header.chunk]);
  device.memory[0]->fail_scatter = 1;
  const auto got = ApplyRankFrames(device.placed[0], d.manifest, frames, current);
  int torn = 0;
  for (const FrameApplied& r : got) {
    if (!r.torn) {
      EXPECT_TRUE(r.status.ok()) << r.status.ToString();
      continue;
    }
    EXPECT_EQ(r.status.code(), Code::kUnavailable) << r.status.ToString();
    EXPECT_EQ(r.written, 0u);
    ++torn;
  }
  EXPECT_GT(torn, 0);
}

}  // namespace
}  // namespace dcr
