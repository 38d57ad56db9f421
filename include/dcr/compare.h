// Bit-level comparison of two versions of tensors: which elements' stored
// bits differ, in which fields, and by how many units in the last place.
// Comparison is on integer views: +0/-0 differ, NaN patterns compare by bits.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "dcr/checkpoint.h"
#include "dcr/dtype.h"

namespace dcr {

class Progress;
class ThreadPool;

struct BitDiffStats {
  uint64_t elements = 0;
  uint64_t changed = 0;  // elements whose stored bits differ
  uint64_t sign_changed = 0;  // floats: elements whose sign bit differs
  uint64_t exponent_changed = 0;  // floats: ... whose exponent field differs
  uint64_t mantissa_changed = 0;  // floats: ... whose mantissa field differs
  // Largest distance between old and new: for floats in units in the last
  // place (difference of OrderedImage; -0 to +0 is 1, NaNs order beyond the
  // infinities), for integers the absolute difference. C64: max over lanes.
  uint64_t max_ulp = 0;
  uint64_t first_changed = std::numeric_limits<uint64_t>::max();  // element index

  // Adds `other`, whose elements follow this one's (first_changed is offset).
  void Append(const BitDiffStats& other);
  friend bool operator==(const BitDiffStats&, const BitDiffStats&) = default;
};

// Compares `numel` elements of `dtype` stored in `a` and `b` (each exactly
// ByteSize(dtype, numel) bytes). Precondition: sizes match.
BitDiffStats CompareBits(DType dtype, uint64_t numel, std::span<const uint8_t> a, std::span<const uint8_t> b);

struct TensorDiff {
  std::string name;
  DType dtype;
  BitDiffStats stats;
};

struct CheckpointDiff {
  std::vector<TensorDiff> tensors;  // tensors present in both with equal dtype and shape, by name
  BitDiffStats total;  // over `tensors` (first_changed unused)
  std::vector<std::string> only_in_a, only_in_b;
  std::vector<std::string> mismatched;  // same name, different dtype or shape: "name: BF16[2,3] vs F32[6]"
  bool identical() const { return total.changed == 0 && only_in_a.empty() && only_in_b.empty() && mismatched.empty(); }
};

// Compares every tensor of `a` with its namesake in `b`, in parallel on
// `pool` (null: DefaultPool()). `progress` (may be null) receives bytes of
// `a` compared.
CheckpointDiff DiffCheckpoints(const Checkpoint& a, const Checkpoint& b, Progress* progress = nullptr,
                               ThreadPool* pool = nullptr);

}  // namespace dcr
