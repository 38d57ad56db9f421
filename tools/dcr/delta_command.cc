// dcr delta make | apply | verify | inspect: deltas between checkpoints.
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "dcr/checkpoint.h"
#include "dcr/delta.h"
#include "dcr/json.h"
#include "dcr/progress.h"

namespace dcr::cli {
namespace {

using json = nlohmann::ordered_json;

struct DeltaArgs {
  std::string base, next, out, target, delta;
  std::string mode = "xor";
  std::string chunk = "1048576";
  bool json = false;
  bool frames = false;
  bool manifest = false;
  bool against_base = false;
  bool no_add = false;
};

// The bytes a receiver downloads per version for the delta in `dir` (its
// manifest and frame objects; the tensor table is the run's, fetched once),
// the manifest's of them, and the table's.
void DeltaDownloadBytes(const std::string& dir, uint64_t* manifest, uint64_t* total, uint64_t* table) {
  std::error_code ec;
  *manifest = *total = *table = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec)) continue;
    const uint64_t size = e.file_size(ec);
    if (e.path().filename() == kTableFileName) {
      *table = size;
      continue;
    }
    *total += size;
    if (e.path().filename() == kManifestFileName) *manifest = size;
  }
}

int RunMake(const DeltaArgs& a) {
  DeltaOptions opt;
  if (a.mode == "xor") opt.encode.delta_class = DeltaClass::kXorClass;
  else if (a.mode == "overwrite") opt.encode.delta_class = DeltaClass::kOverwrite;
  else return Fail("delta make", InvalidArgument("--mode must be xor or overwrite, not '" + a.mode + "'"));
  opt.encode.allow_add = !a.no_add;
  auto chunk = ParseBytes(a.chunk);
  if (!chunk.ok()) return Fail("delta make", chunk.status().WithContext("--chunk"));
  opt.chunk_elements = *chunk;
  auto base = Checkpoint::Open(a.base);
  if (!base.ok()) return Fail("delta make", base.status());
  auto next = Checkpoint::Open(a.next);
  if (!next.ok()) return Fail("delta make", next.status());
  const double t0 = MonotonicSeconds();
  Progress progress("delta make", next->total_bytes());
  auto m = MakeDelta(*base, *next, opt, a.out, &progress);
  progress.Finish();
  if (!m.ok()) return Fail("delta make", m.status());
  const double seconds = MonotonicSeconds() - t0;
  uint64_t manifest_bytes = 0, download_bytes = 0, table_bytes = 0;
  DeltaDownloadBytes(a.out, &manifest_bytes, &download_bytes, &table_bytes);
  if (a.json) {
    json doc = {{"delta", a.out},
                {"delta_id", fmt::format("{:016x}", m->delta_id)},
                {"mode", a.mode},
                {"frames", m->frames.size()},
                {"total_elements", m->total_elements},
                {"total_bytes", m->total_bytes},
                {"changed_elements", m->changed_words},
                {"changed_words", m->changed_words},
                {"payload_bytes", m->payload_bytes},
                {"frame_bytes", m->frame_bytes},
                {"bytes_per_changed_word", PerChange(m->payload_bytes, m->changed_words)},
                {"manifest_bytes", manifest_bytes},
                {"download_bytes", download_bytes},
                {"download_bytes_per_changed_word", PerChange(download_bytes, m->changed_words)},
                {"table_bytes", table_bytes},
                {"seconds", seconds},
                {"base_digest", m->base_digest.ToHex()},
                {"target_digest", m->target_digest.ToHex()}};
    fmt::print("{}\n", JsonText(doc, 2));
  } else {
    fmt::print("delta {} ({} class): {} frames, {} changed words of {} elements ({:.3f}%)\n", a.out, a.mode,
               m->frames.size(), m->changed_words, m->total_elements,
               m->total_elements
                   ? 100.0 * static_cast<double>(m->changed_words) / static_cast<double>(m->total_elements)
                   : 0.0);
    fmt::print(
        "payload {} bytes ({:.3f} bytes per changed word, {:.2f}% of the {} dense bytes) in {:.2f}s ({}/s)\n",
        m->payload_bytes, PerChange(m->payload_bytes, m->changed_words),
        m->total_bytes ? 100.0 * static_cast<double>(m->payload_bytes) / static_cast<double>(m->total_bytes) : 0.0,
        m->total_bytes, seconds, FormatBytes(static_cast<double>(m->total_bytes) / seconds));
    fmt::print(
        "a receiver downloads {} bytes ({:.3f} per changed word): frames and the {}-byte manifest (and once per run "
        "the {}-byte tensor table)\n",
        download_bytes, PerChange(download_bytes, m->changed_words), manifest_bytes, table_bytes);
  }
  return kExitOk;
}

int RunApply(const DeltaArgs& a) {
  auto delta = DeltaReader::Open(a.delta);
  if (!delta.ok()) return Fail("delta apply", delta.status());
  auto target = Checkpoint::Open(a.target, OpenMode::kReadWrite);
  if (!target.ok()) return Fail("delta apply", target.status());
  const double t0 = MonotonicSeconds();
  Progress progress("delta apply", delta->manifest().total_bytes);
  auto report = ApplyDelta(*target, *delta, &progress);
  progress.Finish();
  if (!report.ok()) return Fail("delta apply", report.status());
  const double seconds = MonotonicSeconds() - t0;
  // ApplyDelta checked the manifest's digests against its frames before
  // writing; here the bits now in the files are read back and checked
  // against them too (a full digest pass, as `dcr delta verify`).
  Progress verify_progress("delta apply: verify", delta->manifest().total_bytes);
  auto verified = VerifyDelta(*target, *delta, false, &verify_progress);
  verify_progress.Finish();
  if (!verified.ok()) return Fail("delta apply", verified.status());
  if (!verified->matches) {
    constexpr size_t kNamed = 20;
    std::string names;
    for (size_t i = 0; i < std::min(kNamed, verified->differing.size()); ++i)
      names += (i ? ", '" : "'") + verified->differing[i] + "'";
    if (verified->differing.size() > kNamed) names += fmt::format(" and {} more", verified->differing.size() - kNamed);
    return Fail("delta apply",
                DataLoss(fmt::format("applied, but {} does not hold the delta's target: it reads back with "
                                     "another digest than the manifest's{}; apply an overwrite delta of this version "
                                     "to it, or restore it",
                                     a.target, names.empty() ? "" : " (tensors " + names + ")")));
  }
  const double verify_seconds = MonotonicSeconds() - t0 - seconds;
  if (a.json) {
    json doc = {{"target", a.target},
                {"delta", a.delta},
                {"frames_applied", report->frames_applied},
                {"frames_already_applied", report->frames_already_applied},
                {"payload_bytes", report->payload_bytes},
                {"changed_words", report->changed_words},
                {"verified", true},
                {"seconds", seconds},
                {"verify_seconds", verify_seconds}};
    fmt::print("{}\n", JsonText(doc, 2));
  } else {
    fmt::print(
        "applied {} frames ({} payload bytes, {} changed words) to {} in {:.2f}s{}; read back and verified "
        "in {:.2f}s\n",
        report->frames_applied, report->payload_bytes, report->changed_words, a.target, seconds,
        report->frames_already_applied ? fmt::format("; {} frames were already applied", report->frames_already_applied)
                                       : "",
        verify_seconds);
  }
  return kExitOk;
}

int RunVerify(const DeltaArgs& a) {
  auto delta = DeltaReader::Open(a.delta);
  if (!delta.ok()) return Fail("delta verify", delta.status());
  auto target = Checkpoint::Open(a.target);
  if (!target.ok()) return Fail("delta verify", target.status());
  Progress progress("delta verify", delta->manifest().total_bytes);
  auto report = VerifyDelta(*target, *delta, a.against_base, &progress);
  progress.Finish();
  if (!report.ok()) return Fail("delta verify", report.status());
  const char* what = a.against_base ? "base" : "target";
  if (a.json) {
    json doc = {{"target", a.target},
                {"delta", a.delta},
                {"against", what},
                {"matches", report->matches},
                {"differing", report->differing}};
    fmt::print("{}\n", JsonText(doc, 2));
  } else {
    constexpr size_t kShown = 20;
    for (size_t i = 0; i < std::min(kShown, report->differing.size()); ++i)
      fmt::print("differs: {}\n", report->differing[i]);
    if (report->differing.size() > kShown)
      fmt::print("... and {} more tensors (--json lists all)\n", report->differing.size() - kShown);
    if (!report->matches && report->differing.empty() && !a.against_base)
      fmt::print("differs: outside the chunks the delta changes\n");
    fmt::print("{} {} the delta's {}\n", a.target, report->matches ? "is" : "is NOT", what);
  }
  return report->matches ? kExitOk : kExitDiffers;
}

int RunInspect(const DeltaArgs& a) {
  auto delta = DeltaReader::Open(a.delta);
  if (!delta.ok()) return Fail("delta inspect", delta.status());
  const DeltaManifest& m = delta->manifest();
  // Every frame is parsed and checked (checksums, agreement with the manifest).
  for (size_t i = 0; a.manifest && i < m.frames.size(); ++i)
    if (auto frame = delta->Frame(i); !frame.ok()) return Fail("delta inspect", frame.status());
  if (a.manifest) {
    fmt::print("{}", m.ToJson());
    return kExitOk;
  }
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_kind;  // "add/sparse" -> (frames, payload)
  for (size_t i = 0; i < m.frames.size(); ++i) {
    auto frame = delta->Frame(i);
    if (!frame.ok()) return Fail("delta inspect", frame.status());
    auto& [n, b] = by_kind[fmt::format("{}/{}", ModeName(frame->header.mode), CodecName(frame->header.codec))];
    ++n;
    b += frame->header.payload_bytes;
  }
  if (a.json) {
    json doc = {{"delta", a.delta},
                {"delta_id", fmt::format("{:016x}", m.delta_id)},
                {"class", m.delta_class == DeltaClass::kXorClass ? "xor" : "overwrite"},
                {"chunk_elements", m.chunk_elements},
                {"tensors", m.tensors.size()},
                {"frames", m.frames.size()},
                {"total_elements", m.total_elements},
                {"total_bytes", m.total_bytes},
                {"changed_words", m.changed_words},
                {"payload_bytes", m.payload_bytes},
                {"frame_bytes", m.frame_bytes},
                {"base_digest", m.base_digest.ToHex()},
                {"target_digest", m.target_digest.ToHex()}};
    json kinds = json::object();
    for (const auto& [k, v] : by_kind) kinds[k] = {{"frames", v.first}, {"payload_bytes", v.second}};
    doc["by_mode_and_codec"] = kinds;
    if (a.frames) {
      json& fs = doc["frame_list"] = json::array();
      for (const auto& f : m.frames)
        fs.push_back({{"tensor", m.tensors[f.tensor].name},
                      {"chunk", f.chunk},
                      {"mode", ModeName(f.mode)},
                      {"codec", CodecName(f.codec)},
                      {"changed", f.changed},
                      {"bytes", f.bytes}});
    }
    fmt::print("{}\n", JsonText(doc, 2));
    return kExitOk;
  }
  fmt::print("delta {} (id {:016x}, {} class, chunks of {} elements)\n", a.delta, m.delta_id,
             m.delta_class == DeltaClass::kXorClass ? "xor" : "overwrite", m.chunk_elements);
  fmt::print("base digest {}  target digest {}\n", m.base_digest.ToHex(), m.target_digest.ToHex());
  fmt::print(
      "{} tensors, {} elements, {} dense bytes; {} frames, {} changed words, {} payload bytes ({:.3f} per changed "
      "word)\n",
      m.tensors.size(), m.total_elements, m.total_bytes, m.frames.size(), m.changed_words, m.payload_bytes,
      PerChange(m.payload_bytes, m.changed_words));
  for (const auto& [k, v] : by_kind) fmt::print("  {:<20} {:>8} frames {:>14} bytes\n", k, v.first, v.second);
  if (a.frames)
    for (const auto& f : m.frames)
      fmt::print("  {} chunk {}: {} {} {} changed, {} bytes\n", m.tensors[f.tensor].name, f.chunk, ModeName(f.mode),
                 CodecName(f.codec), f.changed, f.bytes);
  fmt::print("all {} frames verified (checksums, headers)\n", m.frames.size());
  return kExitOk;
}

}  // namespace

void AddDeltaCommand(CLI::App& app) {
  auto a = std::make_shared<DeltaArgs>();
  auto* delta = app.add_subcommand("delta", "Make, apply, verify and inspect deltas between checkpoints");
  delta->require_subcommand(1);

  auto* make = delta->add_subcommand("make", "Encode the change from BASE to NEW as a delta directory");
  make->add_option("base", a->base, "the base checkpoint")->required();
  make->add_option("new", a->next, "the new checkpoint")->required();
  make->add_option("-o,--out", a->out, "the delta directory to write")->required();
  make->add_option("--mode", a->mode, "xor (xor/add frames; the receiver holds the base) or overwrite")
      ->capture_default_str();
  make->add_option("--chunk", a->chunk, "elements per chunk (a multiple of 8)")->capture_default_str();
  make->add_flag("--no-add", a->no_add, "xor class: never use add frames");
  make->add_flag("--json", a->json, "print JSON");
  make->callback([a] { ExitCode() = RunMake(*a); });

  auto* apply = delta->add_subcommand(
      "apply", "Apply a delta to TARGET in place (TARGET must be its base), then read it back and verify it");
  apply->add_option("target", a->target, "the checkpoint to update in place")->required();
  apply->add_option("delta", a->delta, "the delta directory")->required();
  apply->add_flag("--json", a->json, "print JSON");
  apply->callback([a] { ExitCode() = RunApply(*a); });

  auto* verify = delta->add_subcommand("verify", "Is TARGET the delta's target? (exit 0 yes, 1 no, 2 error)");
  verify->add_option("target", a->target, "the checkpoint to check")->required();
  verify->add_option("delta", a->delta, "the delta directory")->required();
  verify->add_flag("--base", a->against_base, "check against the delta's base instead");
  verify->add_flag("--json", a->json, "print JSON");
  verify->callback([a] { ExitCode() = RunVerify(*a); });

  auto* inspect = delta->add_subcommand("inspect", "Describe a delta and check every frame");
  inspect->add_option("delta", a->delta, "the delta directory")->required();
  inspect->add_flag("--frames", a->frames, "list every frame");
  inspect->add_flag("--json", a->json, "print JSON");
  inspect->add_flag("--manifest", a->manifest,
                    "print the whole manifest as JSON (with the tensor table and every frame entry)");
  inspect->callback([a] { ExitCode() = RunInspect(*a); });
}

}  // namespace dcr::cli
