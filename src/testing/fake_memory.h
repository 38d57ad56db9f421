// Test helper: buffers reached only through BufferMemory (what a GPU's
// are), as host vectors behind the interface, counting calls.
#pragma once

#include <cstring>
#include <span>
#include <vector>

#include "dcr/layout_apply.h"

namespace dcr::testing {

// `fail_scatter`: the n-th scatter writes its first request and then fails
// (a device error).
class FakeMemory final : public BufferMemory {
 public:
  explicit FakeMemory(std::vector<std::vector<uint8_t>> bytes) : bytes_(std::move(bytes)) {}
  uint64_t Bytes(size_t b) const override { return bytes_[b].size(); }
  Status Gather(std::span<const WordRequest> requests) override {
    ++gathers;
    for (const WordRequest& r : requests)
      for (size_t i = 0; i < r.offsets.size(); ++i)
        std::memcpy(r.words.data() + i * r.word_bytes, bytes_[r.buffer].data() + r.offsets[i] * r.word_bytes,
                    r.word_bytes);
    return Status::Ok();
  }
  Status Scatter(std::span<const WordRequest> requests) override {
    ++scatters;
    for (const WordRequest& r : requests) {
      for (size_t i = 0; i < r.offsets.size(); ++i)
        std::memcpy(bytes_[r.buffer].data() + r.offsets[i] * r.word_bytes, r.words.data() + i * r.word_bytes,
                    r.word_bytes);
      if (scatters == fail_scatter) return Unavailable("the device is gone");
    }
    return Status::Ok();
  }
  Status Read(size_t b, uint64_t offset, std::span<uint8_t> out) override {
    std::memcpy(out.data(), bytes_[b].data() + offset, out.size());
    return Status::Ok();
  }
  Status Write(size_t b, uint64_t offset, std::span<const uint8_t> in) override {
    std::memcpy(bytes_[b].data() + offset, in.data(), in.size());
    return Status::Ok();
  }
  Status Flush() override {
    ++flushes;
    return Status::Ok();
  }
  const std::vector<std::vector<uint8_t>>& bytes() const { return bytes_; }
  int gathers = 0, scatters = 0, flushes = 0, fail_scatter = -1;

 private:
  std::vector<std::vector<uint8_t>> bytes_;
};

}  // namespace dcr::testing
