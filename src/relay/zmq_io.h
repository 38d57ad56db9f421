// libzmq's C API with errors as values, for the relay and its clients. Not
// public API.
#pragma once

#include <zmq.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/relay.h"

namespace dcr::relay_internal {

struct SocketCloser {
  void operator()(void* s) const { zmq_close(s); }
};
using Socket = std::unique_ptr<void, SocketCloser>;

// A context that is terminated after its sockets (declare it first).
struct Context {
  void* ctx = zmq_ctx_new();
  ~Context() { zmq_ctx_term(ctx); }
};

std::string ZmqError(std::string_view what);

// A socket with LINGER 0 and the given high-water marks.
Result<Socket> OpenSocket(void* ctx, int type);
// Client side of CurveZMQ (no-op without keys).
Status ConfigureCurveClient(void* socket, const RelaySecurity& security);
// Server side of CurveZMQ, authenticated through the ZAP handler (no-op without keys).
Status ConfigureCurveServer(void* socket, const RelaySecurity& security);

// Sends parts (prefixed by `route` unless empty) without blocking. kUnavailable
// with "full" when the peer's queue is full (try later), kNotFound when the
// ROUTER peer is gone.
Status SendParts(void* socket, std::string_view route, const std::vector<std::string>& parts);
// Receives one message if one is waiting; an empty vector when none is.
// Beyond `max_parts`, parts are read and dropped (and the last kept is
// emptied): peers' messages are read with kRelayMaxParts.
// `peer_key`, when given, is set to the sender's CURVE public key (Z85, the
// ZAP handler's user id; empty without CURVE).
Result<std::vector<std::string>> RecvParts(void* socket, size_t max_parts = SIZE_MAX, std::string* peer_key = nullptr);

// Watches whether a relay that was left (silent) is back: a DEALER that
// connects to it and sends nothing, and a monitor of its handshakes. Up()
// turns true once a handshake with `address` succeeded (the peer's process
// runs and, with CURVE, accepted our key); ZeroMQ retries the connection by
// itself meanwhile.
class Probe {
 public:
  static Result<std::unique_ptr<Probe>> Start(void* ctx, const std::string& address, const RelaySecurity& security);
  bool Up();  // never blocks

 private:
  Socket monitor_, sock_;  // the monitor closes last
  bool up_ = false;
};

// For a client attached at `index` of its address list: keeps `probe`
// watching `first` while index > 0 (and none at 0); true once `first` is
// back (the probe is then reset; the caller attaches to it again).
bool FirstIsBack(std::unique_ptr<Probe>& probe, void* ctx, size_t index, const std::string& first,
                 const RelaySecurity& security);

// The ZAP handler: answers one request on `zap` (a REP socket bound to
// inproc://zeromq.zap.01), admitting CURVE clients whose key is in
// `allowed` (their user id is the key, so that each message names it);
// refusals are logged with the peer's address and key.
void AnswerZap(void* zap, const std::map<std::string, RelayRoles>& allowed,
               const std::function<void(const std::string&)>& log);

}  // namespace dcr::relay_internal
