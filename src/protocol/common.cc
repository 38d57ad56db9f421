#include <fcntl.h>
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>

#include "dcr/progress.h"
#include "dcr/run_keys.h"
#include "dcr/run_records.h"
#include "internal.h"

namespace dcr::protocol_internal {

namespace fs = std::filesystem;

double UnixNow() { return RealClock().UnixSeconds(); }

bool Transient(const Status& s) { return s.code() == Code::kUnavailable || s.code() == Code::kDeadlineExceeded; }

Result<std::optional<std::string>> GetIfPresent(Store& store, std::string_view key) {
  auto r = store.Get(key);
  if (r.ok()) return std::optional<std::string>(std::move(*r));
  if (r.status().code() == Code::kNotFound) return std::optional<std::string>();
  return r.status();
}

DeltaManifest TensorTableOf(const RunRecord& run) {
  DeltaManifest m;
  m.chunk_elements = run.chunk_elements;
  m.tensors = run.tensors;
  return m;
}

Status CheckRunTensors(const Checkpoint& ckpt, const RunRecord& run) {
  Status s = CheckSameTensors(ckpt, TensorTableOf(run));
  if (!s.ok())
    return FailedPrecondition(s.message() +
                              " (a run keeps its tensors, dtypes and shapes; publish a changed model as a new run "
                              "in a new store prefix)");
  return Status::Ok();
}

Digest Total(const ChunkDigestTable& table) {
  Digest d;
  for (const auto& t : table)
    for (const auto& c : t) d += c;
  return d;
}

Result<CommitRecord> ReadCommit(Store& store, uint64_t v) {
  const std::string key = run_keys::Commit(v);
  DCR_ASSIGN_OR_RETURN(std::string text, store.Get(key));
  DCR_ASSIGN_OR_RETURN(CommitRecord c, CommitRecord::FromJson(text, StoreContext(store.url(), key)));
  if (c.version != v)
    return InvalidArgument(StoreContext(store.url(), key) + ": records version " + std::to_string(c.version));
  return c;
}

Result<std::vector<AttemptInfo>> ListAttempts(Store& store, uint64_t v) {
  const std::string prefix = run_keys::Attempts(v);
  DCR_ASSIGN_OR_RETURN(auto objects, store.List(prefix));
  std::vector<AttemptInfo> out;
  for (const auto& o : objects) {
    std::string_view rest = std::string_view(o.key).substr(prefix.size());
    size_t slash = rest.find('/');
    if (slash == std::string_view::npos) continue;
    std::string id(rest.substr(0, slash));
    std::string_view leaf = rest.substr(slash + 1);
    if (out.empty() || out.back().id != id) out.push_back({id});
    AttemptInfo& a = out.back();
    if (leaf == kManifestFileName) a.has_manifest = true, a.manifest_bytes = o.size;
    else if (leaf == "fence") a.fenced = true;
    else if (leaf.starts_with("acks/") && leaf.ends_with(".json"))
      a.acks.emplace_back(leaf.substr(5, leaf.size() - 10));
    else if (leaf.starts_with("frames/")) a.frame_objects.push_back(o.key);
    if (leaf == kManifestFileName || leaf == "attempt.json" || leaf.starts_with("frames/") ||
        (leaf.starts_with("procs/") && leaf.ends_with(".pub")))
      a.download_bytes += o.size;
  }
  return out;
}

Result<DeltaManifest> ReadAttemptManifest(Store& store, uint64_t v, const std::string& attempt,
                                          const DeltaManifest& table) {
  const std::string key = run_keys::Manifest(v, attempt);
  DCR_ASSIGN_OR_RETURN(std::string text, store.Get(key));
  return DeltaManifest::Decode(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), table,
                               StoreContext(store.url(), key));
}

Result<DeltaReader> LoadAttempt(Store& store, uint64_t v, const std::string& attempt, DeltaManifest m,
                                const HeldObjects& held) {
  const std::string prefix = run_keys::Attempt(v, attempt);
  // The attempt's prefix ends in '/'; the delta's messages add "/<object>".
  const std::string where = StoreContext(store.url(), prefix.substr(0, prefix.size() - 1));
  if (!held.skip.empty() && held.skip.size() != m.objects.size())
    return InvalidArgument(
        fmt::format("{}: {} skip flags for {} frame objects", where, held.skip.size(), m.objects.size()));
  auto blobs = std::make_shared<std::vector<std::string>>();
  std::vector<std::span<const uint8_t>> spans;
  blobs->reserve(m.objects.size());
  ReleasedFrames released_frames;
  std::vector<std::vector<size_t>> frames_in(m.objects.size());  // frame indexes by object
  for (size_t i = 0; i < m.frames.size(); ++i) frames_in[m.frames[i].object].push_back(i);
  for (size_t o = 0; o < m.objects.size(); ++o) {
    const std::string key = prefix + m.objects[o];
    const auto r = held.released ? held.released->find(key) : std::map<std::string, ReleasedObject>::const_iterator();
    const bool covered = held.released && r != held.released->end() &&
                         std::all_of(frames_in[o].begin(), frames_in[o].end(),
                                     [&](size_t i) { return r->second.headers.count(m.frames[i].offset) > 0; });
    if (covered)
      for (size_t i : frames_in[o]) released_frames.emplace(i, r->second.headers.at(m.frames[i].offset));
    if (covered || (!held.skip.empty() && held.skip[o])) {
      blobs->emplace_back();
      spans.emplace_back();
      continue;
    }
    std::string blob;
    if (held.prefetched && held.prefetched->count(key)) {
      blob = std::move(held.prefetched->at(key));
      held.prefetched->erase(key);
    } else {
      DCR_ASSIGN_OR_RETURN(blob, store.Get(key));
    }
    if (held.object_bytes) *held.object_bytes += blob.size();
    blobs->push_back(std::move(blob));
    spans.emplace_back(reinterpret_cast<const uint8_t*>(blobs->back().data()), blobs->back().size());
  }
  return DeltaReader::FromObjects(std::move(m), std::move(spans), blobs, where, std::move(released_frames), held.skip);
}

Result<DeltaReader> LoadAttempt(Store& store, uint64_t v, const std::string& attempt, const DeltaManifest& table) {
  DCR_ASSIGN_OR_RETURN(DeltaManifest m, ReadAttemptManifest(store, v, attempt, table));
  return LoadAttempt(store, v, attempt, std::move(m), HeldObjects{});
}

namespace {

// The files making up a checkpoint: the file itself, or the top-level
// regular files of its directory (shards, index, configs).
Result<std::vector<fs::path>> CheckpointFiles(const Checkpoint& ckpt) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_regular_file(ckpt.path(), ec)) return std::vector<fs::path>{ckpt.path()};
  for (const auto& e : fs::directory_iterator(ckpt.path(), ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && !name.starts_with(".")) files.push_back(e.path());
  }
  if (ec) return ErrnoError(ec.value(), "cannot list " + ckpt.path());
  std::sort(files.begin(), files.end());
  return files;
}

constexpr uint64_t kCopyBlock = 16u << 20;

}  // namespace

Result<SnapshotRecord::File> UploadSnapshotFile(Store& store, uint64_t v, const std::string& path,
                                                const std::string& name, Progress* progress) {
  DCR_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path, false));
  DCR_ASSIGN_OR_RETURN(auto writer, store.OpenWriter(run_keys::Snapshot(v) + "files/" + name, WriteMode::kOverwrite));
  for (uint64_t off = 0; off < file.size(); off += kCopyBlock) {
    const uint64_t n = std::min<uint64_t>(kCopyBlock, file.size() - off);
    DCR_RETURN_IF_ERROR(writer->Write(file.data().subspan(off, n)));
    if (progress) progress->Add(n);
  }
  DCR_RETURN_IF_ERROR(writer->Close());
  return SnapshotRecord::File{name, file.size()};
}

Status UploadSnapshot(Store& store, uint64_t v, const Checkpoint& ckpt, const Digest& digest, Progress* progress) {
  DCR_ASSIGN_OR_RETURN(auto files, CheckpointFiles(ckpt));
  SnapshotRecord record;
  record.version = v;
  record.digest = digest;
  for (const auto& path : files) {
    // A single-file checkpoint is stored as model.safetensors.
    const std::string name =
        files.size() == 1 && path.extension() == ".safetensors" ? "model.safetensors" : path.filename().string();
    DCR_ASSIGN_OR_RETURN(SnapshotRecord::File file, UploadSnapshotFile(store, v, path.string(), name, progress));
    record.files.push_back(std::move(file));
  }
  // The record last: a snapshot with a record is complete.
  return store.Put(run_keys::Snapshot(v) + "snapshot.json", record.ToJson());
}

Result<SnapshotRecord> ReadSnapshot(Store& store, uint64_t v) {
  const std::string key = run_keys::Snapshot(v) + "snapshot.json";
  DCR_ASSIGN_OR_RETURN(std::string text, store.Get(key));
  DCR_ASSIGN_OR_RETURN(SnapshotRecord r, SnapshotRecord::FromJson(text, StoreContext(store.url(), key)));
  if (r.files.empty()) return InvalidArgument(StoreContext(store.url(), key) + ": a snapshot names no file");
  return r;
}

Result<std::vector<uint64_t>> ListSnapshots(Store& store) {
  const std::string prefix = std::string(run_keys::kSnapshots) + "v";
  DCR_ASSIGN_OR_RETURN(auto objects, store.List(prefix));
  std::vector<uint64_t> out;
  for (const auto& o : objects) {
    // snapshots/v<10 digits>/snapshot.json
    if (o.key.size() != prefix.size() + 10 + 14 || !o.key.ends_with("/snapshot.json")) continue;
    out.push_back(std::strtoull(o.key.substr(prefix.size(), 10).c_str(), nullptr, 10));
  }
  return out;
}

Result<SnapshotRecord> NewestSnapshot(Store& store, uint64_t at_most) {
  DCR_ASSIGN_OR_RETURN(auto versions, ListSnapshots(store));
  std::optional<uint64_t> best;
  for (uint64_t v : versions)
    if (v <= at_most && (!best || v > *best)) best = v;
  if (!best) return NotFound(fmt::format("{}: no snapshot at or below version {}", store.url(), at_most));
  return ReadSnapshot(store, *best);
}

bool IsNoSpace(int err) { return err == ENOSPC || err == EDQUOT; }

Status NoSpace(const std::string& dir, uint64_t need, std::string_view what, std::optional<uint64_t> available) {
  return FailedPrecondition(fmt::format(
      "no space left in {} for {}: it needs {}{}; free space on that filesystem, or use a directory on one with room",
      dir, what, FormatBytes(need), available ? fmt::format(", {} is available", FormatBytes(*available)) : ""));
}

Status CheckFreeSpace(const std::string& dir, uint64_t need, std::string_view what) {
  struct statvfs st;
  if (::statvfs(dir.c_str(), &st) != 0) return ErrnoError(errno, "cannot stat the filesystem of " + dir);
  const uint64_t avail = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  if (avail >= need) return Status::Ok();
  return NoSpace(dir, need, what, avail);
}

Status DownloadSnapshot(Store& store, const SnapshotRecord& snapshot, const std::string& dir, Progress* progress) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir);
  // Peak use: every new file, plus the largest one that replaces an old
  // file (both exist until the rename).
  uint64_t need = 0, largest_replaced = 0;
  for (const auto& f : snapshot.files) {
    if (fs::exists(fs::path(dir) / f.name, ec)) largest_replaced = std::max(largest_replaced, f.bytes);
    else need += f.bytes;
  }
  const std::string what = fmt::format("the snapshot of version {}", snapshot.version);
  DCR_RETURN_IF_ERROR(CheckFreeSpace(dir, need + largest_replaced, what));
  const std::string prefix = run_keys::Snapshot(snapshot.version) + "files/";
  std::vector<uint8_t> block(kCopyBlock);
  for (const auto& f : snapshot.files) {
    // Into a hidden part file, renamed when complete.
    const std::string part = (fs::path(dir) / ("." + f.name + ".dcr-part")).string();
    const int fd = ::open(part.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoError(errno, "cannot create " + part);
    Status s;
    DCR_ASSIGN_OR_RETURN(ObjectInfo head, store.Head(prefix + f.name));
    if (head.size != f.bytes)
      s = DataLoss(fmt::format("{}: snapshot file is {} bytes, the record says {}",
                               StoreContext(store.url(), prefix + f.name), head.size, f.bytes));
    for (uint64_t off = 0; s.ok() && off < f.bytes; off += kCopyBlock) {
      const uint64_t n = std::min<uint64_t>(kCopyBlock, f.bytes - off);
      s = store.ReadRange(prefix + f.name, off, std::span<uint8_t>(block.data(), n), {.if_match = head.etag});
      for (uint64_t w = 0; s.ok() && w < n;) {
        const ssize_t k = ::write(fd, block.data() + w, n - w);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
          s = IsNoSpace(errno) ? NoSpace(dir, need + largest_replaced, what)
                               : ErrnoError(errno, "cannot write " + part);
        else w += static_cast<uint64_t>(k);
      }
      if (progress && s.ok()) progress->Add(n);
    }
    if (s.ok() && ::fsync(fd) != 0)
      s = IsNoSpace(errno) ? NoSpace(dir, need + largest_replaced, what) : ErrnoError(errno, "cannot sync " + part);
    ::close(fd);
    if (s.ok() && ::rename(part.c_str(), (fs::path(dir) / f.name).c_str()) != 0)
      s = ErrnoError(errno, "cannot rename " + part);
    if (!s.ok()) {
      ::unlink(part.c_str());
      return s;
    }
  }
  return Status::Ok();
}

}  // namespace dcr::protocol_internal
