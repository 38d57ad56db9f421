// A rank's buffers held by a Python object (dcr._tensors.TensorMemory:
// torch tensors on any device, reached through torch's index copies) as a
// dcr::BufferMemory, so that the apply loop writes the changed words where
// the tensors live, with no host mirror (docs/python.md, "Tensors and
// memory").
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dcr/layout_apply.h"

namespace dcr_python {

// Runs `call` with the GIL (from a thread that released it); a Python
// exception becomes kInternal, "`what`: <its text>".
dcr::Status WithGil(const std::string& what, const std::function<void()>& call);

// Calls the object's methods gather(requests), scatter(requests) (each a
// list of (buffer, word_bytes, offsets: uint64 array, words: uint8 array)),
// read(buffer, offset, out: uint8 array) and write(buffer, offset, data:
// uint8 array), taking the GIL for each; the arrays view dcr's memory for
// the call only. A Python exception becomes kInternal, with its text.
// `sizes`: each buffer's bytes. Destroy with the GIL held.
class PyBufferMemory final : public dcr::BufferMemory {
 public:
  PyBufferMemory(nanobind::object impl, std::vector<uint64_t> sizes)
      : impl_(std::move(impl)), sizes_(std::move(sizes)) {}
  uint64_t Bytes(size_t buffer) const override { return buffer < sizes_.size() ? sizes_[buffer] : 0; }
  dcr::Status Gather(std::span<const dcr::WordRequest> requests) override { return Words("gather", requests); }
  dcr::Status Scatter(std::span<const dcr::WordRequest> requests) override { return Words("scatter", requests); }
  dcr::Status Read(size_t buffer, uint64_t offset, std::span<uint8_t> out) override;
  dcr::Status Write(size_t buffer, uint64_t offset, std::span<const uint8_t> bytes) override;

 private:
  dcr::Status Words(const char* method, std::span<const dcr::WordRequest> requests);
  nanobind::object impl_;
  std::vector<uint64_t> sizes_;
};

}  // namespace dcr_python
