// A sender's frame stream cut into frame objects as it is written (the
// publisher of a checkpoint, and each trainer process). Not public API.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dcr/frame.h"
#include "dcr/publisher.h"
#include "dcr/run_keys.h"
#include "dcr/signing.h"
#include "dcr/store.h"
#include "publish_metrics.h"

namespace dcr::protocol_internal {

// Frame bytes written into objects not yet closed, and their peak (what the
// store's writers and the relay's copies hold at most; any thread).
class FramesInFlight {
 public:
  void Add(uint64_t n) {
    const uint64_t now = held_.fetch_add(n) + n;
    uint64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void Remove(uint64_t n) { held_.fetch_sub(n); }
  uint64_t peak() const { return peak_.load(); }

 private:
  std::atomic<uint64_t> held_{0}, peak_{0};
};

// The size a sender cuts its frame stream at: the options' segment_bytes,
// else 1/4096 of the model's bytes within [256 KiB, 16 MiB].
inline uint64_t SegmentBytes(const PublishOptions& o, uint64_t model_bytes) {
  return o.segment_bytes ? o.segment_bytes : std::clamp<uint64_t>(model_bytes / 4096, 256 << 10, 16 << 20);
}

// A sender's frame stream (frames in (tensor, chunk) order) cut into objects
// of about `segment_bytes` each, at frame boundaries, named by
// run_keys::FrameObject. Each object is visible (and can
// be downloaded) as soon as it is closed, while the next is being written.
// Closing (the file store's fsyncs and rename, S3's last part and complete)
// runs on a closer thread, so the encoder keeps streaming into the next
// object meanwhile; at most kClosesInFlight objects wait to be closed. The
// first error of any close is returned by the next Write or Close. With
// `relay`, each object is also handed to it once it is in the store (the
// segment's bytes are kept in memory until then).
class SegmentedFrameWriter {
 public:
  SegmentedFrameWriter(Store& store, std::string prefix, uint32_t sender, uint64_t segment_bytes,
                       const ObjectSigner& signer, FrameObjectSink* relay, FramesInFlight& in_flight)
      : store_(store),
        prefix_(std::move(prefix)),
        sender_(sender),
        segment_bytes_(std::max<uint64_t>(segment_bytes, 1)),
        signer_(signer),
        relay_(relay),
        in_flight_(in_flight) {}
  // Without Close (an attempt that failed): nothing more is published.
  ~SegmentedFrameWriter() {
    if (writer_) {
      writer_->Abort();
      in_flight_.Remove(in_segment_);
    }
    std::unique_lock lock(mu_);
    stopping_ = aborting_ = true;
    cv_.notify_all();
    lock.unlock();
    if (closer_.joinable()) closer_.join();
  }

  Status Write(std::string_view frame) {
    if (!writer_ || in_segment_ >= segment_bytes_) {
      DCR_RETURN_IF_ERROR(Rotate());
      std::optional<ChunkId> first;  // the first object is named without its chunk
      if (!names_.empty()) {
        DCR_ASSIGN_OR_RETURN(FrameHeader h,
                             ParseFrameHeader({reinterpret_cast<const uint8_t*>(frame.data()), frame.size()}));
        first = ChunkId{h.tensor, h.chunk};
      }
      names_.push_back(run_keys::FrameObject(sender_, names_.size(), first));
      starts_.push_back(written_);
      DCR_ASSIGN_OR_RETURN(writer_, store_.OpenWriter(prefix_ + names_.back(), WriteMode::kOverwrite));
      signing_ = signer_.Begin(prefix_ + names_.back());
      in_segment_ = 0;
    }
    DCR_RETURN_IF_ERROR(writer_->Write(frame));
    signing_.Update(frame);
    if (relay_) buffer_.append(frame);
    in_segment_ += frame.size();
    in_flight_.Add(frame.size());
    written_ += frame.size();
    return Status::Ok();
  }

  // Closes the current object and waits for every close to finish.
  Status Close() {
    Status s = Rotate();
    std::unique_lock lock(mu_);
    stopping_ = true;
    cv_.notify_all();
    lock.unlock();
    if (closer_.joinable()) closer_.join();
    lock.lock();
    return s.ok() ? failure_ : s;
  }

  // Turns an entry's offset in the whole stream (EncodeFrames' object 0)
  // into its segment (an index into names()) and the offset there.
  void Locate(DeltaFrameEntry* f) const {
    const size_t seg =
        static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), f->offset) - starts_.begin()) - 1;
    f->object = static_cast<uint32_t>(seg);
    f->offset -= starts_[seg];
  }

  const std::vector<std::string>& names() const { return names_; }
  // Bytes of frames written so far: the next frame's offset in the stream.
  uint64_t written() const { return written_; }

 private:
  static constexpr size_t kClosesInFlight = 4;
  struct Pending {
    std::unique_ptr<ObjectWriter> writer;
    std::string key, bytes;  // bytes: only with a relay
    uint64_t size = 0;  // counted in in_flight_ until closed
  };

  // Hands the current object (if any) to the closer thread.
  Status Rotate() {
    std::unique_lock lock(mu_);
    if (!failure_.ok()) return failure_;
    if (!writer_) return Status::Ok();
    const std::string trailer = signing_.Trailer();
    if (Status s = writer_->Write(trailer); !s.ok()) return failure_ = s;
    if (relay_) buffer_.append(trailer);
    in_flight_.Add(trailer.size());
    cv_.wait(lock, [&] { return pending_.size() < kClosesInFlight; });
    pending_.push_back({std::move(writer_), prefix_ + names_.back(), std::move(buffer_), in_segment_ + trailer.size()});
    buffer_.clear();
    if (!closer_.joinable()) closer_ = std::thread([this] { CloseLoop(); });
    cv_.notify_all();
    return failure_;
  }

  void CloseLoop() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !pending_.empty() || stopping_; });
      if (pending_.empty()) return;
      Pending p = std::move(pending_.front());
      const bool abort = aborting_ || !failure_.ok();
      lock.unlock();
      Status s;
      if (abort) {
        p.writer->Abort();
      } else {
        s = p.writer->Close();
        if (s.ok()) CountSentBytes("store", p.size);
        if (s.ok() && relay_) {
          relay_->Object(p.key, p.bytes);
          CountSentBytes("relay", p.size);
        }
      }
      lock.lock();
      in_flight_.Remove(pending_.front().size);
      pending_.pop_front();
      if (!s.ok() && failure_.ok()) failure_ = s;
      cv_.notify_all();
    }
  }

  Store& store_;
  const std::string prefix_;
  const uint32_t sender_;
  const uint64_t segment_bytes_;
  const ObjectSigner& signer_;
  ObjectSigner::Object signing_;  // of the open segment
  FrameObjectSink* const relay_;
  FramesInFlight& in_flight_;
  std::string buffer_;  // the open segment's bytes, with a relay
  std::unique_ptr<ObjectWriter> writer_;
  std::vector<std::string> names_;
  std::vector<uint64_t> starts_;  // stream offset where each segment begins
  uint64_t in_segment_ = 0, written_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;  // front: being closed
  bool stopping_ = false, aborting_ = false;
  Status failure_;
  std::thread closer_;
};

}  // namespace dcr::protocol_internal
