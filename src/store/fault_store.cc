// A store decorator that injects failures and limits bandwidth (docs/stores.md, "Fault
// injection"): for tests and failure campaigns, on any driver.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <random>
#include <thread>

#include "dcr/store.h"

namespace dcr {
namespace {

struct FaultSpec {
  uint64_t seed = 0;
  double fail = 0;  // before the operation: kUnavailable, nothing done
  double lost = 0;  // after a mutation succeeded: kUnavailable (a lost response)
  int delay_ms = 0;  // uniform [0, delay_ms) before each operation
  double mbps = 0;  // bandwidth limit on bytes written and read, MB/s (0: none)
};

Result<FaultSpec> ParseSpec(std::string_view text) {
  FaultSpec spec;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string_view::npos) end = text.size();
    std::string item(text.substr(start, end - start));
    start = end + 1;
    size_t eq = item.find('=');
    if (eq == std::string::npos) return InvalidArgument("DCR_STORE_FAULTS: '" + item + "' is not key=value");
    std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    char* rest = nullptr;
    double x = std::strtod(value.c_str(), &rest);
    // !(x >= 0) also refuses NaN; converting an out-of-range double to an
    // integer is undefined behaviour, so the ranges are checked first.
    if (rest == value.c_str() || *rest != '\0' || !(x >= 0) || std::isinf(x))
      return InvalidArgument("DCR_STORE_FAULTS: '" + item + "' needs a non-negative number");
    if (key == "seed" && x < 0x1p64) spec.seed = static_cast<uint64_t>(x);
    else if (key == "fail" && x <= 1) spec.fail = x;
    else if (key == "lost" && x <= 1) spec.lost = x;
    else if (key == "delay_ms" && x <= 86'400'000) spec.delay_ms = static_cast<int>(x);  // a day at most
    else if (key == "mbps" && (x == 0 || x >= 0.001)) spec.mbps = x;  // 0: off; else at least 1 kB/s
    else
      return InvalidArgument("DCR_STORE_FAULTS: unknown or out-of-range '" + item +
                             "' (seed, fail, lost, delay_ms, mbps)");
  }
  return spec;
}

class FaultStore final : public Store {
 public:
  FaultStore(std::unique_ptr<Store> inner, FaultSpec spec) : inner_(std::move(inner)), spec_(spec), rng_(spec.seed) {}

  const std::string& url() const override { return inner_->url(); }

  Result<std::unique_ptr<ObjectWriter>> OpenWriter(std::string_view key, WriteMode mode) override {
    DCR_RETURN_IF_ERROR(Before("open writer", key));
    DCR_ASSIGN_OR_RETURN(auto w, inner_->OpenWriter(key, mode));
    return std::unique_ptr<ObjectWriter>(new Writer(this, std::string(key), std::move(w)));
  }
  Result<ObjectInfo> Head(std::string_view key) override {
    DCR_RETURN_IF_ERROR(Before("head", key));
    return inner_->Head(key);
  }
  Status ReadRange(std::string_view key, uint64_t offset, std::span<uint8_t> out, const ReadOptions& o) override {
    DCR_RETURN_IF_ERROR(Before("read", key));
    DCR_RETURN_IF_ERROR(inner_->ReadRange(key, offset, out, o));
    Transfer(out.size());
    return Status::Ok();
  }
  Result<std::string> Get(std::string_view key, ObjectInfo* info) override {
    DCR_RETURN_IF_ERROR(Before("get", key));
    DCR_ASSIGN_OR_RETURN(std::string data, inner_->Get(key, info));
    Transfer(data.size());
    return data;
  }
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    DCR_RETURN_IF_ERROR(Before("list", prefix));
    return inner_->List(prefix);
  }
  Status Delete(std::string_view key) override {
    DCR_RETURN_IF_ERROR(Before("delete", key));
    DCR_RETURN_IF_ERROR(inner_->Delete(key));
    return After("delete", key);
  }

 private:
  class Writer final : public ObjectWriter {
   public:
    Writer(FaultStore* store, std::string key, std::unique_ptr<ObjectWriter> inner)
        : store_(store), key_(std::move(key)), inner_(std::move(inner)) {}
    Status Write(std::string_view data) override {
      if (Status s = store_->Before("write", key_); !s.ok()) {
        inner_->Abort();
        return s;
      }
      store_->Transfer(data.size());
      return inner_->Write(data);
    }
    Status Close() override {
      if (Status s = store_->Before("close", key_); !s.ok()) {
        inner_->Abort();
        return s;
      }
      DCR_RETURN_IF_ERROR(inner_->Close());
      return store_->After("close", key_);
    }
    void Abort() override { inner_->Abort(); }

   private:
    FaultStore* store_;
    std::string key_;
    std::unique_ptr<ObjectWriter> inner_;
  };

  // Bandwidth shaping: one link shared by every operation of this store
  // object (per direction would double it); sleeps until the link is free.
  void Transfer(uint64_t bytes) {
    if (spec_.mbps <= 0 || bytes == 0) return;
    using Clock = std::chrono::steady_clock;
    Clock::time_point until;
    {
      std::lock_guard lock(mu_);
      const auto now = Clock::now();
      if (link_free_ < now) link_free_ = now;
      link_free_ +=
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(bytes / (spec_.mbps * 1e6)));
      until = link_free_;
    }
    std::this_thread::sleep_until(until);
  }

  double Draw() {
    std::lock_guard lock(mu_);
    return std::uniform_real_distribution<double>(0, 1)(rng_);
  }
  Status Before(std::string_view op, std::string_view key) {
    if (spec_.delay_ms > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(Draw() * spec_.delay_ms * 1000)));
    if (Draw() < spec_.fail) return Unavailable(fmt::format("{}: {}: injected failure before {}", url(), key, op));
    return Status::Ok();
  }
  Status After(std::string_view op, std::string_view key) {
    if (Draw() < spec_.lost) return Unavailable(fmt::format("{}: {}: injected lost response after {}", url(), key, op));
    return Status::Ok();
  }

  std::unique_ptr<Store> inner_;
  FaultSpec spec_;
  std::mutex mu_;
  std::mt19937_64 rng_;
  std::chrono::steady_clock::time_point link_free_{};
};

}  // namespace

Result<std::unique_ptr<Store>> WrapWithFaults(std::unique_ptr<Store> inner, std::string_view spec_text) {
  DCR_ASSIGN_OR_RETURN(FaultSpec spec, ParseSpec(spec_text));
  return std::unique_ptr<Store>(new FaultStore(std::move(inner), spec));
}

}  // namespace dcr
