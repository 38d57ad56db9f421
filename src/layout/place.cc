// Placement: applying frames through receiver maps, in place.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "dcr/layout_apply.h"

namespace dcr {

Status CheckRankBuffers(const CompiledLayout& layout, std::span<const std::span<uint8_t>> buffers) {
  const auto& declared = layout.map().buffers;
  if (buffers.size() != declared.size())
    return InvalidArgument(fmt::format("the rank has {} buffers but its map declares {}; pass one per declared buffer",
                                       buffers.size(), declared.size()));
  for (size_t i = 0; i < declared.size(); ++i)
    if (buffers[i].size() != layout.BufferBytes(i))
      return InvalidArgument(fmt::format("buffer '{}' has {} bytes but its map declares {} ({} {})", declared[i].id,
                                         buffers[i].size(), layout.BufferBytes(i), Name(declared[i].dtype),
                                         fmt::join(declared[i].shape, "x")));
  return Status::Ok();
}

TensorBytes CheckpointBytes(const Checkpoint& ckpt) {
  return [&ckpt](const std::string& name, uint64_t* bytes) -> const uint8_t* {
    const int64_t i = ckpt.Find(name);
    if (i < 0) return nullptr;
    auto d = ckpt.Data(static_cast<size_t>(i));
    *bytes = d.size();
    return d.data();
  };
}

Status LoadDense(const TensorBytes& source, PlacedRank& rank) {
  const CompiledLayout& l = *rank.layout;
  DCR_RETURN_IF_ERROR(CheckRankBuffers(l, rank.buffers));
  std::vector<CopyRun> runs;
  for (size_t t = 0; t < l.map().tensors.size(); ++t) {
    const LayoutTensor& tensor = l.map().tensors[t];
    uint64_t bytes = 0;
    const uint8_t* data = source(tensor.name, &bytes);
    if (data == nullptr)
      return NotFound(fmt::format("tensor '{}' is mapped but the checkpoint does not hold it", tensor.name));
    const uint64_t eb = l.ElementBytes(t);
    uint64_t numel = 1;
    for (uint64_t d : tensor.shape) numel *= d;
    if (bytes != numel * eb)
      return InvalidArgument(fmt::format("tensor '{}' has {} bytes in the checkpoint, the map expects {}", tensor.name,
                                         bytes, numel * eb));
    for (uint32_t c : l.CopiesOf(t)) {
      runs.clear();
      l.RunsInRange(c, 0, numel, &runs);
      uint8_t* dst = rank.buffers[l.BufferOf(c)].data();
      for (const CopyRun& r : runs) std::memcpy(dst + r.buffer * eb, data + r.canonical * eb, r.length * eb);
    }
  }
  return Status::Ok();
}

Digest RankDigest(const PlacedRank& rank) {
  const CompiledLayout& l = *rank.layout;
  Digest total;
  std::vector<CopyRun> runs;
  for (size_t t = 0; t < l.map().tensors.size(); ++t) {
    const LayoutTensor& tensor = l.map().tensors[t];
    const DigestKey key = MakeDigestKey(tensor.name);
    const uint64_t eb = l.ElementBytes(t);
    uint64_t numel = 1;
    for (uint64_t d : tensor.shape) numel *= d;
    for (uint32_t c : l.CopiesOf(t)) {
      if (!l.map().copies[c].primary) continue;
      runs.clear();
      l.RunsInRange(c, 0, numel, &runs);
      const uint8_t* src = rank.buffers[l.BufferOf(c)].data();
      for (const CopyRun& r : runs)
        total += DigestBytes(key, r.canonical * eb, {src + r.buffer * eb, r.length * eb});
    }
  }
  return total;
}

Result<ApplyOutcome> ApplyEngineFrame(std::span<PlacedRank* const> ranks, const DeltaManifest& manifest,
                                      const FrameView& frame, std::vector<uint8_t>* scratch) {
  const FrameHeader& h = frame.header;
  if (h.tensor >= manifest.tensors.size())
    return InvalidArgument(fmt::format("frame names tensor {} but the manifest has {}", h.tensor, manifest.tensors.size()));
  const DeltaTensor& tensor = manifest.tensors[h.tensor];
  const std::string where = fmt::format("tensor '{}' chunk {}", tensor.name, h.chunk);
  if (h.chunk >= manifest.ChunkCount(h.tensor))
    return InvalidArgument(fmt::format("{}: the tensor has only {} chunks", where, manifest.ChunkCount(h.tensor)));
  uint64_t first_word, words;
  uint32_t elements;
  manifest.ChunkWords(h.tensor, h.chunk, &first_word, &words, &elements);
  const uint64_t first = uint64_t{h.chunk} * manifest.chunk_elements;
  const uint64_t eb = BitsPerElement(tensor.dtype) / 8;
  if (eb == 0 || BitsPerElement(tensor.dtype) % 8 != 0)
    return Unimplemented(fmt::format("{}: dtype {} is packed below a byte; it cannot be placed through a map", where,
                                     Name(tensor.dtype)));
  scratch->resize(uint64_t{elements} * eb);
  uint8_t* chunk = scratch->data();

  // Gather from the primary copies.
  std::vector<int64_t> local(ranks.size());
  std::vector<CopyRun> runs;
  uint64_t covered = 0;
  for (size_t k = 0; k < ranks.size(); ++k) {
    const CompiledLayout& l = *ranks[k]->layout;
    local[k] = l.FindTensor(tensor.name);
    if (local[k] < 0) continue;
    if (l.map().tensors[static_cast<size_t>(local[k])].shape != tensor.shape)
      return InvalidArgument(fmt::format("{}: rank {} maps it with shape {} but the delta's tensor is {}", where, k,
                                         fmt::join(l.map().tensors[static_cast<size_t>(local[k])].shape, "x"),
                                         fmt::join(tensor.shape, "x")));
    for (uint32_t c : l.CopiesOf(static_cast<size_t>(local[k]))) {
      if (!l.map().copies[c].primary) continue;
      runs.clear();
      l.RunsInRange(c, first, elements, &runs);
      const uint8_t* src = ranks[k]->buffers[l.BufferOf(c)].data();
      for (const CopyRun& r : runs) {
        std::memcpy(chunk + (r.canonical - first) * eb, src + r.buffer * eb, r.length * eb);
        covered += r.length;
      }
    }
  }
  if (covered == 0)
    return FailedPrecondition(fmt::format("{}: no rank given holds it; it is a residual here (hand its overwrites to the "
                                          "runtime's loader) or the wrong engine was passed",
                                          where));
  if (covered != elements)
    return FailedPrecondition(fmt::format("{}: the ranks given hold {} of its {} elements; a partial chunk cannot be "
                                          "verified alone, apply it with every rank of the engine",
                                          where, covered, elements));
  const DigestKey key = MakeDigestKey(tensor.name);
  const Digest current = DigestBytes(key, first * eb, {chunk, uint64_t{elements} * eb});
  // The gathered chunk, kept to find what changed.
  std::vector<uint8_t> before(chunk, chunk + uint64_t{elements} * eb);
  ChunkApplier applier;
  Digest after;
  DCR_ASSIGN_OR_RETURN(ApplyOutcome outcome,
                       applier.Apply(frame, key, first_word, {chunk, uint64_t{elements} * eb}, current, &after));
  if (outcome == ApplyOutcome::kAlreadyApplied) return outcome;
  // Scatter: every copy, primary or not, of the runs that changed.
  for (size_t k = 0; k < ranks.size(); ++k) {
    if (local[k] < 0) continue;
    const CompiledLayout& l = *ranks[k]->layout;
    for (uint32_t c : l.CopiesOf(static_cast<size_t>(local[k]))) {
      runs.clear();
      l.RunsInRange(c, first, elements, &runs);
      uint8_t* dst = ranks[k]->buffers[l.BufferOf(c)].data();
      for (const CopyRun& r : runs) {
        const uint64_t at = (r.canonical - first) * eb, n = r.length * eb;
        if (std::memcmp(before.data() + at, chunk + at, n) != 0 || std::memcmp(dst + r.buffer * eb, chunk + at, n) != 0)
          std::memcpy(dst + r.buffer * eb, chunk + at, n);
      }
    }
  }
  return outcome;
}

Result<ApplyReport> ApplyEngineDelta(std::span<PlacedRank* const> ranks, const DeltaReader& delta,
                                     std::span<const std::string> residuals) {
  const DeltaManifest& m = delta.manifest();
  for (size_t k = 0; k < ranks.size(); ++k) {
    Status s = CheckRankBuffers(*ranks[k]->layout, ranks[k]->buffers);
    if (!s.ok()) return s.WithContext(fmt::format("rank {}", k));
  }
  std::vector<bool> residual(m.tensors.size(), false);
  for (size_t t = 0; t < m.tensors.size(); ++t)
    residual[t] = std::find(residuals.begin(), residuals.end(), m.tensors[t].name) != residuals.end();
  ApplyReport report;
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i < m.frames.size(); ++i) {
    if (residual[m.frames[i].tensor]) continue;
    DCR_ASSIGN_OR_RETURN(FrameView frame, delta.Frame(i));
    DCR_ASSIGN_OR_RETURN(ApplyOutcome outcome, ApplyEngineFrame(ranks, m, frame, &scratch));
    if (outcome == ApplyOutcome::kApplied) {
      ++report.frames_applied;
      report.payload_bytes += frame.payload.size();
      report.changed_words += frame.header.changed;
    } else {
      ++report.frames_already_applied;
    }
  }
  Digest total, expected;
  for (PlacedRank* r : ranks) total += RankDigest(*r);
  for (size_t t = 0; t < m.tensors.size(); ++t)
    if (!residual[t]) expected += m.tensors[t].target_digest;
  if (total != expected)
    return DataLoss(fmt::format("after applying, the engine's ranks add up to digest {} but the delta's target is {}; "
                                "a rank is corrupt or a tensor is unmapped (residual) here; resync from a snapshot",
                                total.ToHex(), expected.ToHex()));
  return report;
}

}  // namespace dcr
