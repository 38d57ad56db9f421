// The relay daemon (docs/relay.md): one event loop thread, a ROUTER for its
// children and senders, a DEALER to its upstream.
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "dcr/frame.h"
#include "dcr/hash.h"
#include "dcr/json.h"
#include "dcr/mapped_file.h"
#include "relay_server.h"
#include "zmq_io.h"

namespace dcr::relay_internal {
namespace {

// Acks that arrive together (siblings finishing within a few ms) go up in one message.
constexpr auto kAckLinger = std::chrono::milliseconds(2);

void FreeObjectRef(void*, void* hint) { delete static_cast<ObjectPtr*>(hint); }

}  // namespace

Status RelayServer::Attach(size_t index) {
  upstream_index_ = index;
  const std::string& address = o_.upstream[index];
  DCR_ASSIGN_OR_RETURN(upstream_, OpenSocket(ctx_.ctx, ZMQ_DEALER));
  DCR_RETURN_IF_ERROR(ConfigureCurveClient(upstream_.get(), o_.security));
  if (zmq_connect(upstream_.get(), address.c_str()) != 0)
    return InvalidArgument(ZmqError("relay " + o_.id + ": cannot connect to upstream " + address));
  RelayMessage hello;
  hello.type = RelayMessageType::kHello;
  hello.role = RelayRole::kRelay;
  hello.id = o_.id;
  for (auto it = cache_.rbegin(); it != cache_.rend() && hello.have.size() < kRelayMaxHave; ++it)
    hello.have.push_back((*it)->key);
  SendParts(upstream_.get(), "", EncodeMessage(hello)).IgnoreError();  // queued until connected
  upstream_since_ = upstream_heard_ = Clock::now();
  links_["upstream:" + address].role = "upstream";
  links_["upstream:" + address].attached = true;
  Log(fmt::format("attached to upstream {} (holding {} objects)", address, hello.have.size()));
  // The acks it holds go up again: the old upstream may have died with them.
  for (const auto& [prefix, by_receiver] : acks_) {
    std::vector<AckRecord> all;
    for (const auto& [id, ack] : by_receiver) all.push_back(ack);
    SendAcks(upstream_.get(), "", prefix, std::move(all));
  }
  ack_pending_.clear();
  return Status::Ok();
}

Status RelayServer::Run(const std::function<bool()>& stop) {
  if (o_.id.empty()) return InvalidArgument("relay: an id is needed");
  if (o_.listen.empty()) return InvalidArgument("relay " + o_.id + ": a listen address is needed (tcp://HOST:PORT)");
  if (o_.security.enabled()) {
    DCR_ASSIGN_OR_RETURN(zap_, OpenSocket(ctx_.ctx, ZMQ_REP));
    if (zmq_bind(zap_.get(), "inproc://zeromq.zap.01") != 0) return Internal(ZmqError("relay: ZAP handler"));
  }
  DCR_ASSIGN_OR_RETURN(router_, OpenSocket(ctx_.ctx, ZMQ_ROUTER));
  const int one = 1;
  zmq_setsockopt(router_.get(), ZMQ_ROUTER_MANDATORY, &one, sizeof one);
  DCR_RETURN_IF_ERROR(ConfigureCurveServer(router_.get(), o_.security));
  const std::string mon = fmt::format("inproc://dcr-relay-monitor-{}", static_cast<const void*>(this));
  if (zmq_socket_monitor(router_.get(), mon.c_str(),
                         ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                             ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) == 0) {
    DCR_ASSIGN_OR_RETURN(monitor_, OpenSocket(ctx_.ctx, ZMQ_PAIR));
    zmq_connect(monitor_.get(), mon.c_str());
  }
  if (zmq_bind(router_.get(), o_.listen.c_str()) != 0)
    return Unavailable(
        ZmqError(fmt::format("relay {}: cannot listen on {} (in use, or not tcp://HOST:PORT?)", o_.id, o_.listen)));
  Log(fmt::format("listening on {}{}", o_.listen,
                  o_.security.enabled() ? fmt::format(" (CURVE, {} peers admitted)", o_.security.allowed.size())
                                        : " (no authentication: trusted networks only)"));
  if (!o_.security.enabled()) Log(std::string(kRelayInsecureWarning));
  if (const auto any = std::count_if(o_.security.allowed.begin(), o_.security.allowed.end(),
                                     [](const auto& kv) { return kv.second == kAnyRelayRole; }))
    Log(
        fmt::format("{} admitted keys may take any role (allow-list lines without one): each may send objects and "
                    "fences as a sender; give each line its role (sender, relay or receiver)",
                    any));
  if (o_.upstream.empty() && !o_.verify_object)
    Log("a root without the run's store keeps the first copy of each object a sender sends, unverified: a holder "
        "of a sender's key can push a forged copy first, which receivers refuse and fetch from the store instead "
        "(bits stay safe, the tree's fast path does not); give the root the store to verify signatures here");
  DCR_RETURN_IF_ERROR(OpenSpool());
  if (!o_.upstream.empty()) DCR_RETURN_IF_ERROR(Attach(0));
  last_stats_ = Clock::now();
  while (!(stop && stop())) {
    zmq_pollitem_t items[4];
    int n = 0;
    items[n++] = {router_.get(), 0, ZMQ_POLLIN, 0};
    const int up = upstream_ ? n : -1;
    if (upstream_) items[n++] = {upstream_.get(), 0, ZMQ_POLLIN, 0};
    const int zap = zap_ ? n : -1;
    if (zap_) items[n++] = {zap_.get(), 0, ZMQ_POLLIN, 0};
    const int mo = monitor_ ? n : -1;
    if (monitor_) items[n++] = {monitor_.get(), 0, ZMQ_POLLIN, 0};
    // Acks waiting to go up leave after kAckLinger, not after the poll's usual 10 ms.
    const long timeout = ack_pending_.empty() ? 10 : 1;
    if (zmq_poll(items, n, timeout) < 0 && zmq_errno() != EINTR) return Internal(ZmqError("relay: poll"));
    if (zap >= 0 && (items[zap].revents & ZMQ_POLLIN)) {
      AnswerZap(zap_.get(), o_.security.allowed, [&](const std::string& l) { Refused(l); });
    }
    if (mo >= 0 && (items[mo].revents & ZMQ_POLLIN)) OnMonitor();
    for (int i = 0; i < 512 && (items[0].revents & ZMQ_POLLIN); ++i) {
      std::string key;
      auto parts = RecvParts(router_.get(), kRelayMaxParts, &key);
      if (!parts.ok() || parts->empty()) break;
      OnRouter(std::move(*parts), key);
    }
    for (int i = 0; up >= 0 && upstream_ && i < 512 && (items[up].revents & ZMQ_POLLIN); ++i) {
      auto parts = RecvParts(upstream_.get(), kRelayMaxParts);
      if (!parts.ok() || parts->empty()) break;
      OnUpstream(std::move(*parts));
    }
    Turn(false);
  }
  FlushAcks(true);
  ExportMetrics();
  WriteStats();
  Log("stopped");
  return Status::Ok();
}

void RelayServer::Turn(bool force_acks) {
  std::vector<std::string> gone;
  for (auto& [route, c] : children_)
    if (!Pump(c)) gone.push_back(route);
  for (const auto& r : gone) Detach(r, "its connection is gone");
  FlushAcks(force_acks);
  Timers();
}

void RelayServer::OnMonitor() {
  auto ev = RecvParts(monitor_.get());
  if (!ev.ok() || ev->size() < 2 || (*ev)[0].size() < 6) return;
  uint16_t event = 0;
  std::memcpy(&event, (*ev)[0].data(), 2);
  Refused(fmt::format(
      "refused a peer at {}: handshake failed ({}); peers need CURVE keys: the relays' public key and "
      "their own pair, listed in the relay's allow list (dcr relay keygen)",
      (*ev)[1], event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "authentication" : "no or another security mechanism"));
}

// Whether the allow list admits `key` in the role the HELLO claims.
bool RelayServer::Admitted(const RelayMessage& m, const std::string& key) {
  if (!o_.security.enabled()) return true;
  auto admitted = o_.security.allowed.find(key);
  const RelayRoles roles = admitted == o_.security.allowed.end() ? 0 : admitted->second;
  if (roles & RoleBit(m.role)) return true;
  Refused(fmt::format("refused HELLO as {} {} (CURVE key {}): the allow list admits that key as {}",
                      RelayRoleName(m.role), m.id, key, RelayRolesName(roles)));
  return false;
}

void RelayServer::OnSenderHello(const std::string& route, const std::string& key, const RelayMessage& m) {
  if (!o_.upstream.empty()) {  // objects enter the tree at its roots, where they can be verified
    Refused(
        fmt::format("refused HELLO as sender {}: this relay has an upstream; senders push to the tree's roots", m.id));
    return;
  }
  auto known = senders_.find(route);
  if (known != senders_.end() && known->second.id == m.id) {  // its ping
    known->second.heard = Clock::now();
    return;
  }
  if (known != senders_.end()) LinkGone("sender:" + known->second.id);  // the route's new id
  if (known == senders_.end() && senders_.size() >= o_.max_senders) {
    Refused(fmt::format("refused sender {}: {} senders are attached already (the limit)", m.id, senders_.size()));
    return;
  }
  senders_[route] = Sender{m.id, key, Clock::now()};
  LinkOf("sender:" + m.id).role = "sender";
  LinkOf("sender:" + m.id).attached = true;
  Log(fmt::format("sender {} attached", m.id));
  if (o_.upstream.empty())  // a root: the acks it holds, for a coordinator that restarted
    for (const auto& [prefix, by_receiver] : acks_) {
      std::vector<AckRecord> all;
      for (const auto& [id, ack] : by_receiver) all.push_back(ack);
      SendAcks(router_.get(), route, prefix, std::move(all));
    }
}

void RelayServer::OnChildHello(const std::string& route, const std::string& key, const RelayMessage& m) {
  // Ids are unique among children. The same id on a new connection is the
  // child re-attaching, unless another key says it: an id stays with the
  // key that attached it.
  if (auto same =
          std::find_if(children_.begin(), children_.end(), [&](const auto& kv) { return kv.second.id == m.id; });
      same != children_.end()) {
    if (same->second.key != key) {
      Refused(fmt::format("refused HELLO as {} {} (CURVE key {}): a child of that id is attached with another key",
                          RelayRoleName(m.role), m.id, key));
      return;
    }
    if (same->first != route) children_.erase(same);
  }
  if (!children_.count(route) && children_.size() >= o_.max_children) {
    Refused(fmt::format("refused {} {}: {} children are attached already (the limit)", RelayRoleName(m.role), m.id,
                        children_.size()));
    return;
  }
  Child& c = children_[route];
  if (!c.id.empty() && c.id != m.id) LinkGone("child:" + c.id);  // the route's new id
  c = Child{};
  c.route = route;
  c.id = m.id;
  c.key = key;
  c.role = m.role;
  c.have.insert(m.have.begin(), m.have.end());
  c.heard = Clock::now();
  for (const auto& obj : cache_)
    if (!c.have.count(obj->key)) c.queue.push_back(obj);
  Link& l = LinkOf("child:" + m.id);
  l.role = std::string(RelayRoleName(m.role));
  l.attached = true;
  Log(fmt::format("{} {} attached: {} held objects sent now, {} it already holds", RelayRoleName(m.role), m.id,
                  c.queue.size(), m.have.size()));
}

void RelayServer::OnObject(const std::string& route, RelayMessage m) {
  if (auto child = children_.find(route); child != children_.end()) {
    Log(fmt::format("{} {} sent an object; only senders and the upstream may: ignored",
                    RelayRoleName(child->second.role), child->second.id));
    return;
  }
  auto known = senders_.find(route);
  if (known == senders_.end()) {
    Refused("a peer that did not say HELLO as a sender sent an object: refused");
    return;
  }
  Sender& sender = known->second;
  sender.heard = Clock::now();
  RelayMessage credit;
  credit.type = RelayMessageType::kCredit;
  credit.credit_bytes = m.size;
  credit.credit_objects = 1;
  SendParts(router_.get(), route, EncodeMessage(credit)).IgnoreError();
  Link* link = &LinkOf("sender:" + sender.id);
  link->role = "sender";
  Accept(std::move(m), "sender " + sender.id, link);
}

void RelayServer::OnRouter(std::vector<std::string> parts, const std::string& key) {
  if (parts.size() < 2) return;
  const std::string route = parts[0];
  std::vector<std::string_view> views(parts.begin() + 1, parts.end());
  auto m = DecodeMessage(views);
  if (!m.ok()) {
    if (++malformed_ <= 20) Log("ignored a malformed message from a peer: " + m.status().ToString());
    return;
  }
  auto child = children_.find(route);
  switch (m->type) {
    case RelayMessageType::kHello:
      if (!Admitted(*m, key)) return;
      if (m->role == RelayRole::kSender) OnSenderHello(route, key, *m);
      else OnChildHello(route, key, *m);
      return;
    case RelayMessageType::kObject: OnObject(route, std::move(*m)); return;
    case RelayMessageType::kCredit:
      if (child != children_.end()) {
        child->second.inflight -= std::min(child->second.inflight, m->credit_bytes);
        child->second.heard = Clock::now();
      }
      return;
    case RelayMessageType::kFence:
      if (senders_.count(route)) ApplyFence(m->key);
      else Refused("a peer that is not an attached sender sent a fence: refused");
      return;
    case RelayMessageType::kNotice:
      if (senders_.count(route)) ForwardNotice(m->key);
      else Refused("a peer that is not an attached sender sent a notice: refused");
      return;
    case RelayMessageType::kPing:
      if (child != children_.end()) child->second.heard = Clock::now();
      else if (senders_.count(route)) senders_[route].heard = Clock::now();
      return;
    case RelayMessageType::kAck:
      if (child == children_.end()) {
        Log("a peer that is not a child (no HELLO) sent acks: ignored");
        return;
      }
      child->second.heard = Clock::now();
      OnAck(std::move(*m), child->second);
      return;
  }
}

void RelayServer::OnAck(RelayMessage m, const Child& from) {
  ++ack_messages_in_;
  acks_in_ += m.acks.size();
  if (fenced_.count(m.key)) return;
  if (!acks_.count(m.key)) {
    ack_order_.push_back(m.key);
    if (ack_order_.size() > 64) {
      acks_.erase(ack_order_.front());
      ack_pending_.erase(ack_order_.front());
      ack_order_.pop_front();
    }
  }
  auto& by_receiver = acks_[m.key];
  for (auto& a : m.acks) {
    auto it = by_receiver.find(a.receiver);
    if (it != by_receiver.end() && it->second.ok == a.ok && it->second.digest == a.digest) continue;  // a re-send
    if (!a.ok)
      Log(fmt::format("receiver {} (via {} {}) failed attempt {}: {}", a.receiver, RelayRoleName(from.role), from.id,
                      m.key, a.error));
    if (ack_pending_.empty()) ack_pending_since_ = Clock::now();
    ack_pending_[m.key].insert(a.receiver);
    by_receiver.insert_or_assign(a.receiver, std::move(a));
  }
}

void RelayServer::SendAcks(void* socket, const std::string& route, const std::string& prefix,
                           std::vector<AckRecord> acks) {
  if (acks.empty()) return;
  RelayMessage m;
  m.type = RelayMessageType::kAck;
  m.key = prefix;
  const size_t n = acks.size();
  m.acks = std::move(acks);
  if (SendParts(socket, route, EncodeMessage(m)).ok()) {
    ++ack_messages_out_;
    acks_out_ += n;
  }
}

void RelayServer::FlushAcks(bool force) {
  if (ack_pending_.empty() || (!force && Clock::now() - ack_pending_since_ < kAckLinger)) return;
  for (auto& [prefix, receivers] : ack_pending_) {
    std::vector<AckRecord> batch;
    for (const auto& id : receivers) batch.push_back(acks_[prefix].at(id));
    if (upstream_) {
      SendAcks(upstream_.get(), "", prefix, std::move(batch));
    } else {
      for (const auto& [route, sender] : senders_) SendAcks(router_.get(), route, prefix, batch);
    }
  }
  ack_pending_.clear();
}

void RelayServer::OnUpstream(std::vector<std::string> parts) {
  std::vector<std::string_view> views(parts.begin(), parts.end());
  auto m = DecodeMessage(views);
  if (!m.ok()) {
    if (++malformed_ <= 20) Log("ignored a malformed message from upstream: " + m.status().ToString());
    return;
  }
  upstream_heard_ = Clock::now();
  const std::string address = o_.upstream[upstream_index_];
  if (m->type == RelayMessageType::kObject) {
    RelayMessage credit;
    credit.type = RelayMessageType::kCredit;
    credit.credit_bytes = m->size;
    credit.credit_objects = 1;
    SendParts(upstream_.get(), "", EncodeMessage(credit)).IgnoreError();
    Accept(std::move(*m), "upstream " + address, &links_["upstream:" + address]);
  } else if (m->type == RelayMessageType::kFence) {
    ApplyFence(m->key);
  } else if (m->type == RelayMessageType::kNotice) {
    ForwardNotice(m->key);
  }
}

void RelayServer::Accept(RelayMessage m, const std::string& from, Link* link) {
  ++received_;
  auto obj = std::make_shared<Object>();
  obj->key = m.key;
  obj->crc = m.crc;
  obj->data.assign(m.data);
  if (o_.arrival_fault) o_.arrival_fault(obj->key, obj->data);
  m.data = obj->data;
  // Verified before anything else is done with it.
  if (Status s = VerifyFrameObject(m); !s.ok()) {
    ++corrupt_;
    Log(fmt::format("dropped a corrupt object from {}: {}", from, s.message()));
    return;
  }
  auto prefix = FrameObjectPrefix(obj->key);
  obj->prefix = prefix.ok() ? *prefix : "";
  if (fenced_.count(obj->prefix)) {
    if (++fenced_drops_ == 1 || fenced_drops_ % 1000 == 0)
      Log(fmt::format("refused object {} of a fenced attempt ({} refused so far)", obj->key, fenced_drops_));
    return;
  }
  if (index_.count(obj->key)) {
    ++duplicates_;
    return;
  }
  if (o_.verify_object) {
    if (Status s = o_.verify_object(obj->key, obj->data); !s.ok()) {
      const uint64_t n = ++unverified_;
      if ((n & (n - 1)) == 0)  // the 1st, 2nd, 4th...
        Log(fmt::format("refused object {} from {} ({} refused so far): {}", obj->key, from, n, s.ToString()));
      return;
    }
  }
  ++accepted_;
  accepted_bytes_ += obj->data.size();
  link->bytes_in += obj->data.size();
  ++link->objects_in;
  ObjectPtr p = obj;
  cache_.push_back(p);
  index_[p->key] = p;
  cache_bytes_ += p->data.size();
  for (auto& [route, c] : children_)
    if (!c.have.count(p->key)) c.queue.push_back(p);
  Evict();
}

void RelayServer::Evict() {
  while (cache_bytes_ > o_.cache_bytes && cache_.size() > 1) {
    ObjectPtr old = cache_.front();
    cache_.pop_front();
    index_.erase(old->key);
    cache_bytes_ -= old->data.size();
    ObjectPtr spooled;  // written once, for every child that still needs it
    bool tried = false;
    for (auto& [route, c] : children_) {
      auto it = std::find(c.queue.begin(), c.queue.end(), old);
      if (it == c.queue.end()) continue;
      if (!tried) {
        spooled = Spool(old);
        tried = true;
      }
      if (spooled) {
        *it = spooled;
        ++LinkOf("child:" + c.id).spooled;
        continue;
      }
      c.queue.erase(it);
      ++LinkOf("child:" + c.id).evicted;
      Log(fmt::format("{} {} is too slow: object {} left the cache before it was sent{}; it fetches it from the store",
                      RelayRoleName(c.role), c.id, old->key, o_.spool_dir.empty() ? "" : " and the spool is full"));
    }
  }
}

Status RelayServer::OpenSpool() {
  if (o_.spool_dir.empty()) return Status::Ok();
  std::error_code ec;
  std::filesystem::create_directories(o_.spool_dir, ec);
  if (ec)
    return InvalidArgument(
        fmt::format("relay {}: cannot create the spool directory {}: {}", o_.id, o_.spool_dir, ec.message()));
  size_t stale = 0;
  for (const auto& e : std::filesystem::directory_iterator(o_.spool_dir, ec))
    if (e.path().extension() == ".spool" && std::filesystem::remove(e.path(), ec)) ++stale;
  if (ec)
    return InvalidArgument(
        fmt::format("relay {}: cannot read the spool directory {}: {}", o_.id, o_.spool_dir, ec.message()));
  if (stale) Log(fmt::format("removed {} spool files of an earlier run from {}", stale, o_.spool_dir));
  return Status::Ok();
}

ObjectPtr RelayServer::Spool(const ObjectPtr& old) {
  if (o_.spool_dir.empty()) return nullptr;
  if (*spool_used_ + old->data.size() > o_.spool_bytes) {
    ++spool_full_;
    return nullptr;
  }
  auto file = std::make_shared<SpoolFile>();
  file->path = fmt::format("{}/{}.spool", o_.spool_dir, ++spool_seq_);
  file->used = spool_used_;
  {
    std::ofstream out(file->path, std::ios::binary | std::ios::trunc);
    out.write(old->data.data(), static_cast<std::streamsize>(old->data.size()));
    out.close();
    if (!out) {
      Log(fmt::format("cannot write the spool file {} ({} bytes): {}; object {} is dropped instead", file->path,
                      old->data.size(), std::strerror(errno), old->key));
      ::unlink(file->path.c_str());
      ++spool_full_;
      return nullptr;
    }
  }
  file->bytes = old->data.size();
  *spool_used_ += file->bytes;
  ++spooled_;
  spooled_bytes_ += file->bytes;
  auto s = std::make_shared<Object>();
  s->key = old->key;
  s->prefix = old->prefix;
  s->crc = old->crc;
  s->spooled = std::move(file);
  return s;
}

ObjectPtr RelayServer::Unspool(const Object& spooled) {
  auto obj = std::make_shared<Object>();
  obj->key = spooled.key;
  obj->prefix = spooled.prefix;
  obj->crc = spooled.crc;
  std::ifstream in(spooled.spooled->path, std::ios::binary);
  obj->data.resize(spooled.spooled->bytes);
  in.read(obj->data.data(), static_cast<std::streamsize>(obj->data.size()));
  if (!in || Crc32c(obj->data.data(), obj->data.size()) != obj->crc) {
    Log(fmt::format(
        "spool file {} of object {} is unreadable or damaged; the object is dropped (fetched from the store)",
        spooled.spooled->path, spooled.key));
    return nullptr;
  }
  ++unspooled_;
  return obj;
}

void RelayServer::ApplyFence(const std::string& prefix) {
  if (!fenced_.insert(prefix).second) return;
  fenced_order_.push_back(prefix);
  if (fenced_order_.size() > 4096) {
    fenced_.erase(fenced_order_.front());
    fenced_order_.pop_front();
  }
  size_t dropped = 0;
  std::erase_if(cache_, [&](const ObjectPtr& o) {
    if (o->prefix != prefix) return false;
    index_.erase(o->key);
    cache_bytes_ -= o->data.size();
    ++dropped;
    return true;
  });
  RelayMessage fence;
  fence.type = RelayMessageType::kFence;
  fence.key = prefix;
  const auto parts = EncodeMessage(fence);
  for (auto& [route, c] : children_) {
    std::erase_if(c.queue, [&](const ObjectPtr& o) { return o->prefix == prefix; });
    SendParts(router_.get(), route, parts).IgnoreError();
  }
  acks_.erase(prefix);
  ack_pending_.erase(prefix);
  Log(fmt::format("attempt {} fenced: {} cached objects dropped, later ones refused", prefix, dropped));
}

// Notices go to every child at once, ahead of queued objects, and are not
// kept: a child that attaches later, or misses one, finds the record by its
// slower polls of the store.
void RelayServer::ForwardNotice(const std::string& key) {
  ++notices_;
  RelayMessage notice;
  notice.type = RelayMessageType::kNotice;
  notice.key = key;
  const auto parts = EncodeMessage(notice);
  for (auto& [route, c] : children_) SendParts(router_.get(), route, parts).IgnoreError();
}

bool RelayServer::Pump(Child& c) {
  while (!c.queue.empty() && c.inflight < o_.window_bytes) {
    if (o_.link_bytes_per_second > 0 && Clock::now() < c.next_send) return true;  // the link is busy
    if (c.queue.front()->spooled) {
      ObjectPtr back = Unspool(*c.queue.front());
      if (!back) {
        ++LinkOf("child:" + c.id).evicted;
        c.queue.pop_front();
        continue;
      }
      c.queue.front() = std::move(back);  // the spool file goes once no other child needs it
    }
    const ObjectPtr& p = c.queue.front();
    RelayMessage head;
    head.type = RelayMessageType::kObject;
    head.key = p->key;
    head.size = p->data.size();
    head.crc = p->crc;
    const std::string header = EncodeMessage(head)[0];
    if (zmq_send(router_.get(), c.route.data(), c.route.size(), ZMQ_DONTWAIT | ZMQ_SNDMORE) < 0) {
      return zmq_errno() != EHOSTUNREACH;  // EAGAIN: its pipe is full; later
    }
    zmq_send(router_.get(), header.data(), header.size(), ZMQ_SNDMORE);
    zmq_msg_t data;
    auto* ref = new ObjectPtr(p);  // zero copy: the message holds the object
    zmq_msg_init_data(&data, const_cast<char*>(p->data.data()), p->data.size(), FreeObjectRef, ref);
    if (zmq_msg_send(&data, router_.get(), 0) < 0) zmq_msg_close(&data);
    c.inflight += p->data.size();
    if (o_.link_bytes_per_second > 0)
      c.next_send = std::max(Clock::now(), c.next_send) +
                    std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>(p->data.size() / o_.link_bytes_per_second));
    Link& l = LinkOf("child:" + c.id);
    l.bytes_out += p->data.size();
    ++l.objects_out;
    c.queue.pop_front();
  }
  return true;
}

Link& RelayServer::LinkOf(const std::string& name) {
  auto it = links_.find(name);
  if (it != links_.end()) return it->second;
  if (links_.size() >= o_.max_links)
    for (auto old = links_.begin(); old != links_.end(); ++old)
      if (!old->second.attached) {
        links_.erase(old);
        break;
      }
  return links_[name];
}

void RelayServer::Detach(const std::string& route, const std::string& why) {
  auto it = children_.find(route);
  if (it == children_.end()) return;
  LinkOf("child:" + it->second.id).attached = false;
  Log(fmt::format("{} {} detached: {}", RelayRoleName(it->second.role), it->second.id, why));
  children_.erase(it);
}

void RelayServer::Timers() {
  const auto now = Clock::now();
  if (now - last_ping_ >= o_.ping_every) {
    last_ping_ = now;
    RelayMessage ping;
    ping.type = RelayMessageType::kPing;
    const auto parts = EncodeMessage(ping);
    std::vector<std::string> gone;
    for (auto& [route, c] : children_) {
      if (now - c.heard > 2 * o_.dead_after) gone.push_back(route);
      else if (SendParts(router_.get(), route, parts).code() == Code::kNotFound) gone.push_back(route);
    }
    for (const auto& r : gone) Detach(r, "silent");
    for (auto it = senders_.begin(); it != senders_.end();) {
      if (now - it->second.heard > 10 * o_.dead_after) {
        LinkGone("sender:" + it->second.id);
        it = senders_.erase(it);
      } else SendParts(router_.get(), (it++)->first, parts).IgnoreError();
    }
    if (upstream_) SendParts(upstream_.get(), "", parts).IgnoreError();
  }
  // Attached to an ancestor: back to the parent (a restarted relay) once it
  // answers a handshake again.
  if (!o_.upstream.empty() && FirstIsBack(probe_, ctx_.ctx, upstream_index_, o_.upstream[0], o_.security)) {
    links_["upstream:" + o_.upstream[upstream_index_]].attached = false;
    Log(fmt::format("parent {} is back; attaching to it again", o_.upstream[0]));
    upstream_.reset();
    if (Status s = Attach(0); !s.ok()) Log(s.ToString());
  }
  if (upstream_ && now - upstream_heard_ > o_.dead_after) {
    const std::string old = o_.upstream[upstream_index_];
    links_["upstream:" + old].attached = false;
    const size_t next = (upstream_index_ + 1) % o_.upstream.size();
    Log(fmt::format("upstream {} silent for {} ms; attaching to {}", old, o_.dead_after.count(), o_.upstream[next]));
    upstream_.reset();
    if (Status s = Attach(next); !s.ok()) Log(s.ToString());
  }
  if (now - last_stats_ >= std::chrono::seconds(1)) {
    last_stats_ = now;
    ExportMetrics();
    WriteStats();
  }
}

std::string RelayServer::StatsJson() {
  nlohmann::ordered_json doc = {
      {"format", "dcr-relay-stats"},
      {"id", o_.id},
      {"listen", o_.listen},
      {"upstream", upstream_ ? nlohmann::ordered_json(o_.upstream[upstream_index_]) : nullptr},
      {"received", received_},
      {"accepted", accepted_},
      {"accepted_bytes", accepted_bytes_},
      {"duplicates", duplicates_},
      {"dropped_corrupt", corrupt_},
      {"dropped_unverified", unverified_},
      {"dropped_fenced", fenced_drops_},
      {"notices", notices_},
      {"malformed", malformed_},
      {"refused_peers", refused_},
      {"cached_objects", cache_.size()},
      {"cached_bytes", cache_bytes_},
      {"spooled", spooled_},
      {"spooled_bytes", spooled_bytes_},
      {"spool_bytes_in_use", *spool_used_},
      {"unspooled", unspooled_},
      {"spool_full", spool_full_},
      {"acks_in", acks_in_},
      {"ack_messages_in", ack_messages_in_},
      {"acks_out", acks_out_},
      {"ack_messages_out", ack_messages_out_}};
  auto& links = doc["links"] = nlohmann::ordered_json::array();
  for (const auto& [name, l] : links_) {
    const size_t colon = name.find(':');
    links.push_back({{"peer", name.substr(colon + 1)},
                     {"kind", l.role},
                     {"attached", l.attached},
                     {"bytes_in", l.bytes_in},
                     {"objects_in", l.objects_in},
                     {"bytes_out", l.bytes_out},
                     {"objects_out", l.objects_out},
                     {"evicted", l.evicted},
                     {"spooled", l.spooled}});
  }
  return JsonText(doc, 1) + "\n";
}

void RelayServer::WriteStats() {
  if (o_.stats_path.empty()) return;
  if (Status s = WriteFileAtomically(o_.stats_path, StatsJson()); !s.ok()) Log("stats: " + s.ToString());
}

}  // namespace dcr::relay_internal

namespace dcr {

Status RunRelay(const RelayOptions& options, const std::function<bool()>& stop) {
  relay_internal::RelayServer server(options);
  return server.Run(stop);
}

}  // namespace dcr
