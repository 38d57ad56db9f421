#include "dcr/delta.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <unordered_set>

#include "dcr/progress.h"
#include "dcr/thread_pool.h"

namespace dcr {
namespace {

namespace fs = std::filesystem;

ThreadPool& PoolOr(ThreadPool* pool) { return pool ? *pool : DefaultPool(); }

struct ChunkRef {
  uint32_t tensor;
  uint32_t chunk;
};

std::vector<ChunkRef> AllChunks(const DeltaManifest& m) {
  std::vector<ChunkRef> out;
  for (size_t t = 0; t < m.tensors.size(); ++t)
    for (uint64_t c = 0; c < m.ChunkCount(t); ++c) out.push_back({static_cast<uint32_t>(t), static_cast<uint32_t>(c)});
  return out;
}

// Bytes of chunk c of tensor t within the tensor's data.
std::pair<uint64_t, uint64_t> ChunkByteRange(const DeltaManifest& m, size_t t, uint64_t c) {
  uint64_t first_word, words;
  uint32_t elements;
  m.ChunkWords(t, c, &first_word, &words, &elements);
  const uint64_t wb = WordBytes(m.tensors[t].dtype);
  return {first_word * wb, words * wb};
}

// Writes `text` to `path` atomically: a temporary file, fsync, rename.
Status WriteFileAtomically(const std::string& path, std::string_view text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "cannot create " + tmp);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoError(err, "cannot write " + tmp);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) return ErrnoError(errno, "cannot sync " + tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return ErrnoError(errno, "cannot rename " + tmp);
  return Status::Ok();
}

}  // namespace

Status CheckSameTensors(const Checkpoint& ckpt, const DeltaManifest& m) {
  for (const auto& t : m.tensors) {
    const int64_t i = ckpt.Find(t.name);
    if (i < 0)
      return FailedPrecondition(fmt::format("{} has no tensor '{}', which the delta covers", ckpt.path(), t.name));
    const TensorInfo& info = ckpt.tensors()[static_cast<size_t>(i)];
    if (info.dtype != t.dtype || info.shape != t.shape)
      return FailedPrecondition(fmt::format("tensor '{}' is {}[{}] in {} but {}[{}] in the delta", t.name, Name(info.dtype),
                                            fmt::join(info.shape, ","), ckpt.path(), Name(t.dtype), fmt::join(t.shape, ",")));
  }
  if (ckpt.size() != m.tensors.size()) {  // every manifest tensor is present: find the extra one
    std::unordered_set<std::string_view> covered;
    for (const auto& t : m.tensors) covered.insert(t.name);
    for (const auto& info : ckpt.tensors())
      if (!covered.count(info.name))
        return FailedPrecondition(fmt::format("{} has tensor '{}', which the delta does not cover", ckpt.path(), info.name));
  }
  return Status::Ok();
}

std::vector<std::vector<Digest>> ChunkDigests(const Checkpoint& ckpt, const DeltaManifest& m, Progress* progress,
                                              ThreadPool* pool) {
  std::vector<std::vector<Digest>> out(m.tensors.size());
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

Result<DeltaManifest> MakeDelta(const Checkpoint& base, const Checkpoint& next, const DeltaOptions& options,
                                const std::string& out_dir, Progress* progress, ThreadPool* pool) {
  if (options.chunk_elements == 0 || options.chunk_elements % 8 != 0 || options.chunk_elements > (1ull << 28))
    return InvalidArgument(fmt::format("chunk size {} must be a positive multiple of 8, at most 2^28", options.chunk_elements));
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

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + out_dir);
  const std::string manifest_path = (fs::path(out_dir) / kManifestFileName).string();
  if (fs::exists(manifest_path))
    return AlreadyExists(fmt::format("{} already holds a delta; remove it or choose another directory", out_dir));
  const std::string frames_path = (fs::path(out_dir) / kFramesFileName).string();
  std::ofstream frames_out(frames_path, std::ios::binary | std::ios::trunc);
  if (!frames_out) return ErrnoError(errno, "cannot create " + frames_path);

  std::vector<size_t> base_index(m.tensors.size()), next_index(m.tensors.size());
  std::vector<DigestKey> keys(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    base_index[t] = static_cast<size_t>(base.Find(m.tensors[t].name));
    next_index[t] = static_cast<size_t>(next.Find(m.tensors[t].name));
    keys[t] = MakeDigestKey(m.tensors[t].name);
  }
  const auto chunks = AllChunks(m);
  ThreadPool& workers = PoolOr(pool);
  // Encode a window of chunks in parallel, then append its frames in order:
  // output is deterministic and memory is bounded by the window.
  const size_t window = std::max<size_t>(8, 4 * (workers.size() + 1));
  std::vector<std::string> frames(window);
  std::vector<Digest> chunk_base(window);
  std::vector<Status> errors(window);
  uint64_t offset = 0;
  for (size_t begin = 0; begin < chunks.size(); begin += window) {
    const size_t count = std::min(window, chunks.size() - begin);
    workers.ParallelFor(count, [&](size_t i) {
      thread_local ChunkEncoder encoder;
      thread_local EncodedChunk encoded;
      const auto [t, c] = chunks[begin + i];
      const auto [off, bytes] = ChunkByteRange(m, t, c);
      uint64_t first_word, words;
      uint32_t elements;
      m.ChunkWords(t, c, &first_word, &words, &elements);
      ChunkInput in{m.tensors[t].dtype, keys[t], first_word, elements,
                    base.Data(base_index[t]).subspan(off, bytes), next.Data(next_index[t]).subspan(off, bytes)};
      frames[i].clear();
      auto changed = encoder.Encode(in, options.encode, &encoded);
      if (!changed.ok()) {
        errors[i] = changed.status().WithContext(fmt::format("tensor '{}' chunk {}", m.tensors[t].name, c));
        return;
      }
      chunk_base[i] = encoded.base_digest;
      if (*changed) {
        encoded.header.tensor = t;
        encoded.header.chunk = c;
        encoded.header.first_element = uint64_t{c} * m.chunk_elements;
        encoded.header.delta_id = m.delta_id;
        frames[i] = EncodeFrame(encoded.header, encoded.payload);
        errors[i] = Status::Ok();
      }
      if (progress) progress->Add(bytes);
    });
    for (size_t i = 0; i < count; ++i) {
      DCR_RETURN_IF_ERROR(errors[i]);
      const auto [t, c] = chunks[begin + i];
      DeltaTensor& tensor = m.tensors[t];
      tensor.base_digest += chunk_base[i];
      tensor.target_digest += chunk_base[i];
      if (frames[i].empty()) continue;
      auto view = ParseFrame(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(frames[i].data()), frames[i].size()));
      if (!view.ok()) return view.status().WithContext("internal: a frame just encoded does not parse");
      const FrameHeader& h = view->header;
      tensor.target_digest += h.target_digest - h.base_digest;
      m.frames.push_back({t, c, offset, frames[i].size(), h.mode, h.codec, h.changed});
      m.changed_words += h.changed;
      m.payload_bytes += h.payload_bytes;
      m.frame_bytes += frames[i].size();
      frames_out.write(frames[i].data(), static_cast<std::streamsize>(frames[i].size()));
      offset += frames[i].size();
    }
    if (!frames_out) return Unavailable("cannot write " + frames_path + " (disk full?)");
  }
  frames_out.close();
  if (!frames_out) return Unavailable("cannot write " + frames_path);
  {
    const int fd = ::open(frames_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) return ErrnoError(errno, "cannot sync " + frames_path);
    ::close(fd);
  }
  for (const auto& t : m.tensors) {
    m.base_digest += t.base_digest;
    m.target_digest += t.target_digest;
  }
  DCR_RETURN_IF_ERROR(WriteFileAtomically(manifest_path, m.ToJson()));
  return m;
}

Result<DeltaReader> DeltaReader::Open(const std::string& dir) {
  DeltaReader r;
  r.dir_ = dir;
  const std::string manifest_path = (fs::path(dir) / kManifestFileName).string();
  std::error_code ec;
  if (!fs::exists(manifest_path, ec))
    return NotFound(fmt::format("{} is not a delta: no {} in it", dir, kManifestFileName));
  DCR_ASSIGN_OR_RETURN(MappedFile manifest_file, MappedFile::Open(manifest_path, false));
  const auto text = manifest_file.data();
  DCR_ASSIGN_OR_RETURN(r.manifest_, DeltaManifest::FromJson(
                                        std::string_view(reinterpret_cast<const char*>(text.data()), text.size()),
                                        manifest_path));
  const std::string frames_path = (fs::path(dir) / kFramesFileName).string();
  DCR_ASSIGN_OR_RETURN(MappedFile frames, MappedFile::Open(frames_path, false));
  for (const auto& f : r.manifest_.frames)
    if (f.offset > frames.size() || f.bytes > frames.size() - f.offset)
      return DataLoss(fmt::format("{}: frame (tensor {}, chunk {}) at [{}, +{}) is past the end ({} bytes)", frames_path,
                                  f.tensor, f.chunk, f.offset, f.bytes, frames.size()));
  r.frames_ = std::make_shared<MappedFile>(std::move(frames));
  return r;
}

Result<FrameView> DeltaReader::Frame(size_t i) const {
  const DeltaFrameEntry& e = manifest_.frames[i];
  const DeltaTensor& t = manifest_.tensors[e.tensor];
  const std::string where = fmt::format("{}/{}: frame of tensor '{}' chunk {}", dir_, kFramesFileName, t.name, e.chunk);
  size_t consumed = 0;
  auto view = ParseFrame(frames_->data().subspan(e.offset, e.bytes), &consumed);
  if (!view.ok()) return view.status().WithContext(where);
  const FrameHeader& h = view->header;
  uint64_t first_word, words;
  uint32_t elements;
  manifest_.ChunkWords(e.tensor, e.chunk, &first_word, &words, &elements);
  if (consumed != e.bytes || h.tensor != e.tensor || h.chunk != e.chunk || h.delta_id != manifest_.delta_id ||
      h.dtype != t.dtype || h.elements != elements || h.words != words ||
      h.first_element != uint64_t{e.chunk} * manifest_.chunk_elements || h.mode != e.mode || h.codec != e.codec ||
      h.changed != e.changed)
    return DataLoss(where + ": the frame's header disagrees with the manifest");
  if ((manifest_.delta_class == DeltaClass::kOverwrite) != (h.mode == Mode::kOverwrite))
    return DataLoss(where + ": frame mode " + std::string(ModeName(h.mode)) + " in a delta of the other class");
  return view;
}

Result<ApplyReport> ApplyDelta(Checkpoint& target, const DeltaReader& delta, Progress* progress, ThreadPool* pool) {
  const DeltaManifest& m = delta.manifest();
  if (target.mode() != OpenMode::kReadWrite) return InvalidArgument(target.path() + " must be opened read-write to apply");
  DCR_RETURN_IF_ERROR(CheckSameTensors(target, m));
  const auto digests = ChunkDigests(target, m, nullptr, pool);

  std::vector<size_t> target_index(m.tensors.size());
  std::vector<DigestKey> keys(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    target_index[t] = static_cast<size_t>(target.Find(m.tensors[t].name));
    keys[t] = MakeDigestKey(m.tensors[t].name);
  }

  // Classify frames: done (chunk at target), pending (chunk at base), or,
  // for overwrite frames only, repairable (the chunk holds other bits that
  // the frame still turns into its target: a dense overwrite always, a
  // sparse one when the chunk differs from the target only at its
  // positions, which a dry run on a copy decides). Any other chunk state, or
  // a tensor whose frameless or base chunks moved, is refused before a byte
  // is written.
  std::vector<uint8_t> done(m.frames.size(), 0);
  std::vector<Digest> expected(m.tensors.size()), current(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    expected[t] = m.tensors[t].base_digest;
    for (const auto& d : digests[t]) current[t] += d;
  }
  auto not_base = [&](const DeltaFrameEntry& e, std::string_view why) {
    return FailedPrecondition(fmt::format(
        "{} is not the base of delta {}: tensor '{}' chunk {} holds other bits (digest {}){}; apply the delta to its "
        "base version, or use an overwrite delta",
        target.path(), delta.dir(), m.tensors[e.tensor].name, e.chunk, digests[e.tensor][e.chunk].ToHex(), why));
  };
  ChunkApplier dry_run;
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i < m.frames.size(); ++i) {
    const auto& e = m.frames[i];
    DCR_ASSIGN_OR_RETURN(FrameView frame, delta.Frame(i));
    const Digest& now = digests[e.tensor][e.chunk];
    if (now == frame.header.target_digest) {
      done[i] = 1;
      expected[e.tensor] += frame.header.target_digest - frame.header.base_digest;
    } else if (now != frame.header.base_digest) {
      if (frame.header.mode != Mode::kOverwrite) return not_base(e, "");
      if (frame.header.codec == Codec::kSparse) {
        const auto [offset, bytes] = ChunkByteRange(m, e.tensor, e.chunk);
        const auto data = target.Data(target_index[e.tensor]).subspan(offset, bytes);
        scratch.assign(data.begin(), data.end());
        uint64_t first_word, words;
        uint32_t elements;
        m.ChunkWords(e.tensor, e.chunk, &first_word, &words, &elements);
        Digest after;
        if (!dry_run.Apply(frame, keys[e.tensor], first_word, scratch, now, &after).ok())
          return not_base(e, " that this overwrite frame cannot repair");
      }
      // Repairable: leave the chunk out of its tensor's check.
      current[e.tensor] -= now;
      expected[e.tensor] -= frame.header.base_digest;
    }
  }
  for (size_t t = 0; t < m.tensors.size(); ++t)
    if (current[t] != expected[t])
      return FailedPrecondition(fmt::format(
          "{} is not the base of delta {}: tensor '{}' differs outside the delta's frames (digest {}, the delta's "
          "base is {})",
          target.path(), delta.dir(), m.tensors[t].name, current[t].ToHex(), m.tensors[t].base_digest.ToHex()));

  std::vector<Status> errors(m.frames.size());
  std::atomic<uint64_t> applied{0}, payload{0}, changed{0};
  PoolOr(pool).ParallelFor(m.frames.size(), [&](size_t i) {
    if (done[i]) return;
    thread_local ChunkApplier applier;
    const auto& e = m.frames[i];
    auto frame = delta.Frame(i);
    if (!frame.ok()) {
      errors[i] = frame.status();
      return;
    }
    const auto [offset, bytes] = ChunkByteRange(m, e.tensor, e.chunk);
    uint64_t first_word, words;
    uint32_t elements;
    m.ChunkWords(e.tensor, e.chunk, &first_word, &words, &elements);
    Digest after;
    auto outcome = applier.Apply(*frame, keys[e.tensor], first_word,
                                 target.MutableData(target_index[e.tensor]).subspan(offset, bytes),
                                 digests[e.tensor][e.chunk], &after);
    if (!outcome.ok()) {
      errors[i] = outcome.status().WithContext(fmt::format("tensor '{}'", m.tensors[e.tensor].name));
      return;
    }
    applied.fetch_add(1);
    payload.fetch_add(frame->header.payload_bytes);
    changed.fetch_add(frame->header.changed);
    if (progress) progress->Add(bytes);
  });
  for (const auto& s : errors) DCR_RETURN_IF_ERROR(s);
  DCR_RETURN_IF_ERROR(target.Sync());
  ApplyReport report;
  report.frames_applied = applied.load();
  report.frames_already_applied = static_cast<uint64_t>(std::count(done.begin(), done.end(), 1));
  report.payload_bytes = payload.load();
  report.changed_words = changed.load();
  return report;
}

Result<VerifyReport> VerifyDelta(const Checkpoint& ckpt, const DeltaManifest& m, bool against_base, Progress* progress,
                                 ThreadPool* pool) {
  DCR_RETURN_IF_ERROR(CheckSameTensors(ckpt, m));
  const auto digests = ChunkDigests(ckpt, m, progress, pool);
  VerifyReport report;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    Digest d;
    for (const auto& c : digests[t]) d += c;
    if (d != (against_base ? m.tensors[t].base_digest : m.tensors[t].target_digest))
      report.differing.push_back(m.tensors[t].name);
  }
  report.matches = report.differing.empty();
  return report;
}

}  // namespace dcr
