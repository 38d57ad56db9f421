#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>
#include "dcr/layout_families.h"

#include <map>

#include "layout/test_shapes.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;
using testshapes::DeepseekShape;
using testshapes::LlamaShape;
using testshapes::QwenShape;

// The copies of `tensor` in `map`, in map order.
std::vector<BoxCopy> CopiesOf(const LayoutMap& map, const std::string& tensor) {
  std::vector<BoxCopy> out;
  for (const BoxCopy& c : map.copies)
    if (c.tensor == tensor) out.push_back(c);
  return out;
}

const LayoutBuffer* BufferNamed(const LayoutMap& map, const std::string& id) {
  for (const LayoutBuffer& b : map.buffers)
    if (b.id == id) return &b;
  return nullptr;
}

TEST(ExpertsOfRankTest, ContiguousWithTheRemainderFirst) {
  struct Case {
    uint64_t experts;
    uint32_t ranks;
    std::vector<ExpertRange> want;
  };
  const std::vector<Case> cases = {
      {6, 4, {{0, 2}, {2, 2}, {4, 1}, {5, 1}}},
      {8, 4, {{0, 2}, {2, 2}, {4, 2}, {6, 2}}},
      {3, 4, {{0, 1}, {1, 1}, {2, 1}, {3, 0}}},
      {5, 1, {{0, 5}}},
  };
  for (const Case& c : cases)
    for (uint32_t r = 0; r < c.ranks; ++r)
      EXPECT_EQ(ExpertsOfRank(c.experts, c.ranks, r), c.want[r]) << c.experts << "/" << c.ranks << " rank " << r;
}

// One expected copy of a tensor in a generated map.
struct WantCopy {
  std::string tensor;
  std::vector<uint64_t> offset, extent;
  std::string buffer;
  std::vector<uint64_t> buffer_offset;
  bool primary;
};

struct FamilyCase {
  std::string name;
  ModelShape shape;
  bool megatron;  // else vLLM
  TrainerParallel trainer;
  TrainerRank trainer_rank;
  ServingParallel serving;
  uint32_t serving_rank;
  std::vector<WantCopy> want;  // every copy of these tensors, in order
  std::vector<std::pair<std::string, std::vector<uint64_t>>> buffers;  // buffer shapes
};

class FamilyMapTest : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(FamilyMapTest, ExactBoxes) {
  const FamilyCase& c = GetParam();
  auto map =
      c.megatron ? MegatronLayout(c.shape, c.trainer, c.trainer_rank) : VllmLayout(c.shape, c.serving, c.serving_rank);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  std::map<std::string, std::vector<BoxCopy>> want;
  for (const WantCopy& w : c.want) {
    auto& copies = want[w.tensor];
    if (!w.buffer.empty()) copies.push_back({w.tensor, w.offset, w.extent, w.buffer, w.buffer_offset, w.primary});
  }
  for (const auto& [tensor, copies] : want) EXPECT_EQ(CopiesOf(*map, tensor), copies) << tensor;
  for (const auto& [id, shape] : c.buffers) {
    const LayoutBuffer* b = BufferNamed(*map, id);
    ASSERT_NE(b, nullptr) << id;
    EXPECT_EQ(b->shape, shape) << id;
  }
}

const std::string kQ = "model.layers.0.self_attn.q_proj.weight", kK = "model.layers.0.self_attn.k_proj.weight",
                  kV = "model.layers.0.self_attn.v_proj.weight";

INSTANTIATE_TEST_SUITE_P(
    Cases, FamilyMapTest,
    ::testing::Values(
        // Megatron fused QKV, tp 2, rank 1: its one query group (group 1): q heads 2-3, then k head 1, then v head 1.
        FamilyCase{"megatron_qkv_tp2_rank1",
                   LlamaShape(),
                   true,
                   {2, 1, 1, false, 4},
                   {0, 0, 1},
                   {},
                   0,
                   {{kQ, {4, 0}, {4, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {0, 0}, true},
                    {kK, {2, 0}, {2, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {4, 0}, true},
                    {kV, {2, 0}, {2, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {6, 0}, true}},
                   {{"decoder.layers.0.self_attention.linear_qkv.weight", {8, 8}}}},
        // tp 1: both groups interleaved q q k v | q q k v.
        FamilyCase{"megatron_qkv_tp1",
                   LlamaShape(),
                   true,
                   {1, 1, 1, false, 4},
                   {0, 0, 0},
                   {},
                   0,
                   {{kQ, {0, 0}, {4, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {0, 0}, true},
                    {kQ, {4, 0}, {4, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {8, 0}, true},
                    {kK, {0, 0}, {2, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {4, 0}, true},
                    {kK, {2, 0}, {2, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {12, 0}, true},
                    {kV, {0, 0}, {2, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {6, 0}, true},
                    {kV, {2, 0}, {2, 8}, "decoder.layers.0.self_attention.linear_qkv.weight", {14, 0}, true}},
                   {}},
        // Gate/up fused per shard, down row-parallel; vocab 10 padded to 16 (4 x tp), rank 1 holds rows 8-9;
        // replicated norm: ep 1's copy is not primary; pipeline stage 1 of 2 holds layer 1 as local layer 0.
        FamilyCase{
            "megatron_mlp_vocab_pp",
            LlamaShape(),
            true,
            {2, 2, 2, false, 4},
            {1, 1, 1},
            {},
            0,
            {{"model.layers.1.mlp.gate_proj.weight",
              {4, 0},
              {4, 8},
              "decoder.layers.0.mlp.linear_fc1.weight",
              {0, 0},
              false},
             {"model.layers.1.mlp.up_proj.weight",
              {4, 0},
              {4, 8},
              "decoder.layers.0.mlp.linear_fc1.weight",
              {4, 0},
              false},
             {"model.layers.1.mlp.down_proj.weight",
              {0, 4},
              {8, 4},
              "decoder.layers.0.mlp.linear_fc2.weight",
              {0, 0},
              false},
             {"lm_head.weight", {8, 0}, {2, 8}, "output_layer.weight", {0, 0}, false},
             {"model.layers.1.input_layernorm.weight", {0}, {8}, "decoder.layers.0.input_layernorm.weight", {0}, false},
             {"model.layers.0.input_layernorm.weight", {}, {}, "", {}, false}},
            {{"output_layer.weight", {8, 8}}, {"decoder.layers.0.mlp.linear_fc1.weight", {8, 8}}}},
        // Experts on ep rank 2 of 4 (6 experts: 2, 2, 1, 1): global expert 4 is local expert 0; expert tp splits it.
        FamilyCase{
            "megatron_experts_etp",
            QwenShape(),
            true,
            {2, 1, 4, true, 4},
            {0, 2, 1},
            {},
            0,
            {{"model.layers.0.mlp.experts.4.gate_proj.weight",
              {2, 0},
              {2, 8},
              "decoder.layers.0.mlp.experts.linear_fc1.weight0",
              {0, 0},
              true},
             {"model.layers.0.mlp.experts.4.up_proj.weight",
              {2, 0},
              {2, 8},
              "decoder.layers.0.mlp.experts.linear_fc1.weight0",
              {2, 0},
              true},
             {"model.layers.0.mlp.experts.4.down_proj.weight",
              {0, 2},
              {8, 2},
              "decoder.layers.0.mlp.experts.linear_fc2.weight0",
              {0, 0},
              true},
             {"model.layers.0.mlp.experts.3.up_proj.weight", {}, {}, "", {}, false},
             {"model.layers.0.mlp.gate.weight", {0, 0}, {6, 8}, "decoder.layers.0.mlp.router.weight", {0, 0}, false}},
            {}},
        // vLLM tp 4 > 2 kv heads: rank 1 holds q heads 1 (rows 2-3) and a non-primary replica of kv head 0.
        FamilyCase{"vllm_kv_replicated",
                   LlamaShape(),
                   false,
                   {},
                   {},
                   {4, false, 16},
                   1,
                   {{kQ, {2, 0}, {2, 8}, "model.layers.0.self_attn.qkv_proj.weight", {0, 0}, true},
                    {kK, {0, 0}, {2, 8}, "model.layers.0.self_attn.qkv_proj.weight", {2, 0}, false},
                    {kV, {0, 0}, {2, 8}, "model.layers.0.self_attn.qkv_proj.weight", {4, 0}, false},
                    {"model.embed_tokens.weight", {4, 0}, {4, 8}, "model.embed_tokens.weight", {0, 0}, true}},
                   {{"model.layers.0.self_attn.qkv_proj.weight", {6, 8}}, {"model.embed_tokens.weight", {4, 8}}}},
        // vLLM tp 4, rank 2: the primary copy of kv head 1; the last vocab rows are padding (rank 3 holds none).
        FamilyCase{"vllm_kv_primary",
                   LlamaShape(),
                   false,
                   {},
                   {},
                   {4, false, 16},
                   2,
                   {{kK, {2, 0}, {2, 8}, "model.layers.0.self_attn.qkv_proj.weight", {2, 0}, true},
                    {"model.embed_tokens.weight", {8, 0}, {2, 8}, "model.embed_tokens.weight", {0, 0}, true}},
                   {}},
        // vLLM EP over 4 ranks: rank 2 holds expert 4 alone, stacked as w13 = [gate; up] and w2.
        FamilyCase{"vllm_expert_map",
                   QwenShape(),
                   false,
                   {},
                   {},
                   {4, true, 4},
                   2,
                   {{"model.layers.1.mlp.experts.4.gate_proj.weight",
                     {0, 0},
                     {4, 8},
                     "model.layers.1.mlp.experts.w13_weight",
                     {0, 0, 0},
                     true},
                    {"model.layers.1.mlp.experts.4.up_proj.weight",
                     {0, 0},
                     {4, 8},
                     "model.layers.1.mlp.experts.w13_weight",
                     {0, 4, 0},
                     true},
                    {"model.layers.1.mlp.experts.4.down_proj.weight",
                     {0, 0},
                     {8, 4},
                     "model.layers.1.mlp.experts.w2_weight",
                     {0, 0, 0},
                     true},
                    {"model.layers.1.mlp.experts.5.gate_proj.weight", {}, {}, "", {}, false}},
                   {{"model.layers.1.mlp.experts.w13_weight", {1, 8, 8}},
                    {"model.layers.1.mlp.experts.w2_weight", {1, 8, 4}}}},
        // vLLM without EP, tp 2: every expert narrowed; expert 1 is slot 1 of the stack.
        FamilyCase{"vllm_experts_tp",
                   QwenShape(),
                   false,
                   {},
                   {},
                   {2, false, 4},
                   1,
                   {{"model.layers.0.mlp.experts.1.gate_proj.weight",
                     {2, 0},
                     {2, 8},
                     "model.layers.0.mlp.experts.w13_weight",
                     {1, 0, 0},
                     true},
                    {"model.layers.0.mlp.experts.1.up_proj.weight",
                     {2, 0},
                     {2, 8},
                     "model.layers.0.mlp.experts.w13_weight",
                     {1, 2, 0},
                     true},
                    {"model.layers.0.mlp.experts.1.down_proj.weight",
                     {0, 2},
                     {8, 2},
                     "model.layers.0.mlp.experts.w2_weight",
                     {1, 0, 0},
                     true}},
                   {{"model.layers.0.mlp.experts.w13_weight", {6, 4, 8}}}},
        // DeepSeek MLA on vLLM tp 2, rank 1: fused q_a + kv_a (replica), q_b/kv_b by heads, o_proj by columns.
        FamilyCase{"vllm_mla",
                   DeepseekShape(),
                   false,
                   {},
                   {},
                   {2, false, 4},
                   1,
                   {{"model.layers.0.self_attn.q_a_proj.weight",
                     {0, 0},
                     {4, 8},
                     "model.layers.0.self_attn.fused_qkv_a_proj.weight",
                     {0, 0},
                     false},
                    {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                     {0, 0},
                     {5, 8},
                     "model.layers.0.self_attn.fused_qkv_a_proj.weight",
                     {4, 0},
                     false},
                    {"model.layers.0.self_attn.q_b_proj.weight",
                     {6, 0},
                     {6, 4},
                     "model.layers.0.self_attn.q_b_proj.weight",
                     {0, 0},
                     true},
                    {"model.layers.0.self_attn.kv_b_proj.weight",
                     {8, 0},
                     {8, 4},
                     "model.layers.0.self_attn.kv_b_proj.weight",
                     {0, 0},
                     true},
                    {"model.layers.0.self_attn.o_proj.weight",
                     {0, 4},
                     {8, 4},
                     "model.layers.0.self_attn.o_proj.weight",
                     {0, 0},
                     true},
                    {"model.layers.1.mlp.gate.e_score_correction_bias",
                     {0},
                     {6},
                     "model.layers.1.mlp.gate.e_score_correction_bias",
                     {0},
                     false}},
                   {{"model.layers.0.self_attn.fused_qkv_a_proj.weight", {9, 8}}}},
        // DeepSeek on Megatron tp 2: MLA down projections replicated (primary on tp 0), up projections by heads.
        FamilyCase{"megatron_mla",
                   DeepseekShape(),
                   true,
                   {2, 1, 1, false, 4},
                   {0, 0, 0},
                   {},
                   0,
                   {{"model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                     {0, 0},
                     {5, 8},
                     "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
                     {0, 0},
                     true},
                    {"model.layers.0.self_attn.q_b_proj.weight",
                     {0, 0},
                     {6, 4},
                     "decoder.layers.0.self_attention.linear_q_up_proj.weight",
                     {0, 0},
                     true},
                    {"model.layers.0.self_attn.q_a_layernorm.weight",
                     {0},
                     {4},
                     "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
                     {0},
                     true},
                    {"model.layers.1.mlp.shared_experts.gate_proj.weight",
                     {0, 0},
                     {2, 8},
                     "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                     {0, 0},
                     true}},
                   {}}),
    [](const auto& test_info) { return test_info.param.name; });

// A WantCopy with an empty buffer means "no copies of this tensor here".
TEST(FamilyMapTest, AbsentTensorsHaveNoCopies) {
  auto map = VllmLayout(QwenShape(), {4, true, 4}, 2);
  ASSERT_TRUE(map.ok());
  EXPECT_TRUE(CopiesOf(*map, "model.layers.1.mlp.experts.5.gate_proj.weight").empty());
  EXPECT_EQ(CopiesOf(*map, "model.layers.1.mlp.experts.4.gate_proj.weight").size(), 1u);
}

TEST(FamilyMapTest, RefusesSplitsThatDoNotDivide) {
  auto r = MegatronLayout(LlamaShape(), {4, 1, 1, false, 4}, {0, 0, 0});  // 2 query groups over tp 4
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(),
              HasSubstr("num_kv_heads (query groups) = 2 is not divisible by tensor-parallel size = 4"));
  r = VllmLayout(LlamaShape(), {3, false, 4}, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("num_heads = 4 is not divisible by tensor-parallel size = 3"));
  r = VllmLayout(LlamaShape(), {2, false, 4}, 2);
  EXPECT_THAT(r.status().message(), HasSubstr("serving rank 2 is outside tensor-parallel size 2"));
}

// Every rank grid, every family: the ranks' primary copies cover every
// tensor of the checkpoint exactly once, nothing is left unmapped, and the
// JSON form round-trips.
TEST(FamilyMapTest, EveryGridCoversTheCheckpointOnce) {
  struct Grid {
    ModelShape shape;
    std::vector<TrainerParallel> trainers;
    std::vector<ServingParallel> servers;
  };
  const std::vector<Grid> grids = {
      {LlamaShape(),
       {{1, 1, 1, false, 4}, {2, 2, 1, false, 4}, {2, 1, 4, false, 4}},
       {{1, false, 4}, {2, false, 4}, {4, false, 4}}},
      {QwenShape(),
       {{2, 1, 4, false, 4}, {2, 2, 4, true, 4}, {1, 2, 2, false, 4}},
       {{1, false, 4}, {2, true, 4}, {4, true, 4}, {4, false, 4}}},
      {DeepseekShape(), {{2, 1, 4, false, 4}, {2, 2, 4, true, 4}}, {{1, false, 4}, {2, false, 4}, {4, true, 4}}},
  };
  for (const Grid& g : grids) {
    std::vector<TensorInfo> tensors;
    for (const SynthTensor& t : ModelTensors(g.shape)) tensors.push_back(t.info);
    auto check = [&](std::vector<LayoutMap> maps, const std::string& what) {
      std::vector<CompiledLayout> compiled;
      for (LayoutMap& m : maps) {
        auto back = LayoutMapFromJson(LayoutMapToJson(m), what);
        ASSERT_TRUE(back.ok()) << back.status().ToString();
        EXPECT_EQ(*back, m) << what;
        auto c = CompiledLayout::Compile(std::move(m));
        ASSERT_TRUE(c.ok()) << c.status().ToString();
        compiled.push_back(std::move(*c));
      }
      std::vector<const CompiledLayout*> ptrs;
      for (const auto& c : compiled) ptrs.push_back(&c);
      std::vector<std::string> unmapped;
      Status s = ValidateEngine(ptrs, tensors, &unmapped);
      EXPECT_TRUE(s.ok()) << what << ": " << s.ToString();
      EXPECT_TRUE(unmapped.empty()) << what << ": " << unmapped.size() << " unmapped, first " << unmapped[0];
    };
    for (const TrainerParallel& p : g.trainers) {
      std::vector<LayoutMap> maps;
      for (const TrainerRank& r : TrainerRanks(p)) {
        auto m = MegatronLayout(g.shape, p, r);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        maps.push_back(std::move(*m));
      }
      check(std::move(maps), fmt::format("{} megatron tp {} pp {} ep {} etp {}", FamilyName(g.shape.family), p.tp, p.pp,
                                         p.ep, p.expert_tp));
    }
    for (const ServingParallel& p : g.servers) {
      std::vector<LayoutMap> maps;
      for (uint32_t r = 0; r < p.tp; ++r) {
        auto m = VllmLayout(g.shape, p, r);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        maps.push_back(std::move(*m));
      }
      check(std::move(maps), fmt::format("{} vllm tp {} ep {}", FamilyName(g.shape.family), p.tp, p.expert_parallel));
    }
  }
}

}  // namespace
}  // namespace dcr
