// Fault injection for the failure campaigns (docs/testing.md). The installed
// dcr links no_fault_hooks.cc: no hook, no environment read. dcr-faults, a
// test binary built with the tests and never installed, links
// env_fault_hooks.cc, whose hooks the DCR_TEST_* variables set.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "dcr/status.h"

namespace dcr::cli {

// For PublishOptions::fault and FollowOptions::fault; empty for none.
// `stopping` says the process was asked to stop (a pause then ends).
std::function<Status(std::string_view point)> FaultPointHook(std::function<bool()> stopping);

// For RelayOptions::arrival_fault; empty for none.
std::function<void(const std::string& key, std::string& bytes)> RelayArrivalHook();

// "" in the installed dcr; a line for --version in dcr-faults.
std::string_view FaultInjectionNotice();

}  // namespace dcr::cli
