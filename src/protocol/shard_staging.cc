#include "shard_staging.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "dcr/layout.h"
#include "dcr/text.h"
#include "internal.h"

namespace dcr::protocol_internal {

ShardStaging::ShardStaging(std::span<const ShardSource> local) : local_(local), start_(RealClock().Now()) {
  bool any = false;
  for (const ShardSource& s : local) {
    // Buffers past the map's are refused by the projection, before any wait.
    const bool staged = s.stage && s.layout && s.current.size() == s.layout->map().buffers.size();
    staged_.push_back(staged);
    ready_.emplace_back(s.current.size(), !staged);
    any = any || staged;
  }
  if (any) thread_ = std::thread([this] { Run(); });
  else done_ = true;
}

ShardStaging::~ShardStaging() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

Status ShardStaging::Await(size_t i, size_t b) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return ready_[i][b] || !failed_.ok(); });
  return ready_[i][b] ? Status::Ok() : failed_;
}

Status ShardStaging::Failure() {
  std::lock_guard lock(mu_);
  return failed_;
}

Status ShardStaging::AwaitAll() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_ || !failed_.ok(); });
  return failed_;
}

std::function<Status(size_t)> ShardStaging::AwaiterFor(size_t i) {
  if (!staged_[i]) return {};
  return [this, i](size_t b) { return Await(i, b); };
}

double ShardStaging::seconds() {
  std::lock_guard lock(mu_);
  return seconds_;
}

void ShardStaging::Run() {
  std::vector<std::tuple<std::string, size_t, size_t>> order;  // first tensor name, sender, buffer
  for (size_t i = 0; i < local_.size(); ++i) {
    if (!staged_[i]) continue;
    const CompiledLayout& l = *local_[i].layout;
    std::vector<std::string> first(l.map().buffers.size());  // empty: unmapped, staged last
    for (size_t c = 0; c < l.map().copies.size(); ++c) {
      std::string& f = first[l.BufferOf(c)];
      if (f.empty() || TensorNameLess(l.map().copies[c].tensor, f)) f = l.map().copies[c].tensor;
    }
    for (size_t b = 0; b < local_[i].current.size(); ++b) order.emplace_back(first[b], i, b);
  }
  std::sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
    const std::string &nx = std::get<0>(x), &ny = std::get<0>(y);
    if (nx != ny) return !nx.empty() && (ny.empty() || TensorNameLess(nx, ny));
    return x < y;
  });
  for (const auto& [name, i, b] : order) {
    Status staged = stop_ ? Aborted("the publish ended before staging did") : local_[i].stage(b);
    std::lock_guard lock(mu_);
    if (!staged.ok()) {
      failed_ = staged.WithContext(
          fmt::format("staging buffer '{}' of local sender {}", local_[i].layout->map().buffers[b].id, i));
      cv_.notify_all();
      return;
    }
    ready_[i][b] = true;
    cv_.notify_all();
  }
  std::lock_guard lock(mu_);
  done_ = true;
  seconds_ = SecondsSince(RealClock(), start_);
  cv_.notify_all();
}

}  // namespace dcr::protocol_internal
