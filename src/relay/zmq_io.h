// libzmq's C API with errors as values, for the relay and its clients. Not
// public API.
#pragma once

#include <zmq.h>

#include <chrono>
#include <memory>
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
Result<std::vector<std::string>> RecvParts(void* socket);

// The ZAP handler: answers one request on `zap` (a REP socket bound to
// inproc://zeromq.zap.01), admitting CURVE clients whose key is in
// `allowed`; refusals are logged with the peer's address and key.
void AnswerZap(void* zap, const std::set<std::string>& allowed, const std::function<void(const std::string&)>& log);

}  // namespace dcr::relay_internal
