// Keys and the JSON records of the protocol (docs/protocol.md).
#include <fmt/format.h>

#include <charconv>

#include <cctype>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "dcr/frame.h"
#include "dcr/json.h"
#include "dcr/run_keys.h"
#include "dcr/run_records.h"
#include "internal.h"

namespace dcr {

namespace run_keys {
std::string VersionDir(uint64_t v) { return fmt::format("v{:010}", v); }
std::string Commit(uint64_t v) { return "commits/" + VersionDir(v) + ".json"; }
std::string Attempts(uint64_t v) { return "attempts/" + VersionDir(v) + "/"; }
std::string Attempt(uint64_t v, std::string_view attempt) { return Attempts(v) + std::string(attempt) + "/"; }
std::string Acks(uint64_t v, std::string_view attempt) { return Attempt(v, attempt) + "acks/"; }
std::string Ack(uint64_t v, std::string_view attempt, std::string_view receiver) {
  return Acks(v, attempt) + std::string(receiver) + ".json";
}
std::string AttemptRecord(uint64_t v, std::string_view attempt) { return Attempt(v, attempt) + "attempt.json"; }
std::string Manifest(uint64_t v, std::string_view attempt) {
  return Attempt(v, attempt) + std::string(kManifestFileName);
}
std::string Fence(uint64_t v, std::string_view attempt) { return Attempt(v, attempt) + "fence"; }
std::string Timelines(uint64_t v, std::string_view attempt) { return Attempt(v, attempt) + "timeline/"; }
std::string Timeline(uint64_t v, std::string_view attempt, std::string_view process) {
  return Timelines(v, attempt) + std::string(process) + ".json";
}
std::string FrameObject(uint32_t sender, size_t index, std::optional<ChunkId> first) {
  if (!first) return fmt::format("frames/s{}-{:04}.bin", sender, index);
  return fmt::format("frames/s{}-{:04}-t{}c{}.bin", sender, index, first->tensor, first->chunk);
}

namespace {
// Reads the decimal digits at the start of *s (at most 10) into *out, moving
// *s past them; false when there are none or they overflow.
template <typename T>
bool TakeNumber(std::string_view* s, T* out) {
  size_t n = 0;
  while (n < s->size() && n < 11 && std::isdigit(static_cast<unsigned char>((*s)[n]))) ++n;
  if (n == 0 || n > 10) return false;
  const auto r = std::from_chars(s->data(), s->data() + n, *out);
  if (r.ec != std::errc()) return false;
  s->remove_prefix(n);
  return true;
}
bool Take(std::string_view* s, std::string_view what) {
  if (!s->starts_with(what)) return false;
  s->remove_prefix(what.size());
  return true;
}
}  // namespace

std::optional<FrameObjectName> ParseFrameObject(std::string_view name) {
  FrameObjectName f;
  if (!Take(&name, "frames/s") || !TakeNumber(&name, &f.sender) || !Take(&name, "-")) return std::nullopt;
  const size_t before = name.size();
  if (!TakeNumber(&name, &f.index) || before - name.size() < 4) return std::nullopt;  // NNNN: at least 4 digits
  if (Take(&name, "-t")) {
    ChunkId c;
    if (!TakeNumber(&name, &c.tensor) || !Take(&name, "c") || !TakeNumber(&name, &c.chunk)) return std::nullopt;
    f.first = c;
  }
  if (name != ".bin") return std::nullopt;
  return f;
}
std::string Process(uint64_t v, std::string_view attempt, uint32_t p) {
  return Attempt(v, attempt) + fmt::format("procs/p{}.json", p);
}
std::string ProcessSigner(uint32_t p) { return fmt::format("procs/p{}.pub", p); }
std::string Contribution(uint64_t v, std::string_view attempt, uint32_t from, uint32_t to) {
  return Attempt(v, attempt) + fmt::format("contrib/p{}-p{}.bin", from, to);
}
std::string Snapshot(uint64_t v) { return std::string(kSnapshots) + VersionDir(v) + "/"; }
std::string SnapshotPart(uint64_t v, uint32_t from, uint32_t to) {
  return Snapshot(v) + fmt::format("parts/p{}-p{}.bin", from, to);
}
std::string SnapshotProcess(uint64_t v, uint32_t p) { return Snapshot(v) + fmt::format("parts/p{}.json", p); }
std::string Receiver(std::string_view id) { return std::string(kReceivers) + std::string(id) + ".json"; }
}  // namespace run_keys

namespace protocol_internal {
Result<Digest> DigestField(const JsonFields& f, const char* key) {
  DCR_ASSIGN_OR_RETURN(std::string hex, f.String(key));
  Digest d;
  if (!Digest::FromHex(hex, &d)) return f.Error(fmt::format("'{}' is not a digest", key));
  return d;
}
}  // namespace protocol_internal

namespace {

using json = nlohmann::ordered_json;

Status Bad(const std::string& where, std::string_view what) {
  return InvalidArgument(fmt::format(
      "{}: does not parse: {} (the store holds a damaged record, or one from another dcr; inspect it with dcr status)",
      where, what));
}

Result<json> Parse(std::string_view text, const std::string& where, std::string_view format) {
  DCR_ASSIGN_OR_RETURN(json doc, ParseJsonObject(text, [&](std::string_view what) { return Bad(where, what); }));
  auto f = doc.find("format");
  if (f == doc.end() || !f->is_string() || *f != format)
    return Bad(where, fmt::format("'format' is not \"{}\"", format));
  return doc;
}

JsonFields Fields(const json& o, const std::string& where) {
  return JsonFields(o, [where](std::string_view what) { return Bad(where, what); });
}
Result<uint64_t> U64(const json& o, const char* key, const std::string& where) { return Fields(o, where).U64(key); }
Result<double> Num(const json& o, const char* key, const std::string& where) { return Fields(o, where).Number(key); }
Result<std::string> Str(const json& o, const char* key, const std::string& where) {
  return Fields(o, where).String(key);
}
Result<bool> Bool(const json& o, const char* key, const std::string& where) { return Fields(o, where).Bool(key); }
Result<Digest> Dig(const json& o, const char* key, const std::string& where) {
  return protocol_internal::DigestField(Fields(o, where), key);
}
Result<std::vector<std::string>> Strs(const json& o, const char* key, const std::string& where) {
  return Fields(o, where).Strings(key);
}

std::string Dump(const json& doc) { return JsonText(doc, 1) + "\n"; }

// A record's plain fields are declared once, as a table of (JSON key, member)
// pairs (kCommitFields...): PutFields writes them in the table's order and
// GetFields reads and type-checks them, errors naming the key. What a table
// cannot say (checks across fields, nested arrays) stays beside it.
template <typename R, typename T>
struct Field {
  const char* key;
  T R::*member;
  bool optional = false;  // absent from older dcr's records: the member keeps its default
};
template <typename R, typename T>
constexpr Field<R, T> F(const char* key, T R::*member, bool optional = false) {
  return {key, member, optional};
}

void PutValue(json& j, const Digest& d) { j = d.ToHex(); }
template <typename T>
void PutValue(json& j, const T& v) {
  j = v;
}

Status GetValue(const json& o, const char* key, const std::string& where, uint64_t* out) {
  DCR_ASSIGN_OR_RETURN(*out, U64(o, key, where));
  return Status::Ok();
}
Status GetValue(const json& o, const char* key, const std::string& where, double* out) {
  DCR_ASSIGN_OR_RETURN(*out, Num(o, key, where));
  return Status::Ok();
}
Status GetValue(const json& o, const char* key, const std::string& where, bool* out) {
  DCR_ASSIGN_OR_RETURN(*out, Bool(o, key, where));
  return Status::Ok();
}
Status GetValue(const json& o, const char* key, const std::string& where, std::string* out) {
  DCR_ASSIGN_OR_RETURN(*out, Str(o, key, where));
  return Status::Ok();
}
Status GetValue(const json& o, const char* key, const std::string& where, Digest* out) {
  DCR_ASSIGN_OR_RETURN(*out, Dig(o, key, where));
  return Status::Ok();
}
Status GetValue(const json& o, const char* key, const std::string& where, std::vector<std::string>* out) {
  DCR_ASSIGN_OR_RETURN(*out, Strs(o, key, where));
  return Status::Ok();
}

template <typename R, typename... T>
void PutFields(json& doc, const R& r, const std::tuple<Field<R, T>...>& fields) {
  std::apply([&](const auto&... f) { (PutValue(doc[f.key], r.*f.member), ...); }, fields);
}

template <typename R, typename... T>
Status GetFields(const json& doc, R& r, const std::string& where, const std::tuple<Field<R, T>...>& fields) {
  Status s;
  auto get = [&](const auto& f) {
    if (s.ok() && (!f.optional || doc.contains(f.key))) s = GetValue(doc, f.key, where, &(r.*f.member));
  };
  std::apply([&](const auto&... f) { (get(f), ...); }, fields);
  return s;
}

// A record's JSON: its format, then its table's fields.
template <typename R, typename... T>
json RecordJson(std::string_view format, const R& r, const std::tuple<Field<R, T>...>& fields) {
  json doc;
  doc["format"] = format;
  PutFields(doc, r, fields);
  return doc;
}

// Parses a record of `format` and reads its table's fields into `r`; the
// document, for the fields the table does not hold.
template <typename R, typename... T>
Result<json> ReadRecord(std::string_view text, const std::string& where, std::string_view format, R& r,
                        const std::tuple<Field<R, T>...>& fields) {
  DCR_ASSIGN_OR_RETURN(json doc, Parse(text, where, format));
  DCR_RETURN_IF_ERROR(GetFields(doc, r, where, fields));
  return doc;
}

constexpr auto kFp8SchemeFields = std::make_tuple(
    F("format", &Fp8Scheme::format), F("block_rows", &Fp8Scheme::block_rows), F("block_cols", &Fp8Scheme::block_cols),
    F("scale", &Fp8Scheme::scale), F("rounding", &Fp8Scheme::rounding), F("specials", &Fp8Scheme::specials));
constexpr auto kPublisherMemoryFields = std::make_tuple(
    F("baseline_bytes", &PublisherMemory::baseline_bytes),
    F("baseline_in_memory", &PublisherMemory::baseline_in_memory), F("staging_bytes", &PublisherMemory::staging_bytes),
    F("frames_in_flight_bytes", &PublisherMemory::frames_in_flight_bytes),
    F("digest_bytes", &PublisherMemory::digest_bytes));
constexpr auto kCommitFields = std::make_tuple(
    F("version", &CommitRecord::version), F("base_version", &CommitRecord::base_version),
    F("attempt", &CommitRecord::attempt), F("target_digest", &CommitRecord::target_digest),
    F("acked", &CommitRecord::acked), F("retired", &CommitRecord::retired), F("time", &CommitRecord::time));
// An attempt's other fields depend on its kind (one publisher, or trainer processes).
constexpr auto kAttemptFields =
    std::make_tuple(F("version", &AttemptRecord::version), F("coordinator", &AttemptRecord::coordinator),
                    F("time", &AttemptRecord::time));
constexpr auto kAckFields = std::make_tuple(F("receiver", &AckRecord::receiver), F("ok", &AckRecord::ok),
                                            F("digest", &AckRecord::digest), F("error", &AckRecord::error));
constexpr auto kReceiverFields = std::make_tuple(
    F("id", &ReceiverRecord::id), F("state", &ReceiverRecord::state), F("version", &ReceiverRecord::version),
    F("heartbeat", &ReceiverRecord::heartbeat), F("frames_held_bytes", &ReceiverRecord::frames_held_bytes, true),
    F("master_bytes", &ReceiverRecord::master_bytes, true),
    F("verified_digest", &ReceiverRecord::verified_digest, true), F("verified_at", &ReceiverRecord::verified_at, true));
constexpr auto kSpanFields =
    std::make_tuple(F("stage", &StageSpan::stage), F("start", &StageSpan::start), F("end", &StageSpan::end));
constexpr auto kTimelineFields =
    std::make_tuple(F("process", &TimelineRecord::process), F("role", &TimelineRecord::role),
                    F("version", &TimelineRecord::version), F("total_seconds", &TimelineRecord::total_seconds));
constexpr size_t kMaxSpans = 4096;
constexpr auto kFenceFields = std::make_tuple(F("reason", &FenceRecord::reason), F("time", &FenceRecord::time));
constexpr auto kSnapshotFields =
    std::make_tuple(F("version", &SnapshotRecord::version), F("digest", &SnapshotRecord::digest));
constexpr auto kSnapshotFileFields =
    std::make_tuple(F("name", &SnapshotRecord::File::name), F("bytes", &SnapshotRecord::File::bytes));
constexpr auto kProcessFields =
    std::make_tuple(F("attempt", &ProcessRecord::attempt), F("baseline_digest", &ProcessRecord::baseline_digest),
                    F("target_digest", &ProcessRecord::target_digest), F("objects", &ProcessRecord::objects));

// The optional "engine" member of acks and receiver records: {"id", "rank", "ranks"}.
void PutEngine(json& doc, const EngineRank& e) {
  if (e.ranks == 0) return;
  doc["engine"] = {{"id", e.engine}, {"rank", e.rank}, {"ranks", e.ranks}};
}
Result<EngineRank> GetEngine(const json& doc, const std::string& where) {
  EngineRank e;
  auto it = doc.find("engine");
  if (it == doc.end()) return e;
  if (!it->is_object()) return Bad(where, "'engine' must be an object {id, rank, ranks}");
  DCR_ASSIGN_OR_RETURN(e.engine, Str(*it, "id", where));
  DCR_ASSIGN_OR_RETURN(uint64_t rank, U64(*it, "rank", where));
  DCR_ASSIGN_OR_RETURN(uint64_t ranks, U64(*it, "ranks", where));
  if (e.engine.empty() || ranks == 0 || ranks > (1u << 20) || rank >= ranks)
    return Bad(where, "'engine' needs a non-empty id and 0 <= rank < ranks <= 2^20");
  e.rank = static_cast<uint32_t>(rank);
  e.ranks = static_cast<uint32_t>(ranks);
  return e;
}

// Acks and receiver records: the table's fields and the optional engine.
template <typename R, typename... T>
std::string EngineRecordJson(std::string_view format, const R& r, const std::tuple<Field<R, T>...>& fields) {
  json doc = RecordJson(format, r, fields);
  PutEngine(doc, r.engine);
  return Dump(doc);
}
template <typename R, typename... T>
Result<R> ReadEngineRecord(std::string_view text, const std::string& where, std::string_view format,
                           const std::tuple<Field<R, T>...>& fields) {
  R r;
  DCR_ASSIGN_OR_RETURN(json doc, ReadRecord(text, where, format, r, fields));
  DCR_ASSIGN_OR_RETURN(r.engine, GetEngine(doc, where));
  return r;
}

}  // namespace

std::string RunRecord::ToJson() const {
  json doc;
  doc["format"] = "dcr-run";
  doc["format_version"] = kDeltaFormatVersion;
  doc["run_id"] = run_id;
  doc["chunk_elements"] = chunk_elements;
  json& ts = doc["tensors"] = json::array();
  for (const auto& t : tensors) ts.push_back({{"name", t.name}, {"dtype", Name(t.dtype)}, {"shape", t.shape}});
  if (fp8) PutFields(doc["fp8"], *fp8, kFp8SchemeFields);
  return Dump(doc);
}

std::string Fp8Scheme::ToJson() const {
  json doc;
  PutFields(doc, *this, kFp8SchemeFields);
  return doc.dump();  // one line: it is quoted in errors
}

Result<RunRecord> RunRecord::FromJson(std::string_view text, const std::string& where) {
  DCR_ASSIGN_OR_RETURN(json doc, Parse(text, where, "dcr-run"));
  // Format version 1 (JSON manifests, 96-byte frame headers) had no field.
  const auto version = doc.find("format_version");
  const uint64_t v = version != doc.end() && version->is_number_unsigned() ? version->get<uint64_t>() : 1;
  if (v != kDeltaFormatVersion)
    return Unimplemented(fmt::format("{}: a run of delta format version {} (this dcr reads {}){}", where, v,
                                     kDeltaFormatVersion,
                                     v < kDeltaFormatVersion ? ": it was written by an older dcr; publish into a new, "
                                                               "empty store (a new run)"
                                                             : ""));
  RunRecord r;
  DCR_ASSIGN_OR_RETURN(r.run_id, Str(doc, "run_id", where));
  DCR_ASSIGN_OR_RETURN(DeltaManifest table, DeltaManifest::FromTableJson(text, where, "dcr-run"));
  r.chunk_elements = table.chunk_elements;
  r.tensors = std::move(table.tensors);
  if (auto it = doc.find("fp8"); it != doc.end()) {
    if (!it->is_object()) return Bad(where, "'fp8' must be an object (the FP8 scheme)");
    DCR_RETURN_IF_ERROR(GetFields(*it, r.fp8.emplace(), where, kFp8SchemeFields));
  }
  return r;
}

std::string CommitRecord::ToJson() const {
  json doc = RecordJson("dcr-commit", *this, kCommitFields);
  if (publisher_memory) PutFields(doc["publisher_memory"], *publisher_memory, kPublisherMemoryFields);
  return Dump(doc);
}

Result<CommitRecord> CommitRecord::FromJson(std::string_view text, const std::string& where) {
  CommitRecord r;
  DCR_ASSIGN_OR_RETURN(json doc, ReadRecord(text, where, "dcr-commit", r, kCommitFields));
  if (r.version > 0 && r.base_version + 1 != r.version) return Bad(where, "'base_version' must be version - 1");
  if (auto it = doc.find("publisher_memory"); it != doc.end()) {
    if (!it->is_object()) return Bad(where, "'publisher_memory' must be an object");
    DCR_RETURN_IF_ERROR(GetFields(*it, r.publisher_memory.emplace(), where, kPublisherMemoryFields));
  }
  return r;
}

std::string AttemptRecord::ToJson() const {
  json doc = RecordJson("dcr-attempt", *this, kAttemptFields);
  doc["class"] = cls == DeltaClass::kXorClass ? "xor" : "overwrite";
  doc["delta_id"] = fmt::format("{:016x}", delta_id);
  if (processes == 0) doc["object_key"] = object_key;
  if (processes > 0) {
    doc["processes"] = processes;
    doc["senders"] = senders;
  }
  return Dump(doc);
}

Result<AttemptRecord> AttemptRecord::FromJson(std::string_view text, const std::string& where) {
  AttemptRecord r;
  DCR_ASSIGN_OR_RETURN(json doc, ReadRecord(text, where, "dcr-attempt", r, kAttemptFields));
  DCR_ASSIGN_OR_RETURN(std::string cls, Str(doc, "class", where));
  if (cls != "xor" && cls != "overwrite") return Bad(where, "'class' must be \"xor\" or \"overwrite\"");
  r.cls = cls == "xor" ? DeltaClass::kXorClass : DeltaClass::kOverwrite;
  DCR_ASSIGN_OR_RETURN(std::string id, Str(doc, "delta_id", where));
  const auto parsed = std::from_chars(id.data(), id.data() + id.size(), r.delta_id, 16);
  if (id.size() != 16 || id.find_first_not_of("0123456789abcdef") != std::string::npos ||
      parsed.ptr != id.data() + id.size() || r.delta_id == 0)
    return Bad(where, "'delta_id' must be 16 lowercase hex digits, not all zero");
  if (doc.contains("processes")) {  // trainer processes: each signs its own objects
    DCR_ASSIGN_OR_RETURN(r.processes, U64(doc, "processes", where));
    DCR_ASSIGN_OR_RETURN(r.senders, U64(doc, "senders", where));
    if (r.processes == 0 || r.senders < r.processes || doc.contains("object_key"))
      return Bad(where, "an attempt of trainer processes needs 0 < processes <= senders and no 'object_key'");
  } else {
    DCR_ASSIGN_OR_RETURN(r.object_key, Str(doc, "object_key", where));
    if (r.object_key.size() != 64 || r.object_key.find_first_not_of("0123456789abcdef") != std::string::npos)
      return Bad(where, "'object_key' must be 64 lowercase hex digits (an Ed25519 public key)");
  }
  return r;
}

namespace {

void PutSpans(json& doc, const std::vector<StageSpan>& spans) {
  json& a = doc["spans"] = json::array();
  for (const StageSpan& s : spans) PutFields(a.emplace_back(), s, kSpanFields);
}

// "spans" (absent: none): at most kMaxSpans, each a named stage that does
// not end before it starts.
Result<std::vector<StageSpan>> GetSpans(const json& doc, const std::string& where) {
  std::vector<StageSpan> out;
  auto it = doc.find("spans");
  if (it == doc.end()) return out;
  if (!it->is_array() || it->size() > kMaxSpans)
    return Bad(where, fmt::format("'spans' must be an array of at most {} stage spans", kMaxSpans));
  for (const json& s : *it) {
    if (!s.is_object()) return Bad(where, "each of 'spans' must be an object");
    DCR_RETURN_IF_ERROR(GetFields(s, out.emplace_back(), where, kSpanFields));
    const StageSpan& span = out.back();
    if (span.stage.empty() || span.stage.size() > 64 || !(span.end >= span.start))
      return Bad(where, "a span needs a stage name (at most 64 bytes) and an end not before its start");
  }
  return out;
}

}  // namespace

std::string AckRecord::ToJson() const {
  json doc = RecordJson("dcr-ack", *this, kAckFields);
  PutEngine(doc, engine);
  if (!spans.empty()) PutSpans(doc, spans);
  return Dump(doc);
}

Result<AckRecord> AckRecord::FromJson(std::string_view text, const std::string& where) {
  AckRecord r;
  DCR_ASSIGN_OR_RETURN(json doc, ReadRecord(text, where, "dcr-ack", r, kAckFields));
  DCR_ASSIGN_OR_RETURN(r.engine, GetEngine(doc, where));
  DCR_ASSIGN_OR_RETURN(r.spans, GetSpans(doc, where));
  return r;
}

std::string TimelineRecord::ToJson() const {
  json doc = RecordJson("dcr-timeline", *this, kTimelineFields);
  PutSpans(doc, spans);
  return Dump(doc);
}

Result<TimelineRecord> TimelineRecord::FromJson(std::string_view text, const std::string& where) {
  TimelineRecord r;
  DCR_ASSIGN_OR_RETURN(json doc, ReadRecord(text, where, "dcr-timeline", r, kTimelineFields));
  DCR_ASSIGN_OR_RETURN(r.spans, GetSpans(doc, where));
  return r;
}

std::string ReceiverRecord::ToJson() const { return EngineRecordJson("dcr-receiver", *this, kReceiverFields); }

Result<ReceiverRecord> ReceiverRecord::FromJson(std::string_view text, const std::string& where) {
  return ReadEngineRecord(text, where, "dcr-receiver", kReceiverFields);
}

std::string FenceRecord::ToJson() const { return Dump(RecordJson("dcr-fence", *this, kFenceFields)); }

Result<FenceRecord> FenceRecord::FromJson(std::string_view text, const std::string& where) {
  FenceRecord r;
  DCR_RETURN_IF_ERROR(ReadRecord(text, where, "dcr-fence", r, kFenceFields).status());
  return r;
}

std::string SnapshotRecord::ToJson() const {
  json doc = RecordJson("dcr-snapshot", *this, kSnapshotFields);
  json& fs = doc["files"] = json::array();
  for (const auto& f : files) PutFields(fs.emplace_back(), f, kSnapshotFileFields);
  return Dump(doc);
}

Result<SnapshotRecord> SnapshotRecord::FromJson(std::string_view text, const std::string& where) {
  SnapshotRecord r;
  DCR_ASSIGN_OR_RETURN(json doc, ReadRecord(text, where, "dcr-snapshot", r, kSnapshotFields));
  auto fs = doc.find("files");
  if (fs == doc.end() || !fs->is_array()) return Bad(where, "'files' must be an array");
  for (const auto& f : *fs) {
    if (!f.is_object()) return Bad(where, "each file must be an object");
    File file;
    DCR_RETURN_IF_ERROR(GetFields(f, file, where, kSnapshotFileFields));
    if (file.name.empty() || file.name.find('/') != std::string::npos || file.name.starts_with("."))
      return Bad(where, fmt::format("snapshot file name '{}' must be a plain file name", file.name));
    r.files.push_back(std::move(file));
  }
  return r;
}

std::vector<std::vector<ChunkId>> PlanOwnership(const DeltaManifest& layout, uint32_t senders) {
  senders = std::max<uint32_t>(senders, 1);
  std::vector<std::vector<ChunkId>> plan(senders);
  const auto chunks = AllChunks(layout);
  // Cut the chunk sequence where the running byte count crosses k/senders of the total.
  std::vector<uint64_t> bytes(chunks.size());
  uint64_t total = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    uint64_t first_word, words;
    uint32_t elements;
    layout.ChunkWords(chunks[i].tensor, chunks[i].chunk, &first_word, &words, &elements);
    bytes[i] = words * WordBytes(layout.tensors[chunks[i].tensor].dtype);
    total += bytes[i];
  }
  uint64_t running = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    // The owner is the sender whose share contains this chunk's midpoint.
    const long double mid = static_cast<long double>(running) + bytes[i] / 2.0L;
    uint32_t k = total == 0 ? 0 : static_cast<uint32_t>(mid * senders / static_cast<long double>(total));
    plan[std::min(k, senders - 1)].push_back(chunks[i]);
    running += bytes[i];
  }
  return plan;
}

Result<RunState> ReadRunState(Store& store) {
  RunState state;
  auto run = store.Get(run_keys::kRun);
  if (!run.ok() && run.status().code() != Code::kNotFound) return run.status();
  if (run.ok()) {
    DCR_ASSIGN_OR_RETURN(state.run, RunRecord::FromJson(*run, StoreContext(store.url(), run_keys::kRun)));
  }
  DCR_ASSIGN_OR_RETURN(auto commits, store.List("commits/v"));
  for (const auto& o : commits) {
    // commits/v<10 digits>.json; anything else is not ours.
    std::string_view k = o.key;
    if (k.size() != 8 + 11 + 5 || !k.ends_with(".json")) continue;
    uint64_t v = std::strtoull(std::string(k.substr(9, 10)).c_str(), nullptr, 10);
    if (!state.latest || v > *state.latest) state.latest = v;
  }
  return state;
}

}  // namespace dcr

namespace dcr {

namespace {

using json = nlohmann::ordered_json;

// A process record's object name: "frames/" then [A-Za-z0-9._-]+, not "." or "..".
bool IsFrameObjectName(const std::string& name) {
  constexpr std::string_view kPrefix = "frames/";
  if (!name.starts_with(kPrefix) || name.size() == kPrefix.size() || name.size() > 200) return false;
  const std::string_view leaf = std::string_view(name).substr(kPrefix.size());
  if (leaf == "." || leaf == "..") return false;
  for (char c : leaf)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

}  // namespace

std::string ProcessRecord::ToJson() const {
  json doc = RecordJson("dcr-process", *this, kProcessFields);
  doc["process"] = process;
  doc["processes"] = processes;
  doc["senders"] = senders;
  json& fs = doc["frames"] = json::array();
  for (const DeltaFrameEntry& f : frames)
    fs.push_back({f.tensor, f.chunk, f.object, f.offset, f.bytes, ModeName(f.mode), CodecName(f.codec), f.changed,
                  f.payload_bytes});
  json& cs = doc["chunks"] = json::array();
  for (const Chunk& c : chunks) cs.push_back({c.tensor, c.chunk, c.base.ToHex(), c.target.ToHex()});
  return Dump(doc);
}

Result<ProcessRecord> ProcessRecord::FromJson(std::string_view text, const std::string& where) {
  ProcessRecord r;
  DCR_ASSIGN_OR_RETURN(json doc, ReadRecord(text, where, "dcr-process", r, kProcessFields));
  DCR_ASSIGN_OR_RETURN(uint64_t process, U64(doc, "process", where));
  DCR_ASSIGN_OR_RETURN(uint64_t processes, U64(doc, "processes", where));
  if (processes == 0 || processes > (1u << 16) || process >= processes)
    return Bad(where, "'process' and 'processes' need 0 <= process < processes <= 65536");
  r.process = static_cast<uint32_t>(process);
  r.processes = static_cast<uint32_t>(processes);
  auto ss = doc.find("senders");
  if (ss == doc.end() || !ss->is_array() || ss->empty()) return Bad(where, "'senders' must be a non-empty array");
  for (const auto& s : *ss) {
    if (!s.is_number_unsigned() || s.get<uint64_t>() > 0xFFFFFFFFu ||
        (!r.senders.empty() && s.get<uint64_t>() <= r.senders.back()))
      return Bad(where, "'senders' must be increasing sender indices");
    r.senders.push_back(s.get<uint32_t>());
  }
  for (const std::string& o : r.objects)
    if (!IsFrameObjectName(o)) return Bad(where, "each of 'objects' must be frames/<name> ([A-Za-z0-9._-])");
  auto fs = doc.find("frames");
  if (fs == doc.end() || !fs->is_array()) return Bad(where, "'frames' must be an array");
  for (const auto& f : *fs) {
    if (!f.is_array() || f.size() != 9 || !f[0].is_number_unsigned() || !f[1].is_number_unsigned() ||
        !f[2].is_number_unsigned() || !f[3].is_number_unsigned() || !f[4].is_number_unsigned() || !f[5].is_string() ||
        !f[6].is_string() || !f[7].is_number_unsigned() || !f[8].is_number_unsigned())
      return Bad(where, "each frame must be [tensor, chunk, object, offset, bytes, mode, codec, changed, payload]");
    DeltaFrameEntry e;
    const uint64_t tensor = f[0], chunk = f[1], object = f[2], changed = f[7], payload = f[8];
    e.offset = f[3];
    e.bytes = f[4];
    if (tensor > 0xFFFFFFFFu || chunk > 0xFFFFFFFFu || changed > 0xFFFFFFFFu || object >= r.objects.size() ||
        e.bytes < kMinFrameHeaderBytes || e.bytes > (1ull << 32) || e.offset > (1ull << 62) ||
        payload > e.bytes - kMinFrameHeaderBytes)
      return Bad(where, fmt::format("frame (tensor {}, chunk {}) has impossible indices or sizes", tensor, chunk));
    e.tensor = static_cast<uint32_t>(tensor);
    e.chunk = static_cast<uint32_t>(chunk);
    e.object = static_cast<uint32_t>(object);
    e.changed = static_cast<uint32_t>(changed);
    e.payload_bytes = static_cast<uint32_t>(payload);
    const std::string mode = f[5], codec = f[6];
    if (!ModeFromName(mode, &e.mode)) return Bad(where, fmt::format("frame mode '{}'", mode));
    if (!CodecFromName(codec, &e.codec)) return Bad(where, fmt::format("frame codec '{}'", codec));
    if (!r.frames.empty() && std::pair(r.frames.back().tensor, r.frames.back().chunk) >= std::pair(e.tensor, e.chunk))
      return Bad(where, "frames must be sorted by (tensor, chunk) and unique");
    r.frames.push_back(e);
  }
  auto cs = doc.find("chunks");
  if (cs == doc.end() || !cs->is_array()) return Bad(where, "'chunks' must be an array");
  for (const auto& c : *cs) {
    Chunk x;
    if (!c.is_array() || c.size() != 4 || !c[0].is_number_unsigned() || !c[1].is_number_unsigned() ||
        c[0].get<uint64_t>() > 0xFFFFFFFFu || c[1].get<uint64_t>() > 0xFFFFFFFFu || !c[2].is_string() ||
        !c[3].is_string() || !Digest::FromHex(c[2].get<std::string>(), &x.base) ||
        !Digest::FromHex(c[3].get<std::string>(), &x.target))
      return Bad(where, "each chunk must be [tensor, chunk, base digest, target digest]");
    x.tensor = c[0].get<uint32_t>();
    x.chunk = c[1].get<uint32_t>();
    if (!r.chunks.empty() && std::pair(r.chunks.back().tensor, r.chunks.back().chunk) >= std::pair(x.tensor, x.chunk))
      return Bad(where, "chunks must be sorted by (tensor, chunk) and unique");
    r.chunks.push_back(x);
  }
  return r;
}

Status AssembleLayoutManifest(DeltaManifest& m, std::span<const ProcessRecord> records) {
  struct Owned {
    const ProcessRecord* record;
    const ProcessRecord::Chunk* chunk;
  };
  std::map<ChunkId, Owned> owned;
  for (const ProcessRecord& r : records)
    for (const ProcessRecord::Chunk& c : r.chunks) {
      if (c.tensor >= m.tensors.size() || c.chunk >= m.ChunkCount(c.tensor))
        return InvalidArgument(fmt::format("process {}'s record names tensor {} chunk {}, outside the delta", r.process,
                                           c.tensor, c.chunk));
      if (auto [it, fresh] = owned.emplace(ChunkId{c.tensor, c.chunk}, Owned{&r, &c}); !fresh)
        return FailedPrecondition(
            fmt::format("tensor '{}' chunk {} is owned by processes {} and {}; every process "
                        "must be given the same sender maps and placement",
                        m.tensors[c.tensor].name, c.chunk, it->second.record->process, r.process));
    }
  m.objects.clear();
  m.frames.clear();
  for (const ProcessRecord& r : records) {
    const uint32_t first = static_cast<uint32_t>(m.objects.size());
    for (const std::string& o : r.objects) m.objects.push_back(o);
    for (DeltaFrameEntry f : r.frames) {
      auto it = owned.find(ChunkId{f.tensor, f.chunk});
      if (it == owned.end() || it->second.record != &r)
        return FailedPrecondition(
            fmt::format("process {}'s record has a frame of tensor {} chunk {}, which it does not "
                        "own",
                        r.process, f.tensor, f.chunk));
      if (f.object >= r.objects.size())
        return InvalidArgument(
            fmt::format("process {}'s record names object {} of {}", r.process, f.object, r.objects.size()));
      f.object += first;
      m.frames.push_back(f);
    }
  }
  std::vector<Digest> base, target;
  for (const ChunkId& id : AllChunks(m)) {
    auto it = owned.find(id);
    if (it == owned.end())
      return FailedPrecondition(
          fmt::format("tensor '{}' chunk {} is owned by no process's senders", m.tensors[id.tensor].name, id.chunk));
    base.push_back(it->second.chunk->base);
    target.push_back(it->second.chunk->target);
  }
  FinishDelta(m, base, target);
  return Status::Ok();
}

}  // namespace dcr
