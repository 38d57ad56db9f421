// Which frame objects a rank downloads (held_chunks.h): range queries over
// held chunks, and the choice by object names and by the manifest.
#include "held_chunks.h"

#include <gtest/gtest.h>

#include "dcr/run_keys.h"

namespace dcr::receiver_internal {
namespace {

// Three tensors of 10, 4 and 6 chunks (chunks of 8 elements).
DeltaManifest Shape() {
  DeltaManifest m;
  m.chunk_elements = 8;
  for (uint64_t chunks : {10, 4, 6}) {
    DeltaTensor t;
    t.name = "t" + std::to_string(m.tensors.size());
    t.dtype = DType::kBF16;
    t.shape = {chunks * 8};
    t.elements = chunks * 8;
    m.tensors.push_back(t);
  }
  return m;
}

// Tensor 0: chunks 2-3 and 8; tensor 1: none; tensor 2: chunk 5.
HeldChunks Held() { return HeldChunks(Shape(), {{{2, 4}, {8, 9}}, {}, {{5, 6}}}); }

TEST(HeldChunksTest, RangesAnswerInTensorChunkOrder) {
  const HeldChunks h = Held();
  for (uint32_t c = 0; c < 10; ++c) EXPECT_EQ(h.Holds({0, c}), c == 2 || c == 3 || c == 8) << c;
  for (uint32_t c = 0; c < 4; ++c) EXPECT_FALSE(h.Holds({1, c})) << c;
  EXPECT_TRUE(h.Holds({2, 5}));
  EXPECT_FALSE(h.Holds({2, 4}));
  EXPECT_FALSE(h.Holds({3, 0}));  // no such tensor
  EXPECT_FALSE(h.Holds({UINT32_MAX, 0}));  // a name may say anything
  EXPECT_TRUE(h.AnyIn({0, 0}, ChunkId{UINT32_MAX, UINT32_MAX}));
  EXPECT_FALSE(h.AnyIn({0, 0}, ChunkId{0, 2}));  // [0, 2)
  EXPECT_TRUE(h.AnyIn({0, 0}, ChunkId{0, 3}));
  EXPECT_FALSE(h.AnyIn({0, 4}, ChunkId{0, 8}));
  EXPECT_FALSE(h.AnyIn({0, 9}, ChunkId{2, 5}));  // across tensor 1, which holds nothing
  EXPECT_TRUE(h.AnyIn({0, 9}, ChunkId{2, 6}));
  EXPECT_TRUE(h.AnyIn({1, 0}, std::nullopt));  // to the end
  EXPECT_FALSE(h.AnyIn({2, 6}, std::nullopt));
  EXPECT_FALSE(h.AnyIn({0, 3}, ChunkId{0, 3}));  // empty
  EXPECT_FALSE(h.AnyIn({0, 9}, ChunkId{0, 2}));  // backwards
  EXPECT_TRUE(h.AnyIn({0, 7}, ChunkId{0, 4000}));  // past the tensor's chunks: its end
  EXPECT_FALSE(HeldChunks(Shape(), {}).AnyIn({0, 0}, std::nullopt));
}

TEST(HeldChunksTest, ObjectNamesBoundTheirChunksByTheSendersNextObject) {
  using enum ObjectChoice;
  const std::string p = "attempts/v0000000001/0000-ab/";
  auto key = [&](uint32_t sender, size_t index, std::optional<ChunkId> first) {
    return p + run_keys::FrameObject(sender, index, first);
  };
  const std::vector<std::string> keys = {
      key(0, 0, std::nullopt),  // from the start up to (0, 2): nothing held
      key(0, 1, ChunkId{0, 2}),  // [(0,2), (0,4)): held
      key(0, 2, ChunkId{0, 4}),  // [(0,4), (0,8)): nothing
      key(0, 3, ChunkId{0, 8}),  // sender 0's last listed, its first chunk held
      key(0, 5, ChunkId{2, 0}),  // object 6 not listed yet, (2,0) not held: open
      key(1, 0, std::nullopt),  // sender 1's only object: open
      key(2, 0, std::nullopt),  // sender 2: [start, (2,6)): held
      key(2, 1, ChunkId{2, 6}),  // open, (2,6) not held
      p + "frames/s3-0001.bin",  // an older publisher's names: fetched
      p + "frames/s3-0000.bin", p + "frames/other.bin",
  };
  const std::vector<ObjectChoice> want = {kSkip,  kFetch, kSkip,  kFetch, kWait, kWait,
                                          kFetch, kWait,  kFetch, kFetch, kFetch};
  EXPECT_EQ(ChooseByNames(keys, p, Held()), want);
  // Once the next object is listed, the open ones are decided.
  EXPECT_EQ(ChooseByNames({keys[4], key(0, 6, ChunkId{2, 5})}, p, Held()), (std::vector<ObjectChoice>{kSkip, kFetch}));
  EXPECT_EQ(ChooseByNames({keys[4], key(0, 6, ChunkId{2, 6})}, p, Held()), (std::vector<ObjectChoice>{kFetch, kWait}));
}

TEST(HeldChunksTest, TheManifestSaysWhichObjectsHoldNoHeldChunk) {
  DeltaManifest m = Shape();
  m.objects = {"frames/s0-0000.bin", "frames/s0-0001-t0c8.bin", "frames/s1-0000.bin"};
  auto frame = [](uint32_t t, uint32_t c, uint32_t object) {
    DeltaFrameEntry e;
    e.tensor = t, e.chunk = c, e.object = object;
    return e;
  };
  m.frames = {frame(0, 0, 0), frame(0, 1, 0), frame(0, 8, 1), frame(1, 0, 2), frame(2, 4, 2)};
  EXPECT_EQ(ObjectsWithoutHeldChunks(m, Held()), (std::vector<bool>{true, false, true}));
}

TEST(FrameObjectNamesTest, RoundTripAndRefuseOthers) {
  EXPECT_EQ(run_keys::FrameObject(3, 7), "frames/s3-0007.bin");
  EXPECT_EQ(run_keys::FrameObject(3, 12345, ChunkId{17, 4096}), "frames/s3-12345-t17c4096.bin");
  auto n = run_keys::ParseFrameObject("frames/s3-12345-t17c4096.bin");
  ASSERT_TRUE(n);
  EXPECT_EQ(n->sender, 3u);
  EXPECT_EQ(n->index, 12345u);
  ASSERT_TRUE(n->first);
  EXPECT_EQ(*n->first, (ChunkId{17, 4096}));
  n = run_keys::ParseFrameObject("frames/s0-0000.bin");
  ASSERT_TRUE(n);
  EXPECT_FALSE(n->first);
  for (const char* bad :
       {"frames/s0-000.bin", "frames/s-0000.bin", "frames/s0-0000", "frames/s0-0000-t1.bin", "frames/s0-0000-t1c.bin",
        "frames/s0-0000-t1c2.bin.x", "frames/s0-0000-tc2.bin", "frames/s99999999999-0000.bin", "s0-0000.bin",
        "frames/s0-0000-t1c2-.bin", "frames/p0.bin", "frames/s0-0000-t4294967296c0.bin", ""})
    EXPECT_FALSE(run_keys::ParseFrameObject(bad)) << bad;
}

}  // namespace
}  // namespace dcr::receiver_internal
