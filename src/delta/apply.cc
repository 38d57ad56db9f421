// The apply loop (include/dcr/apply.h).
#include "dcr/apply.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "dcr/checkpoint.h"
#include "dcr/progress.h"
#include "dcr/thread_pool.h"

namespace dcr {
namespace {

// Checks that `h` is a frame of `m` and fills the item's chunk geometry.
Status CheckFrameFits(const DeltaManifest& m, const FrameHeader& h, ApplyItem* item) {
  if (h.tensor >= m.tensors.size())
    return InvalidArgument(fmt::format("frame names tensor {} but the manifest has {}", h.tensor, m.tensors.size()));
  const DeltaTensor& tensor = m.tensors[h.tensor];
  if (h.chunk >= m.ChunkCount(h.tensor))
    return InvalidArgument(fmt::format("tensor '{}' chunk {}: the tensor has only {} chunks", tensor.name, h.chunk,
                                       m.ChunkCount(h.tensor)));
  if (h.dtype != tensor.dtype)
    return InvalidArgument(fmt::format("tensor '{}' chunk {}: the frame is of {} but the tensor is {}", tensor.name,
                                       h.chunk, Name(h.dtype), Name(tensor.dtype)));
  uint64_t first_word = 0, words = 0;
  uint32_t elements = 0;
  m.ChunkWords(h.tensor, h.chunk, &first_word, &words, &elements);
  if (words > 0xFFFFFFFFu)
    return InvalidArgument(fmt::format("tensor '{}' chunk {}: {} words in one chunk", tensor.name, h.chunk, words));
  item->tensor = h.tensor;
  item->chunk = h.chunk;
  item->first_word = first_word;
  item->words = static_cast<uint32_t>(words);
  return Status::Ok();
}

// The digest change of the changes the target counts.
Digest CountedDigest(const DigestKey& key, const ApplyItem& item) {
  if (item.counted.empty()) return ChangesDigest(key, item.first_word, item.changes);
  Digest d;
  item.changes.Visit([&](auto* c) {
    using Record = std::remove_pointer_t<decltype(c)>;
    std::vector<Record> kept;
    for (uint32_t i = 0; i < item.changes.count; ++i)
      if (item.counted[i]) kept.push_back(c[i]);
    d = ChangesDigest(key, item.first_word, {item.changes.word_bytes, static_cast<uint32_t>(kept.size()), kept.data()});
  });
  return d;
}

// Drops the changes whose new word is the old one (a dense overwrite lists
// every word), order kept.
void DropUnchanged(ApplyItem& item) {
  item.changes.Visit([&](auto* c) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < item.changes.count; ++i) {
      if (c[i].new_word == c[i].old_word) continue;
      if (!item.counted.empty()) item.counted[kept] = item.counted[i];
      c[kept++] = c[i];
    }
    item.changes.count = kept;
    if (!item.counted.empty()) item.counted.resize(kept);
  });
}

// One frame's state in the loop.
struct Slot {
  size_t frame = 0;
  DigestKey key;  // of the frame's tensor
  ApplyItem item;
  bool gathered = false;  // decoded for the target's Gather (not Direct, not already done)
};

class Loop {
 public:
  Loop(ApplyTarget& target, const DeltaManifest& m, std::span<const FrameView> frames, std::span<const Digest> current,
       const std::vector<bool>& skip, const ApplyLoopOptions& o, std::vector<FrameApplied>& out)
      : target_(target), m_(m), frames_(frames), current_(current), skip_(skip), o_(o), out_(out) {}

  // Checks frame s.frame, applies it directly when the target allows, or
  // decodes it for a gather (into `storage` when given). Sets s.gathered.
  void Start(Slot& s, uint8_t* storage) {
    FrameApplied& r = out_[s.frame];
    const FrameView& frame = frames_[s.frame];
    r.after = current_[s.frame];
    if (skip_[s.frame]) return;
    r.status = CheckFrameFits(m_, frame.header, &s.item);
    if (!r.status.ok()) return;
    Result<Holding> holding = target_.Holds(s.item.tensor, s.item.chunk);
    if (!holding.ok()) {
      r.status = holding.status();
      return;
    }
    r.holding = *holding;
    if (r.holding == Holding::kNone) return;
    if (target_.Audits() && !Audit(s, r)) return;
    if (r.holding == Holding::kWhole && r.after == frame.header.target_digest) return;  // already applied
    s.key = MakeDigestKey(m_.tensors[s.item.tensor].name);
    if (const std::span<uint8_t> direct = target_.Direct(s.item.tensor, s.item.chunk); !direct.empty()) {
      thread_local ChunkApplier applier;
      Result<ApplyOutcome> outcome =
          applier.Apply(frame, s.key, s.item.first_word, direct, r.after, &r.after, o_.write);
      if (!outcome.ok()) {
        r.status = outcome.status().WithContext(Where(s.item));
        return;
      }
      r.outcome = *outcome;
      if (*outcome == ApplyOutcome::kApplied && o_.write) r.written = frame.header.changed;
      return;
    }
    thread_local ChunkApplier decoder;
    Result<ChunkChanges> changes = decoder.DecodeValues(frame, s.item.words, storage);
    if (!changes.ok()) {
      r.status = changes.status().WithContext(Where(s.item));
      return;
    }
    s.item.changes = *changes;
    s.item.counted.clear();
    s.gathered = true;
  }

  // The chunk's digest from its bits, in place of the tracked one: a whole
  // chunk is then checked from what it holds; a partial one whose bits are
  // not what is tracked takes only an overwrite frame. False: refused.
  bool Audit(Slot& s, FrameApplied& r) {
    Result<Digest> bits = target_.ChunkDigest(s.item.tensor, s.item.chunk);
    if (!bits.ok()) {
      r.status = bits.status().WithContext(Where(s.item));
      return false;
    }
    if (*bits != r.after && r.holding == Holding::kPartial && frames_[s.frame].header.mode != Mode::kOverwrite) {
      r.status = FailedPrecondition(fmt::format(
          "{}: this rank's elements of the chunk are not at the digest it tracks (digest {}, tracked {}): they "
          "changed behind its back or an earlier attempt was partly applied; an overwrite frame repairs them",
          Where(s.item), bits->ToHex(), r.after.ToHex()));
      return false;
    }
    r.after = *bits;
    return true;
  }

  // After the gather: new words, the digest change and its check. Returns
  // whether the item is to be scattered.
  bool Finish(Slot& s) {
    FrameApplied& r = out_[s.frame];
    const FrameHeader& h = frames_[s.frame].header;
    ChunkApplier::Resolve(h, s.item.changes);
    if (h.codec != Codec::kSparse && h.mode == Mode::kOverwrite) DropUnchanged(s.item);
    const Digest after = r.after + CountedDigest(s.key, s.item);
    if (r.holding == Holding::kWhole && after != h.target_digest) {
      r.status = FailedPrecondition(fmt::format(
          "tensor '{}' chunk {}: the target chunk is not this frame's base (applying it would give digest {}, not "
          "the frame's target {}); it needs {} or a resync from a snapshot",
          m_.tensors[s.item.tensor].name, s.item.chunk, after.ToHex(), h.target_digest.ToHex(),
          h.mode == Mode::kOverwrite ? "a dense overwrite" : "an overwrite frame"));
      return false;
    }
    r.after = after;
    r.outcome = ApplyOutcome::kApplied;
    if (o_.write) r.written = r.holding == Holding::kWhole ? h.changed : s.item.changes.count;
    return o_.write;
  }

  // Frame by frame on the pool: a target whose gathers cost nothing per call.
  void RunEach(ThreadPool& pool) {
    pool.ParallelFor(frames_.size(), [&](size_t i) {
      Slot s;
      s.frame = i;
      ApplyOne(s);
      Done(s);
    });
  }

  // Windows of frames whose decoded changes fit `budget` bytes (at least
  // one frame each): decoded on the pool, gathered and scattered at once.
  void RunWindows(ThreadPool& pool, uint64_t budget) {
    for (size_t begin = 0; begin < frames_.size();) {
      std::vector<uint64_t> offset{0};
      size_t end = begin;
      while (end < frames_.size()) {
        const FrameHeader& h = frames_[end].header;
        uint64_t words = 0;
        if (h.tensor < m_.tensors.size() && h.chunk < m_.ChunkCount(h.tensor)) {
          uint64_t first = 0;
          uint32_t elements = 0;
          m_.ChunkWords(h.tensor, h.chunk, &first, &words, &elements);
        }
        const uint64_t bytes = (ChunkApplier::DecodedBytes(h, static_cast<uint32_t>(words)) + 7) / 8 * 8;
        if (end > begin && offset.back() + bytes > budget) break;
        offset.push_back(offset.back() + bytes);
        ++end;
      }
      auto arena = std::make_unique_for_overwrite<uint64_t[]>(offset.back() / 8 + 1);
      if (o_.scratch_peak) *o_.scratch_peak = std::max(*o_.scratch_peak, offset.back());
      std::vector<Slot> slots(end - begin);
      pool.ParallelFor(slots.size(), [&](size_t k) {
        slots[k].frame = begin + k;
        Start(slots[k], reinterpret_cast<uint8_t*>(arena.get()) + offset[k]);
      });
      std::vector<ApplyItem*> items;
      std::vector<Slot*> of;
      for (Slot& s : slots)
        if (s.gathered) items.push_back(&s.item), of.push_back(&s);
      if (!items.empty()) Window(pool, items, of);
      for (const Slot& s : slots) Done(s);
      begin = end;
    }
  }

 private:
  std::string Where(const ApplyItem& item) const {
    return fmt::format("tensor '{}' chunk {}", m_.tensors[item.tensor].name, item.chunk);
  }

  void ApplyOne(Slot& s) {
    Start(s, nullptr);
    if (!s.gathered) return;
    ApplyItem* item = &s.item;
    FrameApplied& r = out_[s.frame];
    if (Status g = target_.Gather({&item, 1}); !g.ok()) {
      r.status = g;
      return;
    }
    if (!Finish(s)) return;
    if (Status w = target_.Scatter({&item, 1}); !w.ok()) {
      r.status = w;
      r.written = 0;
      r.torn = true;
    }
  }

  void Done(const Slot& s) {
    if (o_.progress && s.item.words > 0)
      o_.progress->Add(uint64_t{s.item.words} * WordBytes(m_.tensors[s.item.tensor].dtype));
  }

  void Window(ThreadPool& pool, const std::vector<ApplyItem*>& items, const std::vector<Slot*>& of) {
    auto fail_all = [&](const std::vector<Slot*>& slots, const Status& s) {
      for (Slot* slot : slots) out_[slot->frame].status = s, out_[slot->frame].written = 0;
      if (&slots != &of)  // a scatter's failure
        for (Slot* slot : slots) out_[slot->frame].torn = true;
    };
    if (Status g = target_.Gather(items); !g.ok()) return fail_all(of, g);
    std::vector<char> keep(items.size());
    pool.ParallelFor(items.size(), [&](size_t k) { keep[k] = Finish(*of[k]); });
    std::vector<ApplyItem*> writes;
    std::vector<Slot*> written;
    for (size_t k = 0; k < items.size(); ++k)
      if (keep[k]) writes.push_back(items[k]), written.push_back(of[k]);
    if (writes.empty()) return;
    if (Status w = target_.Scatter(writes); !w.ok()) fail_all(written, w);
  }

  ApplyTarget& target_;
  const DeltaManifest& m_;
  std::span<const FrameView> frames_;
  std::span<const Digest> current_;
  const std::vector<bool>& skip_;  // refused already (a second frame of a chunk)
  const ApplyLoopOptions& o_;
  std::vector<FrameApplied>& out_;
};

// The target settles what the call wrote (ApplyTarget::Finish); a failure
// tears every frame that wrote.
void FinishTarget(ApplyTarget& target, std::vector<FrameApplied>& out) {
  if (std::none_of(out.begin(), out.end(), [](const FrameApplied& r) { return r.written > 0; })) return;
  const Status finished = target.Finish();
  if (finished.ok()) return;
  for (FrameApplied& r : out)
    if (r.written > 0) r.status = finished, r.torn = true;
}

}  // namespace

Result<Digest> ApplyTarget::ChunkDigest(uint32_t tensor, uint32_t chunk) const {
  return Unimplemented(fmt::format("this target cannot digest tensor {} chunk {} from its bits", tensor, chunk));
}

std::vector<FrameApplied> ApplyFrames(ApplyTarget& target, const DeltaManifest& manifest,
                                      std::span<const FrameView> frames, std::span<const Digest> current,
                                      const ApplyLoopOptions& options) {
  std::vector<FrameApplied> out(frames.size());
  if (current.size() != frames.size()) {
    for (FrameApplied& r : out)
      r.status =
          InvalidArgument(fmt::format("ApplyFrames: {} current digests for {} frames", current.size(), frames.size()));
    return out;
  }
  // Frames of one chunk would write the same words at once: the first by
  // frame order is applied, the others refused.
  std::vector<std::pair<std::pair<uint32_t, uint32_t>, size_t>> chunks(frames.size());
  for (size_t i = 0; i < frames.size(); ++i) chunks[i] = {{frames[i].header.tensor, frames[i].header.chunk}, i};
  std::sort(chunks.begin(), chunks.end());
  std::vector<bool> skip(frames.size());
  for (size_t k = 1; k < chunks.size(); ++k)
    if (chunks[k].first == chunks[k - 1].first) {
      skip[chunks[k].second] = true;
      out[chunks[k].second].status =
          InvalidArgument(fmt::format("two frames of tensor {} chunk {} in one apply; the second is refused",
                                      chunks[k].first.first, chunks[k].first.second));
    }
  ThreadPool& pool = options.pool ? *options.pool : DefaultPool();
  Loop loop(target, manifest, frames, current, skip, options, out);
  if (!target.Batched()) {
    loop.RunEach(pool);
  } else {
    // The decoded changes held at once: an eighth of the frames' payload (a
    // record is 8-24 bytes where a coded change is about one, and the target
    // keeps offsets and words beside it), so that the window's memory stays
    // below the frames' own size.
    uint64_t payload = 0;
    for (const FrameView& f : frames) payload += f.header.payload_bytes;
    loop.RunWindows(pool, std::max<uint64_t>(payload / 8, 1));
  }
  FinishTarget(target, out);
  return out;
}

std::span<uint8_t> CheckpointApplyTarget::Direct(uint32_t tensor, uint32_t chunk) const {
  uint64_t first_word = 0, words = 0;
  uint32_t elements = 0;
  manifest_.ChunkWords(tensor, chunk, &first_word, &words, &elements);
  const uint64_t wb = WordBytes(manifest_.tensors[tensor].dtype);
  return ckpt_.MutableData(index_[tensor]).subspan(first_word * wb, words * wb);
}

Status CheckpointApplyTarget::Gather(std::span<ApplyItem* const>) {
  return Internal("CheckpointApplyTarget: every chunk is direct; nothing to gather");
}

Status CheckpointApplyTarget::Scatter(std::span<ApplyItem* const>) {
  return Internal("CheckpointApplyTarget: every chunk is direct; nothing to scatter");
}

}  // namespace dcr
