// What a publishing process counts for its metrics endpoint
// (docs/metrics.md, "Publishers"). Not public API.
#pragma once

#include <cstdint>
#include <string_view>

#include "dcr/publisher.h"

namespace dcr::protocol_internal {

// A publish call that returned: its version, attempts, stage seconds and
// receivers (`report`), or only its attempts when it failed.
void RecordPublish(const Result<PublishReport>& report);
// A frame object in the store ("store") or handed to the relay tree's
// roots ("relay"), with its trailer.
void CountSentBytes(std::string_view link, uint64_t bytes);
void CountFence();

}  // namespace dcr::protocol_internal
