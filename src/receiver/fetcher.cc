#include "fetcher.h"

#include <algorithm>

namespace dcr::receiver_internal {

FrameFetcher::FrameFetcher(Store& store, size_t concurrency) : store_(store) {
  for (size_t i = 0; i < std::max<size_t>(concurrency, 1); ++i) threads_.emplace_back([this] { Worker(); });
}

FrameFetcher::~FrameFetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (auto& t : threads_) t.join();
}

void FrameFetcher::Fetch(const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (IsPendingLocked(key)) return;
    queued_.emplace_back(next_++, key);
  }
  work_.notify_one();
}

bool FrameFetcher::IsPendingLocked(const std::string& key) const {
  for (const auto& [order, k] : in_flight_)
    if (k == key && !dropped_.count(order)) return true;
  if (std::any_of(queued_.begin(), queued_.end(), [&](const auto& q) { return q.second == key; })) return true;
  return std::any_of(finished_.begin(), finished_.end(), [&](const auto& f) { return f.second.first == key; });
}

bool FrameFetcher::IsPending(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return IsPendingLocked(key);
}

bool FrameFetcher::BusyLocked() const { return !queued_.empty() || in_flight_.size() > dropped_.size(); }

bool FrameFetcher::Busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return BusyLocked();
}

size_t FrameFetcher::Pending(const std::string& prefix) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [order, key] : queued_) n += key.starts_with(prefix);
  for (const auto& [order, key] : in_flight_) n += key.starts_with(prefix) && !dropped_.count(order);
  for (const auto& [order, done] : finished_) n += done.first.starts_with(prefix);
  return n;
}

std::vector<std::pair<std::string, Result<std::string>>> FrameFetcher::TakeDone() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, Result<std::string>>> out;
  for (auto& [order, done] : finished_) out.push_back(std::move(done));
  finished_.clear();
  return out;
}

void FrameFetcher::WaitDone(std::chrono::milliseconds at_most) {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait_for(lock, at_most, [&] { return !finished_.empty() || !BusyLocked(); });
}

void FrameFetcher::Drop(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(queued_, [&](const auto& q) { return q.second.starts_with(prefix); });
  std::erase_if(finished_, [&](const auto& f) { return f.second.first.starts_with(prefix); });
  for (const auto& [order, key] : in_flight_)
    if (key.starts_with(prefix)) dropped_.insert(order);
}

void FrameFetcher::Worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !queued_.empty(); });
    if (stop_) return;
    auto [order, key] = std::move(queued_.front());
    queued_.pop_front();
    in_flight_.emplace(order, key);
    lock.unlock();
    Result<std::string> blob = store_.Get(key);
    lock.lock();
    in_flight_.erase(order);
    if (!dropped_.erase(order)) finished_.emplace(order, std::pair{key, std::move(blob)});
    done_.notify_all();
  }
}

}  // namespace dcr::receiver_internal
