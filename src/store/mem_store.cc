// The mem driver: objects in a process-wide map per name, so two
// OpenStore("mem://x") calls see the same objects. The reference driver for
// tests: it implements the interface's contract and nothing else.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "dcr/store.h"

namespace dcr {
namespace {

struct MemObject {
  std::shared_ptr<const std::string> data;
  std::string etag;
};

struct MemNamespace {
  std::mutex mu;
  std::map<std::string, MemObject, std::less<>> objects;
  uint64_t next_etag = 1;
};

std::mutex registry_mu;
std::map<std::string, std::shared_ptr<MemNamespace>, std::less<>>& Registry() {
  static auto* registry = new std::map<std::string, std::shared_ptr<MemNamespace>, std::less<>>();
  return *registry;
}

class MemStore;

class MemWriter final : public ObjectWriter {
 public:
  MemWriter(MemStore* store, std::string key, WriteMode mode) : store_(store), key_(std::move(key)), mode_(mode) {}
  Status Write(std::string_view data) override;
  Status Close() override;
  void Abort() override {
    closed_ = true;
    data_.clear();
  }

 private:
  MemStore* store_;
  std::string key_;
  WriteMode mode_;
  std::string data_;
  bool closed_ = false;
};

class MemStore final : public Store {
 public:
  MemStore(std::string name, std::shared_ptr<MemNamespace> ns) : url_("mem://" + name), ns_(std::move(ns)) {}

  const std::string& url() const override { return url_; }

  Result<std::unique_ptr<ObjectWriter>> OpenWriter(std::string_view key, WriteMode mode) override {
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    return std::unique_ptr<ObjectWriter>(new MemWriter(this, std::string(key), mode));
  }

  Status Publish(const std::string& key, std::string data, WriteMode mode) {
    std::lock_guard lock(ns_->mu);
    auto it = ns_->objects.find(key);
    if (it != ns_->objects.end() && mode == WriteMode::kCreateIfAbsent)
      return AlreadyExists(StoreContext(url_, key) + ": object exists");
    ns_->objects[key] =
        MemObject{std::make_shared<const std::string>(std::move(data)), fmt::format("m{}", ns_->next_etag++)};
    return Status::Ok();
  }

  Result<ObjectInfo> Head(std::string_view key) override {
    DCR_ASSIGN_OR_RETURN(MemObject obj, Find(key));
    return ObjectInfo{std::string(key), obj.data->size(), obj.etag};
  }

  Status ReadRange(std::string_view key, uint64_t offset, std::span<uint8_t> out, const ReadOptions& options) override {
    DCR_ASSIGN_OR_RETURN(MemObject obj, Find(key));
    if (!options.if_match.empty() && obj.etag != options.if_match)
      return Aborted(StoreContext(url_, key) + ": object was replaced");
    uint64_t size = obj.data->size();
    if (offset > size || out.size() > size - offset)
      return OutOfRange(fmt::format("{}: range [{}, {}) is past the end of the {}-byte object", StoreContext(url_, key),
                                    offset, offset + out.size(), size));
    std::copy_n(obj.data->data() + offset, out.size(), reinterpret_cast<char*>(out.data()));
    return Status::Ok();
  }

  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    DCR_RETURN_IF_ERROR(ValidateKeyPrefix(prefix));
    std::vector<ObjectInfo> out;
    std::lock_guard lock(ns_->mu);
    for (auto it = ns_->objects.lower_bound(prefix); it != ns_->objects.end() && it->first.starts_with(prefix); ++it)
      out.push_back(ObjectInfo{it->first, it->second.data->size(), it->second.etag});
    return out;
  }

  Status Delete(std::string_view key) override {
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard lock(ns_->mu);
    if (auto it = ns_->objects.find(key); it != ns_->objects.end()) ns_->objects.erase(it);
    return Status::Ok();
  }

 private:
  Result<MemObject> Find(std::string_view key) {
    DCR_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard lock(ns_->mu);
    auto it = ns_->objects.find(key);
    if (it == ns_->objects.end()) return NotFound(StoreContext(url_, key) + ": no such object");
    return it->second;
  }

  std::string url_;
  std::shared_ptr<MemNamespace> ns_;
};

Status MemWriter::Write(std::string_view data) {
  if (closed_) return FailedPrecondition(StoreContext(store_->url(), key_) + ": write after close");
  data_.append(data);
  return Status::Ok();
}

Status MemWriter::Close() {
  if (closed_) return FailedPrecondition(StoreContext(store_->url(), key_) + ": close after close");
  closed_ = true;
  return store_->Publish(key_, std::move(data_), mode_);
}

}  // namespace

std::unique_ptr<Store> OpenMemStore(std::string_view name) {
  std::lock_guard lock(registry_mu);
  auto& ns = Registry()[std::string(name)];
  if (!ns) ns = std::make_shared<MemNamespace>();
  return std::make_unique<MemStore>(std::string(name), ns);
}

void ResetMemStore(std::string_view name) {
  std::lock_guard lock(registry_mu);
  Registry().erase(std::string(name));
}

}  // namespace dcr
