// Placement: applying frames through receiver maps, in place.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "dcr/layout_apply.h"
#include "dcr/thread_pool.h"

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

Digest RankDigest(const PlacedRank& rank, std::span<const std::string> only) {
  const CompiledLayout& l = *rank.layout;
  std::vector<bool> wanted(l.map().tensors.size(), only.empty());
  for (const std::string& name : only)
    if (int64_t i = l.FindTensor(name); i >= 0) wanted[static_cast<size_t>(i)] = true;
  // The primary runs, cut into pieces of at most kPiece elements, digested in
  // parallel (the digest is a sum, so the pieces' order does not matter).
  constexpr uint64_t kPiece = uint64_t{1} << 20;
  struct Piece {
    DigestKey key;
    uint64_t canonical_byte;
    const uint8_t* bytes;
    uint64_t size;
  };
  std::vector<Piece> pieces;
  std::vector<CopyRun> runs;
  for (size_t t = 0; t < l.map().tensors.size(); ++t) {
    if (!wanted[t]) continue;
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
        for (uint64_t at = 0; at < r.length; at += kPiece)
          pieces.push_back(
              {key, (r.canonical + at) * eb, src + (r.buffer + at) * eb, std::min(kPiece, r.length - at) * eb});
    }
  }
  std::vector<Digest> sums(pieces.size());
  DefaultPool().ParallelFor(pieces.size(), [&](size_t i) {
    sums[i] = DigestBytes(pieces[i].key, pieces[i].canonical_byte, {pieces[i].bytes, pieces[i].size});
  });
  Digest total;
  for (const Digest& d : sums) total += d;
  return total;
}

ChunkDigestTable RankChunkDigests(const PlacedRank& rank, const DeltaManifest& manifest) {
  const CompiledLayout& l = *rank.layout;
  ChunkDigestTable table(manifest.tensors.size());
  std::vector<CopyRun> runs;
  for (size_t t = 0; t < manifest.tensors.size(); ++t) {
    table[t].assign(manifest.ChunkCount(t), Digest{});
    const int64_t local = l.FindTensor(manifest.tensors[t].name);
    if (local < 0) continue;
    const DigestKey key = MakeDigestKey(manifest.tensors[t].name);
    const uint64_t eb = l.ElementBytes(static_cast<size_t>(local));
    const uint64_t numel = manifest.tensors[t].elements, ce = manifest.chunk_elements;
    for (uint32_t c : l.CopiesOf(static_cast<size_t>(local))) {
      if (!l.map().copies[c].primary) continue;
      runs.clear();
      l.RunsInRange(c, 0, numel, &runs);
      const uint8_t* src = rank.buffers[l.BufferOf(c)].data();
      for (const CopyRun& r : runs)
        for (uint64_t at = r.canonical, end = r.canonical + r.length; at < end;) {
          const uint64_t chunk = at / ce, stop = std::min(end, (chunk + 1) * ce);
          table[t][chunk] += DigestBytes(key, at * eb, {src + (r.buffer + at - r.canonical) * eb, (stop - at) * eb});
          at = stop;
        }
    }
  }
  return table;
}

ChunkRanges RankHeldChunks(const CompiledLayout& layout, const DeltaManifest& manifest) {
  ChunkRanges held(manifest.tensors.size());
  std::vector<CopyRun> runs;
  for (size_t t = 0; t < manifest.tensors.size(); ++t) {
    const int64_t local = layout.FindTensor(manifest.tensors[t].name);
    if (local < 0) continue;
    const uint64_t ce = manifest.chunk_elements;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (uint32_t c : layout.CopiesOf(static_cast<size_t>(local))) {
      runs.clear();
      layout.RunsInRange(c, 0, manifest.tensors[t].elements, &runs);
      for (const CopyRun& r : runs)
        if (r.length > 0) ranges.emplace_back(r.canonical / ce, (r.canonical + r.length - 1) / ce + 1);
    }
    std::sort(ranges.begin(), ranges.end());
    for (const auto& [first, end] : ranges) {
      if (!held[t].empty() && first <= held[t].back().second)
        held[t].back().second = std::max(held[t].back().second, end);
      else held[t].emplace_back(first, end);
    }
  }
  return held;
}

namespace {

// The chunk a frame applies to.
struct FrameChunk {
  const DeltaTensor* tensor = nullptr;
  std::string where;  // "tensor 'x' chunk 3", for errors
  uint64_t first = 0;  // its first element
  uint64_t first_word = 0;  // and word
  uint32_t elements = 0;
  uint64_t eb = 0;  // bytes per element
};

// Checks that `frame` is a frame of `manifest` (tensor, chunk, dtype); fills
// the chunk's geometry.
Status CheckFrameFits(const DeltaManifest& manifest, const FrameHeader& h, FrameChunk* fc) {
  uint64_t words = 0;
  std::string& where = fc->where;
  if (h.tensor >= manifest.tensors.size())
    return InvalidArgument(
        fmt::format("frame names tensor {} but the manifest has {}", h.tensor, manifest.tensors.size()));
  const DeltaTensor& tensor = manifest.tensors[h.tensor];
  where = fmt::format("tensor '{}' chunk {}", tensor.name, h.chunk);
  if (h.chunk >= manifest.ChunkCount(h.tensor))
    return InvalidArgument(fmt::format("{}: the tensor has only {} chunks", where, manifest.ChunkCount(h.tensor)));
  manifest.ChunkWords(h.tensor, h.chunk, &fc->first_word, &words, &fc->elements);
  if (h.dtype != tensor.dtype)
    return InvalidArgument(
        fmt::format("{}: the frame is of {} but the tensor is {}", where, Name(h.dtype), Name(tensor.dtype)));
  const uint32_t bits = BitsPerElement(tensor.dtype);
  if (bits == 0 || bits % 8 != 0)
    return Unimplemented(fmt::format("{}: dtype {} is packed below a byte; it cannot be placed through a map", where,
                                     Name(tensor.dtype)));
  fc->tensor = &tensor;
  fc->first = uint64_t{h.chunk} * manifest.chunk_elements;
  fc->eb = bits / 8;
  return Status::Ok();
}

}  // namespace

Result<RankFrameResult> ApplyRankFrame(PlacedRank& rank, const DeltaManifest& manifest, const FrameView& frame,
                                       std::vector<uint8_t>* scratch, const Digest* expected_base) {
  const FrameHeader& h = frame.header;
  FrameChunk fc;
  DCR_RETURN_IF_ERROR(CheckFrameFits(manifest, h, &fc));
  const DeltaTensor& tensor = *fc.tensor;
  const uint64_t first = fc.first, eb = fc.eb;
  const CompiledLayout& l = *rank.layout;
  RankFrameResult out;
  const int64_t local = l.FindTensor(tensor.name);
  if (local < 0) return out;
  if (l.map().tensors[static_cast<size_t>(local)].shape != tensor.shape)
    return InvalidArgument(fmt::format("{}: the rank maps it with shape {} but the delta's tensor is {}", fc.where,
                                       fmt::join(l.map().tensors[static_cast<size_t>(local)].shape, "x"),
                                       fmt::join(tensor.shape, "x")));
  DCR_RETURN_IF_ERROR(CheckRankBuffers(l, rank.buffers));
  const uint64_t chunk_bytes = uint64_t{fc.elements} * eb;
  if (scratch->size() < chunk_bytes) scratch->resize(chunk_bytes);
  uint8_t* chunk = scratch->data();
  // The rank's runs of the chunk: replicas first, so that an element held
  // both ways is gathered from its primary copy.
  struct Run {
    size_t buffer;
    CopyRun run;
    bool primary;
  };
  std::vector<Run> held;
  std::vector<CopyRun> runs;
  for (const bool primary : {false, true})
    for (uint32_t c : l.CopiesOf(static_cast<size_t>(local))) {
      if (l.map().copies[c].primary != primary) continue;
      runs.clear();
      l.RunsInRange(c, first, fc.elements, &runs);
      for (const CopyRun& r : runs) held.push_back({l.BufferOf(c), r, primary});
    }
  if (held.empty()) return out;
  const DigestKey key = MakeDigestKey(tensor.name);
  auto partial = [&] {
    Digest d;
    for (const Run& r : held)
      if (r.primary)
        d += DigestBytes(key, r.run.canonical * eb, {chunk + (r.run.canonical - first) * eb, r.run.length * eb});
    return d;
  };
  // Gather; the chunk's other fc.elements are left as they are (whatever an
  // earlier frame left there): their results are never read.
  for (const Run& r : held) {
    std::memcpy(chunk + (r.run.canonical - first) * eb, rank.buffers[r.buffer].data() + r.run.buffer * eb,
                r.run.length * eb);
    if (r.primary) out.held += r.run.length;
  }
  out.base = partial();
  if (h.mode != Mode::kOverwrite && expected_base != nullptr && out.base != *expected_base)
    return FailedPrecondition(
        fmt::format("{}: this rank's fc.elements of the chunk are not at the digest it tracks (digest {}, tracked {}): "
                    "they changed "
                    "behind its back or an earlier attempt was partly applied; an overwrite frame repairs them",
                    fc.where, out.base.ToHex(), expected_base->ToHex()));
  thread_local ChunkApplier applier;
  DCR_RETURN_IF_ERROR(applier.ApplyUnverified(frame, {chunk, chunk_bytes}).status().WithContext(fc.where));
  out.target = partial();
  // Scatter the runs whose bytes differ, to every copy.
  for (const Run& r : held) {
    uint8_t* dst = rank.buffers[r.buffer].data() + r.run.buffer * eb;
    const uint8_t* src = chunk + (r.run.canonical - first) * eb;
    if (std::memcmp(dst, src, r.run.length * eb) != 0) {
      std::memcpy(dst, src, r.run.length * eb);
      out.written += r.run.length;
    }
  }
  return out;
}

std::vector<Result<RankFrameResult>> ApplyRankFrames(PlacedRank& rank, const DeltaManifest& manifest,
                                                     std::span<const FrameView> frames,
                                                     std::span<const Digest* const> expected_bases) {
  std::vector<Result<RankFrameResult>> out(frames.size(), RankFrameResult{});
  DefaultPool().ParallelFor(frames.size(), [&](size_t i) {
    thread_local std::vector<uint8_t> scratch;
    out[i] = ApplyRankFrame(rank, manifest, frames[i], &scratch, expected_bases.empty() ? nullptr : expected_bases[i]);
  });
  return out;
}

Result<ApplyOutcome> ApplyEngineFrame(std::span<PlacedRank* const> ranks, const DeltaManifest& manifest,
                                      const FrameView& frame, std::vector<uint8_t>* scratch) {
  const FrameHeader& h = frame.header;
  FrameChunk fc;
  DCR_RETURN_IF_ERROR(CheckFrameFits(manifest, h, &fc));
  const DeltaTensor& tensor = *fc.tensor;
  const std::string& where = fc.where;
  const uint32_t elements = fc.elements;
  const uint64_t first = fc.first, eb = fc.eb;
  // The scratch holds the chunk and, after it, the chunk as gathered.
  const uint64_t chunk_bytes = uint64_t{elements} * eb;
  if (scratch->size() < 2 * chunk_bytes) scratch->resize(2 * chunk_bytes);
  uint8_t* chunk = scratch->data();
  uint8_t* before = chunk + chunk_bytes;

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
    return FailedPrecondition(
        fmt::format("{}: no rank given holds it; it is a residual here (hand its overwrites to the "
                    "runtime's loader) or the wrong engine was passed",
                    where));
  if (covered != elements)
    return FailedPrecondition(
        fmt::format("{}: the ranks given hold {} of its {} elements; a partial chunk cannot be "
                    "verified alone, apply it with every rank of the engine",
                    where, covered, elements));
  const DigestKey key = MakeDigestKey(tensor.name);
  const Digest current = DigestBytes(key, first * eb, {chunk, uint64_t{elements} * eb});
  std::memcpy(before, chunk, chunk_bytes);  // to find what changed
  thread_local ChunkApplier applier;  // its scratch is reused between frames
  Digest after;
  DCR_ASSIGN_OR_RETURN(ApplyOutcome outcome,
                       applier.Apply(frame, key, fc.first_word, {chunk, uint64_t{elements} * eb}, current, &after));
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
        if (std::memcmp(before + at, chunk + at, n) != 0 || std::memcmp(dst + r.buffer * eb, chunk + at, n) != 0)
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
  // Frames are one per chunk (the manifest's are unique and each checked
  // against its entry), so they write disjoint elements and run in parallel;
  // each thread reuses a scratch from the free list.
  struct Done {
    Status status;
    ApplyOutcome outcome = ApplyOutcome::kAlreadyApplied;
    uint64_t payload_bytes = 0, changed = 0;
  };
  std::vector<Done> done(m.frames.size());
  std::mutex mu;
  std::vector<std::vector<uint8_t>> free_scratch;
  DefaultPool().ParallelFor(m.frames.size(), [&](size_t i) {
    if (residual[m.frames[i].tensor]) return;
    std::vector<uint8_t> scratch;
    {
      std::lock_guard lock(mu);
      if (!free_scratch.empty()) {
        scratch = std::move(free_scratch.back());
        free_scratch.pop_back();
      }
    }
    Result<FrameView> frame = delta.Frame(i);
    if (!frame.ok()) {
      done[i].status = frame.status();
    } else if (Result<ApplyOutcome> outcome = ApplyEngineFrame(ranks, m, *frame, &scratch); !outcome.ok()) {
      done[i].status = outcome.status();
    } else {
      done[i] = {Status::Ok(), *outcome, frame->payload.size(), frame->header.changed};
    }
    std::lock_guard lock(mu);
    free_scratch.push_back(std::move(scratch));
  });
  ApplyReport report;
  for (size_t i = 0; i < m.frames.size(); ++i) {
    if (residual[m.frames[i].tensor]) continue;
    DCR_RETURN_IF_ERROR(done[i].status);
    if (done[i].outcome == ApplyOutcome::kApplied) {
      ++report.frames_applied;
      report.payload_bytes += done[i].payload_bytes;
      report.changed_words += done[i].changed;
    } else {
      ++report.frames_already_applied;
    }
  }
  // The ranks' digests over the delta's tensors (a residual delta holds a few).
  std::vector<std::string> checked;
  Digest total, expected = m.target_digest;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (!residual[t]) {
      checked.push_back(m.tensors[t].name);
    } else if (m.tensor_target_digests.size() == m.tensors.size()) {
      expected -= m.tensor_target_digests[t];
    } else {
      return FailedPrecondition(fmt::format(
          "tensor '{}' is a residual here, and the delta does not carry per-tensor digests (a stored manifest does "
          "not): the ranks cannot be checked against it; apply it with the delta its sender made in memory",
          m.tensors[t].name));
    }
  }
  for (PlacedRank* r : ranks) total += RankDigest(*r, checked);
  if (total != expected)
    return DataLoss(
        fmt::format("after applying, the engine's ranks add up to digest {} but the delta's target is {}; "
                    "a rank is corrupt or a tensor is unmapped (residual) here; resync from a snapshot",
                    total.ToHex(), expected.ToHex()));
  return report;
}

}  // namespace dcr
