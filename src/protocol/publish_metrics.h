// What a publishing process leaves for operators (docs/metrics.md): its
// metrics ("Publishers") and its timeline records ("Timeline"). Not public
// API.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "dcr/publisher.h"
#include "dcr/store.h"

namespace dcr::protocol_internal {

// A publish call that returned: its version, attempts, stage seconds and
// receivers into the metrics (a failure: only that it failed); and, when
// this call committed its version, its spans into the store as the
// TimelineRecord of `process` (best effort: a failed write is logged).
void RecordPublish(Store& store, const std::string& process, const std::string& role,
                   const Result<PublishReport>& report);
// A frame object in the store ("store") or handed to the relay tree's
// roots ("relay"), with its trailer.
void CountSentBytes(std::string_view link, uint64_t bytes);
void CountFence();

}  // namespace dcr::protocol_internal
