// Fuzzes the relay daemon's handling of messages from several peers
// (src/relay/scripted_relay.h), not only the wire decoder: a script of
// messages from four peers, each with a chosen CURVE key, from the
// upstream, and turns of the daemon's loop. After every step the daemon
// must be within its bounds (ScriptedRelay::CheckInvariants), and nothing
// it sends a peer may be an object that fails VerifyFrameObject or that its
// verify_object refused.
//
// Input: byte 0 sets the relay up: bit 0 CURVE roles on (keys S sender, R
// relay, C receiver, A any role; X is not listed), bit 1 an upstream,
// bit 2 a verify_object that refuses keys ending in "1.bin", bit 3 tight
// limits (2 children, 2 senders, 4 link counters, 4 KiB of cache). Then
// steps, each an op byte: op % 4 == 0 or 1, a message from a peer (next
// byte: peer = bits 0-1, key = bits 2-4 of "", S, R, C, A, X; then a
// little-endian u16 length and that many bytes; op 1 splits them into two
// parts at the offset in the byte after the key byte, 0: one part); 2, a
// message from the upstream (a cut byte as op 1's, then length and bytes: no
// peer byte); 3, a turn of the loop, then what the peers got is checked.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/relay.h"
#include "scripted_relay.h"

namespace {

constexpr size_t kPeers = 4;

void Check(const dcr::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::abort();
  }
}

// What a peer got must be whole, verified objects the relay kept.
void CheckReceived(dcr::relay_internal::ScriptedRelay& relay, bool refuses) {
  static const bool verbose = std::getenv("DCR_FUZZ_VERBOSE") != nullptr;
  for (size_t p = 0; p < kPeers; ++p)
    for (const auto& parts : relay.Received(p)) {
      std::vector<std::string_view> views(parts.begin(), parts.end());
      auto m = dcr::DecodeMessage(views);
      Check(m.status());
      if (verbose)
        std::fprintf(stderr, "p%zu got %s %s\n", p, m->type == dcr::RelayMessageType::kObject ? "OBJECT" : "a message",
                     m->key.c_str());
      if (m->type != dcr::RelayMessageType::kObject) continue;
      Check(dcr::VerifyFrameObject(*m));
      if (refuses && m->key.ends_with("1.bin")) {
        std::fprintf(stderr, "forwarded %s, which verify_object refused\n", m->key.c_str());
        std::abort();
      }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t setup = data[0];
  const bool refuses = setup & 4;
  const std::string keys[] = {
      "", std::string(40, 'S'), std::string(40, 'R'), std::string(40, 'C'), std::string(40, 'A'), std::string(40, 'X')};
  dcr::RelayOptions o;
  o.id = "fuzz";
  if (setup & 1) {
    o.security.own = dcr::CurveKeyPair{std::string(40, 'O'), std::string(40, 'o')};
    o.security.allowed = {{keys[1], dcr::RoleBit(dcr::RelayRole::kSender)},
                          {keys[2], dcr::RoleBit(dcr::RelayRole::kRelay)},
                          {keys[3], dcr::RoleBit(dcr::RelayRole::kReceiver)},
                          {keys[4], dcr::kAnyRelayRole}};
  }
  if (setup & 2) o.upstream = {"parent"};
  if (refuses)
    o.verify_object = [](const std::string& key, std::string_view) {
      return key.ends_with("1.bin") ? dcr::DataLoss(key + ": not the publisher's") : dcr::Status::Ok();
    };
  if (setup & 8) {
    o.max_children = o.max_senders = 2;
    o.max_links = 4;
    o.cache_bytes = 4096;
  }
  o.window_bytes = 1 << 16;
  // DCR_FUZZ_VERBOSE=1: the daemon's log and what peers got, to read what an input does.
  static const bool verbose = std::getenv("DCR_FUZZ_VERBOSE") != nullptr;
  if (verbose) o.log = [](const std::string& line) { std::fprintf(stderr, "relay: %s\n", line.c_str()); };
  dcr::relay_internal::ScriptedRelay relay(o, kPeers);
  Check(relay.status());
  size_t i = 1;
  auto take = [&](size_t n) -> std::string_view {
    n = std::min(n, size - i);
    std::string_view out(reinterpret_cast<const char*>(data) + i, n);
    i += n;
    return out;
  };
  while (i < size) {
    const uint8_t op = data[i++] % 4;
    if (op == 3) {
      relay.Turn();
      CheckReceived(relay, refuses);
    } else {
      uint8_t who = 0, cut = 0;
      if (op != 2 && i < size) who = data[i++];
      if (op != 0 && i < size) cut = data[i++];
      const std::string_view head = take(2);
      const size_t n = head.size() == 2 ? (uint8_t(head[0]) | size_t{uint8_t(head[1])} << 8) : 0;
      const std::string_view bytes = take(n);
      std::vector<std::string> parts;
      if (op != 0 && cut != 0)
        parts = {std::string(bytes.substr(0, std::min<size_t>(cut, bytes.size()))),
                 std::string(bytes.substr(std::min<size_t>(cut, bytes.size())))};
      else parts = {std::string(bytes)};
      if (op == 2) relay.FromUpstream(std::move(parts));
      else relay.FromPeer(who % kPeers, keys[(who >> 2) % 6], std::move(parts));
    }
    Check(relay.CheckInvariants());
  }
  relay.Turn();
  CheckReceived(relay, refuses);
  Check(relay.CheckInvariants());
  return 0;
}
