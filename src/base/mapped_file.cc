#include "dcr/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace dcr {
namespace {

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// Maps `size` bytes of `fd`; nullptr for an empty file.
Result<void*> MapFd(int fd, const std::string& path, uint64_t size, bool writable) {
  if (size == 0) return static_cast<void*>(nullptr);
  const int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  void* p = ::mmap(nullptr, size, prot, writable ? MAP_SHARED : MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) return ErrnoError(errno, "mmap " + path);
  // Huge pages where the kernel offers them for this file (a tmpfs file,
  // such as the publisher's baseline in /dev/shm, with shmem_enabled
  // "advise"): fewer TLB misses in the encode's and apply's sweeps. Advice
  // only; ignored elsewhere.
  if (writable) ::madvise(p, size, MADV_HUGEPAGE);
  return p;
}

}  // namespace

MappedFile::MappedFile(MappedFile&& o) noexcept
    : addr_(std::exchange(o.addr_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      writable_(o.writable_),
      path_(std::move(o.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    Reset();
    addr_ = std::exchange(o.addr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    writable_ = o.writable_;
    path_ = std::move(o.path_);
  }
  return *this;
}

MappedFile::~MappedFile() { Reset(); }

void MappedFile::Reset() {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  addr_ = nullptr;
  size_ = 0;
}

Result<MappedFile> MappedFile::Open(const std::string& path, bool writable) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  const int fd = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoError(errno, "cannot open " + path);
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, "cannot stat " + path);
  if (!S_ISREG(st.st_mode)) return InvalidArgument(path + " is not a regular file");
  DCR_ASSIGN_OR_RETURN(void* addr, MapFd(fd, path, static_cast<uint64_t>(st.st_size), writable));
  MappedFile f;
  f.addr_ = addr;
  f.size_ = static_cast<size_t>(st.st_size);
  f.writable_ = writable;
  f.path_ = path;
  return f;
}

Result<MappedFile> MappedFile::Create(const std::string& path, uint64_t size) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "cannot create " + path);
  FdCloser closer{fd};
  if (size > 0) {
    // Reserve the blocks now so a full disk fails here, not as SIGBUS later.
    const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
    if (err != 0 && err != EOPNOTSUPP && err != EINVAL)
      return ErrnoError(err, "cannot allocate " + std::to_string(size) + " bytes for " + path);
    if (err != 0 && ::ftruncate(fd, static_cast<off_t>(size)) != 0) return ErrnoError(errno, "cannot size " + path);
  }
  DCR_ASSIGN_OR_RETURN(void* addr, MapFd(fd, path, size, /*writable=*/true));
  MappedFile f;
  f.addr_ = addr;
  f.size_ = static_cast<size_t>(size);
  f.writable_ = true;
  f.path_ = path;
  return f;
}

Status MappedFile::Sync(uint64_t offset, uint64_t len) {
  if (!writable_ || addr_ == nullptr || len == 0) return Status::Ok();
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page;
  // Clamp to the mapping; offset + len may wrap, offset may lie past the end.
  const uint64_t end = len > size_ - std::min<uint64_t>(offset, size_) ? size_ : offset + len;
  if (begin >= end) return Status::Ok();
  if (::msync(static_cast<uint8_t*>(addr_) + begin, end - begin, MS_SYNC) != 0)
    return ErrnoError(errno, "msync " + path_);
  return Status::Ok();
}

Status WriteFileAtomically(const std::string& path, std::string_view text, unsigned mode) {
  const std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());  // created anew, so that it has `mode` from its first byte
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, static_cast<mode_t>(mode));
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

}  // namespace dcr
