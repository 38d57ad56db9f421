// ScriptedRelay (scripted_relay.h): the daemon's handlers driven in order by
// a script. Test-only: built into dcr_relay_testing, never into dcr.
#include "scripted_relay.h"

#include <fmt/format.h>

#include "relay_server.h"

namespace dcr::relay_internal {

// The daemon with its sockets set up for a script: a plain ROUTER on a
// private in-process address (peers' CURVE keys come with each message), an
// upstream socket without CURVE, and its steps reachable.
class DrivenRelay : public RelayServer {
 public:
  using RelayServer::RelayServer;

  Status SetUp(RelayOptions& o, size_t peers, std::vector<Socket>& sockets) {
    DCR_ASSIGN_OR_RETURN(router_, OpenSocket(ctx_.ctx, ZMQ_ROUTER));
    const int one = 1;
    zmq_setsockopt(router_.get(), ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    if (zmq_bind(router_.get(), o.listen.c_str()) != 0) return Internal(ZmqError("scripted relay: bind"));
    DCR_RETURN_IF_ERROR(OpenSpool());
    if (!o.upstream.empty()) {
      const RelaySecurity security = o.security;
      o.security.own.reset();  // the upstream socket without CURVE; the handlers still check roles
      Status attached = Attach(0);
      o.security = security;
      DCR_RETURN_IF_ERROR(attached);
    }
    for (size_t i = 0; i < peers; ++i) {
      DCR_ASSIGN_OR_RETURN(Socket p, OpenSocket(ctx_.ctx, ZMQ_DEALER));
      const std::string route = fmt::format("p{}", i);
      zmq_setsockopt(p.get(), ZMQ_ROUTING_ID, route.data(), route.size());
      if (zmq_connect(p.get(), o.listen.c_str()) != 0) return Internal(ZmqError("scripted relay: connect"));
      // The router knows the route once it has read from it.
      DCR_RETURN_IF_ERROR(SendParts(p.get(), "", {"hi"}));
      DCR_ASSIGN_OR_RETURN(auto hi, RecvParts(router_.get()));
      sockets.push_back(std::move(p));
    }
    return Status::Ok();
  }

  void FromPeer(std::vector<std::string> parts, const std::string& key) { OnRouter(std::move(parts), key); }
  void FromUpstream(std::vector<std::string> parts) {
    if (upstream_) OnUpstream(std::move(parts));
  }
  void TurnOnce() { Turn(true); }
  Status CheckInvariants(const RelayOptions& o) const;
};

Status DrivenRelay::CheckInvariants(const RelayOptions& o) const {
  if (children_.size() > o.max_children) return Internal(fmt::format("{} children", children_.size()));
  if (senders_.size() > o.max_senders) return Internal(fmt::format("{} senders", senders_.size()));
  // Links of attached peers are never forgotten, so the bound is the limit plus those.
  if (links_.size() > o.max_links + children_.size() + senders_.size() + 1)
    return Internal(fmt::format("{} link counters", links_.size()));
  if (refusals_.size() > 1025) return Internal(fmt::format("{} refusal lines", refusals_.size()));
  uint64_t bytes = 0;
  for (const auto& obj : cache_) {
    bytes += obj->data.size();
    if (!index_.count(obj->key)) return Internal("a cached object is not indexed: " + obj->key);
  }
  if (bytes != cache_bytes_ || index_.size() != cache_.size())
    return Internal(fmt::format("cache holds {} bytes in {} objects, counted {} bytes, {} indexed", bytes,
                                cache_.size(), cache_bytes_, index_.size()));
  if (cache_.size() > 1 && cache_bytes_ > o.cache_bytes)
    return Internal(fmt::format("cache of {} bytes beyond its bound {}", cache_bytes_, o.cache_bytes));
  for (const auto& [route, c] : children_)
    if (c.route != route) return Internal("a child filed under another route");
  return Status::Ok();
}

struct ScriptedRelay::Impl {
  RelayOptions o;
  std::unique_ptr<DrivenRelay> server;
  std::vector<Socket> peers;
};

ScriptedRelay::ScriptedRelay(RelayOptions o, size_t peers) : impl_(std::make_unique<Impl>()) {
  o.listen = fmt::format("inproc://dcr-scripted-relay-{}", static_cast<const void*>(this));
  if (!o.upstream.empty())
    o.upstream = {fmt::format("inproc://dcr-scripted-upstream-{}", static_cast<const void*>(this))};
  o.ping_every = o.dead_after = std::chrono::hours(24);
  if (!o.log) o.log = [](const std::string&) {};
  impl_->o = std::move(o);
  impl_->server = std::make_unique<DrivenRelay>(impl_->o);
  status_ = impl_->server->SetUp(impl_->o, peers, impl_->peers);
}

ScriptedRelay::~ScriptedRelay() {
  impl_->peers.clear();
  impl_->server.reset();
}

void ScriptedRelay::FromPeer(size_t peer, const std::string& key, std::vector<std::string> parts) {
  parts.insert(parts.begin(), fmt::format("p{}", peer));
  impl_->server->FromPeer(std::move(parts), key);
}

void ScriptedRelay::FromUpstream(std::vector<std::string> parts) {
  if (!impl_->o.upstream.empty()) impl_->server->FromUpstream(std::move(parts));
}

void ScriptedRelay::Turn() { impl_->server->TurnOnce(); }

std::vector<std::vector<std::string>> ScriptedRelay::Received(size_t peer) {
  std::vector<std::vector<std::string>> out;
  for (;;) {
    zmq_pollitem_t item{impl_->peers.at(peer).get(), 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, 0) <= 0 || !(item.revents & ZMQ_POLLIN)) return out;
    auto parts = RecvParts(impl_->peers[peer].get());
    if (!parts.ok()) return out;
    out.push_back(std::move(*parts));
  }
}

Status ScriptedRelay::CheckInvariants() const { return impl_->server->CheckInvariants(impl_->o); }

}  // namespace dcr::relay_internal
