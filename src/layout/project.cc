// Projection: senders diff their own shards and contribute to canonical
// chunks; each chunk's owner merges the contributions into its one frame.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>

#include "dcr/layout_apply.h"
#include "dcr/text.h"
#include "dcr/thread_pool.h"

namespace dcr {
namespace {

uint64_t ElementBytesOf(DType dtype) { return BitsPerElement(dtype) / 8; }

void AppendChange(const uint8_t* b, const uint8_t* x, uint64_t e, uint64_t eb, uint32_t at, ChunkContribution* cc) {
  cc->positions.push_back(at + static_cast<uint32_t>(e));
  cc->old_bits.insert(cc->old_bits.end(), b + e * eb, b + (e + 1) * eb);
  cc->new_bits.insert(cc->new_bits.end(), x + e * eb, x + (e + 1) * eb);
}

// Appends the elements of a run whose bits differ (integer views: +-0 and
// every NaN payload count), positions from `at`. Compares 8 bytes at a time
// and looks inside only the words that differ.
void FindChangedElements(const uint8_t* b, const uint8_t* x, uint64_t n, uint64_t eb, uint32_t at,
                         ChunkContribution* cc) {
  const uint64_t bytes = n * eb;
  uint64_t i = 0;
  if (eb <= 8 && 8 % eb == 0) {
    for (; i + 8 <= bytes; i += 8) {
      uint64_t u, v;
      std::memcpy(&u, b + i, 8);
      std::memcpy(&v, x + i, 8);
      if (u == v) continue;
      for (uint64_t e = i / eb; e < (i + 8) / eb; ++e)
        if (std::memcmp(b + e * eb, x + e * eb, eb) != 0) AppendChange(b, x, e, eb, at, cc);
    }
  }
  for (uint64_t e = i / eb; e < n; ++e)
    if (std::memcmp(b + e * eb, x + e * eb, eb) != 0) AppendChange(b, x, e, eb, at, cc);
}

}  // namespace

Result<uint32_t> ChunkOwner(std::span<const CompiledLayout* const> senders, const DeltaManifest& manifest,
                            uint32_t tensor, uint32_t chunk) {
  const DeltaTensor& t = manifest.tensors.at(tensor);
  const uint64_t first = uint64_t{chunk} * manifest.chunk_elements;
  std::vector<CopyRun> runs;
  for (size_t s = 0; s < senders.size(); ++s) {
    const int64_t lt = senders[s]->FindTensor(t.name);
    if (lt < 0) continue;
    for (uint32_t c : senders[s]->CopiesOf(static_cast<size_t>(lt))) {
      if (!senders[s]->map().copies[c].primary) continue;
      runs.clear();
      senders[s]->RunsInRange(c, first, 1, &runs);
      if (!runs.empty()) return static_cast<uint32_t>(s);
    }
  }
  return NotFound(
      fmt::format("tensor '{}' chunk {}: no sender's primary copy holds its first element; the trainer "
                  "maps leave it unmapped (declare it a residual)",
                  t.name, chunk));
}

namespace {

struct ChunkTask {
  size_t lt;  // the sender's layout tensor
  uint32_t t, chunk;  // the delta's tensor, and its chunk
};

// One task per (mapped tensor, chunk) of the delta; tasks are independent.
Result<std::vector<ChunkTask>> ChunkTasksOf(const CompiledLayout& l, const DeltaManifest& manifest, uint32_t index) {
  std::map<std::string_view, uint32_t> by_name;
  for (size_t t = 0; t < manifest.tensors.size(); ++t)
    by_name.emplace(manifest.tensors[t].name, static_cast<uint32_t>(t));
  std::vector<ChunkTask> tasks;
  for (size_t lt = 0; lt < l.map().tensors.size(); ++lt) {
    const LayoutTensor& lt_info = l.map().tensors[lt];
    auto it = by_name.find(lt_info.name);
    if (it == by_name.end()) continue;  // not in this delta (a residual delta holds some tensors only)
    const uint32_t t = it->second;
    const DeltaTensor& tensor = manifest.tensors[t];
    if (tensor.shape != lt_info.shape || tensor.dtype != lt_info.dtype)
      return InvalidArgument(
          fmt::format("sender {}: tensor '{}' differs in dtype or shape from the delta's", index, tensor.name));
    for (uint64_t c = 0, n = manifest.ChunkCount(t); c < n; ++c) tasks.push_back({lt, t, static_cast<uint32_t>(c)});
  }
  return tasks;
}

// The chunk [first, first + count) whole in one run of one primary copy:
// handed over as spans of the sender's buffers (true); false if it is not.
bool TakeWholeChunk(const SenderRank& sender, size_t lt, uint64_t first, uint64_t count, uint64_t eb,
                    ChunkContribution* cc) {
  const CompiledLayout& l = *sender.layout;
  std::vector<CopyRun> runs;
  uint32_t holder = 0, found = 0;
  CopyRun whole{};
  for (uint32_t copy : l.CopiesOf(lt)) {
    if (!l.map().copies[copy].primary) continue;
    runs.clear();
    l.RunsInRange(copy, first, count, &runs);
    found += static_cast<uint32_t>(runs.size());
    if (!runs.empty()) holder = copy, whole = runs.front();
  }
  if (found != 1 || whole.canonical != first || whole.length != count) return false;
  const size_t b = l.BufferOf(holder);
  // Read when the owner encodes it: awaited there.
  if (sender.await_current) cc->direct_ready = [f = sender.await_current, b] { return f(b); };
  cc->covered.emplace_back(0, static_cast<uint32_t>(count));
  cc->direct_base = sender.baseline[b].subspan(whole.buffer * eb, count * eb);
  cc->direct_next = sender.current[b].subspan(whole.buffer * eb, count * eb);
  return true;
}

// The runs of the chunk [first, first + count) of `tensor` in the sender's
// primary copies: covered ranges, base digest, changed elements (and with
// `overwrite` the covered bits). `await(buffer)` before reading a buffer:
// false stops it.
void DiffChunk(const SenderRank& sender, size_t lt, const DeltaTensor& tensor, uint64_t first, uint64_t count,
               bool overwrite, const std::function<bool(size_t)>& await, ChunkContribution* cc) {
  const CompiledLayout& l = *sender.layout;
  const DigestKey key = MakeDigestKey(tensor.name);
  const uint64_t eb = ElementBytesOf(tensor.dtype);
  std::vector<CopyRun> runs;
  for (uint32_t copy : l.CopiesOf(lt)) {
    if (!l.map().copies[copy].primary) continue;
    runs.clear();
    l.RunsInRange(copy, first, count, &runs);
    if (!runs.empty() && !await(l.BufferOf(copy))) return;
    const uint8_t* base = sender.baseline[l.BufferOf(copy)].data();
    const uint8_t* cur = sender.current[l.BufferOf(copy)].data();
    for (const CopyRun& r : runs) {
      const uint8_t* b = base + r.buffer * eb;
      const uint8_t* x = cur + r.buffer * eb;
      const uint64_t bytes = r.length * eb;
      cc->covered.emplace_back(static_cast<uint32_t>(r.canonical - first), static_cast<uint32_t>(r.length));
      cc->base_digest += DigestBytes(key, r.canonical * eb, {b, bytes});
      if (overwrite) cc->covered_bits.insert(cc->covered_bits.end(), x, x + bytes);
      if (std::memcmp(b, x, bytes) == 0) continue;
      FindChangedElements(b, x, r.length, eb, static_cast<uint32_t>(r.canonical - first), cc);
    }
  }
}

}  // namespace

Result<std::vector<ChunkContribution>> ProjectSender(const SenderRank& sender, uint32_t index,
                                                     const DeltaManifest& manifest,
                                                     const std::function<bool(uint32_t, uint32_t)>& direct) {
  const CompiledLayout& l = *sender.layout;
  const auto& buffers = l.map().buffers;
  if (sender.baseline.size() != buffers.size() || sender.current.size() != buffers.size())
    return InvalidArgument(fmt::format("sender {}: {} baseline and {} current buffers, its map declares {}", index,
                                       sender.baseline.size(), sender.current.size(), buffers.size()));
  for (size_t b = 0; b < buffers.size(); ++b)
    if (sender.baseline[b].size() != l.BufferBytes(b) || sender.current[b].size() != l.BufferBytes(b))
      return InvalidArgument(fmt::format("sender {}: buffer '{}' must have {} bytes (baseline and current)", index,
                                         buffers[b].id, l.BufferBytes(b)));
  DCR_ASSIGN_OR_RETURN(const std::vector<ChunkTask> tasks, ChunkTasksOf(l, manifest, index));
  const bool overwrite = manifest.delta_class == DeltaClass::kOverwrite;
  // Tasks run in parallel, each writing its own slot.
  std::vector<ChunkContribution> slots(tasks.size());
  std::vector<Status> failed(tasks.size());
  DefaultPool().ParallelFor(tasks.size(), [&](size_t i) {
    const ChunkTask& task = tasks[i];
    const DeltaTensor& tensor = manifest.tensors[task.t];
    const uint64_t first = uint64_t{task.chunk} * manifest.chunk_elements;
    const uint64_t count = std::min(manifest.chunk_elements, tensor.elements - first);
    ChunkContribution& cc = slots[i];
    cc.tensor = task.t;
    cc.chunk = task.chunk;
    cc.from = index;
    if (direct && direct(task.t, task.chunk) &&
        TakeWholeChunk(sender, task.lt, first, count, ElementBytesOf(tensor.dtype), &cc))
      return;
    const auto await = [&](size_t buffer) {
      if (!sender.await_current) return true;
      failed[i] = sender.await_current(buffer);
      return failed[i].ok();
    };
    DiffChunk(sender, task.lt, tensor, first, count, overwrite, await, &cc);
  });
  for (const Status& f : failed) DCR_RETURN_IF_ERROR(f);
  std::vector<ChunkContribution> out;
  for (ChunkContribution& cc : slots)
    if (!cc.covered.empty()) out.push_back(std::move(cc));
  std::sort(out.begin(), out.end(), [](const ChunkContribution& a, const ChunkContribution& b) {
    return std::pair(a.tensor, a.chunk) < std::pair(b.tensor, b.chunk);
  });
  return out;
}

namespace {

// One chunk's merged frame (or none, when nothing changed).
struct MergedChunk {
  Digest base_digest, target_digest;
  bool changed = false;
  std::string frame;
};

// Per-thread scratch for MergeChunk, reused between chunks.
struct MergeScratch {
  ChunkEncoder encoder;
  EncodedChunk encoded;
  struct Range {
    uint32_t lo, len, from;
  };
  std::vector<Range> ranges;
  std::vector<uint8_t> base, next;
};

Status EncodeMerged(ChunkId id, const ChunkInput& in, const EncodeOptions& opt, MergeScratch& s, MergedChunk* out);

// Merges one chunk's contributions into its frame: they must cover the chunk
// exactly once; the chunk's base and next bits are rebuilt in a chunk-sized
// scratch (unchanged elements zero in xor class, the covered new bits in
// overwrite class) and encoded as a canonical encoder would; a direct
// contribution's spans are encoded as they are.
Status MergeChunk(const DeltaManifest& manifest, ChunkId id, std::span<const ChunkContribution* const> parts,
                  const EncodeOptions& opt, MergeScratch& s, MergedChunk* out) {
  const bool overwrite = manifest.delta_class == DeltaClass::kOverwrite;
  const DeltaTensor& tensor = manifest.tensors[id.tensor];
  const auto where = [&] { return fmt::format("tensor '{}' chunk {}", tensor.name, id.chunk); };
  uint64_t first_word, words;
  uint32_t elements;
  manifest.ChunkWords(id.tensor, id.chunk, &first_word, &words, &elements);
  const uint64_t eb = ElementBytesOf(tensor.dtype);
  for (const ChunkContribution* c : parts)
    if (c->direct() && parts.size() > 1)
      return FailedPrecondition(
          fmt::format("{}: sender {} holds the whole chunk, and {} other senders contribute to "
                      "it too; the trainer maps need exactly one primary copy",
                      where(), c->from, parts.size() - 1));
  const bool direct = parts.size() == 1 && parts[0]->direct();
  if (direct && (parts[0]->direct_base.size() != uint64_t{elements} * eb ||
                 parts[0]->direct_next.size() != uint64_t{elements} * eb))
    return InvalidArgument(
        fmt::format("{}: sender {}'s direct contribution is not the chunk's size", where(), parts[0]->from));
  Digest base_digest;
  ChunkInput in{tensor.dtype, MakeDigestKey(tensor.name), first_word, elements, {}, {}, &base_digest};
  if (direct) {
    if (parts[0]->direct_ready) DCR_RETURN_IF_ERROR(parts[0]->direct_ready());
    in.base = parts[0]->direct_base;
    in.next = parts[0]->direct_next;
    in.base_digest = nullptr;  // the encoder's pass
    return EncodeMerged(id, in, opt, s, out);
  }
  s.next.assign(uint64_t{elements} * eb, 0);
  s.ranges.clear();
  for (const ChunkContribution* c : parts) {
    base_digest += c->base_digest;
    uint64_t at = 0;
    for (auto [lo, len] : c->covered) {
      if (uint64_t{lo} + len > elements)
        return InvalidArgument(
            fmt::format("{}: sender {} covers elements past the chunk's {}", where(), c->from, elements));
      s.ranges.push_back({lo, len, c->from});
      if (overwrite) {
        if (c->covered_bits.size() < (at + len) * eb)
          return InvalidArgument(
              fmt::format("{}: sender {}'s overwrite contribution lacks the new bits it covers", where(), c->from));
        std::memcpy(s.next.data() + uint64_t{lo} * eb, c->covered_bits.data() + at * eb, uint64_t{len} * eb);
      }
      at += len;
    }
  }
  // Exactly once: sorted, the ranges must tile [0, elements).
  std::sort(s.ranges.begin(), s.ranges.end(), [](const auto& x, const auto& y) { return x.lo < y.lo; });
  uint64_t next_lo = 0, covered = 0;
  for (const auto& r : s.ranges) {
    if (r.lo < next_lo)
      return FailedPrecondition(
          fmt::format("{}: element {} is contributed twice (sender {} among them); the trainer "
                      "maps need exactly one primary copy",
                      where(), r.lo, r.from));
    next_lo = uint64_t{r.lo} + r.len;
    covered += r.len;
  }
  if (covered != elements)
    return FailedPrecondition(
        fmt::format("{}: the contributions cover {} of its {} elements; every sender touching "
                    "the chunk must hand its record to the owner",
                    where(), covered, elements));
  s.base = s.next;
  for (const ChunkContribution* c : parts) {
    if (c->old_bits.size() != c->positions.size() * eb || c->new_bits.size() != c->positions.size() * eb)
      return InvalidArgument(fmt::format("{}: sender {}'s change lists disagree in length", where(), c->from));
    for (size_t i = 0; i < c->positions.size(); ++i) {
      const uint64_t p = c->positions[i];
      if (p >= elements)
        return InvalidArgument(fmt::format("{}: sender {} changes element {} past the chunk", where(), c->from, p));
      std::memcpy(s.base.data() + p * eb, c->old_bits.data() + i * eb, eb);
      std::memcpy(s.next.data() + p * eb, c->new_bits.data() + i * eb, eb);
    }
  }
  in.base = s.base;
  in.next = s.next;
  return EncodeMerged(id, in, opt, s, out);
}

// Encodes a merged chunk's base and next bits into its frame.
Status EncodeMerged(ChunkId id, const ChunkInput& in, const EncodeOptions& opt, MergeScratch& s, MergedChunk* out) {
  DCR_ASSIGN_OR_RETURN(bool changed, s.encoder.Encode(in, opt, &s.encoded));
  out->base_digest = s.encoded.base_digest;
  out->changed = changed;
  if (!changed) {
    out->target_digest = out->base_digest;
    return Status::Ok();
  }
  s.encoded.header.tensor = id.tensor;
  s.encoded.header.chunk = id.chunk;
  out->target_digest = s.encoded.header.target_digest;
  out->frame = EncodeFrame(s.encoded.header, s.encoded.payload);
  return Status::Ok();
}

}  // namespace

Result<OwnedFrames> EncodeOwnedChunks(const DeltaManifest& manifest, std::span<const ChunkContribution> contributions,
                                      const EncodeOptions& options) {
  std::map<ChunkId, std::vector<const ChunkContribution*>> by_chunk;
  for (const ChunkContribution& c : contributions) {
    if (c.tensor >= manifest.tensors.size() || c.chunk >= manifest.ChunkCount(c.tensor))
      return InvalidArgument(fmt::format("a contribution from sender {} names tensor {} chunk {}, outside the delta",
                                         c.from, c.tensor, c.chunk));
    by_chunk[ChunkId{c.tensor, c.chunk}].push_back(&c);
  }
  EncodeOptions opt = options;
  opt.delta_class = manifest.delta_class;
  // Chunks are merged in parallel, each into its own slot; scratch is taken
  // from a free list so each thread reuses one set.
  std::vector<std::pair<ChunkId, const std::vector<const ChunkContribution*>*>> chunks;
  for (const auto& [id, parts] : by_chunk) chunks.emplace_back(id, &parts);
  std::vector<MergedChunk> merged(chunks.size());
  std::vector<Status> status(chunks.size());
  std::mutex mu;
  std::vector<std::unique_ptr<MergeScratch>> free_scratch;
  DefaultPool().ParallelFor(chunks.size(), [&](size_t i) {
    std::unique_ptr<MergeScratch> s;
    {
      std::lock_guard lock(mu);
      if (!free_scratch.empty()) {
        s = std::move(free_scratch.back());
        free_scratch.pop_back();
      }
    }
    if (!s) s = std::make_unique<MergeScratch>();
    status[i] = MergeChunk(manifest, chunks[i].first, *chunks[i].second, opt, *s, &merged[i]);
    std::lock_guard lock(mu);
    free_scratch.push_back(std::move(s));
  });
  OwnedFrames out;
  for (size_t i = 0; i < chunks.size(); ++i) {
    DCR_RETURN_IF_ERROR(status[i]);
    out.chunks.push_back(chunks[i].first);
    out.base_digests.push_back(merged[i].base_digest);
    out.target_digests.push_back(merged[i].target_digest);
    if (!merged[i].changed) {
      out.frame_of.push_back(-1);
      continue;
    }
    out.frame_of.push_back(static_cast<int64_t>(out.frames.size()));
    out.frames.push_back(std::move(merged[i].frame));
  }
  return out;
}

DeltaManifest StartLayoutDelta(std::span<const TensorInfo> tensors, const DeltaOptions& options) {
  DeltaManifest m;
  m.delta_id = options.delta_id;
  if (m.delta_id == 0) {
    std::random_device rd;
    m.delta_id = (uint64_t{rd()} << 32) ^ rd();
    if (m.delta_id == 0) m.delta_id = 1;
  }
  m.delta_class = options.encode.delta_class;
  m.chunk_elements = options.chunk_elements;
  std::vector<TensorInfo> sorted(tensors.begin(), tensors.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return TensorNameLess(a.name, b.name); });
  for (const TensorInfo& t : sorted) {
    m.tensors.push_back({t.name, t.dtype, t.shape, t.numel});
    m.total_elements += t.numel;
    m.total_bytes += t.nbytes;
  }
  return m;
}

Result<std::string> AssembleLayoutDelta(DeltaManifest& m, std::span<const OwnedFrames> owners) {
  struct Slot {
    const OwnedFrames* owner = nullptr;
    size_t index = 0;
  };
  std::map<ChunkId, Slot> slots;
  for (const OwnedFrames& o : owners)
    for (size_t i = 0; i < o.chunks.size(); ++i)
      if (!slots.emplace(o.chunks[i], Slot{&o, i}).second)
        return FailedPrecondition(
            fmt::format("tensor '{}' chunk {} was merged by two owners; ownership must be a "
                        "function of the chunk",
                        m.tensors.at(o.chunks[i].tensor).name, o.chunks[i].chunk));
  std::map<ChunkId, const std::string*> frames;
  for (const OwnedFrames& o : owners)
    for (size_t i = 0; i < o.chunks.size(); ++i)
      if (o.frame_of[i] >= 0) frames[o.chunks[i]] = &o.frames.at(static_cast<size_t>(o.frame_of[i]));
  std::vector<Digest> base, target;
  std::string bytes;
  m.frames.clear();
  for (const ChunkId& id : AllChunks(m)) {
    auto it = slots.find(id);
    if (it == slots.end())
      return FailedPrecondition(
          fmt::format("tensor '{}' chunk {} was merged by no owner; every chunk needs its "
                      "senders' contributions",
                      m.tensors[id.tensor].name, id.chunk));
    base.push_back(it->second.owner->base_digests[it->second.index]);
    target.push_back(it->second.owner->target_digests[it->second.index]);
    auto f = frames.find(id);
    if (f == frames.end()) continue;
    DCR_ASSIGN_OR_RETURN(FrameView v,
                         ParseFrame({reinterpret_cast<const uint8_t*>(f->second->data()), f->second->size()}));
    m.frames.push_back({id.tensor, id.chunk, 0, bytes.size(), f->second->size(), v.header.mode, v.header.codec,
                        v.header.changed, v.header.payload_bytes});
    bytes += *f->second;
  }
  m.objects = {std::string(kFramesFileName)};
  FinishDelta(m, base, target);
  return bytes;
}

}  // namespace dcr
