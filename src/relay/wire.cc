// The relay's wire messages (docs/relay.md) and the checks every hop makes.
#include <fmt/format.h>

#include <cstring>
#include <set>

#include "dcr/frame.h"
#include "dcr/hash.h"
#include "dcr/relay.h"
#include "dcr/run_keys.h"
#include "dcr/text.h"

namespace dcr {

namespace {

constexpr size_t kHeaderBytes = 8;  // magic u32, version u8, type u8, reserved u16

// A peer's or receiver's id as it may appear in logs, stats and records:
// not empty, UTF-8, no control bytes.
bool IsPeerId(std::string_view id) {
  for (unsigned char c : id)
    if (c < 0x20 || c == 0x7f) return false;
  return !id.empty() && IsValidUtf8(id);
}

void PutU16(std::string& out, uint16_t v) { out.append(reinterpret_cast<const char*>(&v), 2); }
void PutU32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void PutU64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
void PutStr(std::string& out, std::string_view s) {
  PutU16(out, static_cast<uint16_t>(s.size()));
  out.append(s);
}

// A bounds-checked little-endian reader over one part.
class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  template <typename T>
  bool Get(T* v) {
    if (b_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetStr(std::string* s, size_t max) {
    uint16_t n = 0;
    if (!Get(&n) || n > max || b_.size() - pos_ < n) return false;
    s->assign(b_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == b_.size(); }

 private:
  std::string_view b_;
  size_t pos_ = 0;
};

bool Digits(std::string_view s, size_t min, size_t max) {
  if (s.size() < min || s.size() > max) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

bool Hex(std::string_view s) {
  if (s.empty() || s.size() > 32) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// "attempts/v<10>/<seq>-<hex>/": the length of that prefix of `key`, or 0.
size_t AttemptPrefixLength(std::string_view key) {
  constexpr std::string_view kStart = "attempts/v";
  if (!key.starts_with(kStart)) return 0;
  size_t pos = kStart.size();
  if (key.size() < pos + 11 || !Digits(key.substr(pos, 10), 10, 10) || key[pos + 10] != '/') return 0;
  pos += 11;
  const size_t slash = key.find('/', pos);
  if (slash == std::string_view::npos) return 0;
  const std::string_view attempt = key.substr(pos, slash - pos);
  const size_t dash = attempt.find('-');
  if (dash == std::string_view::npos || !Digits(attempt.substr(0, dash), 4, 10) || !Hex(attempt.substr(dash + 1)))
    return 0;
  return slash + 1;
}

}  // namespace

std::string_view RelayRoleName(RelayRole role) {
  switch (role) {
    case RelayRole::kRelay: return "relay";
    case RelayRole::kReceiver: return "receiver";
    case RelayRole::kSender: return "sender";
  }
  return "unknown";
}

Status ValidateAttemptPrefix(std::string_view prefix) {
  if (AttemptPrefixLength(prefix) != prefix.size() || prefix.empty())
    return InvalidArgument(
        fmt::format("'{}' is not an attempt prefix (attempts/v<10 digits>/<seq>-<hex>/)", prefix.substr(0, 200)));
  return Status::Ok();
}

Status ValidateNoticeKey(std::string_view key) {
  constexpr std::string_view kCommits = "commits/v";
  if (key.starts_with(kCommits) && key.size() == kCommits.size() + 15 &&
      Digits(key.substr(kCommits.size(), 10), 10, 10) && key.ends_with(".json"))
    return Status::Ok();
  if (ValidateAttemptPrefix(key).ok()) return Status::Ok();
  return InvalidArgument(
      fmt::format("'{}' is not an attempt prefix (attempts/v<10 digits>/<seq>-<hex>/) or a commit record (commits/v<10 "
                  "digits>.json)",
                  key.substr(0, 200)));
}

Result<std::string> FrameObjectPrefix(std::string_view key) {
  const size_t n = AttemptPrefixLength(key);
  const auto bad = [&] {
    return InvalidArgument(fmt::format(
        "'{}' is not a frame object key (attempts/v<10 digits>/<seq>-<hex>/frames/s<K>-<NNNN>[-t<T>c<C>].bin); a "
        "relay carries nothing else",
        key.substr(0, 200)));
  };
  if (n == 0 || key.size() > kRelayMaxKeyBytes || !run_keys::ParseFrameObject(key.substr(n))) return bad();
  return std::string(key.substr(0, n));
}

std::vector<std::string> EncodeMessage(const RelayMessage& m) {
  std::string h;
  PutU32(h, kRelayMagic);
  h.push_back(static_cast<char>(kRelayWireVersion));
  h.push_back(static_cast<char>(m.type));
  PutU16(h, 0);
  switch (m.type) {
    case RelayMessageType::kHello:
      h.push_back(static_cast<char>(m.role));
      PutStr(h, m.id);
      PutU32(h, static_cast<uint32_t>(m.have.size()));
      for (const auto& k : m.have) PutStr(h, k);
      break;
    case RelayMessageType::kObject:
      PutStr(h, m.key);
      PutU64(h, m.size);
      PutU32(h, m.crc);
      return {std::move(h), std::string(m.data)};
    case RelayMessageType::kCredit:
      PutU64(h, m.credit_bytes);
      PutU32(h, m.credit_objects);
      break;
    case RelayMessageType::kFence:
    case RelayMessageType::kNotice: PutStr(h, m.key); break;
    case RelayMessageType::kPing: break;
    case RelayMessageType::kAck:
      PutStr(h, m.key);
      PutU32(h, static_cast<uint32_t>(m.acks.size()));
      for (const auto& a : m.acks) {
        PutStr(h, a.receiver);
        h.push_back(a.ok ? 1 : 0);
        PutU64(h, a.digest.lane[0]);
        PutU64(h, a.digest.lane[1]);
        PutStr(h, std::string_view(a.error).substr(0, kRelayMaxAckErrorBytes));
      }
      break;
  }
  return {std::move(h)};
}

namespace {

// A HELLO's body: role, id, the objects the peer holds.
Status DecodeHello(Reader& r, RelayMessage& m) {
  uint8_t role = 0;
  uint32_t count = 0;
  if (!r.Get(&role) || role < 1 || role > 3) return InvalidArgument("relay HELLO: bad role");
  m.role = static_cast<RelayRole>(role);
  if (!r.GetStr(&m.id, kRelayMaxIdBytes) || !IsPeerId(m.id))
    return InvalidArgument("relay HELLO: bad id (it must be UTF-8 without control bytes)");
  if (!r.Get(&count) || count > kRelayMaxHave) return InvalidArgument("relay HELLO: bad have count");
  m.have.reserve(std::min<uint32_t>(count, 1024));
  for (uint32_t i = 0; i < count; ++i) {
    std::string k;
    if (!r.GetStr(&k, kRelayMaxKeyBytes)) return InvalidArgument(fmt::format("relay HELLO: truncated key {}", i));
    DCR_RETURN_IF_ERROR(FrameObjectPrefix(k).status().WithContext("relay HELLO from " + m.id));
    m.have.push_back(std::move(k));
  }
  return Status::Ok();
}

// An ACK's body: the attempt and its receivers' acks, each once.
Status DecodeAcks(Reader& r, RelayMessage& m) {
  uint32_t count = 0;
  if (!r.GetStr(&m.key, kRelayMaxKeyBytes)) return InvalidArgument("relay ACK: truncated attempt prefix");
  DCR_RETURN_IF_ERROR(ValidateAttemptPrefix(m.key).WithContext("relay ACK"));
  if (!r.Get(&count) || count > kRelayMaxAcks) return InvalidArgument("relay ACK: bad count");
  m.acks.reserve(std::min<uint32_t>(count, 1024));
  std::set<std::string> seen;
  for (uint32_t i = 0; i < count; ++i) {
    AckRecord a;
    uint8_t ok = 0;
    if (!r.GetStr(&a.receiver, kRelayMaxIdBytes) || !IsPeerId(a.receiver) || !r.Get(&ok) || ok > 1 ||
        !r.Get(&a.digest.lane[0]) || !r.Get(&a.digest.lane[1]) || !r.GetStr(&a.error, kRelayMaxAckErrorBytes))
      return InvalidArgument(fmt::format("relay ACK: truncated or bad entry {}", i));
    if (a.digest.lane[0] >= kDigestPrime || a.digest.lane[1] >= kDigestPrime)
      return InvalidArgument(fmt::format("relay ACK: entry {} ({}): digest lane not below the prime", i, a.receiver));
    if (!seen.insert(a.receiver).second)
      return InvalidArgument(fmt::format("relay ACK: receiver {} twice", a.receiver));
    a.ok = ok == 1;
    m.acks.push_back(std::move(a));
  }
  return Status::Ok();
}

}  // namespace

Result<RelayMessage> DecodeMessage(std::span<const std::string_view> parts) {
  if (parts.empty()) return InvalidArgument("relay message: no parts");
  const std::string_view head = parts[0];
  if (head.size() < kHeaderBytes) return InvalidArgument("relay message: header shorter than 8 bytes");
  Reader r(head);
  uint32_t magic = 0;
  uint8_t version = 0, type = 0;
  uint16_t reserved = 0;
  r.Get(&magic);
  r.Get(&version);
  r.Get(&type);
  r.Get(&reserved);
  if (magic != kRelayMagic) return InvalidArgument(fmt::format("relay message: bad magic {:#010x}", magic));
  if (version != kRelayWireVersion)
    return Unimplemented(fmt::format("relay message: wire version {} (this dcr speaks {}); upgrade the older side",
                                     version, kRelayWireVersion));
  if (reserved != 0) return InvalidArgument("relay message: reserved bytes are not zero");
  RelayMessage m;
  m.type = static_cast<RelayMessageType>(type);
  const size_t want_parts = m.type == RelayMessageType::kObject ? 2 : 1;
  if (parts.size() != want_parts)
    return InvalidArgument(fmt::format("relay message type {}: {} parts, expected {}", type, parts.size(), want_parts));
  switch (m.type) {
    case RelayMessageType::kHello: {
      DCR_RETURN_IF_ERROR(DecodeHello(r, m));
      break;
    }
    case RelayMessageType::kObject:
      if (!r.GetStr(&m.key, kRelayMaxKeyBytes) || !r.Get(&m.size) || !r.Get(&m.crc))
        return InvalidArgument("relay OBJECT: truncated header");
      DCR_RETURN_IF_ERROR(FrameObjectPrefix(m.key).status().WithContext("relay OBJECT"));
      if (m.size > kRelayMaxObjectBytes)
        return InvalidArgument(fmt::format("relay OBJECT {}: {} bytes is over the limit", m.key, m.size));
      if (parts[1].size() != m.size)
        return InvalidArgument(
            fmt::format("relay OBJECT {}: {} bytes of data, the header says {}", m.key, parts[1].size(), m.size));
      m.data = parts[1];
      break;
    case RelayMessageType::kCredit:
      if (!r.Get(&m.credit_bytes) || !r.Get(&m.credit_objects)) return InvalidArgument("relay CREDIT: truncated");
      break;
    case RelayMessageType::kFence:
      if (!r.GetStr(&m.key, kRelayMaxKeyBytes)) return InvalidArgument("relay FENCE: truncated");
      DCR_RETURN_IF_ERROR(ValidateAttemptPrefix(m.key).WithContext("relay FENCE"));
      break;
    case RelayMessageType::kNotice:
      if (!r.GetStr(&m.key, kRelayMaxKeyBytes)) return InvalidArgument("relay NOTICE: truncated");
      DCR_RETURN_IF_ERROR(ValidateNoticeKey(m.key).WithContext("relay NOTICE"));
      break;
    case RelayMessageType::kPing: break;
    case RelayMessageType::kAck: {
      DCR_RETURN_IF_ERROR(DecodeAcks(r, m));
      break;
    }
    default: return InvalidArgument(fmt::format("relay message: unknown type {}", type));
  }
  if (!r.done()) return InvalidArgument(fmt::format("relay message type {}: trailing bytes", type));
  return m;
}

Status VerifyFrameObject(const RelayMessage& object) {
  const std::string_view d = object.data;
  if (d.size() != object.size)
    return DataLoss(fmt::format("frame object {}: {} bytes, the sender sent {}", object.key, d.size(), object.size));
  if (const uint32_t crc = Crc32c(d.data(), d.size()); crc != object.crc)
    return DataLoss(
        fmt::format("frame object {}: CRC32C {:08x}, the sender computed {:08x}: damaged on the way; "
                    "dropped (receivers fetch it from the store)",
                    object.key, crc, object.crc));
  // Frames, then the publisher's signature trailer: only receivers hold
  // the key that checks it (the store's record of the attempt).
  const std::string_view frames = ObjectFrames(d);
  if (frames.empty()) return DataLoss(fmt::format("frame object {}: no frames", object.key));
  const auto* p = reinterpret_cast<const uint8_t*>(frames.data());
  size_t off = 0;
  while (off < frames.size()) {
    size_t consumed = 0;
    auto f = ParseFrame(std::span<const uint8_t>(p + off, frames.size() - off), &consumed);
    if (!f.ok())
      return DataLoss(
          fmt::format("frame object {}: the frame at offset {} fails its checks ({}); dropped (receivers "
                      "fetch it from the store)",
                      object.key, off, f.status().message()));
    off += consumed;
  }
  return Status::Ok();
}

}  // namespace dcr
