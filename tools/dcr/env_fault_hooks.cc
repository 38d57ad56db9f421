// dcr-faults, the test binary (fault_hooks.h): fault points set by the
// environment. Never in the installed dcr.
//
// DCR_TEST_CRASH_AT=<point>[:<count>] kills the process with SIGKILL the
// <count>th time (default the first) it reaches the named fault point of
// PublishOptions::fault / FollowOptions::fault (publisher: frames-written,
// manifest-written, acked, before-commit, committed; follower: applying,
// applied, acked). The failure campaign (tests/python/test_refit.py) uses it
// to crash at points that timing cannot hit reliably. DCR_TEST_FAIL_AT (same
// syntax) makes that point fail with an error instead, as a failed store
// operation would (the publisher fences the attempt and retries).
// DCR_TEST_PAUSE_AT=<point>:<file> waits at the point (its first time) until
// <file> exists: a handshake for tests that act while a process stands at a
// known place; with a crash or failure at the same point, the pause comes
// first. DCR_TEST_CORRUPT_NTH=N (dcr relay) flips a byte of the Nth object
// the relay receives, before it is verified, as a corrupting link would.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <thread>

#include "fault_hooks.h"

namespace dcr::cli {
namespace {

std::function<Status(std::string_view)> PauseHook(std::function<bool()> stopping) {
  const char* pause = std::getenv("DCR_TEST_PAUSE_AT");
  if (!pause || !*pause) return {};
  const std::string spec = pause;
  const size_t colon = spec.find(':');
  const std::string point = spec.substr(0, colon), file = colon == std::string::npos ? "" : spec.substr(colon + 1);
  auto done = std::make_shared<std::atomic<bool>>(false);
  return [point, file, done, stopping](std::string_view at) {
    if (at != point || done->exchange(true)) return Status::Ok();
    std::cerr << "DCR_TEST_PAUSE_AT: waiting at " << point << " for " << file << std::endl;
    while (!std::filesystem::exists(file) && !(stopping && stopping()))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return Status::Ok();
  };
}

std::function<Status(std::string_view)> CrashOrFailHook() {
  const char* spec = std::getenv("DCR_TEST_CRASH_AT");
  const bool fail = !spec || !*spec;
  if (fail) spec = std::getenv("DCR_TEST_FAIL_AT");
  if (!spec || !*spec) return {};
  std::string point = spec;
  uint64_t count = 1;
  if (size_t colon = point.find(':'); colon != std::string::npos) {
    count = std::strtoull(point.c_str() + colon + 1, nullptr, 10);
    point.resize(colon);
  }
  auto seen = std::make_shared<std::atomic<uint64_t>>(0);
  return [point, count, seen, fail](std::string_view at) {
    if (at == point && seen->fetch_add(1) + 1 == count) {
      if (fail) {
        std::cerr << "DCR_TEST_FAIL_AT: failing at " << point << std::endl;
        return Aborted("injected failure at " + point + " (DCR_TEST_FAIL_AT)");
      }
      std::cerr << "DCR_TEST_CRASH_AT: killing myself at " << point << std::endl;
      std::raise(SIGKILL);
    }
    return Status::Ok();
  };
}

}  // namespace

std::function<Status(std::string_view)> FaultPointHook(std::function<bool()> stopping) {
  auto pause = PauseHook(std::move(stopping));
  auto fault = CrashOrFailHook();
  if (!pause || !fault) return pause ? pause : fault;
  return [pause, fault](std::string_view at) {
    DCR_RETURN_IF_ERROR(pause(at));
    return fault(at);
  };
}

std::function<void(const std::string&, std::string&)> RelayArrivalHook() {
  const char* n = std::getenv("DCR_TEST_CORRUPT_NTH");
  if (!n || !*n) return {};
  const uint64_t nth = std::strtoull(n, nullptr, 10);
  auto received = std::make_shared<uint64_t>(0);  // the relay's thread only
  return [nth, received](const std::string& key, std::string& bytes) {
    if (++*received != nth || bytes.empty()) return;
    bytes[bytes.size() / 2] ^= 0x5a;
    std::cerr << "DCR_TEST_CORRUPT_NTH: corrupted object " << nth << " (" << key << ") on arrival" << std::endl;
  };
}

std::string_view FaultInjectionNotice() {
  return "dcr-faults: a test build; DCR_TEST_CRASH_AT, DCR_TEST_FAIL_AT, DCR_TEST_PAUSE_AT and DCR_TEST_CORRUPT_NTH "
         "inject faults";
}

}  // namespace dcr::cli
