// A relay's counters and levels as metrics (docs/metrics.md, "Relays"),
// exported about every second and at exit, labelled by relay id.
#include "dcr/metrics.h"
#include "relay_server.h"

namespace dcr::relay_internal {

namespace {

Counter objects("dcr_relay_objects_total",
                "Frame objects that reached a relay, by result: received, accepted, duplicate, corrupt, "
                "unverified (signature), fenced.",
                {"relay", "result"});
Counter link_bytes("dcr_relay_link_bytes_total",
                   "Object bytes over each link of a relay, by peer, its kind (sender, relay, receiver, upstream) and "
                   "direction (in, out).",
                   {"relay", "peer", "kind", "direction"});
Counter acks("dcr_relay_acks_total", "Receivers' acks through a relay, by direction: in (from children), out (up).",
             {"relay", "direction"});
Gauge links_attached("dcr_relay_link_attached", "1 while a link's peer is attached, 0 after it left.",
                     {"relay", "peer", "kind"});
Gauge queue_bytes("dcr_relay_queue_bytes", "Bytes of objects queued for children, not yet sent.", {"relay"});
Gauge inflight_bytes("dcr_relay_inflight_bytes", "Bytes sent to children and not yet credited back.", {"relay"});
Gauge cache_bytes("dcr_relay_cache_bytes", "Bytes of objects a relay keeps in memory for its children.", {"relay"});
Gauge spool_bytes("dcr_relay_spool_bytes", "Bytes of objects a relay holds in its spool directory.", {"relay"});
Gauge children("dcr_relay_children", "Peers attached to a relay to receive objects (relays and receivers).", {"relay"});

}  // namespace

void RelayServer::ExportMetrics() {
  const std::string& id = o_.id;
  const std::pair<const char*, uint64_t> results[] = {{"received", received_},     {"accepted", accepted_},
                                                      {"duplicate", duplicates_},  {"corrupt", corrupt_},
                                                      {"unverified", unverified_}, {"fenced", fenced_drops_}};
  for (const auto& [result, n] : results) objects.Mirror(static_cast<double>(n), {id, result});
  acks.Mirror(static_cast<double>(acks_in_), {id, "in"});
  acks.Mirror(static_cast<double>(acks_out_), {id, "out"});
  for (const auto& [name, l] : links_) {
    const std::string peer = name.substr(name.find(':') + 1);
    link_bytes.Mirror(static_cast<double>(l.bytes_in), {id, peer, l.role, "in"});
    link_bytes.Mirror(static_cast<double>(l.bytes_out), {id, peer, l.role, "out"});
    links_attached.Set(l.attached ? 1 : 0, {id, peer, l.role});
  }
  uint64_t queued = 0, inflight = 0;
  for (const auto& [route, c] : children_) {
    inflight += c.inflight;
    for (const ObjectPtr& o : c.queue) queued += o->spooled ? o->spooled->bytes : o->data.size();
  }
  queue_bytes.Set(static_cast<double>(queued), {id});
  inflight_bytes.Set(static_cast<double>(inflight), {id});
  cache_bytes.Set(static_cast<double>(cache_bytes_), {id});
  spool_bytes.Set(static_cast<double>(*spool_used_), {id});
  children.Set(static_cast<double>(children_.size()), {id});
}

}  // namespace dcr::relay_internal
