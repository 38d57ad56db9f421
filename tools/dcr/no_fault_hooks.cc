// The installed dcr: no fault injection (fault_hooks.h).
#include "fault_hooks.h"

namespace dcr::cli {

std::function<Status(std::string_view)> FaultPointHook(std::function<bool()>) { return {}; }

std::function<void(const std::string&, std::string&)> RelayArrivalHook() { return {}; }

std::string_view FaultInjectionNotice() { return ""; }

}  // namespace dcr::cli
