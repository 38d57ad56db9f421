// Frame object signatures (protocol.h; docs/format.md, "Frame objects").
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sodium.h>

#include <cstring>

#include "dcr/protocol.h"

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
