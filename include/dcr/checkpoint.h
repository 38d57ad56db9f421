// A checkpoint: canonical tensors (name -> dtype, shape, bytes) stored in one
// safetensors file or a directory of them (sharded, with
// model.safetensors.index.json). Tensor bytes are zero-copy views into
// memory-mapped files. Opened kReadWrite, the mapping is shared, so stores
// into MutableData() update the files in place (receivers apply deltas this way).
//
// Thread-safety: const methods may be called concurrently; writes through
// MutableData() to disjoint ranges may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/safetensors.h"
#include "dcr/status.h"

namespace dcr {

enum class OpenMode { kReadOnly, kReadWrite };

inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";

struct CreateOptions {
  // 0: one file. Otherwise start a new shard whenever the next tensor would
  // take the current one past this many bytes (as transformers does).
  uint64_t max_shard_bytes = 0;
  Metadata metadata;  // written to every file's __metadata__
};

class Checkpoint {
 public:
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  // `path` is a .safetensors file, or a directory holding
  // model.safetensors.index.json (every shard it names), or else every
  // *.safetensors file in it. Every file is validated as ParseSafetensorsHeader
  // does; errors name the file.
  static Result<Checkpoint> Open(const std::string& path, OpenMode mode = OpenMode::kReadOnly);

  // Creates a checkpoint holding `tensors` (zero-filled) and opens it
  // kReadWrite. When `path` ends in ".safetensors" it is one file (and
  // max_shard_bytes must be 0); otherwise it is a directory (created if
  // missing) holding model.safetensors, or model-0000i-of-0000N.safetensors
  // shards plus the index. Tensors are stored in the given order.
  // kAlreadyExists when the file, or a checkpoint in the directory, exists.
  static Result<Checkpoint> Create(const std::string& path, const std::vector<TensorInfo>& tensors,
                                   const CreateOptions& options = {});

  const std::string& path() const { return path_; }
  OpenMode mode() const { return mode_; }

  // Tensors in name order (TensorNameLess); a tensor's position here is its index.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  size_t size() const { return tensors_.size(); }
  // Index of `name`, or -1.
  int64_t Find(std::string_view name) const;
  uint64_t total_bytes() const { return total_bytes_; }
  uint64_t total_elements() const { return total_elements_; }

  std::span<const uint8_t> Data(size_t index) const;
  // Precondition: mode() == kReadWrite.
  std::span<uint8_t> MutableData(size_t index);
  // The file holding tensor `index`, and all files.
  const std::string& FileOf(size_t index) const;
  std::vector<std::string> files() const;
  // Metadata of the first file.
  const Metadata& metadata() const;

  // Flushes writes to the files (msync). kReadOnly: no-op.
  Status Sync();

 private:
  struct Shard;
  struct Location {
    size_t shard;
    uint64_t offset;  // absolute, within the shard file
  };
  Checkpoint();
  Status AddShard(const std::string& file, OpenMode mode);
  void Finalize();

  std::string path_;
  OpenMode mode_ = OpenMode::kReadOnly;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<TensorInfo> tensors_;
  std::vector<Location> locations_;
  uint64_t total_bytes_ = 0;
  uint64_t total_elements_ = 0;
};

}  // namespace dcr
