// Frame object signatures (dcr/signing.h; docs/format.md, "Frame objects").
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sodium.h>

#include <charconv>
#include <cstring>

#include "dcr/run_keys.h"
#include "dcr/run_records.h"
#include "dcr/signing.h"
#include "internal.h"

namespace dcr {

namespace {

constexpr uint32_t kTrailerMagic = 0x53524344;  // "DCRS" little-endian
constexpr uint8_t kTrailerVersion = 1;
constexpr uint8_t kEd25519OverBlake2b = 1;
constexpr std::string_view kDomain = "dcr frame object v1\n";
static_assert(sizeof(crypto_generichash_state) <= 384);
static_assert(kObjectTrailerBytes == 8 + crypto_sign_BYTES);

std::string TrailerHead() {
  std::string h(8, '\0');
  std::memcpy(h.data(), &kTrailerMagic, 4);
  h[4] = static_cast<char>(kTrailerVersion);
  h[5] = static_cast<char>(kEd25519OverBlake2b);
  return h;
}

crypto_generichash_state* State(std::array<uint8_t, 384>& bytes) {
  return reinterpret_cast<crypto_generichash_state*>(bytes.data());
}

void Start(std::array<uint8_t, 384>& state, std::string_view key) {
  crypto_generichash_init(State(state), nullptr, 0, 32);
  crypto_generichash_update(State(state), reinterpret_cast<const uint8_t*>(kDomain.data()), kDomain.size());
  crypto_generichash_update(State(state), reinterpret_cast<const uint8_t*>(key.data()), key.size());
  crypto_generichash_update(State(state), reinterpret_cast<const uint8_t*>("\n"), 1);
}

bool ParseHex(std::string_view hex, uint8_t* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i) {
    int v = 0;
    for (char c : hex.substr(2 * i, 2)) {
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else return false;
    }
    out[i] = static_cast<uint8_t>(v);
  }
  return true;
}

}  // namespace

std::string_view ObjectFrames(std::string_view object) {
  static const std::string head = TrailerHead();
  if (object.size() >= kObjectTrailerBytes && object.substr(object.size() - kObjectTrailerBytes, head.size()) == head)
    return object.substr(0, object.size() - kObjectTrailerBytes);
  return object;
}

Result<ObjectSigner> ObjectSigner::Generate() {
  if (sodium_init() < 0) return Internal("libsodium cannot start: no frame object signing key");
  ObjectSigner s;
  uint8_t pk[crypto_sign_PUBLICKEYBYTES];
  crypto_sign_keypair(pk, s.secret_.data());
  s.public_hex_ = fmt::format("{:02x}", fmt::join(pk, pk + sizeof pk, ""));
  return s;
}

ObjectSigner::Object ObjectSigner::Begin(std::string_view key) const {
  Object o;
  o.signer_ = this;
  Start(o.state_, key);
  return o;
}

void ObjectSigner::Object::Update(std::string_view frames) {
  crypto_generichash_update(State(state_), reinterpret_cast<const uint8_t*>(frames.data()), frames.size());
}

std::string ObjectSigner::Object::Trailer() {
  uint8_t digest[32];
  crypto_generichash_final(State(state_), digest, sizeof digest);
  std::string t = TrailerHead();
  t.resize(kObjectTrailerBytes);
  crypto_sign_detached(reinterpret_cast<uint8_t*>(t.data()) + 8, nullptr, digest, sizeof digest,
                       signer_->secret_.data());
  return t;
}

std::string ObjectSigner::Sign(std::string_view key, std::string frames) const {
  Object o = Begin(key);
  o.Update(frames);
  frames += o.Trailer();
  return frames;
}

Status VerifyObjectSignature(std::string_view signer_hex, std::string_view key, std::string_view object) {
  uint8_t pk[crypto_sign_PUBLICKEYBYTES];
  if (!ParseHex(signer_hex, pk, sizeof pk))
    return InvalidArgument(
        fmt::format("'{}' is not a frame object signing key (64 lowercase hex digits)", signer_hex.substr(0, 80)));
  const std::string_view frames = ObjectFrames(object);
  if (frames.size() == object.size())
    return DataLoss(fmt::format("frame object {}: not signed (no signature trailer)", key));
  if (sodium_init() < 0) return Internal("libsodium cannot start: frame object signatures cannot be checked");
  alignas(64) std::array<uint8_t, 384> state{};
  Start(state, key);
  crypto_generichash_update(State(state), reinterpret_cast<const uint8_t*>(frames.data()), frames.size());
  uint8_t digest[32];
  crypto_generichash_final(State(state), digest, sizeof digest);
  const auto* sig = reinterpret_cast<const uint8_t*>(object.data()) + frames.size() + 8;
  if (crypto_sign_verify_detached(sig, digest, sizeof digest, pk) != 0)
    return DataLoss(
        fmt::format("frame object {}: its signature is not by the attempt's publisher (key {}...): forged "
                    "or altered on the way",
                    key, signer_hex.substr(0, 16)));
  return Status::Ok();
}

}  // namespace dcr

// Who signs an attempt's frame objects (streaming.cc reads the same).
namespace dcr::protocol_internal {

Result<std::optional<StreamedAttempt>> ReadStreamedAttempt(Store& store, uint64_t v, const std::string& id,
                                                           const std::function<void(const std::string&)>& log) {
  const std::string prefix = run_keys::Attempt(v, id);
  DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store, run_keys::AttemptRecord(v, id)));
  if (!text) return std::optional<StreamedAttempt>();  // not yet visible: look again next time
  StreamedAttempt st;
  auto record = AttemptRecord::FromJson(*text, StoreContext(store.url(), run_keys::AttemptRecord(v, id)));
  if (record.ok() && record->version == v) st = std::move(*record);
  else
    log(
        fmt::format("{}attempt.json does not name this version's delta id, class and signing keys ({}); its frames are "
                    "applied once its manifest exists",
                    prefix, record.ok() ? "another version" : record.status().message()));
  return std::optional<StreamedAttempt>(std::move(st));
}

Result<std::optional<std::string>> ObjectSignerOf(Store& store, const std::string& attempt_prefix,
                                                  const StreamedAttempt& st, const std::string& key) {
  if (!st) return std::optional<std::string>("");
  if (!st->object_key.empty() || st->processes == 0) return std::optional<std::string>(st->object_key);
  // frames/s<P>-<NNNN>[-t<T>c<C>].bin: process P's object.
  const auto name =
      run_keys::ParseFrameObject(std::string_view(key).substr(std::min(key.size(), attempt_prefix.size())));
  if (!name) return std::optional<std::string>("");
  DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(store, attempt_prefix + run_keys::ProcessSigner(name->sender)));
  if (!text) return std::optional<std::string>();
  while (!text->empty() && text->back() == '\n') text->pop_back();
  return std::optional<std::string>(std::move(*text));
}

}  // namespace dcr::protocol_internal

namespace dcr {

Status FrameObjectVerifier::Verify(const std::string& key, std::string_view bytes) {
  using namespace protocol_internal;
  // attempts/v<10 digits>/<attempt>/frames/<name>
  const std::string_view k = key;
  const size_t id_end = k.find('/', 21);
  uint64_t v = 0;
  const auto digits = k.substr(std::min<size_t>(10, k.size()), 10);
  const auto parsed = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (!k.starts_with("attempts/v") || k.size() < 21 || k[20] != '/' || parsed.ec != std::errc() ||
      parsed.ptr != digits.data() + digits.size() || id_end == std::string_view::npos ||
      !k.substr(id_end + 1).starts_with("frames/"))
    return InvalidArgument(fmt::format("{}: not a frame object's key", key));
  const std::string id(k.substr(21, id_end - 21));
  const std::string prefix(k.substr(0, id_end + 1));
  const size_t dash = k.find('-', id_end + 1);
  const std::string signer_of(k.substr(0, dash == std::string_view::npos ? k.size() : dash));
  auto it = signers_.find(signer_of);
  if (it == signers_.end()) {
    DCR_ASSIGN_OR_RETURN(auto attempt, ReadStreamedAttempt(store_, v, id, [](const std::string&) {}));
    if (!attempt) return NotFound(fmt::format("{}attempt.json is not in {} (yet)", prefix, store_.url()));
    DCR_ASSIGN_OR_RETURN(auto signer, ObjectSignerOf(store_, prefix, *attempt, key));
    if (!signer) return NotFound(fmt::format("{}: its trainer process's key is not in {} (yet)", key, store_.url()));
    if (signer->empty())
      return FailedPrecondition(fmt::format("{}: its attempt names no signing key (an older publisher)", key));
    if (signers_.size() >= 4096) signers_.clear();  // keys of attempts long gone
    it = signers_.emplace(signer_of, std::move(*signer)).first;
  }
  return VerifyObjectSignature(it->second, key, bytes);
}

}  // namespace dcr
