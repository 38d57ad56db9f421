// Tiny model shapes for the layout tests: every split dcr's generators make
// divides them at tensor-parallel 1, 2 and 4, and their experts (6) split
// unevenly over 4 expert-parallel ranks.
#pragma once

#include "dcr/synth.h"

namespace dcr::testshapes {

inline ModelShape LlamaShape() {
  ModelShape s;
  s.family = Family::kLlama;
  s.hidden_size = 8;
  s.num_layers = 2;
  s.vocab_size = 10;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 2;
  s.intermediate_size = 8;
  return s;
}

inline ModelShape QwenShape() {
  ModelShape s = LlamaShape();
  s.family = Family::kQwen3Moe;
  s.num_experts = 6;
  s.moe_intermediate_size = 4;
  return s;
}

inline ModelShape DeepseekShape() {
  ModelShape s;
  s.family = Family::kDeepseekV3;
  s.hidden_size = 8;
  s.num_layers = 3;
  s.vocab_size = 10;
  s.num_heads = 4;
  s.num_kv_heads = 4;
  s.intermediate_size = 8;
  s.num_experts = 6;
  s.moe_intermediate_size = 4;
  s.num_shared_experts = 1;
  s.first_dense_layers = 1;
  s.q_lora_rank = 4;
  s.kv_lora_rank = 4;
  s.qk_nope_head_dim = 2;
  s.qk_rope_head_dim = 1;
  s.v_head_dim = 2;
  return s;
}

}  // namespace dcr::testshapes
