// Where a publisher keeps its state, and one publisher per state directory.
//
// The state (the baseline: the last committed version's bits, and the
// records beside it) is a cache of the store: a publisher that finds it
// missing, of another run or damaged rebuilds it from the newest snapshot
// and the committed deltas. So by default it lives in memory, where
// advancing the baseline after each commit writes nothing to a disk.
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "dcr/hash.h"
#include "dcr/json.h"
#include "dcr/publisher.h"
#include "internal.h"

namespace dcr {

namespace fs = std::filesystem;

namespace {

// A directory of this user's that no one else can write into: created with
// mode 0700 when missing; refused when it is a link, another user's, or
// open to others (/dev/shm is shared by every user of the machine).
Status PrivateDirectory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return ErrnoError(errno, "cannot create " + dir);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return ErrnoError(errno, "cannot stat " + dir);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0)
    return PermissionDenied(
        fmt::format("{} is not this user's private directory (a directory of uid {}, mode 0700); "
                    "remove it, or give the publisher a state directory",
                    dir, ::geteuid()));
  return Status::Ok();
}

}  // namespace

Result<std::string> DefaultPublisherStateDir(std::string_view store_url) {
  if (const char* d = std::getenv("DCR_STATE_DIR"); d && *d) return std::string(d);
  std::string name;
  for (char c : store_url) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  if (name.size() > 128)  // a file name has at most 255 bytes; long URLs keep a prefix and a hash
    name = fmt::format("{}-{:016x}", name.substr(0, 96), Xxh3_64(store_url.data(), store_url.size()));
  std::error_code ec;
  if (fs::is_directory("/dev/shm", ec)) {
    const std::string root = fmt::format("/dev/shm/dcr-{}", ::geteuid());
    DCR_RETURN_IF_ERROR(PrivateDirectory(root));
    return fmt::format("{}/publish/{}", root, name);
  }
  // No shared-memory filesystem: the state goes to the disk.
  const char* home = std::getenv("HOME");
  return fmt::format("{}/.cache/dcr/publish/{}", home && *home ? home : "/tmp", name);
}

namespace protocol_internal {

bool OnMemoryFilesystem(const std::string& dir) {
  struct statfs st {};
  if (::statfs(dir.c_str(), &st) != 0) return false;
  return st.f_type == TMPFS_MAGIC || st.f_type == RAMFS_MAGIC;
}

Result<StateDirLock> StateDirLock::Acquire(const std::string& state_dir) {
  std::error_code ec;
  fs::create_directories(state_dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + state_dir);
  const std::string path = (fs::path(state_dir) / "lock").string();
  StateDirLock lock;
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (lock.fd_ < 0) return ErrnoError(errno, "cannot open " + path);
  if (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return ErrnoError(errno, "cannot lock " + path);
    char pid[32] = {0};
    const ssize_t n = ::pread(lock.fd_, pid, sizeof pid - 1, 0);
    return FailedPrecondition(
        fmt::format("{} is in use by another publisher (process {}); give each publisher its "
                    "own state directory",
                    state_dir, n > 0 ? std::string(pid, static_cast<size_t>(n)) : "unknown"));
  }
  const std::string me = std::to_string(::getpid());
  if (::ftruncate(lock.fd_, 0) != 0 || ::pwrite(lock.fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size()))
    return ErrnoError(errno, "cannot write " + path);
  return lock;
}

StateDirLock::StateDirLock(StateDirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }

StateDirLock::~StateDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::string BaselineDir(const std::string& state_dir) { return (fs::path(state_dir) / "baseline").string(); }
std::string BaselineRecord(const std::string& state_dir) { return (fs::path(state_dir) / "publisher.json").string(); }

namespace {

// A local state record of the publisher at `path`: nullopt when there is
// none; kInvalidArgument naming the file when it does not parse.
template <class Record>
Result<std::optional<Record>> ReadStateRecord(const std::string& path,
                                              Result<Record> (*parse)(const JsonFields& fields)) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<Record>();
  DCR_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open(path, false));
  const auto bad = [&](std::string_view what) {
    return InvalidArgument(fmt::format("{}: does not parse: {}", path, what));
  };
  const std::string_view text(reinterpret_cast<const char*>(f.data().data()), f.data().size());
  DCR_ASSIGN_OR_RETURN(const nlohmann::ordered_json doc, ParseJsonObject(text, bad));
  DCR_ASSIGN_OR_RETURN(Record r, parse(JsonFields(doc, bad)));
  return std::optional<Record>(std::move(r));
}

Result<BaselineState> ParseBaselineState(const JsonFields& f) {
  BaselineState s;
  DCR_ASSIGN_OR_RETURN(s.run_id, f.String("run_id"));
  DCR_ASSIGN_OR_RETURN(s.version, f.U64("version"));
  return s;
}

Result<ShardsState> ParseShardsState(const JsonFields& f) {
  ShardsState s;
  DCR_ASSIGN_OR_RETURN(s.run_id, f.String("run_id"));
  DCR_ASSIGN_OR_RETURN(s.version, f.U64("version"));
  DCR_ASSIGN_OR_RETURN(auto senders, f.U64s("senders", std::numeric_limits<uint32_t>::max()));
  for (uint64_t k : senders) {
    if (k > std::numeric_limits<uint32_t>::max()) return f.Error("'senders' must hold sender indices");
    s.senders.push_back(static_cast<uint32_t>(k));
  }
  DCR_ASSIGN_OR_RETURN(s.digest, DigestField(f, "digest"));
  return s;
}

}  // namespace

Result<std::optional<BaselineState>> ReadBaseline(const std::string& state_dir) {
  return ReadStateRecord<BaselineState>(BaselineRecord(state_dir), ParseBaselineState);
}

Status WriteBaseline(const std::string& state_dir, const BaselineState& s) {
  nlohmann::ordered_json doc = {{"run_id", s.run_id}, {"version", s.version}};
  return WriteFileAtomically(BaselineRecord(state_dir), JsonText(doc, 1) + "\n");
}

std::string ShardsRecordPath(const std::string& state_dir) { return (fs::path(state_dir) / "shards.json").string(); }

Result<std::optional<ShardsState>> ReadShardsState(const std::string& state_dir) {
  return ReadStateRecord<ShardsState>(ShardsRecordPath(state_dir), ParseShardsState);
}

Status WriteShardsState(const std::string& state_dir, const ShardsState& s) {
  nlohmann::ordered_json doc = {
      {"run_id", s.run_id}, {"version", s.version}, {"senders", s.senders}, {"digest", s.digest.ToHex()}};
  return WriteFileAtomically(ShardsRecordPath(state_dir), JsonText(doc, 1) + "\n");
}

// state_dir/baseline-digests.json: the baseline's chunk digests at a
// version, so that a publish costs O(changed chunks) instead of a digest pass
// over the whole baseline (DESIGN section 4). Trusted only while the
// baseline's files have the sizes and modification times recorded and the
// machine has not rebooted since (the baseline is not msynced: an OS crash
// may lose its writes, a killed process does not); otherwise the pass runs.
std::string DigestCachePath(const std::string& state_dir) {
  return (fs::path(state_dir) / "baseline-digests.json").string();
}

namespace {

std::string BootId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

// Name, size and mtime (ns) of every file of the baseline, sorted by name;
// nullopt when one cannot be read (then no cache matches).
struct FileStamp {
  std::string name;
  uint64_t size = 0, mtime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};
std::optional<std::vector<FileStamp>> BaselineFileStamps(const Checkpoint& baseline) {
  std::vector<std::string> names = baseline.files();
  std::sort(names.begin(), names.end());
  std::vector<FileStamp> out;
  for (const auto& name : names) {
    struct stat st {};
    if (::stat(name.c_str(), &st) != 0) return std::nullopt;
    out.push_back(
        {fs::path(name).filename().string(), static_cast<uint64_t>(st.st_size),
         static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull + static_cast<uint64_t>(st.st_mtim.tv_nsec)});
  }
  return out;
}

// The cache's record: what it was taken of, and the digests.
struct DigestCacheRecord {
  uint64_t version = 0;
  std::string boot_id;
  std::vector<FileStamp> files;
  ChunkDigestTable chunks;
};

Result<DigestCacheRecord> ParseDigestCache(const JsonFields& f) {
  DigestCacheRecord r;
  DCR_ASSIGN_OR_RETURN(std::string format, f.String("format"));
  if (format != "dcr-baseline-digests") return f.Error("'format' is not \"dcr-baseline-digests\"");
  DCR_ASSIGN_OR_RETURN(r.version, f.U64("version"));
  DCR_ASSIGN_OR_RETURN(r.boot_id, f.String("boot_id"));
  DCR_ASSIGN_OR_RETURN(const JsonFields::Json* files, f.Array("files"));
  for (const auto& file : *files) {
    const JsonFields ff(file, [&](std::string_view what) { return f.Error(what); });
    FileStamp stamp;
    DCR_ASSIGN_OR_RETURN(stamp.name, ff.String("name"));
    DCR_ASSIGN_OR_RETURN(stamp.size, ff.U64("size"));
    DCR_ASSIGN_OR_RETURN(stamp.mtime_ns, ff.U64("mtime_ns"));
    r.files.push_back(std::move(stamp));
  }
  DCR_ASSIGN_OR_RETURN(const JsonFields::Json* chunks, f.Array("chunks"));
  for (const auto& row : *chunks) {
    if (!row.is_array()) return f.Error("'chunks' must hold arrays of digests");
    std::vector<Digest>& out = r.chunks.emplace_back();
    for (const auto& hex : row) {
      Digest d;
      if (!hex.is_string() || !Digest::FromHex(hex.get<std::string>(), &d)) return f.Error("a chunk digest is not one");
      out.push_back(d);
    }
  }
  return r;
}

}  // namespace

void DropDigestCache(const std::string& state_dir) {
  std::error_code ec;
  fs::remove(DigestCachePath(state_dir), ec);
}

// Best effort: a cache that cannot be written costs the next publish a pass.
void WriteDigestCache(const std::string& state_dir, uint64_t version, const Checkpoint& baseline,
                      const ChunkDigestTable& digests) {
  const auto stamps = BaselineFileStamps(baseline);
  if (!stamps) return DropDigestCache(state_dir);
  nlohmann::ordered_json files = nlohmann::ordered_json::array(), table = nlohmann::ordered_json::array();
  for (const FileStamp& f : *stamps) files.push_back({{"name", f.name}, {"size", f.size}, {"mtime_ns", f.mtime_ns}});
  for (const auto& tensor : digests) {
    nlohmann::ordered_json row = nlohmann::ordered_json::array();
    for (const auto& d : tensor) row.push_back(d.ToHex());
    table.push_back(std::move(row));
  }
  const nlohmann::ordered_json doc = {{"format", "dcr-baseline-digests"},
                                      {"version", version},
                                      {"boot_id", BootId()},
                                      {"files", std::move(files)},
                                      {"chunks", std::move(table)}};
  if (!WriteFileAtomically(DigestCachePath(state_dir), JsonText(doc) + "\n").ok()) DropDigestCache(state_dir);
}

// The cached chunk digests of `baseline` at `version` in `layout`'s chunking,
// or nullopt when there is no cache or it cannot be trusted.
std::optional<ChunkDigestTable> ReadDigestCache(const std::string& state_dir, uint64_t version,
                                                const Checkpoint& baseline, const DeltaManifest& layout) {
  auto read = ReadStateRecord<DigestCacheRecord>(DigestCachePath(state_dir), ParseDigestCache);
  if (!read.ok() || !*read) return std::nullopt;
  DigestCacheRecord& r = **read;
  const std::string boot = BootId();
  if (r.version != version || boot.empty() || r.boot_id != boot || r.files != BaselineFileStamps(baseline) ||
      r.chunks.size() != layout.tensors.size())
    return std::nullopt;
  for (size_t t = 0; t < r.chunks.size(); ++t)
    if (r.chunks[t].size() != layout.ChunkCount(t)) return std::nullopt;
  return std::move(r.chunks);
}

}  // namespace protocol_internal
}  // namespace dcr
