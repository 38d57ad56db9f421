#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dcr/layout.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

// A small valid map: a [4, 6] tensor split into two row halves of a [2, 6]
// buffer pair, plus a [3] norm copied whole twice (one primary).
LayoutMap Good() {
  LayoutMap m;
  m.tensors = {{"w", DType::kBF16, {4, 6}}, {"n", DType::kF32, {3}}};
  m.buffers = {
      {"a", DType::kBF16, {2, 6}}, {"b", DType::kBF16, {1, 2, 6}}, {"n0", DType::kF32, {3}}, {"n1", DType::kF32, {3}}};
  m.copies = {{"w", {0, 0}, {2, 6}, "a", {0, 0}, true},
              {"w", {2, 0}, {2, 6}, "b", {0, 0, 0}, true},
              {"n", {0}, {3}, "n0", {0}, true},
              {"n", {0}, {3}, "n1", {0}, false}};
  return m;
}

TEST(LayoutMapTest, GoodMapValidates) { EXPECT_TRUE(ValidateLayoutMap(Good()).ok()); }

struct BadCase {
  const char* name;
  void (*edit)(LayoutMap&);
  const char* error;  // a substring the message must hold
};

class BadMapTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadMapTest, RefusedWithAClearError) {
  LayoutMap m = Good();
  GetParam().edit(m);
  Status s = ValidateLayoutMap(m);
  ASSERT_FALSE(s.ok()) << GetParam().name;
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(GetParam().error)) << s.message();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadMapTest,
    ::testing::Values(
        BadCase{"duplicate tensor", [](LayoutMap& m) { m.tensors.push_back(m.tensors[0]); },
                "tensor #2 'w': declared twice"},
        BadCase{"duplicate buffer", [](LayoutMap& m) { m.buffers.push_back(m.buffers[0]); },
                "buffer #4 'a': declared twice"},
        BadCase{"empty buffer id", [](LayoutMap& m) { m.buffers[1].id = ""; }, "buffer #1: empty id"},
        BadCase{"sub-byte dtype", [](LayoutMap& m) { m.tensors[0].dtype = DType::kF4; }, "packed below a byte"},
        BadCase{"unknown tensor", [](LayoutMap& m) { m.copies[1].tensor = "x"; },
                "copy #1 (tensor 'x' -> buffer 'b'): the tensor is not declared"},
        BadCase{"unknown buffer", [](LayoutMap& m) { m.copies[0].buffer = "zz"; },
                "copy #0 (tensor 'w' -> buffer 'zz'): the buffer is not declared"},
        BadCase{"dtype differs", [](LayoutMap& m) { m.buffers[0].dtype = DType::kF16; },
                "the tensor is BF16 but the buffer is F16"},
        BadCase{"offset rank", [](LayoutMap& m) { m.copies[0].offset = {0}; }, "need 2 entries"},
        BadCase{"buffer offset rank",
                [](LayoutMap& m) {
                  m.copies[1].buffer_offset = {0, 0};
                },
                "needs 3 entries"},
        BadCase{"buffer rank too small",
                [](LayoutMap& m) {
                  m.buffers[2].shape = {};
                  m.copies[2].buffer_offset = {};
                },
                "fewer than the tensor's 1"},
        BadCase{"empty extent",
                [](LayoutMap& m) {
                  m.copies[0].extent = {0, 6};
                },
                "is empty in dimension 0"},
        BadCase{"box leaves tensor",
                [](LayoutMap& m) {
                  m.copies[1].offset = {3, 0};
                },
                "leaves tensor shape [4, 6] in dimension 0"},
        BadCase{"box offset overflows",
                [](LayoutMap& m) {
                  m.copies[1].offset = {UINT64_MAX, 0};
                },
                "leaves tensor shape"},
        BadCase{"buffer box leaves buffer",
                [](LayoutMap& m) {
                  m.copies[0].buffer_offset = {0, 1};
                },
                "leaves buffer shape [2, 6] in dimension 1"},
        BadCase{"two writers",
                [](LayoutMap& m) {
                  m.copies[1].buffer = "a";
                  m.copies[1].buffer_offset = {0, 0};
                },
                "copy #0 (tensor 'w' -> buffer 'a') and copy #1 (tensor 'w' -> buffer 'a') write the same elements"},
        BadCase{"partial overlap of writers",
                [](LayoutMap& m) {
                  m.copies[0] = {"w", {0, 0}, {1, 4}, "a", {0, 0}, true};
                  m.copies.push_back({"w", {1, 3}, {1, 3}, "a", {0, 3}, true});
                },
                "write the same elements of buffer 'a'"},
        BadCase{"two primaries", [](LayoutMap& m) { m.copies[3].primary = true; },
                "both primary for the same elements of tensor 'n'"},
        BadCase{"shape overflow",
                [](LayoutMap& m) {
                  m.buffers[0].shape = {UINT64_MAX, 3};
                },
                "overflows 64 bits"}),
    [](const auto& test_info) {
      std::string n = test_info.param.name;
      for (char& c : n)
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      return n;
    });

TEST(LayoutMapTest, DisjointNeighboursAreNotOverlaps) {
  LayoutMap m = Good();
  // Two copies into one buffer, side by side in the last dimension.
  m.buffers.push_back({"c", DType::kBF16, {4, 12}});
  m.copies.push_back({"w", {0, 0}, {4, 6}, "c", {0, 0}, false});
  m.copies.push_back({"w", {0, 0}, {4, 6}, "c", {0, 6}, false});
  EXPECT_TRUE(ValidateLayoutMap(m).ok()) << ValidateLayoutMap(m).ToString();
}

TEST(LayoutMapJsonTest, RoundTrips) {
  const LayoutMap m = Good();
  const std::string json = LayoutMapToJson(m);
  auto back = LayoutMapFromJson(json, "test.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, m);
  EXPECT_THAT(json, HasSubstr("\"primary\": false"));
}

TEST(LayoutMapJsonTest, ParserErrorsNameTheEntry) {
  struct Case {
    std::string json, error;
  };
  const std::string head = R"({"format": "dcr-layout", "format_version": 1, )";
  const std::vector<Case> cases = {
      {"[]", "not a JSON object"},
      {"{", "not a JSON object"},
      {R"({"format": "other", "format_version": 1})", "'format' is 'other'"},
      {R"({"format": "dcr-layout", "format_version": 9, "tensors": [], "buffers": [], "copies": []})", "version 9"},
      {head + R"("tensors": {}, "buffers": [], "copies": []})", "'tensors' must be an array"},
      {head + R"("tensors": [{"name": "t", "dtype": "BF99", "shape": [1]}], "buffers": [], "copies": []})",
       "tensors[0]: malformed layout map: unknown dtype 'BF99'"},
      {head + R"("tensors": [{"name": "t", "dtype": "BF16", "shape": [-1]}], "buffers": [], "copies": []})",
       "'shape' must hold non-negative integers"},
      {head + R"("tensors": [], "buffers": [{"id": 3, "dtype": "BF16", "shape": [1]}], "copies": []})",
       "buffers[0]: malformed layout map: 'id' must be a string"},
      {head + R"("tensors": [], "buffers": [], "copies": [{"tensor": "t", "buffer": "b", "offset": [0], "extent": [1],
          "buffer_offset": [0], "primary": 1}]})",
       "copies[0]: malformed layout map: 'primary' must be true or false"},
      {head + R"("tensors": [{"name": "t", "dtype": "BF16", "shape": [4]}], "buffers": [{"id": "b", "dtype": "BF16",
          "shape": [2]}], "copies": [{"tensor": "t", "buffer": "b", "offset": [0], "extent": [4], "buffer_offset": [0]}]})",
       "m.json: copy #0 (tensor 't' -> buffer 'b'): buffer box at [0] of extent 4 leaves buffer shape [2]"},
  };
  for (const Case& c : cases) {
    auto r = LayoutMapFromJson(c.json, "m.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_THAT(r.status().message(), HasSubstr(c.error)) << c.json;
  }
}

// Runs: exact stretches for boxes, table-driven.
struct RunCase {
  const char* name;
  std::vector<uint64_t> tensor_shape, buffer_shape, offset, extent, buffer_offset;
  uint64_t first, count;
  std::vector<CopyRun> runs;
};

class RunsTest : public ::testing::TestWithParam<RunCase> {};

TEST_P(RunsTest, ExactRuns) {
  const RunCase& c = GetParam();
  LayoutMap m;
  m.tensors = {{"t", DType::kBF16, c.tensor_shape}};
  m.buffers = {{"b", DType::kBF16, c.buffer_shape}};
  m.copies = {{"t", c.offset, c.extent, "b", c.buffer_offset, true}};
  auto l = CompiledLayout::Compile(m);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  std::vector<CopyRun> got;
  l->RunsInRange(0, c.first, c.count, &got);
  ASSERT_EQ(got.size(), c.runs.size()) << c.name;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].canonical, c.runs[i].canonical) << c.name << " run " << i;
    EXPECT_EQ(got[i].buffer, c.runs[i].buffer) << c.name << " run " << i;
    EXPECT_EQ(got[i].length, c.runs[i].length) << c.name << " run " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RunsTest,
    ::testing::Values(
        // Row block of full rows: one merged run.
        RunCase{"rows", {4, 6}, {2, 6}, {2, 0}, {2, 6}, {0, 0}, 0, 24, {{12, 0, 12}}},
        // Column narrow (row-parallel): one run per row.
        RunCase{"cols", {3, 6}, {3, 2}, {0, 4}, {3, 2}, {0, 0}, 0, 18, {{4, 0, 2}, {10, 2, 2}, {16, 4, 2}}},
        // Clipped by the range on both ends.
        RunCase{"clipped", {3, 6}, {3, 2}, {0, 4}, {3, 2}, {0, 0}, 5, 7, {{5, 1, 1}, {10, 2, 2}}},
        // Range past the box: nothing.
        RunCase{"outside", {4, 6}, {2, 6}, {2, 0}, {2, 6}, {0, 0}, 0, 12, {}},
        // Into a stack slot with padding columns: rows are not merged.
        RunCase{"stack", {2, 3}, {2, 2, 4}, {0, 0}, {2, 3}, {1, 0, 1}, 0, 6, {{0, 9, 3}, {3, 13, 3}}},
        // 3-D box whose inner two dimensions are full on both sides.
        RunCase{"3d", {3, 2, 2}, {2, 2, 2}, {1, 0, 0}, {2, 2, 2}, {0, 0, 0}, 4, 8, {{4, 0, 8}}},
        // A scalar.
        RunCase{"scalar", {}, {2}, {}, {}, {1}, 0, 1, {{0, 1, 1}}}),
    [](const auto& test_info) { return std::string(test_info.param.name); });

TEST(ValidateEngineTest, PrimariesMustCoverOnce) {
  std::vector<TensorInfo> tensors = {*MakeTensorInfo("w", DType::kBF16, {4, 6}), *MakeTensorInfo("n", DType::kF32, {3}),
                                     *MakeTensorInfo("r", DType::kF32, {2})};
  auto a = CompiledLayout::Compile(Good());
  ASSERT_TRUE(a.ok());
  std::vector<std::string> unmapped;
  const CompiledLayout* one[] = {&*a};
  ASSERT_TRUE(ValidateEngine(one, tensors, &unmapped).ok());
  EXPECT_EQ(unmapped, std::vector<std::string>{"r"});
  // Two ranks with the same map: every element is primary twice.
  const CompiledLayout* two[] = {&*a, &*a};
  Status s = ValidateEngine(two, tensors);
  EXPECT_THAT(s.message(), HasSubstr("tensor 'w': ranks 0 and 1 both hold primary copies"));
  // A rank holding half of w only.
  LayoutMap half = Good();
  half.copies.erase(half.copies.begin() + 1);
  auto h = CompiledLayout::Compile(half);
  ASSERT_TRUE(h.ok());
  const CompiledLayout* partial[] = {&*h};
  EXPECT_THAT(ValidateEngine(partial, tensors).message(),
              HasSubstr("tensor 'w': the engine's primary copies cover 12 of its 24"));
  // Shape disagreement with the checkpoint.
  tensors[0] = *MakeTensorInfo("w", DType::kBF16, {4, 7});
  EXPECT_THAT(ValidateEngine(one, tensors).message(),
              HasSubstr("tensor 'w' is BF16 [4, 6] in the map but BF16 [4, 7]"));
}

}  // namespace
}  // namespace dcr
