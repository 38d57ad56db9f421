// Object stores: one interface, three drivers (DESIGN section 5).
//
//   file:///abs/path           a local or shared directory (the default)
//   s3://bucket/prefix?...     S3 or an S3-compatible server (include/dcr/s3.h)
//   mem://name                 process-local, for tests (one namespace per name)
//
// Keys are relative, '/'-separated paths: non-empty, at most 1024 bytes, no
// empty, "." or ".." components, no leading '/', no NUL or control bytes, and
// no component starting with ".dcr-" (reserved for the drivers' own use).
// Every driver validates keys with ValidateKey (and List's prefix with
// ValidateKeyPrefix) and returns kInvalidArgument for a bad one before doing
// any I/O.
//
// Visibility: an object appears whole or not at all. A writer publishes on
// Close(); until then (and after Abort or a failed Close) readers see the old
// object, or none. Objects are replaced only by whole-object writes.
//
// Errors name the store, the key and the cause. Codes:
//   kNotFound           the key (or the bucket / root) does not exist
//   kAlreadyExists      a kCreateIfAbsent write found the key present
//   kOutOfRange         a ranged read goes past the end of the object
//   kAborted            an if_match read found the object replaced
//   kPermissionDenied   credentials rejected, access denied
//   kUnavailable        the service failed transiently and retries ran out
//   kDeadlineExceeded   a timeout passed and retries ran out
//   kDataLoss           the bytes returned are not the bytes stored
//   kInvalidArgument    a bad key or URL
//
// Thread-safety: every method of Store may be called concurrently. An
// ObjectWriter is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/status.h"

namespace dcr {

struct ObjectInfo {
  std::string key;
  uint64_t size = 0;
  // Opaque; differs whenever the object is replaced. Pass it as
  // ReadOptions::if_match to read consistent ranges of one version.
  std::string etag;
};

enum class WriteMode {
  kOverwrite,  // replace whatever is there
  kCreateIfAbsent,  // fail with kAlreadyExists if the key exists (atomic)
};

struct ReadOptions {
  std::string if_match;  // non-empty: kAborted unless the object's etag is this
};

// A streaming upload: bytes may be written while they are still being
// produced (a large object is uploaded in parts as they fill).
class ObjectWriter {
 public:
  virtual ~ObjectWriter() = default;  // without Close: as Abort()

  virtual Status Write(std::string_view data) = 0;
  Status Write(std::span<const uint8_t> data) {
    return Write(std::string_view(reinterpret_cast<const char*>(data.data()), data.size()));
  }
  // Publishes the object. For kCreateIfAbsent, kAlreadyExists when the key
  // exists (the existing object is untouched). Nothing is published on error.
  virtual Status Close() = 0;
  // Discards everything written; idempotent; never publishes.
  virtual void Abort() = 0;
};

class Store {
 public:
  virtual ~Store() = default;

  // The URL this store was opened from, without credentials.
  virtual const std::string& url() const = 0;

  virtual Result<std::unique_ptr<ObjectWriter>> OpenWriter(std::string_view key, WriteMode mode) = 0;

  // Whole-object write (OpenWriter, Write, Close).
  virtual Status Put(std::string_view key, std::string_view data, WriteMode mode = WriteMode::kOverwrite);

  virtual Result<ObjectInfo> Head(std::string_view key) = 0;

  // Reads out.size() bytes from `offset`. kOutOfRange when offset + size
  // exceeds the object's size (nothing useful is left in `out`).
  virtual Status ReadRange(std::string_view key, uint64_t offset, std::span<uint8_t> out,
                           const ReadOptions& options = {}) = 0;

  // The whole object. If `info` is given it receives the object's metadata.
  virtual Result<std::string> Get(std::string_view key, ObjectInfo* info = nullptr);

  // Every object whose key starts with `prefix` (any string that some valid
  // key starts with, not only whole components: see ValidateKeyPrefix),
  // sorted by key (bytewise).
  virtual Result<std::vector<ObjectInfo>> List(std::string_view prefix) = 0;

  // Removes the object; OK when it does not exist.
  virtual Status Delete(std::string_view key) = 0;
};

// Opens a store from its URL (see the top of this file; S3 options in
// include/dcr/s3.h). kInvalidArgument for a malformed or unknown URL;
// kNotFound when a file:// root does not exist and create_root is false.
// When the environment variable DCR_STORE_FAULTS is set, the store is
// wrapped by WrapWithFaults with its value (failure campaigns).
struct OpenStoreOptions {
  bool create_root = true;  // file://: mkdir -p the root
};
Result<std::unique_ptr<Store>> OpenStore(std::string_view url, const OpenStoreOptions& options = {});

// Fault injection for tests: `spec` is "key=value,..." with seed=N,
// fail=P (an operation fails with kUnavailable before it runs), lost=P (a
// write or delete succeeds but reports kUnavailable, as a lost response
// does), delay_ms=N (each operation first sleeps up to N ms), mbps=R (bytes
// written and read pass one link of R MB/s: benchmarks of slow links).
Result<std::unique_ptr<Store>> WrapWithFaults(std::unique_ptr<Store> inner, std::string_view spec);

// Validates a key (rules above). The error names the key and the rule.
Status ValidateKey(std::string_view key);

// Validates List's prefix: empty, or the start of some valid key ("a/",
// "a/b", "snapshots/v"); "../", "/etc" or "a//" are kInvalidArgument naming
// the prefix and the rule.
Status ValidateKeyPrefix(std::string_view prefix);

// "s3://bucket/prefix: key: cause" style context for driver errors.
std::string StoreContext(std::string_view url, std::string_view key);

// Drivers (normally reached through OpenStore).
Result<std::unique_ptr<Store>> OpenFileStore(const std::string& root, bool create_root);
std::unique_ptr<Store> OpenMemStore(std::string_view name);
// Forgets mem://name: later opens start empty; stores already open keep
// the objects they had.
void ResetMemStore(std::string_view name);

}  // namespace dcr
