// Fuzzes the contribution object parser (docs/format.md section 5): objects
// one trainer process writes for another through the store. The delta is a
// fixed two-tensor layout (F32 [12, 10] and BF16 [20], 16-element chunks);
// byte 0 of the input picks the class, which senders the writer holds, and
// whether the object's checksum is recomputed first (so that the fuzzer
// reaches the records; seeds.py writes them with a dummy checksum).
// Any input must be refused or parse into records that pass the parser's
// own invariants and serialise back to the very same bytes (the writer
// canonicalises, the parser accepts only canonical objects).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "dcr/contribution.h"
#include "dcr/hash.h"

namespace {

dcr::DeltaManifest Manifest(dcr::DeltaClass cls) {
  std::vector<dcr::TensorInfo> tensors = {{"a", dcr::DType::kF32, {12, 10}, 120, 480},
                                          {"b", dcr::DType::kBF16, {20}, 20, 40}};
  dcr::DeltaOptions opt;
  opt.chunk_elements = 16;
  opt.delta_id = 0x1234;
  opt.encode.delta_class = cls;
  return dcr::StartLayoutDelta(tensors, opt);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const dcr::DeltaManifest xor_m = Manifest(dcr::DeltaClass::kXorClass);
  static const dcr::DeltaManifest ow_m = Manifest(dcr::DeltaClass::kOverwrite);
  const bool overwrite = data[0] & 1;
  const dcr::DeltaManifest& m = overwrite ? ow_m : xor_m;
  std::vector<uint32_t> senders = {0};
  if (data[0] & 2) senders.push_back(1);
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 4) && bytes.size() >= 8) {
    const uint64_t sum = dcr::Xxh3_64(bytes.data(), bytes.size() - 8);
    for (int i = 0; i < 8; ++i) bytes[bytes.size() - 8 + i] = static_cast<char>(sum >> (8 * i));
  }
  const dcr::ContributionHeader header{m.delta_id, m.delta_class, 1, 0};
  auto parsed = dcr::ParseContributions({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, header, m,
                                        senders, "fuzz");
  if (!parsed.ok()) return 0;
  for (const auto& c : *parsed) {
    uint64_t covered = 0;
    for (auto [lo, len] : c.covered) covered += len;
    const uint64_t eb = c.tensor == 0 ? 4 : 2;
    if (c.covered.empty() || c.positions.size() > covered || c.old_bits.size() != c.positions.size() * eb ||
        c.new_bits.size() != c.positions.size() * eb || c.covered_bits.size() != (overwrite ? covered * eb : 0))
      std::abort();
  }
  auto again = dcr::WriteContributions(header, m, *parsed);
  if (!again.ok() || *again != bytes) std::abort();
  return 0;
}
