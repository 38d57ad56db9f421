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

#include "dcr/hash.h"
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

}  // namespace protocol_internal
}  // namespace dcr
