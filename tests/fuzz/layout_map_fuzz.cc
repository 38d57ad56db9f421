// Fuzzes the layout map parser: reject or accept, never crash; an accepted
// map re-serialises to one that parses to the same map, compiles, and its
// runs cover each copy's box exactly (checked for boxes of moderate size).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "dcr/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = dcr::LayoutMapFromJson(text, "fuzz");
  if (!m.ok()) return 0;
  auto again = dcr::LayoutMapFromJson(dcr::LayoutMapToJson(*m), "fuzz-again");
  if (!again.ok() || !(*again == *m)) std::abort();
  auto compiled = dcr::CompiledLayout::Compile(*m);
  if (!compiled.ok()) std::abort();  // a valid map always compiles
  std::vector<dcr::CopyRun> runs;
  for (size_t i = 0; i < m->copies.size(); ++i) {
    const auto& c = m->copies[i];
    uint64_t volume = 1, numel = 1;
    for (uint64_t e : c.extent) volume *= e;
    const auto& t = m->tensors[static_cast<size_t>(compiled->FindTensor(c.tensor))];
    for (uint64_t d : t.shape) numel = d != 0 && numel > UINT64_MAX / d ? UINT64_MAX : numel * d;
    if (volume > (1u << 16) || numel == UINT64_MAX) continue;
    runs.clear();
    compiled->RunsInRange(i, 0, numel, &runs);
    uint64_t covered = 0, last_end = 0;
    for (const auto& r : runs) {
      if (r.length == 0 || r.canonical < last_end || r.canonical + r.length > numel) std::abort();
      last_end = r.canonical + r.length;
      covered += r.length;
    }
    if (covered != volume) std::abort();
  }
  return 0;
}
