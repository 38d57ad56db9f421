// Fuzzes the refit protocol's store records (docs/protocol.md): run, commit,
// ack, receiver, snapshot, trainer process, attempt, fence and timeline records are read from a store other processes
// write. The first input byte picks the record type; the rest is the JSON.
// Any input must be refused or parse into a record whose ToJson parses back
// to the same JSON (nothing lost or invented).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "dcr/run_records.h"

namespace {

template <typename Record>
void RoundTrip(std::string_view text) {
  auto r = Record::FromJson(text, "fuzz");
  if (!r.ok()) return;
  const std::string json = r->ToJson();
  auto again = Record::FromJson(json, "fuzz-again");
  if (!again.ok() || again->ToJson() != json) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 9) {
    case 0: RoundTrip<dcr::RunRecord>(text); break;
    case 1: RoundTrip<dcr::CommitRecord>(text); break;
    case 2: RoundTrip<dcr::AckRecord>(text); break;
    case 3: RoundTrip<dcr::ReceiverRecord>(text); break;
    case 4: RoundTrip<dcr::SnapshotRecord>(text); break;
    case 5: RoundTrip<dcr::ProcessRecord>(text); break;
    case 6: RoundTrip<dcr::AttemptRecord>(text); break;
    case 7: RoundTrip<dcr::FenceRecord>(text); break;
    default: RoundTrip<dcr::TimelineRecord>(text); break;
  }
  return 0;
}
