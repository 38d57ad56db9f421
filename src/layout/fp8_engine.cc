// FP8 engine ranks: a master in the run's dtype, requantized by touched
// block (fp8_engine.h).
#include "dcr/fp8_engine.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "dcr/dtype.h"
#include "dcr/thread_pool.h"

namespace dcr {

namespace {

// A copy into an FP8 buffer keeps the block grid when, in the last two
// dimensions, its offsets are multiples of the block and its extent is too,
// or reaches the edge of both the tensor and the buffer.
Status CheckBlockAligned(const CompiledLayout& layout, size_t copy, uint64_t block) {
  const BoxCopy& c = layout.map().copies[copy];
  const LayoutTensor& t = layout.map().tensors[static_cast<size_t>(layout.FindTensor(c.tensor))];
  const LayoutBuffer& b = layout.map().buffers[layout.BufferOf(copy)];
  const size_t tn = t.shape.size(), bn = b.shape.size();
  if (tn < 2)
    return InvalidArgument(fmt::format("copy {} (tensor '{}' into FP8 buffer '{}'): a {}-D tensor has no 2-D blocks",
                                       copy, c.tensor, c.buffer, tn));
  for (size_t d = 0; d < 2; ++d) {
    const size_t td = tn - 2 + d, bd = bn - 2 + d;
    const bool edge = c.offset[td] + c.extent[td] == t.shape[td] && c.buffer_offset[bd] + c.extent[td] == b.shape[bd];
    if (c.offset[td] % block != 0 || c.buffer_offset[bd] % block != 0 || (c.extent[td] % block != 0 && !edge))
      return InvalidArgument(fmt::format(
          "copy {} (tensor '{}' box offset [{}] extent [{}] into FP8 buffer '{}' at [{}]) is not aligned to "
          "{}-element blocks: a rank's share of a block-FP8 tensor must be whole blocks (shard at block edges)",
          copy, c.tensor, fmt::join(c.offset, ", "), fmt::join(c.extent, ", "), c.buffer,
          fmt::join(c.buffer_offset, ", "), block));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Fp8EngineMemory>> Fp8EngineMemory::Create(const CompiledLayout& layout,
                                                                 std::map<size_t, Fp8Placement> fp8,
                                                                 std::vector<std::span<uint8_t>> plain,
                                                                 BufferMemory* inner, uint64_t block) {
  const auto& buffers = layout.map().buffers;
  if (block == 0) return InvalidArgument("FP8 engine: block size 0");
  if (inner != nullptr && !plain.empty())
    return InvalidArgument("FP8 engine: the other buffers are in host memory or behind `inner`, not both");
  if (inner == nullptr && plain.size() != buffers.size())
    return InvalidArgument(
        fmt::format("FP8 engine: {} plain buffers given for a map of {} buffers", plain.size(), buffers.size()));
  std::unique_ptr<Fp8EngineMemory> m(new Fp8EngineMemory(layout, inner, block));
  for (auto& [b, placement] : fp8) {
    if (b >= buffers.size()) return InvalidArgument(fmt::format("FP8 engine: no buffer {} in the map", b));
    const LayoutBuffer& lb = buffers[b];
    if ((lb.dtype != DType::kBF16 && lb.dtype != DType::kF32) || lb.shape.size() < 2 || lb.shape.size() > 3)
      return InvalidArgument(fmt::format("FP8 buffer '{}' is {} [{}]; its master is a 2-D or 3-D BF16 or F32 buffer",
                                         lb.id, Name(lb.dtype), fmt::join(lb.shape, ", ")));
    Fp8Buffer f;
    f.dtype = lb.dtype;
    f.stack = lb.shape.size() == 3 ? lb.shape[0] : 1;
    f.rows = lb.shape[lb.shape.size() - 2];
    f.cols = lb.shape.back();
    f.shape = {f.rows, f.cols, block};
    const uint64_t blocks = f.stack * f.shape.scale_rows() * f.shape.scale_cols();
    if (placement.fp8.size() != f.stack * f.rows * f.cols || placement.scales.size() != blocks * 4)
      return InvalidArgument(fmt::format("FP8 buffer '{}': the engine's bytes are {} (want {}) and scales {} (want {})",
                                         lb.id, placement.fp8.size(), f.stack * f.rows * f.cols,
                                         placement.scales.size(), blocks * 4));
    if (inner == nullptr && !plain[b].empty())
      return InvalidArgument(fmt::format("FP8 buffer '{}' lives in the master: give no plain buffer for it", lb.id));
    f.master.assign(layout.BufferBytes(b), 0);
    f.placement = placement;
    f.marked.assign(blocks, 0);
    m->fp8_.emplace(b, std::move(f));
  }
  for (size_t b = 0; b < buffers.size() && inner == nullptr; ++b)
    if (!m->fp8_.count(b) && plain[b].size() != layout.BufferBytes(b))
      return InvalidArgument(fmt::format("buffer '{}' has {} bytes, the map says {}", buffers[b].id, plain[b].size(),
                                         layout.BufferBytes(b)));
  for (size_t c = 0; c < layout.map().copies.size(); ++c)
    if (m->fp8_.count(layout.BufferOf(c))) DCR_RETURN_IF_ERROR(CheckBlockAligned(layout, c, block));
  m->plain_ = std::move(plain);
  return m;
}

uint64_t Fp8EngineMemory::Bytes(size_t buffer) const { return layout_.BufferBytes(buffer); }

std::span<uint8_t> Fp8EngineMemory::Bytes(size_t buffer) {
  auto it = fp8_.find(buffer);
  if (it != fp8_.end()) return it->second.master;
  return buffer < plain_.size() ? plain_[buffer] : std::span<uint8_t>();
}

uint64_t Fp8EngineMemory::master_bytes() const {
  uint64_t n = 0;
  for (const auto& [b, f] : fp8_) n += f.master.size();
  return n;
}

void Fp8EngineMemory::Mark(Fp8Buffer& f, uint64_t element) {
  const uint64_t k = element / (f.rows * f.cols), in = element % (f.rows * f.cols);
  const uint64_t block =
      (k * f.shape.scale_rows() + in / f.cols / block_) * f.shape.scale_cols() + in % f.cols / block_;
  if (f.marked[block]) return;
  f.marked[block] = 1;
  f.dirty.push_back(block);
  ++pending_;
}

void Fp8EngineMemory::MarkRange(Fp8Buffer& f, uint64_t first, uint64_t count) {
  // One element per block column of each row the range crosses.
  for (uint64_t e = first, end = first + count; e < end;) {
    Mark(f, e);
    const uint64_t col = e % f.cols, next_block = std::min(f.cols, (col / block_ + 1) * block_);
    e += next_block - col;
  }
}

Status Fp8EngineMemory::Words(std::span<const WordRequest> requests, bool scatter) {
  std::vector<WordRequest> forwarded;
  for (const WordRequest& r : requests) {
    const std::span<uint8_t> bytes = Bytes(r.buffer);
    if (inner_ != nullptr && !fp8_.count(r.buffer)) {
      forwarded.push_back(r);
      continue;
    }
    auto it = fp8_.find(r.buffer);
    const uint64_t eb = it == fp8_.end() ? 0 : BitsPerElement(it->second.dtype) / 8;
    for (size_t i = 0; i < r.offsets.size(); ++i) {
      uint8_t* word = bytes.data() + r.offsets[i] * r.word_bytes;
      uint8_t* value = r.words.data() + i * r.word_bytes;
      if (!scatter) {
        std::memcpy(value, word, r.word_bytes);
        continue;
      }
      std::memcpy(word, value, r.word_bytes);
      if (eb != 0) Mark(it->second, r.offsets[i] * r.word_bytes / eb);
    }
  }
  if (forwarded.empty()) return Status::Ok();
  return scatter ? inner_->Scatter(forwarded) : inner_->Gather(forwarded);
}

Status Fp8EngineMemory::Gather(std::span<const WordRequest> requests) { return Words(requests, false); }
Status Fp8EngineMemory::Scatter(std::span<const WordRequest> requests) { return Words(requests, true); }

Status Fp8EngineMemory::Read(size_t buffer, uint64_t offset, std::span<uint8_t> out) {
  if (inner_ != nullptr && !fp8_.count(buffer)) return inner_->Read(buffer, offset, out);
  const std::span<uint8_t> bytes = Bytes(buffer);
  if (offset > bytes.size() || out.size() > bytes.size() - offset)
    return OutOfRange(
        fmt::format("read of {} bytes at {} past buffer {}'s {}", out.size(), offset, buffer, bytes.size()));
  std::memcpy(out.data(), bytes.data() + offset, out.size());
  return Status::Ok();
}

Status Fp8EngineMemory::Write(size_t buffer, uint64_t offset, std::span<const uint8_t> in) {
  if (inner_ != nullptr && !fp8_.count(buffer)) return inner_->Write(buffer, offset, in);
  const std::span<uint8_t> bytes = Bytes(buffer);
  if (offset > bytes.size() || in.size() > bytes.size() - offset)
    return OutOfRange(
        fmt::format("write of {} bytes at {} past buffer {}'s {}", in.size(), offset, buffer, bytes.size()));
  std::memcpy(bytes.data() + offset, in.data(), in.size());
  if (auto it = fp8_.find(buffer); it != fp8_.end() && !in.empty()) {
    const uint64_t eb = BitsPerElement(it->second.dtype) / 8;
    MarkRange(it->second, offset / eb, (offset + in.size() + eb - 1) / eb - offset / eb);
  }
  return Status::Ok();
}

Status Fp8EngineMemory::Flush() {
  std::vector<std::pair<Fp8Buffer*, uint64_t>> blocks;  // distinct blocks: written disjointly, in parallel
  for (auto& [b, f] : fp8_)
    for (const uint64_t block : f.dirty) blocks.emplace_back(&f, block);
  DefaultPool().ParallelFor(blocks.size(), [&](size_t i) {
    Fp8Buffer& f = *blocks[i].first;
    const uint64_t per_entry = f.shape.scale_rows() * f.shape.scale_cols(), eb = BitsPerElement(f.dtype) / 8;
    const uint64_t entry_elements = f.rows * f.cols, k = blocks[i].second / per_entry;
    const uint64_t in = blocks[i].second % per_entry;
    QuantizeFp8Block(f.dtype, std::span<const uint8_t>(f.master).subspan(k * entry_elements * eb, entry_elements * eb),
                     f.shape, in / f.shape.scale_cols(), in % f.shape.scale_cols(),
                     f.placement.fp8.subspan(k * entry_elements, entry_elements),
                     f.placement.scales.subspan(k * per_entry * 4, per_entry * 4));
  });
  std::vector<size_t> written;
  for (auto& [b, f] : fp8_) {
    if (!f.dirty.empty()) written.push_back(b);
    for (const uint64_t block : f.dirty) f.marked[block] = 0;
    f.dirty.clear();
  }
  requantized_ += blocks.size();
  pending_ = 0;
  if (after_flush_ && !written.empty()) DCR_RETURN_IF_ERROR(after_flush_(written));
  return inner_ != nullptr ? inner_->Flush() : Status::Ok();
}

}  // namespace dcr
