// Placement: ranks' buffers (host memory or a device's) as targets of the
// apply loop, dense loads through maps, and ranks' digests.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "dcr/layout_apply.h"
#include "dcr/thread_pool.h"

namespace dcr {

namespace {

// The host memory a rank in BufferMemory is read or written through at once.
constexpr uint64_t kMemoryWindowBytes = uint64_t{64} << 20;

uint64_t Numel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

}  // namespace

Status CheckRankBuffers(const PlacedRank& rank) {
  const CompiledLayout& layout = *rank.layout;
  const auto& declared = layout.map().buffers;
  if (rank.memory == nullptr && rank.buffers.size() != declared.size())
    return InvalidArgument(fmt::format("the rank has {} buffers but its map declares {}; pass one per declared buffer",
                                       rank.buffers.size(), declared.size()));
  for (size_t i = 0; i < declared.size(); ++i) {
    const uint64_t bytes = rank.memory ? rank.memory->Bytes(i) : rank.buffers[i].size();
    if (bytes != layout.BufferBytes(i))
      return InvalidArgument(fmt::format("buffer '{}' has {} bytes but its map declares {} ({} {})", declared[i].id,
                                         bytes, layout.BufferBytes(i), Name(declared[i].dtype),
                                         fmt::join(declared[i].shape, "x")));
  }
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

namespace {

// A run of one copy in byte terms: canonical bytes of its tensor to buffer bytes.
struct ByteRun {
  size_t tensor;  // the map's tensor index
  bool primary;
  uint64_t canonical, buffer, bytes;  // byte offsets in the tensor and the buffer, length
};

// Every run of the copies into buffer b (of the tensors `wanted` selects, all
// when empty; primaries only with `primary_only`), by buffer offset.
std::vector<ByteRun> BufferRuns(const CompiledLayout& l, size_t b, const std::vector<bool>& wanted, bool primary_only) {
  std::vector<ByteRun> out;
  std::vector<CopyRun> runs;
  for (size_t c = 0; c < l.map().copies.size(); ++c) {
    if (l.BufferOf(c) != b || (primary_only && !l.map().copies[c].primary)) continue;
    const size_t t = static_cast<size_t>(l.FindTensor(l.map().copies[c].tensor));
    if (!wanted.empty() && !wanted[t]) continue;
    const uint64_t eb = l.ElementBytes(t);
    runs.clear();
    l.RunsInRange(c, 0, Numel(l.map().tensors[t].shape), &runs);
    for (const CopyRun& r : runs)
      out.push_back({t, l.map().copies[c].primary, r.canonical * eb, r.buffer * eb, r.length * eb});
  }
  std::sort(out.begin(), out.end(), [](const ByteRun& x, const ByteRun& y) { return x.buffer < y.buffer; });
  return out;
}

// Calls fn(run, bytes of the run in host memory) for consecutive runs of
// `runs` (sorted by buffer offset), reading them from rank's memory a window
// of at most kMemoryWindowBytes at a time (a longer run: in pieces, each with
// its own ByteRun); fn runs on the default pool for the runs of a window. With
// `write_back`, fn may change the bytes, and the window is written back.
Status ForEachRunInMemory(BufferMemory& memory, size_t b, std::span<const ByteRun> runs, bool write_back,
                          const std::function<void(const ByteRun&, std::span<uint8_t>)>& fn) {
  std::vector<ByteRun> pieces;
  for (const ByteRun& r : runs)
    for (uint64_t at = 0; at < r.bytes; at += kMemoryWindowBytes)
      pieces.push_back(
          {r.tensor, r.primary, r.canonical + at, r.buffer + at, std::min(kMemoryWindowBytes, r.bytes - at)});
  std::vector<uint8_t> window;
  for (size_t first = 0; first < pieces.size();) {
    const uint64_t start = pieces[first].buffer;
    size_t end = first + 1;
    while (end < pieces.size() && pieces[end].buffer + pieces[end].bytes - start <= kMemoryWindowBytes) ++end;
    uint64_t stop = 0;
    for (size_t k = first; k < end; ++k) stop = std::max(stop, pieces[k].buffer + pieces[k].bytes);
    window.resize(stop - start);
    DCR_RETURN_IF_ERROR(memory.Read(b, start, window));
    DefaultPool().ParallelFor(end - first, [&](size_t k) {
      const ByteRun& p = pieces[first + k];
      fn(p, std::span<uint8_t>(window).subspan(p.buffer - start, p.bytes));
    });
    if (write_back) DCR_RETURN_IF_ERROR(memory.Write(b, start, window));
    first = end;
  }
  return Status::Ok();
}

// Calls fn(tensor, canonical byte offset, bytes) for every piece (at most
// 2^20 elements' bytes) of the primary runs of `wanted` tensors (all when
// empty), from the rank's host buffers or its memory, in parallel.
Status ForEachPrimaryPiece(const PlacedRank& rank, const std::vector<bool>& wanted,
                           const std::function<void(size_t, uint64_t, std::span<const uint8_t>)>& fn) {
  const CompiledLayout& l = *rank.layout;
  constexpr uint64_t kPieceElements = uint64_t{1} << 20;
  for (size_t b = 0; b < l.map().buffers.size(); ++b) {
    std::vector<ByteRun> runs = BufferRuns(l, b, wanted, /*primary_only=*/true);
    std::vector<ByteRun> pieces;
    for (const ByteRun& r : runs) {
      const uint64_t piece = kPieceElements * l.ElementBytes(r.tensor);
      for (uint64_t at = 0; at < r.bytes; at += piece)
        pieces.push_back({r.tensor, true, r.canonical + at, r.buffer + at, std::min(piece, r.bytes - at)});
    }
    if (rank.memory != nullptr) {
      DCR_RETURN_IF_ERROR(ForEachRunInMemory(*rank.memory, b, pieces, false,
                                             [&](const ByteRun& p, auto bytes) { fn(p.tensor, p.canonical, bytes); }));
      continue;
    }
    const uint8_t* base = rank.buffers[b].data();
    DefaultPool().ParallelFor(pieces.size(), [&](size_t k) {
      fn(pieces[k].tensor, pieces[k].canonical, {base + pieces[k].buffer, pieces[k].bytes});
    });
  }
  return Status::Ok();
}

}  // namespace

Status LoadDense(const TensorBytes& source, PlacedRank& rank) {
  const CompiledLayout& l = *rank.layout;
  DCR_RETURN_IF_ERROR(CheckRankBuffers(rank));
  std::vector<const uint8_t*> data(l.map().tensors.size());
  for (size_t t = 0; t < l.map().tensors.size(); ++t) {
    const LayoutTensor& tensor = l.map().tensors[t];
    uint64_t bytes = 0;
    data[t] = source(tensor.name, &bytes);
    if (data[t] == nullptr)
      return NotFound(fmt::format("tensor '{}' is mapped but the checkpoint does not hold it", tensor.name));
    const uint64_t want = Numel(tensor.shape) * l.ElementBytes(t);
    if (bytes != want)
      return InvalidArgument(
          fmt::format("tensor '{}' has {} bytes in the checkpoint, the map expects {}", tensor.name, bytes, want));
  }
  for (size_t b = 0; b < l.map().buffers.size(); ++b) {
    const std::vector<ByteRun> runs = BufferRuns(l, b, {}, /*primary_only=*/false);
    if (rank.memory != nullptr) {
      DCR_RETURN_IF_ERROR(ForEachRunInMemory(*rank.memory, b, runs, true, [&](const ByteRun& r, auto bytes) {
        std::memcpy(bytes.data(), data[r.tensor] + r.canonical, r.bytes);
      }));
      continue;
    }
    for (const ByteRun& r : runs) std::memcpy(rank.buffers[b].data() + r.buffer, data[r.tensor] + r.canonical, r.bytes);
  }
  return rank.memory != nullptr ? rank.memory->Flush() : Status::Ok();
}

Result<Digest> RankDigest(const PlacedRank& rank, std::span<const std::string> only) {
  const CompiledLayout& l = *rank.layout;
  std::vector<bool> wanted;
  if (!only.empty()) {
    wanted.assign(l.map().tensors.size(), false);
    for (const std::string& name : only)
      if (int64_t i = l.FindTensor(name); i >= 0) wanted[static_cast<size_t>(i)] = true;
  }
  std::vector<DigestKey> keys;
  for (const LayoutTensor& t : l.map().tensors) keys.push_back(MakeDigestKey(t.name));
  std::mutex mu;
  Digest total;
  DCR_RETURN_IF_ERROR(ForEachPrimaryPiece(rank, wanted, [&](size_t t, uint64_t canonical, auto bytes) {
    const Digest d = DigestBytes(keys[t], canonical, bytes);
    std::lock_guard lock(mu);
    total += d;
  }));
  return total;
}

Result<ChunkDigestTable> RankChunkDigests(const PlacedRank& rank, const DeltaManifest& manifest) {
  const CompiledLayout& l = *rank.layout;
  ChunkDigestTable table(manifest.tensors.size());
  std::vector<int64_t> run_tensor(l.map().tensors.size(), -1);  // map tensor -> manifest tensor
  std::vector<bool> wanted(l.map().tensors.size(), false);
  std::vector<DigestKey> keys(l.map().tensors.size());
  for (size_t t = 0; t < manifest.tensors.size(); ++t) {
    table[t].assign(manifest.ChunkCount(t), Digest{});
    if (const int64_t local = l.FindTensor(manifest.tensors[t].name); local >= 0) {
      run_tensor[static_cast<size_t>(local)] = static_cast<int64_t>(t);
      wanted[static_cast<size_t>(local)] = true;
      keys[static_cast<size_t>(local)] = MakeDigestKey(manifest.tensors[t].name);
    }
  }
  if (std::find(wanted.begin(), wanted.end(), true) == wanted.end()) return table;
  std::mutex mu;
  DCR_RETURN_IF_ERROR(ForEachPrimaryPiece(rank, wanted, [&](size_t local, uint64_t canonical, auto bytes) {
    const size_t t = static_cast<size_t>(run_tensor[local]);
    const uint64_t eb = l.ElementBytes(local), chunk_bytes = manifest.chunk_elements * eb;
    std::vector<std::pair<uint64_t, Digest>> sums;  // a piece spans at most two chunks
    for (uint64_t at = canonical, end = canonical + bytes.size(); at < end;) {
      const uint64_t chunk = at / chunk_bytes, stop = std::min(end, (chunk + 1) * chunk_bytes);
      sums.emplace_back(chunk, DigestBytes(keys[local], at, bytes.subspan(at - canonical, stop - at)));
      at = stop;
    }
    std::lock_guard lock(mu);
    for (const auto& [chunk, d] : sums) table[t][chunk] += d;
  }));
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

}  // namespace dcr
