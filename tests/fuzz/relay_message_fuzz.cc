// Fuzzes the relay's wire messages (docs/relay.md): any parts must be
// refused or decode into a message that re-encodes to the same parts, and
// an object's verification must never crash. The first input byte chooses
// the split: even, one part; odd, two parts cut at the offset in the next
// two bytes (little-endian).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/relay.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 3, size - 3);
  std::vector<std::string_view> parts;
  if (data[0] & 1) {
    const size_t cut = std::min<size_t>(in.size(), size_t{data[1]} | size_t{data[2]} << 8);
    parts = {in.substr(0, cut), in.substr(cut)};
  } else {
    parts = {in};
  }
  auto m = dcr::DecodeMessage(parts);
  if (!m.ok()) return 0;
  if (m->type == dcr::RelayMessageType::kObject) (void)dcr::VerifyFrameObject(*m);
  const std::vector<std::string> again = dcr::EncodeMessage(*m);
  if (again.size() != parts.size()) std::abort();
  for (size_t i = 0; i < parts.size(); ++i)
    if (again[i] != parts[i]) std::abort();  // decoding lost or invented something
  return 0;
}
