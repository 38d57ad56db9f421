// The file driver: one file per object under a root directory.
//
// A writer fills ROOT/.dcr-tmp/<random> (same filesystem as the objects),
// fsyncs it, then publishes with rename(2) (overwrite) or link(2), which fails
// with EEXIST when the key exists (create-if-absent), and fsyncs the parent
// directory. Readers therefore see whole objects only. The etag is the
// file's identity (device, inode, size, mtime): publishing always makes a new
// inode, so a replaced object has a new etag. Guarantees on shared
// filesystems are in docs/stores.md.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <random>

#include "dcr/store.h"

namespace dcr {
namespace {

constexpr std::string_view kTmpDir = ".dcr-tmp";
constexpr uint64_t kWritebackBytes = uint64_t{8} << 20;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

std::string Etag(const struct stat& st) {
  return fmt::format("{:x}-{:x}-{:x}-{:x}.{:x}", st.st_dev, st.st_ino, st.st_size, st.st_mtim.tv_sec,
                     st.st_mtim.tv_nsec);
}

Status FsyncDir(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError(errno, "open directory " + dir);
  if (::fsync(fd.get()) != 0) return ErrnoError(errno, "fsync directory " + dir);
  return Status::Ok();
}

// mkdir -p for the directories of `key` below `root` (root exists).
Status MakeParents(const std::string& root, std::string_view key) {
  size_t pos = 0;
  while ((pos = key.find('/', pos)) != std::string_view::npos) {
    std::string dir = root + "/" + std::string(key.substr(0, pos));
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return ErrnoError(errno, "mkdir " + dir);
    ++pos;
  }
  return Status::Ok();
}

std::string RandomName() {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  return fmt::format("{:016x}.{}.{}", rng(), ::getpid(), counter.fetch_add(1));
}

class FileStore;

class FileWriter final : public ObjectWriter {
 public:
  FileWriter(const FileStore* store, std::string key, WriteMode mode, std::string tmp, Fd fd)
      : store_(store), key_(std::move(key)), mode_(mode), tmp_(std::move(tmp)), fd_(std::move(fd)) {}
  ~FileWriter() override { Abort(); }

  Status Write(std::string_view data) override;
  Status Close() override;
  void Abort() override {
    if (fd_.get() >= 0 || !closed_) {
      fd_.Reset();
      if (!tmp_.empty()) ::unlink(tmp_.c_str());
      tmp_.clear();
      closed_ = true;
    }
  }

 private:
  Status Fail(Status s) {
    Abort();
    return s;
  }

  const FileStore* store_;
  std::string key_;
  WriteMode mode_;
  std::string tmp_;
  Fd fd_;
  bool closed_ = false;
  uint64_t written_ = 0;  // bytes written so far
  uint64_t started_ = 0;  // writeback started for [0, started_)
};

class FileStore final : public Store {
 public:
  explicit FileStore(std::string root) : root_(std::move(root)), url_("file://" + root_) {}

  const std::string& url() const override { return url_; }
  const std::string& root() const { return root_; }
  std::string Path(std::string_view key) const { return root_ + "/" + std::string(key); }
  Status Error(std::string_view key, Status s) const { return s.WithContext(StoreContext(url_, key)); }

  Result<std::unique_ptr<ObjectWriter>> OpenWriter(std::string_view key, WriteMode mode) override {
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    std::string tmp_dir = root_ + "/" + std::string(kTmpDir);
    if (::mkdir(tmp_dir.c_str(), 0755) != 0 && errno != EEXIST)
      return Error(key, ErrnoError(errno, "mkdir " + tmp_dir));
    std::string tmp = tmp_dir + "/" + RandomName();
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0) return Error(key, ErrnoError(errno, "create " + tmp));
    return std::unique_ptr<ObjectWriter>(new FileWriter(this, std::string(key), mode, tmp, std::move(fd)));
  }

  Result<ObjectInfo> Head(std::string_view key) override {
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    struct stat st;
    if (::stat(Path(key).c_str(), &st) != 0) return Error(key, MissingOr(errno, "stat"));
    if (!S_ISREG(st.st_mode)) return Error(key, NotFound("no such object (a directory of keys)"));
    return ObjectInfo{std::string(key), static_cast<uint64_t>(st.st_size), Etag(st)};
  }

  Status ReadRange(std::string_view key, uint64_t offset, std::span<uint8_t> out, const ReadOptions& options) override {
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    Fd fd;
    struct stat st;
    DCR_RETURN_IF_ERROR(OpenForRead(key, &fd, &st));
    if (!options.if_match.empty() && Etag(st) != options.if_match)
      return Error(key, Aborted("object was replaced (etag " + Etag(st) + ", expected " + options.if_match + ")"));
    uint64_t size = static_cast<uint64_t>(st.st_size);
    if (offset > size || out.size() > size - offset)
      return Error(key, OutOfRange(fmt::format("range [{}, {}) is past the end of the {}-byte object", offset,
                                               offset + out.size(), size)));
    return Error(key, PreadFull(fd.get(), offset, out));
  }

  Result<std::string> Get(std::string_view key, ObjectInfo* info) override {
    // One descriptor: the bytes read are those of the version stat'ed,
    // whatever is published under the key meanwhile.
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    Fd fd;
    struct stat st;
    DCR_RETURN_IF_ERROR(OpenForRead(key, &fd, &st));
    std::string data(static_cast<size_t>(st.st_size), '\0');
    DCR_RETURN_IF_ERROR(Error(key, PreadFull(fd.get(), 0, {reinterpret_cast<uint8_t*>(data.data()), data.size()})));
    if (info) *info = ObjectInfo{std::string(key), data.size(), Etag(st)};
    return data;
  }

  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    // Symbolic links are never followed, so a listing stays inside the root
    // (which itself may be a link: the user chose it). A link met in the
    // tree is skipped: the store never makes one, so it is no object. A
    // prefix whose directories pass through a link is refused, naming it,
    // rather than answered with an empty list that hides what is there.
    DCR_RETURN_IF_ERROR(ValidateKeyPrefix(prefix).WithContext(url_));
    std::vector<ObjectInfo> out;
    Fd dir(::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (dir.get() < 0) return ErrnoError(errno, "list " + root_).WithContext(url_);
    // Walk only the directory the prefix's complete components name.
    std::string base;
    for (size_t pos = 0, slash; (slash = prefix.find('/', pos)) != std::string_view::npos; pos = slash + 1) {
      const std::string name(prefix.substr(pos, slash - pos));
      Fd next(::openat(dir.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (next.get() < 0) {
        const int err = errno;
        struct stat st;
        if ((err == ENOTDIR || err == ELOOP) && ::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISLNK(st.st_mode))
          return FailedPrecondition(
                     fmt::format(
                         "'{}' is a symbolic link; the file store does not follow links when listing (list the link's "
                         "target as a store of its own)",
                         base + name))
              .WithContext(url_);
        if (err == ENOENT || err == ENOTDIR) return out;  // nothing under this prefix
        return ErrnoError(err, "list " + Path(base + name)).WithContext(url_);
      }
      dir = std::move(next);
      base += name + "/";
    }
    DCR_RETURN_IF_ERROR(Walk(std::move(dir), base, prefix, &out));
    std::sort(out.begin(), out.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  Status Delete(std::string_view key) override {
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    std::string path = Path(key);
    if (::unlink(path.c_str()) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return Status::Ok();
      if (errno == EISDIR || errno == EPERM) {  // a directory of keys: no object here
        struct stat st;
        if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return Status::Ok();
      }
      return Error(key, ErrnoError(errno, "unlink"));
    }
    // Remove directories the delete emptied (best effort: a concurrent
    // writer re-creates what it needs, see FileWriter::Close).
    for (size_t pos = key.rfind('/'); pos != std::string_view::npos && pos > 0; pos = key.rfind('/', pos - 1)) {
      if (::rmdir(Path(key.substr(0, pos)).c_str()) != 0) break;
    }
    return Status::Ok();
  }

 private:
  // ENOENT/ENOTDIR: "no such object"; other errno as ErrnoError.
  static Status MissingOr(int err, std::string_view what) {
    if (err == ENOENT || err == ENOTDIR) return NotFound("no such object");
    return ErrnoError(err, what);
  }

  Status OpenForRead(std::string_view key, Fd* fd, struct stat* st) const {
    *fd = Fd(::open(Path(key).c_str(), O_RDONLY | O_CLOEXEC));
    if (fd->get() < 0) return Error(key, MissingOr(errno, "open"));
    if (::fstat(fd->get(), st) != 0) return Error(key, ErrnoError(errno, "fstat"));
    if (!S_ISREG(st->st_mode)) return Error(key, NotFound("no such object (a directory of keys)"));
    return Status::Ok();
  }

  static Status PreadFull(int fd, uint64_t offset, std::span<uint8_t> out) {
    size_t done = 0;
    while (done < out.size()) {
      ssize_t n = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoError(errno, "read");
      if (n == 0)
        return DataLoss(fmt::format("object ended after {} bytes, {} expected", offset + done, offset + out.size()));
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

  // Appends the regular files under the open directory `fd` (key prefix
  // `rel`, ending in '/', or empty for the root) whose keys start with
  // `prefix`. Subdirectories are opened from their parent with O_NOFOLLOW:
  // links are skipped, even one that replaces a directory while listing.
  Status Walk(Fd fd, const std::string& rel, std::string_view prefix, std::vector<ObjectInfo>* out) const {
    DIR* d = ::fdopendir(fd.get());
    if (!d) return ErrnoError(errno, "list " + (rel.empty() ? root_ : Path(rel))).WithContext(url_);
    fd.Release();  // owned by `d` now
    Status status;
    while (struct dirent* e = ::readdir(d)) {
      std::string_view name = e->d_name;
      if (name == "." || name == ".." || name.starts_with(".dcr-")) continue;
      std::string key = rel + std::string(name);
      // Skip entries that can neither be nor contain a match.
      size_t common = std::min(key.size(), prefix.size());
      if (key.compare(0, common, prefix.substr(0, common)) != 0) continue;
      struct stat st;
      if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;  // deleted while listing
        status = ErrnoError(errno, "stat " + Path(key)).WithContext(url_);
        break;
      }
      if (S_ISDIR(st.st_mode)) {
        Fd sub(::openat(::dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (sub.get() < 0) {
          if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP) continue;  // deleted or replaced meanwhile
          status = ErrnoError(errno, "list " + Path(key)).WithContext(url_);
          break;
        }
        status = Walk(std::move(sub), key + "/", prefix, out);
        if (!status.ok()) break;
      } else if (S_ISREG(st.st_mode) && key.size() >= prefix.size()) {
        out->push_back(ObjectInfo{key, static_cast<uint64_t>(st.st_size), Etag(st)});
      }
    }
    ::closedir(d);
    return status;
  }

  std::string root_, url_;
};

Status FileWriter::Write(std::string_view data) {
  if (closed_) return FailedPrecondition(StoreContext(store_->url(), key_) + ": write after close");
  while (!data.empty()) {
    ssize_t n = ::write(fd_.get(), data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Fail(store_->Error(key_, ErrnoError(errno, "write")));
    data.remove_prefix(static_cast<size_t>(n));
    written_ += static_cast<uint64_t>(n);
  }
  // Start writing back every few MiB, so the fsync in Close finds little
  // left to do: a streaming put then finishes soon after its producer
  // (docs/benchmarks.md, "Object stores"). A hint only: errors show at fsync.
#ifdef __linux__
  if (written_ - started_ >= kWritebackBytes) {
    ::sync_file_range(fd_.get(), static_cast<off_t>(started_), static_cast<off_t>(written_ - started_),
                      SYNC_FILE_RANGE_WRITE);
    started_ = written_;
  }
#endif
  return Status::Ok();
}

Status FileWriter::Close() {
  if (closed_) return FailedPrecondition(StoreContext(store_->url(), key_) + ": close after close");
  if (::fsync(fd_.get()) != 0) return Fail(store_->Error(key_, ErrnoError(errno, "fsync")));
  fd_.Reset();
  const std::string dst = store_->Path(key_);
  // A concurrent Delete may remove an emptied parent directory between our
  // mkdir and the publish; make the parents again and retry.
  for (int tries = 0;; ++tries) {
    if (Status s = MakeParents(store_->root(), key_); !s.ok()) return Fail(store_->Error(key_, s));
    int rc = mode_ == WriteMode::kOverwrite ? ::rename(tmp_.c_str(), dst.c_str()) : ::link(tmp_.c_str(), dst.c_str());
    if (rc == 0) break;
    int err = errno;
    if (err == ENOENT && tries < 8) continue;
    if (err == EEXIST && mode_ == WriteMode::kCreateIfAbsent)
      return Fail(store_->Error(key_, AlreadyExists("object exists")));
    if (err == EISDIR || (err == EEXIST && mode_ == WriteMode::kOverwrite))
      return Fail(store_->Error(key_, FailedPrecondition("the key is a directory of other keys on this file store")));
    if (err == ENOTDIR)
      return Fail(store_->Error(key_, FailedPrecondition("a parent of the key is an object on this file store")));
    return Fail(store_->Error(key_, ErrnoError(err, "publish")));
  }
  if (mode_ == WriteMode::kCreateIfAbsent) ::unlink(tmp_.c_str());
  tmp_.clear();
  closed_ = true;
  size_t slash = dst.rfind('/');
  return store_->Error(key_, FsyncDir(dst.substr(0, slash)));
}

}  // namespace

Result<std::unique_ptr<Store>> OpenFileStore(const std::string& root, bool create_root) {
  if (root.empty() || root.front() != '/' || root.find('\0') != std::string::npos)
    return InvalidArgument(fmt::format("file store root '{}': not an absolute path", root));
  std::string r = root.size() > 1 && root.back() == '/' ? root.substr(0, root.size() - 1) : root;
  struct stat st;
  if (::stat(r.c_str(), &st) != 0) {
    if (errno != ENOENT || !create_root) return ErrnoError(errno, "file store root " + r);
    std::error_code ec;
    std::filesystem::create_directories(r, ec);
    if (ec) return ErrnoError(ec.value(), "create file store root " + r);
  } else if (!S_ISDIR(st.st_mode)) {
    return InvalidArgument(fmt::format("file store root '{}' is not a directory", r));
  }
  return std::unique_ptr<Store>(new FileStore(r));
}

}  // namespace dcr
