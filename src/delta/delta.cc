#include "dcr/delta.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <unordered_set>

#include "dcr/apply.h"
#include "dcr/progress.h"
#include "dcr/thread_pool.h"

namespace dcr {
namespace {

namespace fs = std::filesystem;

ThreadPool& PoolOr(ThreadPool* pool) { return pool ? *pool : DefaultPool(); }

// Bytes of chunk c of tensor t within the tensor's data.
std::pair<uint64_t, uint64_t> ChunkByteRange(const DeltaManifest& m, size_t t, uint64_t c) {
  uint64_t first_word, words;
  uint32_t elements;
  m.ChunkWords(t, c, &first_word, &words, &elements);
  const uint64_t wb = WordBytes(m.tensors[t].dtype);
  return {first_word * wb, words * wb};
}

}  // namespace

std::vector<ChunkId> AllChunks(const DeltaManifest& m) {
  std::vector<ChunkId> out;
  for (size_t t = 0; t < m.tensors.size(); ++t)
    for (uint64_t c = 0; c < m.ChunkCount(t); ++c) out.push_back({static_cast<uint32_t>(t), static_cast<uint32_t>(c)});
  return out;
}

Status CheckSameTensors(const Checkpoint& ckpt, const DeltaManifest& m) {
  for (const auto& t : m.tensors) {
    const int64_t i = ckpt.Find(t.name);
    if (i < 0)
      return FailedPrecondition(fmt::format("{} has no tensor '{}', which the delta covers", ckpt.path(), t.name));
    const TensorInfo& info = ckpt.tensors()[static_cast<size_t>(i)];
    if (info.dtype != t.dtype || info.shape != t.shape)
      return FailedPrecondition(fmt::format("tensor '{}' is {}[{}] in {} but {}[{}] in the delta", t.name,
                                            Name(info.dtype), fmt::join(info.shape, ","), ckpt.path(), Name(t.dtype),
                                            fmt::join(t.shape, ",")));
  }
  if (ckpt.size() != m.tensors.size()) {  // every manifest tensor is present: find the extra one
    std::unordered_set<std::string_view> covered;
    for (const auto& t : m.tensors) covered.insert(t.name);
    for (const auto& info : ckpt.tensors())
      if (!covered.count(info.name))
        return FailedPrecondition(
            fmt::format("{} has tensor '{}', which the delta does not cover", ckpt.path(), info.name));
  }
  return Status::Ok();
}

ChunkDigestTable ChunkDigests(const Checkpoint& ckpt, const DeltaManifest& m, Progress* progress, ThreadPool* pool) {
  ChunkDigestTable out(m.tensors.size());
  std::vector<size_t> index(m.tensors.size());
  std::vector<DigestKey> keys(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    out[t].resize(m.ChunkCount(t));
    index[t] = static_cast<size_t>(ckpt.Find(m.tensors[t].name));
    keys[t] = MakeDigestKey(m.tensors[t].name);
  }
  const auto chunks = AllChunks(m);
  PoolOr(pool).ParallelFor(chunks.size(), [&](size_t i) {
    const auto [t, c] = chunks[i];
    const auto [offset, bytes] = ChunkByteRange(m, t, c);
    uint64_t first_word, words;
    uint32_t elements;
    m.ChunkWords(t, c, &first_word, &words, &elements);
    out[t][c] = DigestBytes(keys[t], offset, ckpt.Data(index[t]).subspan(offset, bytes));
    if (progress) progress->Add(bytes);
  });
  return out;
}

Result<DeltaManifest> StartDelta(const Checkpoint& base, const Checkpoint& next, const DeltaOptions& options) {
  if (options.chunk_elements == 0 || options.chunk_elements % 8 != 0 || options.chunk_elements > (1ull << 28))
    return InvalidArgument(
        fmt::format("chunk size {} must be a positive multiple of 8, at most 2^28", options.chunk_elements));
  DeltaManifest m;
  m.chunk_elements = options.chunk_elements;
  m.delta_class = options.encode.delta_class;
  m.delta_id = options.delta_id;
  if (m.delta_id == 0) {
    std::random_device rd;
    m.delta_id = (uint64_t{rd()} << 32) ^ rd();
    if (m.delta_id == 0) m.delta_id = 1;
  }
  for (const auto& info : next.tensors()) {
    DeltaTensor t;
    t.name = info.name;
    t.dtype = info.dtype;
    t.shape = info.shape;
    t.elements = info.numel;
    m.tensors.push_back(std::move(t));
    m.total_elements += info.numel;
    m.total_bytes += info.nbytes;
  }
  if (Status s = CheckSameTensors(base, m); !s.ok())
    return s.WithContext(fmt::format("{} and {} must hold the same tensors to make a delta", base.path(), next.path()));
  return m;
}

namespace {

// Encodes `chunk` of the two checkpoints (its tensor at base_index and
// next_index in them) into `frame` (left empty when nothing changed),
// setting the chunk's base and target digests.
Status EncodeChunk(const Checkpoint& base, const Checkpoint& next, const DeltaManifest& m, ChunkId chunk,
                   size_t base_index, size_t next_index, const DigestKey& key, const EncodeOptions& options,
                   const Digest* tracked, std::string* frame, Digest* base_digest, Digest* target_digest) {
  thread_local ChunkEncoder encoder;
  thread_local EncodedChunk encoded;
  const auto [t, c] = chunk;  // a chunk of the manifest (the caller checked)
  const auto [off, bytes] = ChunkByteRange(m, t, c);
  uint64_t first_word, words;
  uint32_t elements;
  m.ChunkWords(t, c, &first_word, &words, &elements);
  const ChunkInput in{m.tensors[t].dtype,
                      key,
                      first_word,
                      elements,
                      base.Data(base_index).subspan(off, bytes),
                      next.Data(next_index).subspan(off, bytes),
                      tracked};
  auto changed = encoder.Encode(in, options, &encoded);
  if (!changed.ok()) return changed.status().WithContext(fmt::format("tensor '{}' chunk {}", m.tensors[t].name, c));
  *base_digest = *target_digest = encoded.base_digest;
  if (*changed) {
    encoded.header.tensor = t;
    encoded.header.chunk = c;
    *target_digest = encoded.header.target_digest;
    *frame = EncodeFrame(encoded.header, encoded.payload);
  }
  return Status::Ok();
}

}  // namespace

Result<EncodedFrames> EncodeFrames(const Checkpoint& base, const Checkpoint& next, const DeltaManifest& m,
                                   std::span<const ChunkId> chunks, const EncodeOptions& options, const FrameSink& sink,
                                   const std::vector<Digest>* base_digests, Progress* progress, ThreadPool* pool) {
  if (base_digests && base_digests->size() != chunks.size())
    return InvalidArgument("EncodeFrames: one tracked base digest per chunk is needed");
  std::vector<size_t> base_index(m.tensors.size()), next_index(m.tensors.size());
  std::vector<DigestKey> keys(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const int64_t b = base.Find(m.tensors[t].name), n = next.Find(m.tensors[t].name);
    if (b < 0 || n < 0)
      return FailedPrecondition(fmt::format("tensor '{}' is missing from a checkpoint", m.tensors[t].name));
    base_index[t] = static_cast<size_t>(b);
    next_index[t] = static_cast<size_t>(n);
    keys[t] = MakeDigestKey(m.tensors[t].name);
  }
  EncodedFrames out;
  out.base_digests.resize(chunks.size());
  out.target_digests.resize(chunks.size());
  ThreadPool& workers = PoolOr(pool);
  // Encode a window of chunks in parallel while the previous window's frames
  // go to the sink (on another thread), in order: output is deterministic,
  // the sink's I/O overlaps the encoding, and memory is bounded by two windows.
  const size_t window = std::max<size_t>(8, 4 * (workers.size() + 1));
  std::vector<std::string> frames[2] = {std::vector<std::string>(window), std::vector<std::string>(window)};
  std::vector<Status> errors[2] = {std::vector<Status>(window), std::vector<Status>(window)};
  // Hands window `begin` (in buffers `b`) to the sink; the first error wins.
  auto drain = [&](size_t begin, size_t count, int b) -> Status {
    for (size_t i = 0; i < count; ++i) {
      DCR_RETURN_IF_ERROR(errors[b][i]);
      const std::string& frame = frames[b][i];
      if (frame.empty()) continue;
      const auto [t, c] = chunks[begin + i];
      auto view = ParseFrame(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(frame.data()), frame.size()));
      if (!view.ok()) return view.status().WithContext("internal: a frame just encoded does not parse");
      const FrameHeader& h = view->header;
      out.frames.push_back({t, c, 0, out.bytes, frame.size(), h.mode, h.codec, h.changed, h.payload_bytes});
      DCR_RETURN_IF_ERROR(sink(frame));
      out.bytes += frame.size();
    }
    return Status::Ok();
  };
  std::future<Status> draining;  // the previous window, at the sink
  int b = 0;
  for (size_t begin = 0; begin < chunks.size(); begin += window, b ^= 1) {
    const size_t count = std::min(window, chunks.size() - begin);
    workers.ParallelFor(count, [&](size_t i) {
      const ChunkId chunk = chunks[begin + i];
      const uint32_t t = chunk.tensor;
      frames[b][i].clear();
      errors[b][i] = t >= m.tensors.size() || chunk.chunk >= m.ChunkCount(t)
                         ? InvalidArgument(fmt::format("EncodeFrames: no chunk {} of tensor {}", chunk.chunk, t))
                         : EncodeChunk(base, next, m, chunk, base_index[t], next_index[t], keys[t], options,
                                       base_digests ? &(*base_digests)[begin + i] : nullptr, &frames[b][i],
                                       &out.base_digests[begin + i], &out.target_digests[begin + i]);
      if (progress && errors[b][i].ok()) progress->Add(ChunkByteRange(m, chunk.tensor, chunk.chunk).second);
    });
    if (draining.valid()) DCR_RETURN_IF_ERROR(draining.get());
    draining = std::async(std::launch::async, drain, begin, count, b);
  }
  if (draining.valid()) DCR_RETURN_IF_ERROR(draining.get());
  return out;
}

void FinishDelta(DeltaManifest& m, std::span<const Digest> base_digests, std::span<const Digest> target_digests) {
  std::sort(m.frames.begin(), m.frames.end(), [](const DeltaFrameEntry& a, const DeltaFrameEntry& b) {
    return std::pair(a.tensor, a.chunk) < std::pair(b.tensor, b.chunk);
  });
  m.base_digest = m.target_digest = Digest();
  for (const Digest& d : base_digests) m.base_digest += d;
  m.tensor_target_digests.assign(m.tensors.size(), Digest());
  for (size_t t = 0, i = 0; t < m.tensors.size(); ++t)
    for (uint64_t c = 0; c < m.ChunkCount(t); ++c) m.tensor_target_digests[t] += target_digests[i++];
  for (const Digest& d : m.tensor_target_digests) m.target_digest += d;
  m.changed_words = m.payload_bytes = m.frame_bytes = 0;
  for (const auto& f : m.frames) {
    m.changed_words += f.changed;
    m.payload_bytes += f.payload_bytes;
    m.frame_bytes += f.bytes;
  }
}

Result<DeltaManifest> MakeDelta(const Checkpoint& base, const Checkpoint& next, const DeltaOptions& options,
                                const std::string& out_dir, Progress* progress, ThreadPool* pool) {
  DCR_ASSIGN_OR_RETURN(DeltaManifest m, StartDelta(base, next, options));
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + out_dir);
  const std::string manifest_path = (fs::path(out_dir) / kManifestFileName).string();
  if (fs::exists(manifest_path) || fs::exists(fs::path(out_dir) / kOldManifestFileName))
    return AlreadyExists(fmt::format("{} already holds a delta; remove it or choose another directory", out_dir));
  const std::string frames_path = (fs::path(out_dir) / kFramesFileName).string();
  std::ofstream frames_out(frames_path, std::ios::binary | std::ios::trunc);
  if (!frames_out) return ErrnoError(errno, "cannot create " + frames_path);
  const auto chunks = AllChunks(m);
  DCR_ASSIGN_OR_RETURN(EncodedFrames encoded,
                       EncodeFrames(
                           base, next, m, chunks, options.encode,
                           [&](std::string_view frame) {
                             frames_out.write(frame.data(), static_cast<std::streamsize>(frame.size()));
                             return frames_out ? Status::Ok()
                                               : Unavailable("cannot write " + frames_path + " (disk full?)");
                           },
                           nullptr, progress, pool));
  frames_out.close();
  if (!frames_out) return Unavailable("cannot write " + frames_path);
  {
    const int fd = ::open(frames_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) return ErrnoError(errno, "cannot sync " + frames_path);
    ::close(fd);
  }
  m.objects = {std::string(kFramesFileName)};
  m.frames = std::move(encoded.frames);
  FinishDelta(m, encoded.base_digests, encoded.target_digests);
  DCR_RETURN_IF_ERROR(WriteFileAtomically((fs::path(out_dir) / kTableFileName).string(), m.TableJson()));
  DCR_RETURN_IF_ERROR(WriteFileAtomically(manifest_path, m.Encode()));
  return m;
}

Result<DeltaReader> DeltaReader::Open(const std::string& dir) {
  const std::string manifest_path = (fs::path(dir) / kManifestFileName).string();
  const std::string table_path = (fs::path(dir) / kTableFileName).string();
  std::error_code ec;
  if (!fs::exists(manifest_path, ec)) {
    if (fs::exists(fs::path(dir) / kOldManifestFileName, ec))
      return Unimplemented(
          fmt::format("{} holds a delta of format version 1 ({}; this dcr reads version {}): remake "
                      "it with this dcr",
                      dir, kOldManifestFileName, kDeltaFormatVersion));
    return NotFound(fmt::format("{} is not a delta: no {} in it", dir, kManifestFileName));
  }
  DCR_ASSIGN_OR_RETURN(MappedFile table_file, MappedFile::Open(table_path, false));
  const auto table_text = table_file.data();
  DCR_ASSIGN_OR_RETURN(
      DeltaManifest table,
      DeltaManifest::FromTableJson(
          std::string_view(reinterpret_cast<const char*>(table_text.data()), table_text.size()), table_path));
  DCR_ASSIGN_OR_RETURN(MappedFile manifest_file, MappedFile::Open(manifest_path, false));
  DCR_ASSIGN_OR_RETURN(DeltaManifest m, DeltaManifest::Decode(manifest_file.data(), table, manifest_path));
  auto files = std::make_shared<std::vector<MappedFile>>();
  std::vector<std::span<const uint8_t>> objects;
  for (const auto& name : m.objects) {
    DCR_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open((fs::path(dir) / name).string(), false));
    files->push_back(std::move(f));
    objects.push_back(files->back().data());
  }
  return FromObjects(std::move(m), std::move(objects), files, dir);
}

Result<DeltaReader> DeltaReader::FromObjects(DeltaManifest manifest, std::vector<std::span<const uint8_t>> objects,
                                             std::shared_ptr<const void> owner, std::string where,
                                             ReleasedFrames released, std::vector<bool> skipped) {
  if (objects.size() != manifest.objects.size() || (!skipped.empty() && skipped.size() != objects.size()))
    return InvalidArgument(fmt::format("{}: {} frame objects given ({} skip flags) for {} named", where, objects.size(),
                                       skipped.size(), manifest.objects.size()));
  const bool some_skipped = std::find(skipped.begin(), skipped.end(), true) != skipped.end();
  if (!released.empty() && released.rbegin()->first >= manifest.frames.size())
    return InvalidArgument(
        fmt::format("{}: a released frame {} of {}", where, released.rbegin()->first, manifest.frames.size()));
  // Each entry's mode, codec and changed come from its frame's header
  // (manifest.bin does not repeat them); Frame() checks the rest.
  uint64_t changed = 0, payload = 0;
  for (size_t i = 0; i < manifest.frames.size(); ++i) {
    DeltaFrameEntry& f = manifest.frames[i];
    if (some_skipped && skipped[f.object]) continue;
    std::span<const uint8_t> header;
    if (auto it = released.find(i); it != released.end()) {
      header = it->second;
    } else {
      const uint64_t size = objects[f.object].size();
      if (f.offset > size || f.bytes > size - f.offset)
        return DataLoss(fmt::format("{}/{}: frame (tensor {}, chunk {}) at [{}, +{}) is past the end ({} bytes)", where,
                                    manifest.objects[f.object], f.tensor, f.chunk, f.offset, f.bytes, size));
      header = objects[f.object].subspan(f.offset, f.bytes);
    }
    auto h = ParseFrameHeader(header);
    if (!h.ok())  // the manifest places a frame where there is none
      return DataLoss(fmt::format("{}/{}: frame of tensor {} chunk {}: {}", where, manifest.objects[f.object], f.tensor,
                                  f.chunk, h.status().message()));
    f.mode = h->mode;
    f.codec = h->codec;
    f.changed = h->changed;
    f.payload_bytes = h->payload_bytes;
    changed += h->changed;
    payload += h->payload_bytes;
  }
  if (!some_skipped && (changed != manifest.changed_words || payload != manifest.payload_bytes))
    return DataLoss(
        fmt::format("{}: the manifest's totals ({} changed words, {} payload bytes) are not its frames' "
                    "({}, {})",
                    where, manifest.changed_words, manifest.payload_bytes, changed, payload));
  DeltaReader r;
  r.dir_ = std::move(where);
  r.manifest_ = std::move(manifest);
  r.objects_ = std::move(objects);
  r.released_ = std::move(released);
  if (some_skipped) r.skipped_ = std::move(skipped);
  r.owner_ = std::move(owner);
  return r;
}

Result<FrameView> DeltaReader::Frame(size_t i) const {
  const DeltaFrameEntry& e = manifest_.frames[i];
  const DeltaTensor& t = manifest_.tensors[e.tensor];
  const std::string where =
      fmt::format("{}/{}: frame of tensor '{}' chunk {}", dir_, manifest_.objects[e.object], t.name, e.chunk);
  if (Skipped(i)) return FailedPrecondition(where + ": its frame object was not fetched");
  size_t consumed = 0;
  Result<FrameView> view = FrameView{};
  if (auto released = released_.find(i); released != released_.end()) {
    auto header = ParseFrameHeader(released->second);
    if (header.ok()) {
      view = FrameView{*header, {}};
      consumed = header->header_bytes + header->payload_bytes;
    } else {
      view = header.status();
    }
  } else {
    view = ParseFrame(objects_[e.object].subspan(e.offset, e.bytes), &consumed);
  }
  if (!view.ok()) return view.status().WithContext(where);
  const FrameHeader& h = view->header;
  if (consumed != e.bytes || h.tensor != e.tensor || h.chunk != e.chunk || h.dtype != t.dtype || h.mode != e.mode ||
      h.codec != e.codec || h.changed != e.changed || h.payload_bytes != e.payload_bytes)
    return DataLoss(where + ": the frame's header disagrees with the manifest");
  if ((manifest_.delta_class == DeltaClass::kOverwrite) != (h.mode == Mode::kOverwrite))
    return DataLoss(where + ": frame mode " + std::string(ModeName(h.mode)) + " in a delta of the other class");
  return view;
}

namespace {

// The frames of `delta` still to apply to `target`, whose chunk digests are
// `digests`, with their chunks' digests, after the checks ApplyDelta makes
// before a byte is written: the chunks without frames must hold what the
// manifest's target says they hold (its digest less its frames' targets);
// each framed chunk is done (at its frame's target) or must reach it. When
// no chunk is done, the framed chunks' sum against the manifest's base
// digest shows that at once; otherwise (a resumed apply, a chunk in another
// state, an overwrite delta repairing a half-written chunk) a dry run of
// the pending frames decides, naming the chunk.
struct Pending {
  std::vector<FrameView> frames;
  std::vector<size_t> entry;  // pending frame -> manifest frame
  std::vector<Digest> current;
  size_t done = 0;  // frames found applied
};
Result<Pending> PendingFrames(const Checkpoint& target, const DeltaReader& delta, const ChunkDigestTable& digests,
                              ApplyTarget& placed, ThreadPool* pool) {
  const DeltaManifest& m = delta.manifest();
  auto not_base = [&](const DeltaFrameEntry& e, std::string_view why) {
    return FailedPrecondition(fmt::format(
        "{} is not the base of delta {}: tensor '{}' chunk {} holds other bits (digest {}){}; apply the delta to its "
        "base version, or use an overwrite delta",
        target.path(), delta.dir(), m.tensors[e.tensor].name, e.chunk, digests[e.tensor][e.chunk].ToHex(), why));
  };
  Pending p;
  Digest framed_now, framed_target, all_now;
  for (const auto& chunks : digests)
    for (const Digest& d : chunks) all_now += d;
  for (size_t i = 0; i < m.frames.size(); ++i) {
    const auto& e = m.frames[i];
    DCR_ASSIGN_OR_RETURN(FrameView frame, delta.Frame(i));
    const Digest& now = digests[e.tensor][e.chunk];
    framed_now += now;
    framed_target += frame.header.target_digest;
    if (now == frame.header.target_digest) {
      ++p.done;
      continue;
    }
    if (!frame.PayloadHeld())
      return not_base(e, " but its frame's payload was dropped once applied (the chunk changed since)");
    p.frames.push_back(frame);
    p.entry.push_back(i);
    p.current.push_back(now);
  }
  const Digest rest = m.target_digest - framed_target;  // the chunks no frame changes
  if (all_now - framed_now != rest)
    return FailedPrecondition(fmt::format(
        "{} is not the base of delta {}: it differs outside the chunks the delta changes (digest {}, the delta's is "
        "{}), or the manifest does not belong to these frames; nothing was written",
        target.path(), delta.dir(), (all_now - framed_now).ToHex(), rest.ToHex()));
  if (p.done == 0 && framed_now == m.base_digest - rest) return p;
  const auto dry = ApplyFrames(placed, m, p.frames, p.current, {.write = false, .pool = pool});
  for (size_t k = 0; k < dry.size(); ++k) {
    if (dry[k].status.ok()) continue;
    if (dry[k].status.code() != Code::kFailedPrecondition) return dry[k].status;
    return not_base(m.frames[p.entry[k]],
                    p.frames[k].header.mode == Mode::kOverwrite ? " that this overwrite frame cannot repair" : "");
  }
  return p;
}

}  // namespace

Result<ApplyReport> ApplyDelta(Checkpoint& target, const DeltaReader& delta, Progress* progress, ThreadPool* pool,
                               ChunkDigestTable* tracked, bool sync) {
  const DeltaManifest& m = delta.manifest();
  if (target.mode() != OpenMode::kReadWrite)
    return InvalidArgument(target.path() + " must be opened read-write to apply");
  DCR_RETURN_IF_ERROR(CheckSameTensors(target, m));
  ChunkDigestTable computed;
  if (!tracked || tracked->empty()) {
    computed = ChunkDigests(target, m, nullptr, pool);
  } else {
    bool shaped = tracked->size() == m.tensors.size();
    for (size_t t = 0; shaped && t < m.tensors.size(); ++t) shaped = (*tracked)[t].size() == m.ChunkCount(t);
    if (!shaped) return InvalidArgument("ApplyDelta: tracked chunk digests do not match the delta's chunking");
  }
  ChunkDigestTable& digests = computed.empty() ? *tracked : computed;
  std::vector<size_t> target_index(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) target_index[t] = static_cast<size_t>(target.Find(m.tensors[t].name));
  CheckpointApplyTarget placed(target, m, std::move(target_index));
  DCR_ASSIGN_OR_RETURN(const Pending pending, PendingFrames(target, delta, digests, placed, pool));

  const auto applied = ApplyFrames(placed, m, pending.frames, pending.current, {.pool = pool, .progress = progress});
  ApplyReport report;
  report.frames_already_applied = pending.done;
  Status first;  // by frame order; the other frames' chunks are applied (and tracked) all the same
  for (size_t k = 0; k < applied.size(); ++k) {
    if (!applied[k].status.ok()) {
      if (first.ok()) first = applied[k].status;
      continue;
    }
    const DeltaFrameEntry& e = m.frames[pending.entry[k]];
    digests[e.tensor][e.chunk] = applied[k].after;
    ++report.frames_applied;
    report.payload_bytes += pending.frames[k].header.payload_bytes;
    report.changed_words += pending.frames[k].header.changed;
  }
  DCR_RETURN_IF_ERROR(first);
  if (sync) DCR_RETURN_IF_ERROR(target.Sync());
  // The digests of what was applied, against the manifest once more.
  Digest made;
  for (const auto& chunks : digests)
    for (const Digest& d : chunks) made += d;
  if (tracked && tracked != &digests) *tracked = std::move(digests);
  if (made != m.target_digest)
    return DataLoss(
        fmt::format("delta {}: the manifest's target digest is {}, but {} holds {}; apply an overwrite "
                    "delta of this version to it, or restore it",
                    delta.dir(), m.target_digest.ToHex(), target.path(), made.ToHex()));
  return report;
}

Result<VerifyReport> VerifyDelta(const Checkpoint& ckpt, const DeltaReader& delta, bool against_base,
                                 Progress* progress, ThreadPool* pool) {
  const DeltaManifest& m = delta.manifest();
  DCR_RETURN_IF_ERROR(CheckSameTensors(ckpt, m));
  const auto digests = ChunkDigests(ckpt, m, progress, pool);
  VerifyReport report;
  Digest total;
  for (const auto& chunks : digests)
    for (const Digest& d : chunks) total += d;
  report.matches = total == (against_base ? m.base_digest : m.target_digest);
  if (report.matches || against_base) return report;
  for (size_t i = 0; i < m.frames.size(); ++i) {
    const auto& e = m.frames[i];
    DCR_ASSIGN_OR_RETURN(FrameView frame, delta.Frame(i));
    const std::string& name = m.tensors[e.tensor].name;
    if (digests[e.tensor][e.chunk] != frame.header.target_digest &&
        (report.differing.empty() || report.differing.back() != name))
      report.differing.push_back(name);
  }
  return report;
}

}  // namespace dcr
