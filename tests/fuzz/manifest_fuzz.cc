// Fuzzes the delta manifest parser: reject or accept, never crash; an
// accepted manifest re-serialises to one that parses to the same content.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "dcr/delta.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = dcr::DeltaManifest::FromJson(text, "fuzz");
  if (!m.ok()) return 0;
  auto again = dcr::DeltaManifest::FromJson(m->ToJson(), "fuzz-again");
  if (!again.ok() || again->frames.size() != m->frames.size() || again->tensors.size() != m->tensors.size() ||
      again->delta_id != m->delta_id || again->base_digest != m->base_digest)
    std::abort();
  return 0;
}
