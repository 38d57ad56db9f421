// Frame object signatures: the publisher's signer, and the checks receivers and relays run on objects.
//
// docs/format.md, "Frame objects": every frame object an attempt writes ends
// with a trailer: the Ed25519 signature, by a key its publisher made for the
// attempt, of BLAKE2b-256 over the object's key and frames. The public half
// is in the store (attempt.json, or procs/p<P>.pub for a trainer process);
// receivers verify every object that did not come from the store before
// using it. The secret half never leaves the publisher's process.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "dcr/status.h"

namespace dcr {

class Store;

class ObjectSigner {
 public:
  // A fresh key pair (libsodium). Errors: kInternal when libsodium cannot start.
  static Result<ObjectSigner> Generate();
  // The public key as 64 lowercase hex digits (what the store records).
  const std::string& public_hex() const { return public_hex_; }

  // Signs one object incrementally: Begin with its key, Update with its
  // frames in order, then Trailer() is the bytes to append.
  class Object {
   public:
    void Update(std::string_view frames);
    std::string Trailer();

   private:
    friend class ObjectSigner;
    const ObjectSigner* signer_ = nullptr;
    alignas(64) std::array<uint8_t, 384> state_{};  // a crypto_generichash_state
  };
  Object Begin(std::string_view key) const;
  // Frames plus trailer, in one call.
  std::string Sign(std::string_view key, std::string frames) const;

 private:
  std::array<uint8_t, 64> secret_{};
  std::string public_hex_;
};

// Whether `object` (stored under `key`) ends with a trailer that public key
// `signer_hex` signed. kDataLoss naming the key: no trailer, or a signature
// that does not verify; kInvalidArgument: `signer_hex` is not a public key.
Status VerifyObjectSignature(std::string_view signer_hex, std::string_view key, std::string_view object);

// Checks that a frame object is its attempt's publisher's: its trailer's
// signature verifies against the key the store records for it
// (attempt.json's object_key, or procs/p<P>.pub of a trainer process). What
// a relay that can read the store runs before it keeps an object (`dcr
// relay --store`): a forged copy pushed ahead of the publisher's is then
// refused, and the publisher's copy is kept. Keys are cached once read; an
// attempt or key not in the store yet is kNotFound (the publisher writes
// them before any object, so nothing genuine is refused for it). Not
// thread-safe.
class FrameObjectVerifier {
 public:
  explicit FrameObjectVerifier(Store& store) : store_(store) {}
  Status Verify(const std::string& key, std::string_view bytes);

 private:
  Store& store_;
  std::map<std::string, std::string> signers_;  // by attempt prefix + object name up to '-': the key (hex)
};

}  // namespace dcr
