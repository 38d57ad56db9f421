// PyBufferMemory (buffer_memory.h).
#include "buffer_memory.h"

#include <nanobind/ndarray.h>

#include <string>

namespace nb = nanobind;

namespace dcr_python {
namespace {

// A numpy array viewing n elements at p (no copy, no owner: valid for the call).
template <typename T>
nb::object View(const T* p, size_t n) {
  return nb::cast(nb::ndarray<nb::numpy, T, nb::ndim<1>>(const_cast<T*>(p), {n}, nb::handle()),
                  nb::rv_policy::reference);
}

}  // namespace

dcr::Status WithGil(const std::string& what, const std::function<void()>& call) {
  nb::gil_scoped_acquire gil;
  try {
    call();
  } catch (nb::python_error& e) {
    return dcr::Internal(what + ": " + e.what());
  }
  return dcr::Status::Ok();
}

dcr::Status PyBufferMemory::Words(const char* method, std::span<const dcr::WordRequest> requests) {
  return WithGil(std::string("the tensors' memory, ") + method, [&] {
    nb::list batch;
    for (const dcr::WordRequest& r : requests)
      batch.append(nb::make_tuple(r.buffer, r.word_bytes, View(r.offsets.data(), r.offsets.size()),
                                  View(r.words.data(), r.words.size())));
    impl_.attr(method)(batch);
  });
}

dcr::Status PyBufferMemory::Read(size_t buffer, uint64_t offset, std::span<uint8_t> out) {
  return WithGil("the tensors' memory, read",
                 [&] { impl_.attr("read")(buffer, offset, View(out.data(), out.size())); });
}

dcr::Status PyBufferMemory::Write(size_t buffer, uint64_t offset, std::span<const uint8_t> bytes) {
  return WithGil("the tensors' memory, write",
                 [&] { impl_.attr("write")(buffer, offset, View(bytes.data(), bytes.size())); });
}

}  // namespace dcr_python
