// The relay's clients: a follower's attachment (RelayReceiver) and a
// publisher's push into the roots (RelaySender).
#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <iostream>
#include <mutex>
#include <thread>
#include <utility>

#include "dcr/hash.h"
#include "zmq_io.h"

namespace dcr {

using namespace relay_internal;
using Clock = std::chrono::steady_clock;

namespace {

void DefaultLog(const std::string& who, const std::string& line) {
  std::cerr << "dcr relay client [" << who << "] " << line << std::endl;
}

RelayMessage Credit(uint64_t bytes) {
  RelayMessage c;
  c.type = RelayMessageType::kCredit;
  c.credit_bytes = bytes;
  c.credit_objects = 1;
  return c;
}

Status CheckClientOptions(const RelayClientOptions& o, std::string_view what) {
  if (o.id.empty()) return InvalidArgument(fmt::format("{}: an id is needed", what));
  if (o.addresses.empty()) return InvalidArgument(fmt::format("{}: no relay address (tcp://HOST:PORT)", what));
  if (o.security.enabled() && o.security.server_public.empty())
    return InvalidArgument(fmt::format("{}: CURVE keys given but not the relays' public key", what));
  if (!o.security.enabled()) {
    const std::string line = fmt::format("{} [{}]: {}", what, o.id, kRelayInsecureWarning);
    if (o.log) o.log(line);
    else std::cerr << "dcr " << line << std::endl;
  }
  return Status::Ok();
}

}  // namespace

// ---- RelayReceiver --------------------------------------------------------------

struct RelayReceiver::State {
  RelayClientOptions o;
  Context ctx;
  std::mutex mu;
  std::map<std::string, std::string> ready;  // verified, not yet taken
  std::deque<std::string> ready_order;  // arrival order, to evict the oldest beyond max_queue_bytes
  uint64_t ready_bytes = 0;
  std::set<std::string> have;  // every key received (HELLO on re-attach)
  std::deque<std::string> have_order;
  std::set<std::string> fenced;
  std::vector<std::pair<std::string, AckRecord>> acks_pending;  // queued by Ack, sent by the thread
  std::deque<std::pair<std::string, AckRecord>> acks_sent;  // the last 16: sent again on re-attachment
  // Ack wakes the thread through this pipe (written under mu), so that an ack
  // leaves at once rather than after the thread's poll timeout.
  Socket wake_tx, wake_rx;
  RelayClientStats stats;
  Clock::time_point last_delivery{}, heard{};
  // What arrived (objects kept, fences, notices), for AwaitNews; notices and fences, for Notices.
  uint64_t news = 0, notices = 0;
  std::condition_variable news_cv;
  bool attached = false;
  bool newly_attached = false;  // heard from the relay since (re)connecting: Loop logs it once
  std::atomic<bool> stop{false};
  std::thread thread;

  void Log(const std::string& line) {
    if (o.log) o.log(line);
    else DefaultLog(o.id, line);
  }
  Result<Socket> Connect(size_t index);
  void Loop();
  void OnMessage(void* sock, std::vector<std::string> parts);
  void SendAcks(void* sock, const std::vector<std::pair<std::string, AckRecord>>& acks);
};

void RelayReceiver::State::SendAcks(void* sock, const std::vector<std::pair<std::string, AckRecord>>& acks) {
  for (const auto& [prefix, ack] : acks) {
    RelayMessage m;
    m.type = RelayMessageType::kAck;
    m.key = prefix;
    m.acks = {ack};
    SendParts(sock, "", EncodeMessage(m)).IgnoreError();  // queued until connected
  }
  std::lock_guard lock(mu);
  stats.acks += acks.size();
}

Result<Socket> RelayReceiver::State::Connect(size_t index) {
  DCR_ASSIGN_OR_RETURN(Socket s, OpenSocket(ctx.ctx, ZMQ_DEALER));
  DCR_RETURN_IF_ERROR(ConfigureCurveClient(s.get(), o.security));
  if (zmq_connect(s.get(), o.addresses[index].c_str()) != 0)
    return InvalidArgument(ZmqError("cannot connect to relay " + o.addresses[index]));
  RelayMessage hello;
  hello.type = RelayMessageType::kHello;
  hello.role = RelayRole::kReceiver;
  hello.id = o.id;
  {
    std::lock_guard lock(mu);
    for (auto it = have_order.rbegin(); it != have_order.rend() && hello.have.size() < kRelayMaxHave; ++it)
      hello.have.push_back(*it);
    stats.attached = o.addresses[index];
    attached = false;
  }
  SendParts(s.get(), "", EncodeMessage(hello)).IgnoreError();
  std::vector<std::pair<std::string, AckRecord>> again;
  {
    std::lock_guard lock(mu);
    again.assign(acks_sent.begin(), acks_sent.end());
  }
  SendAcks(s.get(), again);
  return s;
}

void RelayReceiver::State::OnMessage(void* sock, std::vector<std::string> parts) {
  std::vector<std::string_view> views(parts.begin(), parts.end());
  auto m = DecodeMessage(views);
  if (!m.ok()) {
    Log("ignored a malformed message from the relay: " + m.status().ToString());
    return;
  }
  std::lock_guard lock(mu);
  heard = Clock::now();
  if (!attached) newly_attached = true;
  attached = true;
  if (m->type == RelayMessageType::kNotice) {
    ++notices;
    ++news;
    news_cv.notify_all();
    return;
  }
  if (m->type == RelayMessageType::kFence) {
    ++notices;  // as a notice: the follower looks at the store
    ++news;
    news_cv.notify_all();
    fenced.insert(m->key);
    std::erase_if(ready, [&](const auto& kv) {
      if (!kv.first.starts_with(m->key)) return false;
      ready_bytes -= kv.second.size();
      return true;
    });
    return;
  }
  if (m->type != RelayMessageType::kObject) return;
  SendParts(sock, "", EncodeMessage(Credit(m->size))).IgnoreError();
  if (Status s = VerifyFrameObject(*m); !s.ok()) {
    ++stats.corrupt;
    Log(s.message());
    return;
  }
  auto prefix = FrameObjectPrefix(m->key);
  if (!prefix.ok() || fenced.count(*prefix)) {
    ++stats.fenced;
    return;
  }
  if (have.count(m->key)) {
    ++stats.duplicates;
    return;
  }
  have.insert(m->key);
  have_order.push_back(m->key);
  if (have_order.size() > kRelayMaxHave) {
    have.erase(have_order.front());
    have_order.pop_front();
  }
  ++stats.objects;
  stats.bytes += m->size;
  last_delivery = Clock::now();
  ++news;
  news_cv.notify_all();
  ready.emplace(m->key, std::string(m->data));
  ready_order.push_back(m->key);
  ready_bytes += m->size;
  // Objects nobody takes (a follower that applied from the store, a lost
  // FENCE) must not pile up: the oldest go first.
  while (ready_bytes > o.max_queue_bytes && !ready_order.empty()) {
    auto it = ready.find(ready_order.front());
    ready_order.pop_front();
    if (it == ready.end()) continue;
    ready_bytes -= it->second.size();
    ready.erase(it);
    ++stats.dropped;
  }
}

void RelayReceiver::State::Loop() {
  size_t index = 0;
  auto sock = Connect(index);
  if (!sock.ok()) Log(sock.status().ToString());
  auto since = Clock::now(), last_ping = Clock::now();
  std::unique_ptr<Probe> probe;
  while (!stop.load()) {
    zmq_pollitem_t items[2] = {{wake_rx.get(), 0, ZMQ_POLLIN, 0},
                               {sock.ok() ? sock->get() : nullptr, 0, ZMQ_POLLIN, 0}};
    zmq_poll(items, sock.ok() ? 2 : 1, 10);
    for (int i = 0; i < 256 && (items[0].revents & ZMQ_POLLIN); ++i) {  // drain the wake pipe
      auto w = RecvParts(wake_rx.get());
      if (!w.ok() || w->empty()) break;
    }
    for (int i = 0; sock.ok() && i < 256 && (items[1].revents & ZMQ_POLLIN); ++i) {
      auto parts = RecvParts(sock->get(), kRelayMaxParts);
      if (!parts.ok() || parts->empty()) break;
      OnMessage(sock->get(), std::move(*parts));
    }
    std::vector<std::pair<std::string, AckRecord>> acks;
    bool announce = false;
    {
      std::lock_guard lock(mu);
      announce = std::exchange(newly_attached, false);
      acks.swap(acks_pending);
      for (const auto& a : acks) {
        acks_sent.push_back(a);
        if (acks_sent.size() > 16) acks_sent.pop_front();
      }
    }
    // What tests and people wait for: from here on, objects come from the relay.
    if (announce) Log(fmt::format("attached to relay {} (heard from it)", o.addresses[index]));
    if (sock.ok() && !acks.empty()) SendAcks(sock->get(), acks);
    const auto now = Clock::now();
    if (sock.ok() && now - last_ping >= o.ping_every) {
      last_ping = now;
      RelayMessage ping;
      ping.type = RelayMessageType::kPing;
      SendParts(sock->get(), "", EncodeMessage(ping)).IgnoreError();
    }
    // Attached past the first address: back to it (a restarted relay) once
    // it answers a handshake again.
    if (FirstIsBack(probe, ctx.ctx, index, o.addresses[0], o.security)) {
      Log(fmt::format("relay {} is back; attaching to it again", o.addresses[0]));
      {
        std::lock_guard lock(mu);
        attached = false;  // until it is heard from
      }
      index = 0;
      sock = Socket();
      sock = Connect(index);
      if (!sock.ok()) Log(sock.status().ToString());
      since = Clock::now();
      continue;
    }
    Clock::time_point heard_at;
    {
      std::lock_guard lock(mu);
      heard_at = std::max(heard, since);
    }
    if (now - heard_at > o.dead_after) {
      const size_t next = (index + 1) % o.addresses.size();
      Log(fmt::format("relay {} silent for {} ms; attaching to {} (the store serves what no relay delivers)",
                      o.addresses[index], o.dead_after.count(), o.addresses[next]));
      {
        std::lock_guard lock(mu);
        attached = false;
        ++stats.reattached;
      }
      index = next;
      sock = Socket();  // close before reconnecting
      sock = Connect(index);
      if (!sock.ok()) Log(sock.status().ToString());
      since = Clock::now();
    }
  }
}

RelayReceiver::RelayReceiver(std::unique_ptr<State> state) : state_(std::move(state)) {}

Result<std::unique_ptr<RelayReceiver>> RelayReceiver::Start(RelayClientOptions options) {
  DCR_RETURN_IF_ERROR(CheckClientOptions(options, "relay receiver"));
  auto state = std::make_unique<State>();
  state->o = std::move(options);
  const std::string wake = fmt::format("inproc://dcr-relay-receiver-wake-{}", static_cast<const void*>(state.get()));
  DCR_ASSIGN_OR_RETURN(state->wake_rx, OpenSocket(state->ctx.ctx, ZMQ_PAIR));
  DCR_ASSIGN_OR_RETURN(state->wake_tx, OpenSocket(state->ctx.ctx, ZMQ_PAIR));
  if (zmq_bind(state->wake_rx.get(), wake.c_str()) != 0 || zmq_connect(state->wake_tx.get(), wake.c_str()) != 0)
    return Internal(ZmqError("relay receiver: wake pipe"));
  State* raw = state.get();
  std::unique_ptr<RelayReceiver> r(new RelayReceiver(std::move(state)));
  raw->thread = std::thread([raw] { raw->Loop(); });
  return r;
}

RelayReceiver::~RelayReceiver() {
  state_->stop = true;
  if (state_->thread.joinable()) state_->thread.join();
}

std::map<std::string, std::string> RelayReceiver::Take(std::string_view prefix) {
  std::lock_guard lock(state_->mu);
  std::map<std::string, std::string> out;
  for (auto it = state_->ready.lower_bound(std::string(prefix));
       it != state_->ready.end() && it->first.starts_with(prefix);) {
    state_->ready_bytes -= it->second.size();
    out.insert(state_->ready.extract(it++));
  }
  return out;
}

bool RelayReceiver::Attached() {
  std::lock_guard lock(state_->mu);
  return state_->attached && Clock::now() - state_->heard < state_->o.dead_after;
}

Clock::time_point RelayReceiver::LastDelivery() {
  std::lock_guard lock(state_->mu);
  return state_->last_delivery;
}

void RelayReceiver::Ack(const std::string& attempt_prefix, const AckRecord& ack) {
  std::lock_guard lock(state_->mu);
  state_->acks_pending.emplace_back(attempt_prefix, ack);
  SendParts(state_->wake_tx.get(), "", {std::string(1, '\0')}).IgnoreError();
}

uint64_t RelayReceiver::Notices() {
  std::lock_guard lock(state_->mu);
  return state_->notices;
}

uint64_t RelayReceiver::AwaitNews(uint64_t seen, std::chrono::milliseconds wait) {
  std::unique_lock lock(state_->mu);
  state_->news_cv.wait_for(lock, wait, [&] { return state_->news != seen || state_->stop.load(); });
  return state_->news;
}

RelayClientStats RelayReceiver::Stats() {
  std::lock_guard lock(state_->mu);
  return state_->stats;
}

// ---- RelaySender ------------------------------------------------------------------

namespace {

struct Item {
  RelayMessageType type = RelayMessageType::kObject;  // or kFence, kNotice (a key, no data)
  std::string key;
  std::shared_ptr<const std::string> data;
  uint32_t crc = 0;
};

struct Root {
  std::string address;
  Socket sock;
  std::deque<Item> queue;
  uint64_t queued_bytes = 0, inflight = 0;
  Clock::time_point heard;
  bool warned = false;
  bool hello_sent = false;  // sent once the connection is up (ZMQ_IMMEDIATE)
  Clock::time_point next_send{};  // pacing (link_bytes_per_second)
};

}  // namespace

struct RelaySender::State {
  RelayClientOptions o;
  Context ctx;
  std::mutex mu;
  std::condition_variable idle, acked;
  std::vector<Root> roots;
  // Acks from the roots by attempt prefix: not taken yet, and the receivers
  // already handed out (a re-sent ack is not handed out twice); the last 64 attempts.
  std::map<std::string, std::map<std::string, AckRecord>> acks;
  std::map<std::string, std::set<std::string>> acks_taken;
  std::deque<std::string> ack_order;
  RelayClientStats stats;
  std::atomic<bool> stop{false};
  std::thread thread;

  void Log(const std::string& line) {
    if (o.log) o.log(line);
    else DefaultLog(o.id, line);
  }
  void Loop();
  // Loop's steps, under mu: one root's messages taken (credits, acks), and
  // its queue sent within the window.
  void Take(Root& r, bool readable, Clock::time_point now);
  void Send(Root& r);
  bool Empty() {
    for (const auto& r : roots)
      if (!r.queue.empty() || r.inflight) return false;
    return true;
  }
};

void RelaySender::State::Take(Root& r, bool readable, Clock::time_point now) {
  for (int n = 0; n < 256 && readable; ++n) {
    auto parts = RecvParts(r.sock.get(), kRelayMaxParts);
    if (!parts.ok() || parts->empty()) break;
    std::vector<std::string_view> views(parts->begin(), parts->end());
    auto m = DecodeMessage(views);
    if (!m.ok()) continue;
    r.heard = now;
    if (m->type == RelayMessageType::kCredit) {
      r.inflight -= std::min(r.inflight, m->credit_bytes);
      ++stats.objects;
      stats.bytes += m->credit_bytes;
    } else if (m->type == RelayMessageType::kAck) {
      if (!acks_taken.count(m->key)) {
        ack_order.push_back(m->key);
        acks_taken[m->key];
        if (ack_order.size() > 64) {
          acks.erase(ack_order.front());
          acks_taken.erase(ack_order.front());
          ack_order.pop_front();
        }
      }
      const auto& taken = acks_taken[m->key];
      for (auto& a : m->acks) {
        if (taken.count(a.receiver)) continue;
        ++stats.acks;
        acks[m->key].insert_or_assign(a.receiver, std::move(a));
      }
      acked.notify_all();
    }
  }
}

void RelaySender::State::Send(Root& r) {
  while (!r.queue.empty() && r.inflight < o.window_bytes) {
    if (o.link_bytes_per_second > 0 && Clock::now() < r.next_send) break;  // the link is busy
    Item& it = r.queue.front();
    RelayMessage m;
    m.type = it.type;
    m.key = it.key;
    if (it.data) {
      m.size = it.data->size();
      m.crc = it.crc;
      m.data = *it.data;
    }
    if (!SendParts(r.sock.get(), "", EncodeMessage(m)).ok()) break;  // full: later
    if (it.data) {
      r.inflight += it.data->size();
      r.queued_bytes -= it.data->size();
      if (o.link_bytes_per_second > 0)
        r.next_send = std::max(Clock::now(), r.next_send) +
                      std::chrono::duration_cast<Clock::duration>(
                          std::chrono::duration<double>(it.data->size() / o.link_bytes_per_second));
    }
    r.queue.pop_front();
  }
}

void RelaySender::State::Loop() {
  auto last_ping = Clock::now();
  while (!stop.load()) {
    std::vector<zmq_pollitem_t> items;
    for (auto& r : roots) items.push_back({r.sock.get(), 0, ZMQ_POLLIN, 0});
    zmq_poll(items.data(), static_cast<int>(items.size()), 5);
    std::lock_guard lock(mu);
    const auto now = Clock::now();
    for (size_t i = 0; i < roots.size(); ++i) {
      Root& r = roots[i];
      Take(r, items[i].revents & ZMQ_POLLIN, now);
      if (r.inflight && now - r.heard > o.dead_after) {
        Log(fmt::format("root {} silent for {} ms: {} bytes written off (its receivers fetch them from the store)",
                        r.address, o.dead_after.count(), r.inflight));
        r.inflight = 0;
        r.heard = now;
      }
      if (!r.hello_sent) {
        RelayMessage hello;
        hello.type = RelayMessageType::kHello;
        hello.role = RelayRole::kSender;
        hello.id = o.id;
        r.hello_sent = SendParts(r.sock.get(), "", EncodeMessage(hello)).ok();
        if (!r.hello_sent) continue;  // not connected yet
        r.heard = now;
      }
      Send(r);
      if (now - last_ping >= o.ping_every) {
        // A sender's ping is its HELLO again: a root that restarted takes
        // objects and fences only from peers that said HELLO as senders.
        RelayMessage ping;
        ping.type = RelayMessageType::kHello;
        ping.role = RelayRole::kSender;
        ping.id = o.id;
        SendParts(r.sock.get(), "", EncodeMessage(ping)).IgnoreError();
      }
    }
    if (now - last_ping >= o.ping_every) last_ping = now;
    if (Empty()) idle.notify_all();
  }
}

RelaySender::RelaySender(std::unique_ptr<State> state) : state_(std::move(state)) {}

Result<std::unique_ptr<RelaySender>> RelaySender::Start(RelayClientOptions options) {
  DCR_RETURN_IF_ERROR(CheckClientOptions(options, "relay sender"));
  auto state = std::make_unique<State>();
  state->o = std::move(options);
  for (const auto& address : state->o.addresses) {
    Root r;
    r.address = address;
    DCR_ASSIGN_OR_RETURN(r.sock, OpenSocket(state->ctx.ctx, ZMQ_DEALER));
    // Queue only to a live connection and only a few messages in ZeroMQ: the
    // bounded queue above is where objects wait for a slow or absent root.
    const int one = 1, hwm = 64;
    zmq_setsockopt(r.sock.get(), ZMQ_IMMEDIATE, &one, sizeof one);
    zmq_setsockopt(r.sock.get(), ZMQ_SNDHWM, &hwm, sizeof hwm);
    DCR_RETURN_IF_ERROR(ConfigureCurveClient(r.sock.get(), state->o.security));
    if (zmq_connect(r.sock.get(), address.c_str()) != 0)
      return InvalidArgument(ZmqError("cannot connect to relay " + address));
    r.heard = Clock::now();
    state->roots.push_back(std::move(r));
  }
  State* raw = state.get();
  std::unique_ptr<RelaySender> s(new RelaySender(std::move(state)));
  raw->thread = std::thread([raw] { raw->Loop(); });
  return s;
}

RelaySender::~RelaySender() {
  Flush(std::chrono::milliseconds(2000));
  state_->stop = true;
  if (state_->thread.joinable()) state_->thread.join();
}

void RelaySender::Object(const std::string& key, std::string_view bytes) {
  Item it;
  it.key = key;
  it.data = std::make_shared<const std::string>(bytes);
  it.crc = Crc32c(bytes.data(), bytes.size());
  std::lock_guard lock(state_->mu);
  for (Root& r : state_->roots) {
    while (!r.queue.empty() && r.queued_bytes + bytes.size() > state_->o.max_queue_bytes) {
      if (r.queue.front().data) r.queued_bytes -= r.queue.front().data->size();
      r.queue.pop_front();
      ++state_->stats.dropped;
      if (!r.warned)
        state_->Log(
            fmt::format("root {} is too slow: dropping its oldest queued objects (its receivers fetch them "
                        "from the store)",
                        r.address));
      r.warned = true;
    }
    r.queue.push_back(it);
    r.queued_bytes += bytes.size();
  }
}

void RelaySender::Fence(const std::string& attempt_prefix) {
  Item it;
  it.type = RelayMessageType::kFence;
  it.key = attempt_prefix;
  std::lock_guard lock(state_->mu);
  for (Root& r : state_->roots) {
    std::erase_if(r.queue, [&](const Item& q) {
      if (!q.data || !q.key.starts_with(attempt_prefix)) return false;
      r.queued_bytes -= q.data->size();
      return true;
    });
    r.queue.push_back(it);
  }
}

void RelaySender::Notice(const std::string& key) {
  Item it;
  it.type = RelayMessageType::kNotice;
  it.key = key;
  std::lock_guard lock(state_->mu);
  for (Root& r : state_->roots) r.queue.push_back(it);
}

bool RelaySender::Flush(std::chrono::milliseconds timeout) {
  std::unique_lock lock(state_->mu);
  return state_->idle.wait_for(lock, timeout, [&] { return state_->Empty(); });
}

std::vector<AckRecord> RelaySender::TakeAcks(const std::string& attempt_prefix, std::chrono::milliseconds wait) {
  std::unique_lock lock(state_->mu);
  auto ready = [&] {
    auto it = state_->acks.find(attempt_prefix);
    return it != state_->acks.end() && !it->second.empty();
  };
  if (!ready() && wait.count() > 0) state_->acked.wait_for(lock, wait, ready);
  std::vector<AckRecord> out;
  auto it = state_->acks.find(attempt_prefix);
  if (it == state_->acks.end()) return out;
  for (auto& [receiver, ack] : it->second) {
    state_->acks_taken[attempt_prefix].insert(receiver);
    out.push_back(std::move(ack));
  }
  it->second.clear();
  return out;
}

RelayClientStats RelaySender::Stats() {
  std::lock_guard lock(state_->mu);
  return state_->stats;
}

}  // namespace dcr
