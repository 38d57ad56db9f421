// Test helper: a store that forwards to another and lets a test break or
// hold chosen requests.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "dcr/store.h"

namespace dcr::testing {

// A store that forwards to another and lets a test break chosen requests:
// `hook(op, key, after)` runs before each request (after=false; a non-OK
// status fails it unrun) and after each write or delete succeeded
// (after=true; a non-OK status is reported although the write happened, as
// a lost response).
class HookStore final : public Store {
 public:
  using Hook = std::function<Status(std::string_view op, std::string_view key, bool after)>;
  HookStore(Store& inner, Hook hook) : inner_(inner), hook_(std::move(hook)) {}

  const std::string& url() const override { return inner_.url(); }
  Result<std::unique_ptr<ObjectWriter>> OpenWriter(std::string_view key, WriteMode mode) override {
    DCR_RETURN_IF_ERROR(hook_("write", key, false));
    DCR_ASSIGN_OR_RETURN(auto w, inner_.OpenWriter(key, mode));
    return std::unique_ptr<ObjectWriter>(new Writer(this, std::string(key), std::move(w)));
  }
  Result<ObjectInfo> Head(std::string_view key) override {
    DCR_RETURN_IF_ERROR(hook_("read", key, false));
    return inner_.Head(key);
  }
  Status ReadRange(std::string_view key, uint64_t offset, std::span<uint8_t> out, const ReadOptions& o) override {
    DCR_RETURN_IF_ERROR(hook_("read", key, false));
    return inner_.ReadRange(key, offset, out, o);
  }
  Result<std::string> Get(std::string_view key, ObjectInfo* info) override {
    DCR_RETURN_IF_ERROR(hook_("read", key, false));
    return inner_.Get(key, info);
  }
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    DCR_RETURN_IF_ERROR(hook_("list", prefix, false));
    return inner_.List(prefix);
  }
  Status Delete(std::string_view key) override {
    DCR_RETURN_IF_ERROR(hook_("delete", key, false));
    DCR_RETURN_IF_ERROR(inner_.Delete(key));
    return hook_("delete", key, true);
  }

 private:
  class Writer final : public ObjectWriter {
   public:
    Writer(HookStore* store, std::string key, std::unique_ptr<ObjectWriter> inner)
        : store_(store), key_(std::move(key)), inner_(std::move(inner)) {}
    Status Write(std::string_view data) override { return inner_->Write(data); }
    Status Close() override {
      DCR_RETURN_IF_ERROR(inner_->Close());
      return store_->hook_("write", key_, true);
    }
    void Abort() override { inner_->Abort(); }

   private:
    HookStore* store_;
    std::string key_;
    std::unique_ptr<ObjectWriter> inner_;
  };
  Store& inner_;
  Hook hook_;
};

}  // namespace dcr::testing
