// Fuzzes the safetensors header parser with whole files: any input must give
// a header whose tensors tile the data buffer, or an error; never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "dcr/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto header = dcr::ParseSafetensorsHeader(std::span<const uint8_t>(data, size), size);
  if (!header.ok()) return 0;
  // Accepted headers must describe in-bounds, contiguous tensors.
  uint64_t expected = 0;
  for (const auto& e : header->entries) {
    if (e.offset != expected) std::abort();
    expected += e.info.nbytes;
  }
  if (8 + header->header_bytes + expected != size) std::abort();
  // Re-encoding an accepted header must parse back to the same tensors.
  std::vector<dcr::TensorInfo> infos;
  for (const auto& e : header->entries) infos.push_back(e.info);
  const std::string encoded = dcr::EncodeSafetensorsHeader(infos, header->metadata);
  std::string file = encoded;
  file.append(expected, '\0');
  auto again = dcr::ParseSafetensorsHeader(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(file.data()), file.size()), file.size());
  if (!again.ok() || again->entries.size() != header->entries.size()) std::abort();
  for (size_t i = 0; i < infos.size(); ++i)
    if (!(again->entries[i].info == header->entries[i].info)) std::abort();
  return 0;
}
