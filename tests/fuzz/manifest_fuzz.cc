// Fuzzes the delta manifest parsers: reject or accept, never crash, and what
// is accepted re-encodes to what parses to the same content.
// An input that starts with '{' is a manifest's JSON description
// (DeltaManifest::FromJson), also tried as a tensor table (tensors.json).
// Any other input is [u32 LE n][n bytes of tensors.json][manifest.bin]: the
// table, then the binary manifest decoded against it. When n's top bit is
// set, the manifest's checksum is recomputed first, so that mutations reach
// the fields behind it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include "dcr/delta.h"
#include "dcr/hash.h"

namespace {

void Same(const dcr::DeltaManifest& a, const dcr::DeltaManifest& b) {
  bool same = a.frames.size() == b.frames.size() && a.tensors.size() == b.tensors.size() && a.delta_id == b.delta_id &&
              a.delta_class == b.delta_class && a.base_digest == b.base_digest && a.target_digest == b.target_digest &&
              a.objects == b.objects && a.changed_words == b.changed_words && a.payload_bytes == b.payload_bytes &&
              a.frame_bytes == b.frame_bytes;
  for (size_t i = 0; same && i < a.frames.size(); ++i)
    same = a.frames[i].tensor == b.frames[i].tensor && a.frames[i].chunk == b.frames[i].chunk &&
           a.frames[i].object == b.frames[i].object && a.frames[i].offset == b.frames[i].offset &&
           a.frames[i].bytes == b.frames[i].bytes;
  if (!same) std::abort();
}

std::span<const uint8_t> Bytes(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 0 && data[0] == '{') {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    if (auto table = dcr::DeltaManifest::FromTableJson(text, "fuzz"); table.ok()) {
      auto again = dcr::DeltaManifest::FromTableJson(table->TableJson(), "fuzz-again");
      if (!again.ok() || again->TableId() != table->TableId()) std::abort();
    }
    auto m = dcr::DeltaManifest::FromJson(text, "fuzz");
    if (!m.ok()) return 0;
    auto again = dcr::DeltaManifest::FromJson(m->ToJson(), "fuzz-again");
    if (!again.ok()) std::abort();
    Same(*m, *again);
    return 0;
  }
  if (size < 4) return 0;
  const uint32_t word = data[0] | data[1] << 8 | data[2] << 16 | static_cast<uint32_t>(data[3]) << 24;
  const uint32_t n = word & 0x7fffffffu;
  if (n > size - 4) return 0;
  auto table = dcr::DeltaManifest::FromTableJson(std::string_view(reinterpret_cast<const char*>(data + 4), n), "fuzz");
  if (!table.ok()) return 0;
  std::string bytes(reinterpret_cast<const char*>(data + 4 + n), size - 4 - n);
  if ((word >> 31) && bytes.size() >= 4) {
    const uint32_t crc = dcr::Crc32c(bytes.data(), bytes.size() - 4);
    for (int i = 0; i < 4; ++i) bytes[bytes.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  }
  auto m = dcr::DeltaManifest::Decode(Bytes(bytes), *table, "fuzz");
  if (!m.ok()) return 0;
  const std::string encoded = m->Encode();
  auto again = dcr::DeltaManifest::Decode(Bytes(encoded), *table, "fuzz-again");
  if (!again.ok()) std::abort();
  Same(*m, *again);
  return 0;
}
