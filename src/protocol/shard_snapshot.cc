// Snapshots taken by trainer processes (docs/protocol.md, "Snapshots from
// trainer shards"). No process holds the checkpoint, so each canonical
// tensor is assembled by one process, its owner: the process of the sender
// whose primary copy holds the tensor's first element. The owner takes its
// own senders' primary copies and the elements the other processes send it
// as overwrite-class contribution objects (docs/format.md section 5). Each
// owner uploads its tensors as one safetensors file and records the file
// with its digest. Process 0 writes snapshot.json once every record is in
// and their digests add up to the version's.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "coordinator.h"
#include "dcr/contribution.h"
#include "dcr/run_keys.h"
#include "internal.h"

namespace dcr::protocol_internal {

namespace fs = std::filesystem;

namespace {

using Interval = std::pair<uint64_t, uint64_t>;  // canonical elements [first, first + length)

class ShardSnapshot {
 public:
  ShardSnapshot(const ShardSnapshotContext& c, uint64_t v) : c_(c), v_(v) {}

  Status Take() {
    DCR_ASSIGN_OR_RETURN(bool done, Done());
    if (done) return Status::Ok();
    DCR_ASSIGN_OR_RETURN(commit_, ReadCommit(*c_.store, v_));
    DCR_RETURN_IF_ERROR(Plan());
    DCR_RETURN_IF_ERROR(Send());
    DCR_ASSIGN_OR_RETURN(bool received, Receive());
    if (!received) return Status::Ok();  // another round completed it meanwhile
    DCR_RETURN_IF_ERROR(CheckCovered());
    DCR_RETURN_IF_ERROR(Record());
    if (c_.process != 0) return Status::Ok();
    return Complete();
  }

  ~ShardSnapshot() {
    file_.reset();
    std::error_code ec;
    if (!scratch_.empty()) fs::remove(scratch_, ec);
  }

 private:
  uint32_t Me() const { return c_.process; }
  uint32_t P() const { return c_.processes; }
  Clock& clock() const { return ClockOf(*c_.options); }
  std::string Where(const std::string& key) const { return StoreContext(c_.store->url(), key); }
  // The name of process p's file in the snapshot.
  std::string FileName(uint32_t p) const {
    return P() == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", p + 1, P());
  }

  Result<bool> Done() {
    auto r = ReadSnapshot(*c_.store, v_);
    if (r.ok()) return true;
    if (r.status().code() == Code::kNotFound) return false;
    return r.status();
  }

  // The layout as an overwrite-class delta (contribution objects name one),
  // each tensor's owner, and this process's file of the tensors it owns.
  Status Plan() {
    m_ = TensorTableOf(*c_.run);
    m_.delta_class = DeltaClass::kOverwrite;
    m_.delta_id = v_;
    std::vector<TensorInfo> mine;
    for (uint32_t t = 0; t < m_.tensors.size(); ++t) {
      DCR_ASSIGN_OR_RETURN(uint32_t sender, ChunkOwner(c_.maps, m_, t, 0));
      owner_.push_back(c_.sender_process[sender]);
      if (owner_.back() != Me()) continue;
      const DeltaTensor& d = m_.tensors[t];
      mine.push_back({d.name, d.dtype, d.shape, d.elements, d.elements * BitsPerElement(d.dtype) / 8});
    }
    covered_.resize(m_.tensors.size());
    if (mine.empty()) return Status::Ok();
    scratch_ = (fs::path(c_.scratch_dir) / fmt::format("snapshot-p{}.safetensors", Me())).string();
    std::error_code ec;
    fs::remove(scratch_, ec);
    DCR_ASSIGN_OR_RETURN(Checkpoint file, Checkpoint::Create(scratch_, mine));
    file_.emplace(std::move(file));
    file_index_.assign(m_.tensors.size(), 0);
    for (uint32_t t = 0; t < m_.tensors.size(); ++t)
      if (owner_[t] == Me()) file_index_[t] = static_cast<size_t>(file_->Find(m_.tensors[t].name));
    return Status::Ok();
  }

  // This process's senders' primary copies: copied into its own file where
  // it owns the tensor, otherwise into the contribution object of the owner
  // (digest field zero: process 0 checks the files' digests); one object per
  // other process, written even when empty (its reader waits for it).
  Status Send() {
    std::vector<std::vector<ChunkContribution>> to(P());
    std::vector<CopyRun> runs;
    for (size_t i = 0; i < c_.local.size(); ++i) {
      const CompiledLayout& l = *c_.local[i].layout;
      for (uint32_t t = 0; t < m_.tensors.size(); ++t) {
        const int64_t lt = l.FindTensor(m_.tensors[t].name);
        if (lt < 0) continue;
        const uint64_t eb = BitsPerElement(m_.tensors[t].dtype) / 8;
        for (uint32_t chunk = 0; chunk < m_.ChunkCount(t); ++chunk) {
          const uint64_t first = uint64_t{chunk} * m_.chunk_elements;
          const uint64_t count = std::min<uint64_t>(m_.chunk_elements, m_.tensors[t].elements - first);
          ChunkContribution part;
          part.tensor = t;
          part.chunk = chunk;
          part.from = c_.local_ids[i];
          for (uint32_t copy : l.CopiesOf(static_cast<size_t>(lt))) {
            if (!l.map().copies[copy].primary) continue;
            runs.clear();
            l.RunsInRange(copy, first, count, &runs);
            const uint8_t* buffer = c_.local[i].buffers[l.BufferOf(copy)].data();
            for (const CopyRun& r : runs) {
              const std::span<const uint8_t> bits(buffer + r.buffer * eb, r.length * eb);
              if (owner_[t] == Me()) {
                Place(t, r.canonical, bits);
                continue;
              }
              part.covered.emplace_back(static_cast<uint32_t>(r.canonical - first), static_cast<uint32_t>(r.length));
              part.covered_bits.insert(part.covered_bits.end(), bits.begin(), bits.end());
            }
          }
          if (!part.covered.empty()) to[owner_[t]].push_back(std::move(part));
        }
      }
    }
    for (uint32_t q = 0; q < P(); ++q) {
      if (q == Me()) continue;
      DCR_ASSIGN_OR_RETURN(std::string bytes, WriteContributions({v_, DeltaClass::kOverwrite, Me(), q}, m_, to[q]));
      to[q].clear();
      DCR_RETURN_IF_ERROR(c_.store->Put(run_keys::SnapshotPart(v_, Me(), q), bytes));
    }
    return Fault(*c_.options, "snapshot-parts-written");
  }

  // Canonical elements of owned tensor t from `first` on.
  void Place(uint32_t t, uint64_t first, std::span<const uint8_t> bits) {
    const uint64_t eb = BitsPerElement(m_.tensors[t].dtype) / 8;
    std::span<uint8_t> data = file_->MutableData(file_index_[t]);
    std::copy(bits.begin(), bits.end(), data.begin() + static_cast<ptrdiff_t>(first * eb));
    covered_[t].emplace_back(first, bits.size() / eb);
  }

  // The other processes' objects for this one, placed; false when the
  // snapshot was completed by another round while this one waited.
  Result<bool> Receive() {
    std::set<uint32_t> missing;
    for (uint32_t q = 0; q < P(); ++q)
      if (q != Me()) missing.insert(q);
    const auto deadline = clock().Now() + c_.options->peer_timeout;
    while (!missing.empty()) {
      for (auto it = missing.begin(); it != missing.end();) {
        const std::string key = run_keys::SnapshotPart(v_, *it, Me());
        DCR_ASSIGN_OR_RETURN(auto bytes, GetIfPresent(*c_.store, key));
        if (!bytes) {
          ++it;
          continue;
        }
        DCR_RETURN_IF_ERROR(PlaceParts(*it, key, *bytes));
        it = missing.erase(it);
      }
      if (missing.empty()) break;
      DCR_ASSIGN_OR_RETURN(bool done, Done());
      if (done) return false;
      if (clock().Now() >= deadline)
        return Unavailable(fmt::format(
            "the snapshot of version {}: process {} sent process {} no part within the peer timeout ({} ms); "
            "the next publish takes the snapshot again",
            v_, *missing.begin(), Me(), c_.options->peer_timeout.count()));
      clock().Sleep(c_.options->peer_poll);
    }
    return true;
  }

  Status PlaceParts(uint32_t from, const std::string& key, const std::string& bytes) {
    DCR_ASSIGN_OR_RETURN(
        auto parts, ParseContributions({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()},
                                       {v_, DeltaClass::kOverwrite, from, Me()}, m_, c_.senders_of[from], Where(key)));
    for (const ChunkContribution& part : parts) {
      if (owner_[part.tensor] != Me() || !part.positions.empty())
        return InvalidArgument(fmt::format("{}: elements of tensor '{}', which process {} does not assemble",
                                           Where(key), m_.tensors[part.tensor].name, Me()));
      const uint64_t eb = BitsPerElement(m_.tensors[part.tensor].dtype) / 8;
      const uint64_t first = uint64_t{part.chunk} * m_.chunk_elements;
      uint64_t at = 0;
      for (const auto& [start, length] : part.covered) {
        Place(part.tensor, first + start, {part.covered_bits.data() + at * eb, uint64_t{length} * eb});
        at += length;
      }
    }
    return Status::Ok();
  }

  // Every owned tensor's elements placed exactly once.
  Status CheckCovered() {
    for (uint32_t t = 0; t < m_.tensors.size(); ++t) {
      if (owner_[t] != Me()) continue;
      std::vector<Interval>& runs = covered_[t];
      std::sort(runs.begin(), runs.end());
      uint64_t next = 0;
      for (const auto& [first, length] : runs) {
        if (first != next) break;
        next += length;
      }
      if (next != m_.tensors[t].elements)
        return FailedPrecondition(fmt::format(
            "the snapshot of version {}: tensor '{}' is not covered exactly once by the senders' primary copies "
            "(element {} {}); give every process the same layout maps and placement",
            v_, m_.tensors[t].name, next, next < m_.tensors[t].elements ? "is missing or held twice" : "overflows"));
    }
    return Status::Ok();
  }

  // This process's file uploaded, then its record with the file's digest.
  Status Record() {
    SnapshotRecord rec;
    rec.version = v_;
    if (file_) {
      for (size_t i = 0; i < file_->size(); ++i)
        rec.digest += DigestBytes(MakeDigestKey(file_->tensors()[i].name), 0, file_->Data(i));
      DCR_RETURN_IF_ERROR(file_->Sync());
      DCR_ASSIGN_OR_RETURN(SnapshotRecord::File f,
                           UploadSnapshotFile(*c_.store, v_, scratch_, FileName(Me()), nullptr));
      rec.files.push_back(std::move(f));
    }
    return c_.store->Put(run_keys::SnapshotProcess(v_, Me()), rec.ToJson());
  }

  // Process 0: every process's record, their digests checked against the
  // version's, the index (several files), then snapshot.json; the parts go
  // (also when the digests do not add up).
  Status Complete() {
    SnapshotRecord snapshot;
    snapshot.version = v_;
    DCR_ASSIGN_OR_RETURN(std::vector<SnapshotRecord> records, AwaitRecords());
    std::string partials;
    for (uint32_t q = 0; q < P(); ++q) {
      const SnapshotRecord& r = records[q];
      snapshot.digest += r.digest;
      partials += fmt::format(" p{}={}", q, r.digest.ToHex());
      for (const auto& f : r.files) snapshot.files.push_back(f);
    }
    if (snapshot.digest != commit_.target_digest) {
      // Every process has recorded, so none reads the parts any more: the
      // next round starts from fresh ones.
      RemoveParts();
      return DataLoss(fmt::format(
          "the snapshot of version {}: the processes' files' digests ({}) add up to {}, not the version's {}; "
          "no snapshot was recorded",
          v_, partials.substr(1), snapshot.digest.ToHex(), commit_.target_digest.ToHex()));
    }
    if (P() > 1) DCR_RETURN_IF_ERROR(WriteIndex(&snapshot));
    DCR_RETURN_IF_ERROR(CarryOtherFiles(&snapshot));
    DCR_RETURN_IF_ERROR(c_.store->Put(run_keys::Snapshot(v_) + "snapshot.json", snapshot.ToJson()));
    RemoveParts();
    return Status::Ok();
  }

  // Best effort: GC removes what is left once a newer snapshot exists.
  void RemoveParts() {
    if (auto parts = c_.store->List(run_keys::Snapshot(v_) + "parts/"); parts.ok())
      for (const auto& o : *parts) c_.store->Delete(o.key).IgnoreError();
  }

  Result<std::vector<SnapshotRecord>> AwaitRecords() {
    std::vector<SnapshotRecord> records(P());
    const auto deadline = clock().Now() + c_.options->peer_timeout;
    for (uint32_t q = 0; q < P();) {
      const std::string key = run_keys::SnapshotProcess(v_, q);
      DCR_ASSIGN_OR_RETURN(auto text, GetIfPresent(*c_.store, key));
      if (!text) {
        if (clock().Now() >= deadline)
          return Unavailable(
              fmt::format("the snapshot of version {}: process {} recorded no file within the peer timeout ({} ms); "
                          "the next publish takes the snapshot again",
                          v_, q, c_.options->peer_timeout.count()));
        clock().Sleep(c_.options->peer_poll);
        continue;
      }
      DCR_ASSIGN_OR_RETURN(SnapshotRecord r, SnapshotRecord::FromJson(*text, Where(key)));
      const bool owns = std::count(owner_.begin(), owner_.end(), q) > 0;
      if (r.version != v_ || r.files.size() != (owns ? 1u : 0u) || (owns && r.files[0].name != FileName(q)))
        return FailedPrecondition(fmt::format("{}: the record is not process {}'s file of version {} ({})", Where(key),
                                              q, v_, owns ? FileName(q) : "none"));
      records[q] = std::move(r);
      ++q;
    }
    return records;
  }

  // The checkpoint's other files (config, tokenizer), which no trainer
  // process holds: copied from the newest earlier snapshot (version 0's
  // holds those of the checkpoint the run started from).
  Status CarryOtherFiles(SnapshotRecord* snapshot) {
    auto earlier = NewestSnapshot(*c_.store, v_ - 1);
    if (!earlier.ok()) return earlier.status().code() == Code::kNotFound ? Status::Ok() : earlier.status();
    for (const SnapshotRecord::File& f : earlier->files) {
      if (f.name.ends_with(".safetensors") || f.name == kIndexName) continue;
      DCR_ASSIGN_OR_RETURN(std::string bytes, c_.store->Get(run_keys::Snapshot(earlier->version) + "files/" + f.name));
      DCR_RETURN_IF_ERROR(c_.store->Put(run_keys::Snapshot(v_) + "files/" + f.name, bytes));
      snapshot->files.push_back({f.name, bytes.size()});
    }
    return Status::Ok();
  }

  static constexpr std::string_view kIndexName = "model.safetensors.index.json";

  // model.safetensors.index.json: which file holds each tensor.
  Status WriteIndex(SnapshotRecord* snapshot) {
    nlohmann::json weight_map = nlohmann::json::object();
    for (uint32_t t = 0; t < m_.tensors.size(); ++t) weight_map[m_.tensors[t].name] = FileName(owner_[t]);
    uint64_t total = 0;
    for (const DeltaTensor& t : m_.tensors) total += t.elements * BitsPerElement(t.dtype) / 8;
    const nlohmann::json doc = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string text = JsonText(doc, 2) + "\n";
    DCR_RETURN_IF_ERROR(c_.store->Put(run_keys::Snapshot(v_) + "files/" + std::string(kIndexName), text));
    snapshot->files.push_back({std::string(kIndexName), text.size()});
    return Status::Ok();
  }

  const ShardSnapshotContext& c_;
  const uint64_t v_;
  CommitRecord commit_;
  DeltaManifest m_;
  std::vector<uint32_t> owner_;  // per tensor: the process that assembles it
  std::vector<size_t> file_index_;  // per tensor this process owns: its index in file_
  std::vector<std::vector<Interval>> covered_;  // per owned tensor: elements placed
  std::string scratch_;  // this process's file while it is assembled
  std::optional<Checkpoint> file_;
};

}  // namespace

Status TakeShardSnapshot(const ShardSnapshotContext& context, uint64_t v) {
  return ShardSnapshot(context, v).Take().WithContext(fmt::format("taking the snapshot of version {}", v));
}

}  // namespace dcr::protocol_internal
