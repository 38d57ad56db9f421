// Layout map generators for the model families dcr generates (synth.h:
// llama, qwen3-moe, deepseek-v3), trainer side (Megatron-style shards) and
// receiver side (vLLM-style fused parameters). Pure functions; the buffer
// names and the exact boxes are documented in docs/layouts.md.
#pragma once

#include <cstdint>
#include <vector>

#include "dcr/layout.h"
#include "dcr/status.h"
#include "dcr/synth.h"

namespace dcr {

// The experts an expert-parallel rank holds: [first, first + count), the
// global experts in contiguous blocks, the first (experts % ranks) ranks
// holding one more (vLLM's linear expert map). Local expert i of the rank is
// global expert first + i.
struct ExpertRange {
  uint64_t first = 0, count = 0;
  friend bool operator==(const ExpertRange&, const ExpertRange&) = default;
};
ExpertRange ExpertsOfRank(uint64_t experts, uint32_t ranks, uint32_t rank);

// A Megatron-style trainer: a grid of pp x ep x tp ranks.
//  - Pipeline stage s owns a contiguous range of layers (the first
//    layers % pp stages one more), numbered locally from 0; stage 0 holds the
//    embedding, the last stage the final norm and the output layer.
//  - Attention, dense MLPs, shared experts, embedding and output are split
//    over tp (column-parallel: rows; row-parallel: columns; the vocabulary
//    padded to a multiple of vocab_multiple * tp and split by rows) and
//    replicated over ep: ep rank 0 holds the primary copies.
//  - Fused QKV interleaves per query group: q heads of the group, then its k
//    head, then its v head (query groups = kv heads, split over tp).
//  - Gate/up are fused per shard: the shard's gate rows, then its up rows.
//  - Routed experts: ep rank r holds ExpertsOfRank(experts, ep, r), as local
//    experts 0..count-1; with expert_tp, each expert's fc1/fc2 is split over
//    tp like a dense MLP, otherwise every tp rank holds whole experts and tp
//    rank 0 is primary.
//  - Norms and routers (and MLA's down projections, which Megatron does not
//    split) are replicated on every rank of the stage; (ep 0, tp 0) is primary.
struct TrainerParallel {
  uint32_t tp = 1, pp = 1, ep = 1;
  bool expert_tp = false;
  uint64_t vocab_multiple = 128;
};
struct TrainerRank {
  uint32_t pp = 0, ep = 0, tp = 0;
  friend bool operator==(const TrainerRank&, const TrainerRank&) = default;
};
// Every rank of the grid, pp-major then ep then tp.
std::vector<TrainerRank> TrainerRanks(const TrainerParallel& parallel);
// The first layer and layer count of pipeline stage `stage`.
void StageLayers(uint64_t layers, uint32_t pp, uint32_t stage, uint64_t* first, uint64_t* count);
// Errors (kInvalidArgument): a dimension the split needs divisible is not
// (named, with the sizes), or the rank is outside the grid.
Result<LayoutMap> MegatronLayout(const ModelShape& shape, const TrainerParallel& parallel, const TrainerRank& rank);

// A vLLM-style engine of tp ranks.
//  - qkv_proj fuses the rank's q heads, then its kv heads' k, then v; when
//    tp exceeds the kv heads, each kv head is replicated on tp / kv ranks
//    (the first of them primary).
//  - gate_up_proj fuses the rank's gate rows, then up rows; o_proj/down_proj
//    are narrowed by columns.
//  - MoE experts are stacked: w13_weight [local experts, 2 * width, hidden]
//    (gate rows then up rows of each expert) and w2_weight [local experts,
//    hidden, width]; with expert_parallel the experts are spread over the tp
//    ranks by ExpertsOfRank (the expert map) and not split, otherwise every
//    rank holds every expert narrowed by tp.
//  - The vocabulary is padded to a multiple of vocab_multiple and split by
//    rows; padding rows are not mapped.
//  - DeepSeek MLA: fused_qkv_a_proj [q_lora + kv_lora + rope, hidden] (q_a_proj
//    rows then kv_a_proj_with_mqa rows), replicated; q_b_proj and kv_b_proj
//    split by rows (heads), o_proj by columns.
//  - Norms, routers and replicated projections are on every rank; rank 0 is
//    primary.
struct ServingParallel {
  uint32_t tp = 1;
  bool expert_parallel = false;
  uint64_t vocab_multiple = 64;
};
Result<LayoutMap> VllmLayout(const ModelShape& shape, const ServingParallel& parallel, uint32_t rank);

}  // namespace dcr
