// Layout maps (DESIGN section 6; docs/layouts.md): box copies between
// canonical checkpoint tensors and one process's local buffers (a trainer
// rank's shards, or a serving rank's fused, sharded parameters).
//
// A map is data. Each copy moves a box of a canonical tensor (offset and
// extent per dimension) to a box of a buffer of the same dtype; the buffer
// box has the same extent, left-padded with 1s when the buffer has more
// dimensions (an expert stack [E, rows, cols] holds one expert's [rows, cols]
// at [e, r0, c0]). Copies move bits unchanged, so xor/add deltas are valid
// through them. One canonical box may have several destinations (a tied
// embedding, a replicated norm); exactly one copy of each canonical element
// per engine is *primary*: it is the one a sender projects from and the one
// the engine's digest counts (see ValidateEngine).
//
// Everything here is a pure function of its inputs; no I/O. Thread-safety:
// const objects may be shared between threads.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/dtype.h"
#include "dcr/safetensors.h"
#include "dcr/status.h"

namespace dcr {

inline constexpr std::string_view kLayoutFormat = "dcr-layout";
inline constexpr uint32_t kLayoutFormatVersion = 1;

// A canonical tensor a map refers to (as in the checkpoint).
struct LayoutTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  friend bool operator==(const LayoutTensor&, const LayoutTensor&) = default;
};

// A local buffer: a dense row-major array.
struct LayoutBuffer {
  std::string id;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  friend bool operator==(const LayoutBuffer&, const LayoutBuffer&) = default;
};

struct BoxCopy {
  std::string tensor;
  std::vector<uint64_t> offset, extent;  // the canonical box; one entry per tensor dimension
  std::string buffer;
  std::vector<uint64_t> buffer_offset;  // where the box starts in the buffer; one entry per buffer dimension
  bool primary = true;  // the engine's one copy of these elements (see above)
  friend bool operator==(const BoxCopy&, const BoxCopy&) = default;
};

struct LayoutMap {
  std::vector<LayoutTensor> tensors;  // every tensor a copy names, each once
  std::vector<LayoutBuffer> buffers;  // every buffer of the process, mapped or not, each once
  std::vector<BoxCopy> copies;
  friend bool operator==(const LayoutMap&, const LayoutMap&) = default;
};

// Checks a map on its own: names unique and non-empty; dtypes whole-byte
// (sub-byte F4/F6 are packed and cannot be boxed); every copy names a
// declared tensor and buffer of the same dtype, with ranks that fit (buffer
// rank >= tensor rank), non-empty extents, the canonical box inside its
// tensor and the buffer box inside its buffer; no two copies write the same
// buffer element; no two primary copies read the same canonical element.
// Errors (kInvalidArgument) name the copy by index, tensor and buffer, and
// say what to change.
Status ValidateLayoutMap(const LayoutMap& map);

// The JSON form (docs/layouts.md). FromJson validates (ValidateLayoutMap);
// `where` names the source in errors. Never throws.
std::string LayoutMapToJson(const LayoutMap& map);
Result<LayoutMap> LayoutMapFromJson(std::string_view json, const std::string& where);

// A contiguous stretch of elements: canonical elements [canonical,
// canonical + length) of a tensor are buffer elements [buffer, buffer +
// length) of a buffer (flat row-major indices).
struct CopyRun {
  uint64_t canonical = 0, buffer = 0, length = 0;
};

// A validated map with indices and strides resolved, for the apply and
// projection loops.
class CompiledLayout {
 public:
  // Validates (ValidateLayoutMap) and resolves.
  static Result<CompiledLayout> Compile(LayoutMap map);

  const LayoutMap& map() const { return map_; }
  // Index of a tensor / buffer in map().tensors / map().buffers, or -1.
  int64_t FindTensor(std::string_view name) const;
  int64_t FindBuffer(std::string_view id) const;
  // Copies (indices into map().copies) reading tensor t, in map order.
  const std::vector<uint32_t>& CopiesOf(size_t tensor) const { return by_tensor_[tensor]; }
  size_t BufferOf(size_t copy) const { return resolved_[copy].buffer; }
  uint64_t ElementBytes(size_t tensor) const;
  uint64_t BufferBytes(size_t buffer) const;

  // Appends to `out` the runs of copy `copy` that fall inside canonical
  // elements [first, first + count), in increasing canonical order, split
  // at the range's ends. Runs are as long as both layouts allow (trailing
  // dimensions the box spans entirely on both sides are merged).
  void RunsInRange(size_t copy, uint64_t first, uint64_t count, std::vector<CopyRun>* out) const;

 private:
  struct Resolved {
    size_t tensor = 0, buffer = 0;
    // Per merged dimension: extent, canonical stride, buffer stride (elements);
    // the last is contiguous on both sides (stride 1) and spans `inner`.
    std::vector<uint64_t> extent, canonical_stride, buffer_stride;
    uint64_t canonical_origin = 0, buffer_origin = 0;
  };
  void Runs(const Resolved& r, size_t dim, uint64_t canonical, uint64_t buffer, uint64_t first, uint64_t end,
            std::vector<CopyRun>* out) const;

  LayoutMap map_;
  std::vector<Resolved> resolved_;
  std::vector<std::vector<uint32_t>> by_tensor_;
};

// Checks that the maps of one engine (its ranks) fit a checkpoint: every
// tensor a map names is in `tensors` with the same dtype and shape, and for
// every tensor the primary copies of all ranks together cover each element
// exactly once (so the ranks' partial digests add up to the checkpoint's).
// Tensors no rank maps are reported, not refused: `*unmapped` (optional)
// receives their names (residuals, DESIGN section 6). Errors name the tensor
// and the ranks involved.
Status ValidateEngine(std::span<const CompiledLayout* const> ranks, std::span<const TensorInfo> tensors,
                      std::vector<std::string>* unmapped = nullptr);

}  // namespace dcr
