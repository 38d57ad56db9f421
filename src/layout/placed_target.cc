// Ranks as a target of the apply loop (PlacedTarget, layout_apply.h), and
// the rank and engine applies built on it.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "dcr/layout_apply.h"
#include "dcr/thread_pool.h"

namespace dcr {

using placement::Segment;

// One copy's run of a chunk, in words: chunk words [chunk_word, +words) are
// buffer words [buffer_word, +words) of `buffer` of ranks_[rank].
struct PlacedTarget::Run {
  uint32_t rank = 0, copy = 0;  // copy: the map's copy index
  size_t buffer = 0;
  bool primary = false;
  uint64_t chunk_word = 0, buffer_word = 0, words = 0;
};

PlacedTarget::PlacedTarget(std::span<PlacedRank* const> ranks, const DeltaManifest& manifest, bool partial)
    : ranks_(ranks.begin(), ranks.end()), manifest_(manifest), partial_(partial) {
  for (const PlacedRank* r : ranks_) {
    batched_ = batched_ || r->memory != nullptr;
    std::vector<int64_t> local(manifest.tensors.size());
    for (size_t t = 0; t < manifest.tensors.size(); ++t) local[t] = r->layout->FindTensor(manifest.tensors[t].name);
    local_.push_back(std::move(local));
  }
}

// The chunk's runs over every rank's copies: primaries first, each copy's
// runs together and in increasing chunk_word.
std::vector<PlacedTarget::Run> PlacedTarget::Runs(uint32_t tensor, uint32_t chunk) const {
  const DeltaTensor& t = manifest_.tensors[tensor];
  const uint64_t first = uint64_t{chunk} * manifest_.chunk_elements;
  const uint64_t elements = std::min<uint64_t>(manifest_.chunk_elements, t.elements - first);
  const uint64_t wb = WordBytes(t.dtype), wpe = BitsPerElement(t.dtype) / 8 / wb;  // words per element
  std::vector<Run> out;
  std::vector<CopyRun> runs;
  for (const bool primary : {true, false})
    for (uint32_t k = 0; k < ranks_.size(); ++k) {
      if (local_[k][tensor] < 0) continue;
      const CompiledLayout& l = *ranks_[k]->layout;
      for (uint32_t c : l.CopiesOf(static_cast<size_t>(local_[k][tensor]))) {
        if (l.map().copies[c].primary != primary) continue;
        runs.clear();
        l.RunsInRange(c, first, elements, &runs);
        for (const CopyRun& r : runs)
          out.push_back({k, c, l.BufferOf(c), primary, (r.canonical - first) * wpe, r.buffer * wpe, r.length * wpe});
      }
    }
  return out;
}

Result<Holding> PlacedTarget::Holds(uint32_t tensor, uint32_t chunk) const {
  const DeltaTensor& t = manifest_.tensors[tensor];
  const std::string where = fmt::format("tensor '{}' chunk {}", t.name, chunk);
  for (size_t k = 0; k < ranks_.size(); ++k) {
    if (local_[k][tensor] < 0) continue;
    const LayoutTensor& mapped = ranks_[k]->layout->map().tensors[static_cast<size_t>(local_[k][tensor])];
    if (mapped.shape != t.shape)
      return InvalidArgument(fmt::format("{}: rank {} maps it with shape {} but the delta's tensor is {}", where, k,
                                         fmt::join(mapped.shape, "x"), fmt::join(t.shape, "x")));
    if (BitsPerElement(t.dtype) % 8 != 0)
      return Unimplemented(
          fmt::format("{}: dtype {} is packed below a byte; it cannot be placed through a map", where, Name(t.dtype)));
  }
  uint64_t first_word = 0, words = 0, primary = 0;
  uint32_t elements = 0;
  manifest_.ChunkWords(tensor, chunk, &first_word, &words, &elements);
  const std::vector<Run> runs = Runs(tensor, chunk);
  for (const Run& r : runs) primary += r.primary ? r.words : 0;
  if (primary == words) return Holding::kWhole;
  if (partial_) return runs.empty() ? Holding::kNone : Holding::kPartial;
  if (runs.empty())
    return FailedPrecondition(
        fmt::format("{}: no rank given holds it; it is a residual here (hand its overwrites to the runtime's loader) "
                    "or the wrong engine was passed",
                    where));
  return FailedPrecondition(
      fmt::format("{}: the ranks given hold {} of its {} words; a partial chunk cannot be verified alone, apply it "
                  "with every rank of the engine",
                  where, primary, words));
}

std::span<uint8_t> PlacedTarget::Direct(uint32_t tensor, uint32_t chunk) const {
  const std::vector<Run> runs = Runs(tensor, chunk);
  uint64_t first_word = 0, words = 0;
  uint32_t elements = 0;
  manifest_.ChunkWords(tensor, chunk, &first_word, &words, &elements);
  if (runs.size() != 1 || !runs[0].primary || runs[0].words != words || ranks_[runs[0].rank]->memory != nullptr)
    return {};
  const uint64_t wb = WordBytes(manifest_.tensors[tensor].dtype);
  return ranks_[runs[0].rank]->buffers[runs[0].buffer].subspan(runs[0].buffer_word * wb, words * wb);
}

Result<Digest> PlacedTarget::ChunkDigest(uint32_t tensor, uint32_t chunk) const {
  const DeltaTensor& t = manifest_.tensors[tensor];
  const uint64_t wb = WordBytes(t.dtype);
  uint64_t first_word = 0, words = 0;
  uint32_t elements = 0;
  manifest_.ChunkWords(tensor, chunk, &first_word, &words, &elements);
  const DigestKey key = MakeDigestKey(t.name);
  Digest d;
  std::vector<uint8_t> read;
  for (const Run& r : Runs(tensor, chunk)) {
    if (!r.primary) continue;
    const PlacedRank& rank = *ranks_[r.rank];
    std::span<const uint8_t> bytes;
    if (rank.memory == nullptr) {
      bytes = rank.buffers[r.buffer].subspan(r.buffer_word * wb, r.words * wb);
    } else {
      read.resize(r.words * wb);
      DCR_RETURN_IF_ERROR(rank.memory->Read(r.buffer, r.buffer_word * wb, read));
      bytes = read;
    }
    d += DigestBytes(key, (first_word + r.chunk_word) * wb, bytes);
  }
  return d;
}

Status PlacedTarget::Finish() {
  for (PlacedRank* r : ranks_)
    if (r->memory != nullptr) DCR_RETURN_IF_ERROR(r->memory->Flush());
  return Status::Ok();
}

namespace placement {

// One frame's words in one buffer of a rank in BufferMemory: which of its
// changes they are, at which word offsets, and (scatter) their new words.
struct Segment {
  uint32_t rank = 0;
  size_t buffer = 0;
  uint32_t word_bytes = 0;
  std::vector<uint32_t> change;
  std::vector<uint64_t> offset;
  std::vector<uint8_t> words;  // scatter: the new words
  uint64_t at = 0;  // its first word in its buffer's request
};

}  // namespace placement

namespace {

// Calls f(change index, buffer word) for each change of `c` (n of them,
// positions increasing) inside the runs [first, last) of one copy (in
// increasing chunk_word).
template <typename Record, typename Run, typename F>
void ForEachHeld(const Record* c, uint32_t n, const Run* first, const Run* last, F&& f) {
  uint32_t i = 0;
  for (const Run* r = first; r != last && i < n; ++r) {
    i = static_cast<uint32_t>(
        std::lower_bound(c + i, c + n, r->chunk_word, [](const Record& x, uint64_t w) { return x.position < w; }) - c);
    for (; i < n && c[i].position < r->chunk_word + r->words; ++i)
      f(i, r->buffer_word + (c[i].position - r->chunk_word));
  }
}

template <typename U>
U LoadWord(const uint8_t* p) {
  U v;
  std::memcpy(&v, p, sizeof(U));
  return v;
}

Segment& SegmentFor(std::vector<Segment>& segs, uint32_t rank, size_t buffer, uint32_t word_bytes) {
  for (Segment& s : segs)
    if (s.rank == rank && s.buffer == buffer) return s;
  segs.push_back({rank, buffer, word_bytes, {}, {}, {}, 0});
  return segs.back();
}

// The window's segments, concatenated item by item into one request per
// (rank, buffer), issued rank by rank; `words` gets each request's words
// (scatter: filled from the segments first). Sets each segment's `at`.
Status Issue(const std::vector<PlacedRank*>& ranks, std::vector<std::vector<Segment>>& segs, bool gather,
             std::map<std::pair<uint32_t, size_t>, std::vector<uint8_t>>* words) {
  std::map<std::pair<uint32_t, size_t>, std::vector<uint64_t>> offsets;
  std::map<std::pair<uint32_t, size_t>, uint32_t> word_bytes;
  for (auto& item : segs)
    for (Segment& s : item) {
      auto& o = offsets[{s.rank, s.buffer}];
      s.at = o.size();
      o.resize(o.size() + s.offset.size());
      word_bytes[{s.rank, s.buffer}] = s.word_bytes;
    }
  for (const auto& [key, o] : offsets) (*words)[key].resize(o.size() * word_bytes.at(key));
  DefaultPool().ParallelFor(segs.size(), [&](size_t j) {  // map lookups only: no insertion while in parallel
    for (const Segment& s : segs[j]) {
      std::copy(s.offset.begin(), s.offset.end(), offsets.at({s.rank, s.buffer}).begin() + s.at);
      if (!gather)
        std::copy(s.words.begin(), s.words.end(), words->at({s.rank, s.buffer}).begin() + s.at * s.word_bytes);
    }
  });
  for (uint32_t k = 0; k < ranks.size(); ++k) {
    std::vector<WordRequest> requests;
    for (auto& [key, o] : offsets)
      if (key.first == k)
        requests.push_back({static_cast<uint32_t>(key.second), word_bytes.at(key), o, words->at(key)});
    if (requests.empty()) continue;
    DCR_RETURN_IF_ERROR(gather ? ranks[k]->memory->Gather(requests) : ranks[k]->memory->Scatter(requests));
  }
  return Status::Ok();
}

// Keeps the changes held (held[i] != 0), and marks which count (held 2).
void KeepHeld(ApplyItem& item, std::vector<uint8_t>& held) {
  item.counted.clear();
  bool all_counted = true;
  item.changes.Visit([&](auto* c) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < item.changes.count; ++i) {
      if (held[i] == 0) continue;
      all_counted = all_counted && held[i] == 2;
      held[kept] = held[i];
      c[kept++] = c[i];
    }
    item.changes.count = kept;
  });
  if (!all_counted)
    for (uint32_t i = 0; i < item.changes.count; ++i) item.counted.push_back(held[i] == 2);
}

}  // namespace

// The item's changes placed through the runs, one copy at a time: a gather
// claims each change for the first copy holding it (counted copies first)
// and reads it there (host) or lists it in `segs` (BufferMemory); a scatter
// writes every copy (host) or lists it.
void PlacedTarget::Place(ApplyItem& item, bool gather, std::vector<Segment>* segs, std::vector<uint8_t>* held) const {
  const std::vector<Run> runs = Runs(item.tensor, item.chunk);
  if (gather) held->assign(item.changes.count, 0);
  item.changes.Visit([&](auto* c) {
    using U = decltype(c->old_word);
    for (size_t g = 0; g < runs.size();) {  // one copy at a time
      size_t end = g;
      while (end < runs.size() && runs[end].rank == runs[g].rank && runs[end].copy == runs[g].copy) ++end;
      const Run& run = runs[g];
      const PlacedRank& rank = *ranks_[run.rank];
      Segment* seg = rank.memory ? &SegmentFor(*segs, run.rank, run.buffer, sizeof(U)) : nullptr;
      uint8_t* host = rank.memory ? nullptr : rank.buffers[run.buffer].data();
      if (seg != nullptr) {  // at most every change lands here: no reallocation in the loop
        seg->change.reserve(seg->change.size() + item.changes.count);
        seg->offset.reserve(seg->offset.size() + item.changes.count);
        if (!gather) seg->words.reserve(seg->words.size() + size_t{item.changes.count} * sizeof(U));
      }
      ForEachHeld(c, item.changes.count, runs.data() + g, runs.data() + end, [&](uint32_t i, uint64_t word) {
        if (gather) {
          if ((*held)[i] != 0) return;  // a counted copy (or an earlier replica) has it
          (*held)[i] = run.primary ? 2 : 1;
        }
        if (host != nullptr) {
          if (gather) c[i].old_word = LoadWord<U>(host + word * sizeof(U));
          else std::memcpy(host + word * sizeof(U), &c[i].new_word, sizeof(U));
          return;
        }
        seg->change.push_back(i);
        seg->offset.push_back(word);
        if (!gather) {
          const size_t at = seg->words.size();
          seg->words.resize(at + sizeof(U));  // within the reservation
          std::memcpy(seg->words.data() + at, &c[i].new_word, sizeof(U));
        }
      });
      g = end;
    }
  });
}

// Per item, on the pool for a window of a batched target; inline otherwise
// (the loop already runs those items on the pool).
void PlacedTarget::ForItems(size_t n, const std::function<void(size_t)>& fn) const {
  if (batched_) {
    DefaultPool().ParallelFor(n, fn);
    return;
  }
  for (size_t j = 0; j < n; ++j) fn(j);
}

Status PlacedTarget::Gather(std::span<ApplyItem* const> items) {
  std::vector<std::vector<Segment>> segs(items.size());
  std::vector<std::vector<uint8_t>> held(items.size());  // per change: 0 none, 1 a replica, 2 a counted copy
  ForItems(items.size(), [&](size_t j) { Place(*items[j], true, &segs[j], &held[j]); });
  std::map<std::pair<uint32_t, size_t>, std::vector<uint8_t>> words;
  DCR_RETURN_IF_ERROR(Issue(ranks_, segs, /*gather=*/true, &words));
  ForItems(items.size(), [&](size_t j) {
    items[j]->changes.Visit([&](auto* c) {
      for (const Segment& s : segs[j]) {
        const uint8_t* got = words.at({s.rank, s.buffer}).data() + s.at * s.word_bytes;
        for (size_t k = 0; k < s.change.size(); ++k)
          std::memcpy(&c[s.change[k]].old_word, got + k * s.word_bytes, s.word_bytes);
      }
    });
    KeepHeld(*items[j], held[j]);
  });
  return Status::Ok();
}

Status PlacedTarget::Scatter(std::span<ApplyItem* const> items) {
  std::vector<std::vector<Segment>> segs(items.size());
  ForItems(items.size(), [&](size_t j) { Place(*items[j], false, &segs[j], nullptr); });
  std::map<std::pair<uint32_t, size_t>, std::vector<uint8_t>> words;
  return Issue(ranks_, segs, /*gather=*/false, &words);
}

std::vector<FrameApplied> ApplyRankFrames(PlacedRank& rank, const DeltaManifest& manifest,
                                          std::span<const FrameView> frames, std::span<const Digest> current) {
  PlacedRank* ranks[] = {&rank};
  if (Status s = CheckRankBuffers(rank); !s.ok()) {
    std::vector<FrameApplied> out(frames.size());
    for (FrameApplied& r : out) r.status = s;
    return out;
  }
  PlacedTarget target(ranks, manifest, /*partial=*/true);
  return ApplyFrames(target, manifest, frames, current);
}

namespace {

// The engine's chunk digests: `tracked` when it fits the manifest, else the
// ranks' own (a pass over them).
Result<ChunkDigestTable> EngineDigests(std::span<PlacedRank* const> ranks, const DeltaManifest& m,
                                       ChunkDigestTable* tracked) {
  if (tracked != nullptr && !tracked->empty()) {
    bool shaped = tracked->size() == m.tensors.size();
    for (size_t t = 0; shaped && t < m.tensors.size(); ++t) shaped = (*tracked)[t].size() == m.ChunkCount(t);
    if (!shaped) return InvalidArgument("ApplyEngineDelta: tracked chunk digests do not match the delta's chunking");
    return std::move(*tracked);
  }
  ChunkDigestTable table(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) table[t].assign(m.ChunkCount(t), Digest{});
  for (PlacedRank* r : ranks) {
    DCR_ASSIGN_OR_RETURN(ChunkDigestTable mine, RankChunkDigests(*r, m));
    for (size_t t = 0; t < m.tensors.size(); ++t)
      for (size_t c = 0; c < mine[t].size(); ++c) table[t][c] += mine[t][c];
  }
  return table;
}

// The digest the engine must reach over the non-residual tensors.
Result<Digest> ExpectedDigest(const DeltaManifest& m, const std::vector<bool>& residual) {
  Digest expected = m.target_digest;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (!residual[t]) continue;
    if (m.tensor_target_digests.size() != m.tensors.size())
      return FailedPrecondition(fmt::format(
          "tensor '{}' is a residual here, and the delta does not carry per-tensor digests (a stored manifest does "
          "not): the ranks cannot be checked against it; apply it with the delta its sender made in memory",
          m.tensors[t].name));
    expected -= m.tensor_target_digests[t];
  }
  return expected;
}

}  // namespace

Result<ApplyReport> ApplyEngineDelta(std::span<PlacedRank* const> ranks, const DeltaReader& delta,
                                     std::span<const std::string> residuals, ChunkDigestTable* tracked) {
  const DeltaManifest& m = delta.manifest();
  for (size_t k = 0; k < ranks.size(); ++k)
    if (Status s = CheckRankBuffers(*ranks[k]); !s.ok()) return s.WithContext(fmt::format("rank {}", k));
  std::vector<bool> residual(m.tensors.size(), false);
  for (size_t t = 0; t < m.tensors.size(); ++t)
    residual[t] = std::find(residuals.begin(), residuals.end(), m.tensors[t].name) != residuals.end();
  DCR_ASSIGN_OR_RETURN(const Digest expected, ExpectedDigest(m, residual));
  DCR_ASSIGN_OR_RETURN(ChunkDigestTable digests, EngineDigests(ranks, m, tracked));
  std::vector<FrameView> frames;
  std::vector<Digest> current;
  for (size_t i = 0; i < m.frames.size(); ++i) {
    if (residual[m.frames[i].tensor]) continue;
    DCR_ASSIGN_OR_RETURN(FrameView frame, delta.Frame(i));
    frames.push_back(frame);
    current.push_back(digests[frame.header.tensor][frame.header.chunk]);
  }
  PlacedTarget target(ranks, m, /*partial=*/false);
  uint64_t scratch = 0;
  const auto applied = ApplyFrames(target, m, frames, current, {.scratch_peak = &scratch});
  ApplyReport report;
  report.scratch_peak_bytes = scratch;
  Status first;
  for (size_t i = 0; i < frames.size(); ++i) {
    const FrameApplied& r = applied[i];
    if (!r.status.ok()) {
      if (first.ok()) first = r.status;
      continue;
    }
    digests[frames[i].header.tensor][frames[i].header.chunk] = r.after;
    if (r.outcome == ApplyOutcome::kApplied) {
      ++report.frames_applied;
      report.payload_bytes += frames[i].payload.size();
      report.changed_words += frames[i].header.changed;
    } else {
      ++report.frames_already_applied;
    }
  }
  Digest total;
  for (size_t t = 0; t < m.tensors.size(); ++t)
    if (!residual[t])
      for (const Digest& d : digests[t]) total += d;
  if (tracked != nullptr) *tracked = std::move(digests);
  DCR_RETURN_IF_ERROR(first);
  if (total != expected)
    return DataLoss(
        fmt::format("after applying, the engine's ranks add up to digest {} but the delta's target is {}; "
                    "a rank is corrupt or a tensor is unmapped (residual) here; resync from a snapshot",
                    total.ToHex(), expected.ToHex()));
  return report;
}

}  // namespace dcr
