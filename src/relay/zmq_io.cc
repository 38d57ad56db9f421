// libzmq with errors as values, CurveZMQ keys and the ZAP handler.
#include "zmq_io.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "dcr/mapped_file.h"

namespace dcr {
namespace relay_internal {

std::string ZmqError(std::string_view what) { return fmt::format("{}: {}", what, zmq_strerror(zmq_errno())); }

Result<Socket> OpenSocket(void* ctx, int type) {
  Socket s(zmq_socket(ctx, type));
  if (!s) return Internal(ZmqError("cannot create a ZeroMQ socket"));
  const int zero = 0, hwm = 100000;
  const int64_t max_part = static_cast<int64_t>(kRelayMaxPartBytes);
  zmq_setsockopt(s.get(), ZMQ_MAXMSGSIZE, &max_part, sizeof max_part);
  zmq_setsockopt(s.get(), ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(s.get(), ZMQ_SNDHWM, &hwm, sizeof hwm);
  zmq_setsockopt(s.get(), ZMQ_RCVHWM, &hwm, sizeof hwm);
  return s;
}

Status ConfigureCurveClient(void* socket, const RelaySecurity& sec) {
  if (!sec.enabled()) return Status::Ok();
  if (sec.server_public.size() != 40)
    return InvalidArgument("CURVE: the relay's public key is missing (pass the relays' .pub file)");
  if (zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, sec.server_public.c_str(), 41) != 0 ||
      zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, sec.own->public_key.c_str(), 41) != 0 ||
      zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, sec.own->secret_key.c_str(), 41) != 0)
    return InvalidArgument(ZmqError("CURVE: a key is not a valid Z85 key (regenerate with dcr relay keygen)"));
  return Status::Ok();
}

Status ConfigureCurveServer(void* socket, const RelaySecurity& sec) {
  if (!sec.enabled()) return Status::Ok();
  const int one = 1;
  if (zmq_setsockopt(socket, ZMQ_CURVE_SERVER, &one, sizeof one) != 0 ||
      zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, sec.own->secret_key.c_str(), 41) != 0 ||
      zmq_setsockopt(socket, ZMQ_ZAP_DOMAIN, "dcr", 3) != 0)
    return InvalidArgument(
        ZmqError("CURVE: the relay's secret key is not a valid Z85 key (regenerate with dcr relay keygen)"));
  return Status::Ok();
}

Status SendParts(void* socket, std::string_view route, const std::vector<std::string>& parts) {
  std::vector<std::string_view> all;
  if (!route.empty()) all.push_back(route);
  for (const auto& p : parts) all.push_back(p);
  for (size_t i = 0; i < all.size(); ++i) {
    const int flags = ZMQ_DONTWAIT | (i + 1 < all.size() ? ZMQ_SNDMORE : 0);
    if (zmq_send(socket, all[i].data(), all[i].size(), flags) < 0) {
      const int err = zmq_errno();
      if (i == 0 && err == EAGAIN) return Unavailable("full");
      if (err == EHOSTUNREACH) return NotFound("peer gone");
      return Unavailable(ZmqError("send"));
    }
  }
  return Status::Ok();
}

Result<std::unique_ptr<Probe>> Probe::Start(void* ctx, const std::string& address, const RelaySecurity& security) {
  auto p = std::make_unique<Probe>();
  DCR_ASSIGN_OR_RETURN(p->sock_, OpenSocket(ctx, ZMQ_DEALER));
  DCR_RETURN_IF_ERROR(ConfigureCurveClient(p->sock_.get(), security));
  const std::string mon = fmt::format("inproc://dcr-relay-probe-{}", static_cast<const void*>(p.get()));
  if (zmq_socket_monitor(p->sock_.get(), mon.c_str(), ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0)
    return Internal(ZmqError("relay probe: monitor"));
  DCR_ASSIGN_OR_RETURN(p->monitor_, OpenSocket(ctx, ZMQ_PAIR));
  if (zmq_connect(p->monitor_.get(), mon.c_str()) != 0) return Internal(ZmqError("relay probe: monitor"));
  if (zmq_connect(p->sock_.get(), address.c_str()) != 0)
    return InvalidArgument(ZmqError("relay probe: cannot connect to " + address));
  return p;
}

bool Probe::Up() {
  for (;;) {
    auto ev = RecvParts(monitor_.get());
    if (!ev.ok() || ev->empty()) break;
    uint16_t event = 0;
    if ((*ev)[0].size() >= 2) std::memcpy(&event, (*ev)[0].data(), 2);
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) up_ = true;
  }
  return up_;
}

bool FirstIsBack(std::unique_ptr<Probe>& probe, void* ctx, size_t index, const std::string& first,
                 const RelaySecurity& security) {
  if (index == 0) {
    probe.reset();
    return false;
  }
  if (!probe) {
    auto p = Probe::Start(ctx, first, security);
    if (p.ok()) probe = std::move(*p);
    return false;
  }
  if (!probe->Up()) return false;
  probe.reset();
  return true;
}

Result<std::vector<std::string>> RecvParts(void* socket, size_t max_parts, std::string* peer_key) {
  std::vector<std::string> parts;
  for (;;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket, parts.empty() ? ZMQ_DONTWAIT : 0) < 0) {
      const int err = zmq_errno();
      zmq_msg_close(&msg);
      if (err == EAGAIN && parts.empty()) return parts;
      return Unavailable(ZmqError("receive"));
    }
    // Parts past the limit are read and dropped; the last one kept stays
    // empty, so that the message fails to decode.
    if (parts.size() < max_parts) parts.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    else parts.back().clear();
    const bool more = zmq_msg_more(&msg);
    if (peer_key && !more) {
      const char* user = zmq_msg_gets(&msg, "User-Id");
      *peer_key = user ? user : "";
    }
    zmq_msg_close(&msg);
    if (!more) return parts;
  }
}

void AnswerZap(void* zap, const std::map<std::string, RelayRoles>& allowed,
               const std::function<void(const std::string&)>& log) {
  auto req = RecvParts(zap);
  if (!req.ok() || req->empty()) return;
  const auto& p = *req;
  std::string key, status = "400", text = "unknown peer";
  const std::string address = p.size() > 3 ? p[3] : "?", mechanism = p.size() > 5 ? p[5] : "?";
  if (mechanism == "CURVE" && p.size() > 6 && p[6].size() == 32) {
    char z85[41] = {0};
    zmq_z85_encode(z85, reinterpret_cast<const uint8_t*>(p[6].data()), 32);
    key = z85;
    if (allowed.count(key)) status = "200", text = "OK";
  }
  if (status != "200")
    log(fmt::format("refused peer {} ({} key {}): not in the allow list; add its public key there to admit it", address,
                    mechanism, key.empty() ? "none" : key));
  std::vector<std::string> reply = {"1.0", p.size() > 1 ? p[1] : "", status, text, key, ""};
  for (size_t i = 0; i < reply.size(); ++i)
    zmq_send(zap, reply[i].data(), reply[i].size(), i + 1 < reply.size() ? ZMQ_SNDMORE : 0);
}

}  // namespace relay_internal

Result<CurveKeyPair> GenerateCurveKeyPair() {
  char pub[41] = {0}, sec[41] = {0};
  if (zmq_curve_keypair(pub, sec) != 0)
    return Unimplemented(relay_internal::ZmqError("CURVE key generation (is libzmq built with libsodium?)"));
  return CurveKeyPair{pub, sec};
}

namespace {

Result<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("cannot read key file {} (make one with dcr relay keygen)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Z85Key(const std::string& s) {
  if (s.size() != 40) return false;
  uint8_t bin[32];
  return zmq_z85_decode(bin, s.c_str()) != nullptr;
}

}  // namespace

Status WriteCurveKeyFiles(const std::string& stem, const CurveKeyPair& pair) {
  DCR_RETURN_IF_ERROR(WriteFileAtomically(
      stem + ".key",
      fmt::format("# dcr relay CURVE key pair: keep secret\npublic {}\nsecret {}\n", pair.public_key, pair.secret_key),
      0600));
  return WriteFileAtomically(stem + ".pub", pair.public_key + "\n");
}

Result<CurveKeyPair> ReadCurveKeyPair(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0)
    return PermissionDenied(
        fmt::format("{}: a secret key file that others may read (mode {:04o}) is refused; chmod "
                    "600 {} (and make a new pair if others may have read it)",
                    path, st.st_mode & 07777, path));
  DCR_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  CurveKeyPair pair;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.starts_with("public ")) pair.public_key = line.substr(7);
    if (line.starts_with("secret ")) pair.secret_key = line.substr(7);
  }
  if (!Z85Key(pair.public_key) || !Z85Key(pair.secret_key))
    return InvalidArgument(
        fmt::format("{}: not a CURVE key pair (lines 'public <z85>' and 'secret <z85>'); make one "
                    "with dcr relay keygen",
                    path));
  return pair;
}

Result<std::string> ReadCurvePublicKey(const std::string& path) {
  DCR_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  if (text.find("secret ") != std::string::npos) {
    DCR_ASSIGN_OR_RETURN(CurveKeyPair pair, ReadCurveKeyPair(path));
    return pair.public_key;
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  if (!Z85Key(text))
    return InvalidArgument(
        fmt::format("{}: not a CURVE public key (40 Z85 characters); make one with dcr relay keygen", path));
  return text;
}

std::string RelayRolesName(RelayRoles roles) {
  if (roles == kAnyRelayRole) return "any role";
  std::string out;
  for (RelayRole r : {RelayRole::kSender, RelayRole::kRelay, RelayRole::kReceiver})
    if (roles & RoleBit(r)) out += (out.empty() ? "" : ", ") + std::string(RelayRoleName(r));
  return out.empty() ? "no role" : out;
}

Result<std::map<std::string, RelayRoles>> ReadCurveAllowList(const std::string& path) {
  DCR_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  std::map<std::string, RelayRoles> keys;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    // Z85 keys may contain '#': only a line that starts with it is a comment.
    while (!line.empty() && (line.back() == ' ' || line.back() == '\t' || line.back() == '\r')) line.pop_back();
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.erase(0, 1);
    if (line.empty() || line.front() == '#') continue;
    RelayRoles roles = kAnyRelayRole;
    if (const size_t space = line.find_first_of(" \t"); space != std::string::npos) {
      const std::string role = line.substr(0, space);
      if (role == "sender") roles = RoleBit(RelayRole::kSender);
      else if (role == "relay") roles = RoleBit(RelayRole::kRelay);
      else if (role == "receiver") roles = RoleBit(RelayRole::kReceiver);
      else
        return InvalidArgument(
            fmt::format("{}:{}: unknown role '{}' (sender, relay or receiver, then the key)", path, n, role));
      line.erase(0, line.find_first_not_of(" \t", space));
    }
    if (!Z85Key(line))
      return InvalidArgument(fmt::format("{}:{}: not a CURVE public key (40 Z85 characters)", path, n));
    keys[line] |= roles;
  }
  return keys;
}

Result<RelaySecurity> LoadRelaySecurity(const std::string& key_file, const std::string& server_public_file,
                                        const std::string& allow_file, bool insecure, const RelaySecurityNames& names) {
  RelaySecurity sec;
  if (key_file.empty()) {
    if (!server_public_file.empty() || !allow_file.empty())
      return InvalidArgument(fmt::format("relay keys: {} without this process's own key pair ({})",
                                         server_public_file.empty() ? names.allow : names.server_public, names.key));
    if (!insecure)
      return InvalidArgument(
          fmt::format("relay links are authenticated by default: give this process's CURVE key pair ({}; dcr relay "
                      "keygen makes one), or ask for {} (plain TCP) on a trusted network",
                      names.key, names.insecure));
    return sec;
  }
  if (insecure)
    return InvalidArgument(
        fmt::format("relay keys: a key pair ({}) and {} together; drop one", names.key, names.insecure));
  DCR_ASSIGN_OR_RETURN(CurveKeyPair own, ReadCurveKeyPair(key_file));
  sec.own = own;
  if (!server_public_file.empty()) {
    DCR_ASSIGN_OR_RETURN(sec.server_public, ReadCurvePublicKey(server_public_file));
  } else {
    sec.server_public = own.public_key;
  }
  if (!allow_file.empty()) {
    DCR_ASSIGN_OR_RETURN(sec.allowed, ReadCurveAllowList(allow_file));
  }
  return sec;
}

}  // namespace dcr
