// FP8 engines (DESIGN, "FP8 engines"): a rank that serves block-FP8 weights
// takes the ordinary frames of a version. It keeps a master of its FP8
// buffers in the run's dtype (BF16), the apply loop applies the frames to
// the master like any rank's buffers (verified by the same digests), and
// every quantization block holding a changed element is requantized from the
// master into the engine's E4M3 bytes and F32 scale. Bytes per version are a
// BF16 engine's; work is O(changed elements) plus O(block) per touched block.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "dcr/layout.h"
#include "dcr/layout_apply.h"
#include "dcr/layout_residual.h"
#include "dcr/status.h"

namespace dcr {

// Where an engine rank keeps one FP8 buffer: its E4M3 bytes (the buffer's
// shape, row-major) and its F32 block scales ([n,] ceil(rows / block),
// ceil(cols / block) for a [n,] rows x cols buffer: DeepSeek-V3's
// `weight_scale_inv`, which multiplies the FP8 values back).
struct Fp8Placement {
  std::span<uint8_t> fp8;
  std::span<uint8_t> scales;
};

// The memory of an FP8 engine rank, for the apply loop (PlacedRank::memory):
// `layout` is the engine's map in the run's dtype (its FP8 buffers declared
// BF16 or F32, with the FP8 buffers' shapes). The buffers named in `fp8` live
// in a host master owned here (master_bytes()); each write to them marks the
// blocks it touches, and Flush() (the end of every apply loop call and dense
// load) quantizes exactly those blocks from the master (QuantizeFp8Block, the
// run's block FP8 scheme) into the engine's placement, so the engine's FP8
// weights hold a version before it is acked. The other buffers are the
// engine's own: in host memory (`plain[b]`; empty for FP8 buffers), or,
// when `inner` is given (`plain` empty), reached through it (a device's).
// A fresh rank joins by a dense load of a BF16 checkpoint (LoadDense): every
// block is marked. `after_flush`, when set, is called at the end of every
// flush that requantized something, with the FP8 buffers it wrote: an
// engine whose FP8 tensors live on a device gives host placements and copies
// them there (its error fails the flush). Not thread-safe.
class Fp8EngineMemory final : public BufferMemory {
 public:
  // kInvalidArgument when a buffer in `fp8` is not 2-D or 3-D BF16/F32, a
  // placement or plain buffer has the wrong size, or a copy into an FP8 buffer
  // is not block aligned: its canonical and buffer offsets must be multiples
  // of `block` in the last two dimensions, and so must its extents unless the
  // box reaches both the tensor's edge and the buffer's (then the buffer's
  // block grid is the canonical tensors', and a buffer block is one
  // canonical block).
  static Result<std::unique_ptr<Fp8EngineMemory>> Create(const CompiledLayout& layout,
                                                         std::map<size_t, Fp8Placement> fp8,
                                                         std::vector<std::span<uint8_t>> plain,
                                                         BufferMemory* inner = nullptr, uint64_t block = 128);
  void set_after_flush(std::function<Status(std::span<const size_t> buffers)> f) { after_flush_ = std::move(f); }

  uint64_t Bytes(size_t buffer) const override;
  Status Gather(std::span<const WordRequest> requests) override;
  Status Scatter(std::span<const WordRequest> requests) override;
  Status Read(size_t buffer, uint64_t offset, std::span<uint8_t> out) override;
  Status Write(size_t buffer, uint64_t offset, std::span<const uint8_t> bytes) override;
  // Quantizes every block written since the last flush into the engine's
  // bytes and scales (and flushes `inner`).
  Status Flush() override;

  uint64_t blocks_pending() const { return pending_; }
  uint64_t blocks_requantized() const { return requantized_; }  // since Create
  uint64_t master_bytes() const;
  uint64_t MasterBytes() const override { return master_bytes(); }

 private:
  struct Fp8Buffer {
    DType dtype = DType::kBF16;
    uint64_t stack = 1, rows = 0, cols = 0;  // [stack,] rows x cols
    Fp8BlockShape shape;  // of one stack entry
    std::vector<uint8_t> master;
    Fp8Placement placement;
    std::vector<uint8_t> marked;  // per block: written since the last Flush
    std::vector<uint64_t> dirty;  // the marked blocks, in marking order
  };
  Fp8EngineMemory(const CompiledLayout& layout, BufferMemory* inner, uint64_t block)
      : layout_(layout), inner_(inner), block_(block) {}
  // The bytes of a buffer this memory holds (a master, or a plain host
  // buffer); empty for a buffer of `inner`.
  std::span<uint8_t> Bytes(size_t buffer);
  // Forwards to `inner` the requests for its buffers, handles the others.
  Status Words(std::span<const WordRequest> requests, bool scatter);
  void Mark(Fp8Buffer& f, uint64_t element);
  void MarkRange(Fp8Buffer& f, uint64_t first, uint64_t count);

  const CompiledLayout& layout_;
  BufferMemory* const inner_;
  const uint64_t block_;
  std::map<size_t, Fp8Buffer> fp8_;
  std::vector<std::span<uint8_t>> plain_;
  uint64_t pending_ = 0, requantized_ = 0;
  std::function<Status(std::span<const size_t>)> after_flush_;
};

}  // namespace dcr
