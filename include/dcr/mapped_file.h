// A whole file mapped into memory. Move-only; unmaps on destruction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dcr/status.h"

namespace dcr {

class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  ~MappedFile();

  // Maps `path` read-only (private), or read-write shared when `writable`, so
  // that stores into data() reach the file. Empty files map to an empty span.
  // Errors: kNotFound, kInvalidArgument (a directory, no permission), kUnavailable.
  static Result<MappedFile> Open(const std::string& path, bool writable);

  // Creates (or truncates) `path` with `size` zero bytes and maps it writable.
  static Result<MappedFile> Create(const std::string& path, uint64_t size);

  std::span<const uint8_t> data() const { return {static_cast<const uint8_t*>(addr_), size_}; }
  // Precondition: opened writable.
  std::span<uint8_t> mutable_data() { return {static_cast<uint8_t*>(addr_), size_}; }
  uint64_t size() const { return size_; }
  bool writable() const { return writable_; }
  const std::string& path() const { return path_; }

  // Writes dirty pages of [offset, offset+len) to the file and waits (msync).
  Status Sync(uint64_t offset, uint64_t len);
  Status Sync() { return Sync(0, size_); }

 private:
  void Reset();

  void* addr_ = nullptr;
  size_t size_ = 0;
  bool writable_ = false;
  std::string path_;
};

// Writes `data` to the file `path` atomically: a temporary file beside it,
// fsync, rename. Readers see the old file or the new one, never a mix. The
// file is created with `mode` (less the umask) before its first byte.
Status WriteFileAtomically(const std::string& path, std::string_view data, unsigned mode = 0644);

}  // namespace dcr
