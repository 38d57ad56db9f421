// A version's timeline: gathered from the store's timeline records and acks,
// written as a Chrome / Perfetto trace (include/dcr/run_status.h).
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "dcr/json.h"
#include "dcr/run_keys.h"
#include "dcr/run_status.h"
#include "internal.h"

namespace dcr {

using namespace protocol_internal;

namespace {

template <typename Record>
Result<Record> ReadRecordAt(Store& store, const std::string& key) {
  DCR_ASSIGN_OR_RETURN(std::string text, store.Get(key));
  auto r = Record::FromJson(text, StoreContext(store.url(), key));
  if (!r.ok()) return DataLoss(r.status().message());
  return r;
}

// The rows of attempt `a`: its publishing processes' records, then its acks.
Status ReadAttemptRows(Store& store, uint64_t v, const AttemptInfo& a, VersionTimeline* t) {
  DCR_ASSIGN_OR_RETURN(auto records, store.List(run_keys::Timelines(v, a.id)));
  for (const ObjectInfo& o : records) {
    DCR_ASSIGN_OR_RETURN(TimelineRecord r, ReadRecordAt<TimelineRecord>(store, o.key));
    if (r.version != v) return DataLoss(fmt::format("{}: a timeline of version {}", o.key, r.version));
    if (a.id == t->attempt && r.role == "publisher") t->publish_seconds = r.total_seconds;
    t->rows.push_back({r.role, r.process, a.id, std::move(r.spans)});
  }
  for (const std::string& receiver : a.acks) {
    DCR_ASSIGN_OR_RETURN(AckRecord ack, ReadRecordAt<AckRecord>(store, run_keys::Ack(v, a.id, receiver)));
    t->rows.push_back({"receiver", ack.receiver, a.id, std::move(ack.spans)});
  }
  return Status::Ok();
}

}  // namespace

Result<VersionTimeline> ReadVersionTimeline(Store& store, uint64_t v) {
  if (v == 0) return FailedPrecondition("version 0 is the run's snapshot: it has no attempts, so no timeline");
  auto commit = ReadCommit(store, v);
  if (commit.status().code() == Code::kNotFound)
    return FailedPrecondition(fmt::format("version {} is not committed in {}", v, store.url()));
  DCR_RETURN_IF_ERROR(commit.status());
  VersionTimeline t;
  t.version = v;
  t.attempt = commit->attempt;
  t.commit_time = commit->time;
  DCR_ASSIGN_OR_RETURN(auto attempts, ListAttempts(store, v));
  for (const AttemptInfo& a : attempts) DCR_RETURN_IF_ERROR(ReadAttemptRows(store, v, a, &t));
  std::stable_sort(t.rows.begin(), t.rows.end(), [](const TimelineRow& x, const TimelineRow& y) {
    return std::make_pair(x.role == "receiver", x.process) < std::make_pair(y.role == "receiver", y.process);
  });
  t.start = t.commit_time;
  for (const TimelineRow& r : t.rows)
    for (const StageSpan& s : r.spans) t.start = std::min(t.start, s.start);
  return t;
}

std::string TimelineTraceJson(const VersionTimeline& t) {
  const double t0 = t.start;
  auto micros = [&](double unix) { return (unix - t0) * 1e6; };
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  for (size_t pid = 0; pid < t.rows.size(); ++pid) {
    const TimelineRow& r = t.rows[pid];
    const std::string label = fmt::format("{} {}{}", r.role, r.process,
                                          r.attempt == t.attempt ? "" : fmt::format(" (attempt {})", r.attempt));
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", label}}}});
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
    for (const StageSpan& s : r.spans)
      events.push_back({{"name", s.stage},
                        {"cat", r.role},
                        {"ph", s.end > s.start ? "X" : "i"},
                        {"pid", pid},
                        {"tid", 0},
                        {"ts", micros(s.start)},
                        {"dur", micros(s.end) - micros(s.start)},
                        {"args", {{"attempt", r.attempt}}}});
  }
  events.push_back(
      {{"name", "commit"}, {"ph", "i"}, {"s", "g"}, {"pid", 0}, {"tid", 0}, {"ts", micros(t.commit_time)}});
  nlohmann::ordered_json doc = {{"traceEvents", std::move(events)},
                                {"displayTimeUnit", "ms"},
                                {"otherData",
                                 {{"format", "dcr-timeline-trace"},
                                  {"version", t.version},
                                  {"attempt", t.attempt},
                                  {"publish_seconds", t.publish_seconds},
                                  {"t0_unix", t0}}}};
  return JsonText(doc, 1) + "\n";
}

}  // namespace dcr
