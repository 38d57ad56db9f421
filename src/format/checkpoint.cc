#include "dcr/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>

#include "dcr/json.h"
#include "dcr/mapped_file.h"
#include "dcr/text.h"

namespace dcr {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Checkpoint::Shard {
  MappedFile file;
  SafetensorsHeader header;
};

Checkpoint::Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

namespace {

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

Result<std::string> ReadSmallFile(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) return ErrnoError(ec.value(), "cannot read " + path);
  if (size > kMaxSafetensorsHeaderBytes)
    return InvalidArgument(fmt::format("{} is {} bytes, more than an index file may hold", path, size));
  std::ifstream in(path, std::ios::binary);
  std::string text(size, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size))) return Unavailable("cannot read " + path);
  return text;
}

// Reads model.safetensors.index.json: the shard files in first-mention
// order, and the weight map.
Status ReadIndex(const std::string& index_path, std::vector<std::string>* files,
                 std::map<std::string, std::string>* weight_map) {
  DCR_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path));
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return InvalidArgument(index_path + ": not a JSON object");
  auto wm = doc.find("weight_map");
  if (wm == doc.end() || !wm->is_object())
    return InvalidArgument(index_path + ": needs a \"weight_map\" object {tensor: file}");
  for (auto& [name, file] : wm->items()) {
    if (!file.is_string())
      return InvalidArgument(fmt::format("{}: weight_map['{}'] must be a file name", index_path, name));
    const auto& f = file.get_ref<const std::string&>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      return InvalidArgument(
          fmt::format("{}: weight_map['{}'] = '{}' must name a file in the same directory", index_path, name, f));
    if (std::find(files->begin(), files->end(), f) == files->end()) files->push_back(f);
    (*weight_map)[name] = f;
  }
  std::sort(files->begin(), files->end());
  return Status::Ok();
}

}  // namespace

Status Checkpoint::AddShard(const std::string& file, OpenMode mode) {
  DCR_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(file, mode == OpenMode::kReadWrite));
  auto header = ParseSafetensorsHeader(mapped.data(), mapped.size());
  if (!header.ok()) return header.status().WithContext(file);
  auto shard = std::make_unique<Shard>();
  shard->file = std::move(mapped);
  shard->header = std::move(header).value();
  shards_.push_back(std::move(shard));
  return Status::Ok();
}

// Builds the sorted tensor list from the shards; rejects names present in two.
void Checkpoint::Finalize() {
  struct Item {
    const TensorInfo* info;
    Location loc;
  };
  std::vector<Item> items;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const auto& h = shards_[s]->header;
    for (const auto& e : h.entries) items.push_back({&e.info, {s, 8 + h.header_bytes + e.offset}});
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return TensorNameLess(a.info->name, b.info->name); });
  tensors_.clear();
  locations_.clear();
  total_bytes_ = total_elements_ = 0;
  for (const auto& it : items) {
    tensors_.push_back(*it.info);
    locations_.push_back(it.loc);
    total_bytes_ += it.info->nbytes;
    total_elements_ += it.info->numel;
  }
}

Result<Checkpoint> Checkpoint::Open(const std::string& path, OpenMode mode) {
  Checkpoint ckpt;
  ckpt.path_ = path;
  ckpt.mode_ = mode;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (ec || !fs::exists(status)) return NotFound(fmt::format("no checkpoint at {}", path));

  std::map<std::string, std::string> weight_map;  // empty unless indexed
  if (fs::is_directory(status)) {
    std::vector<std::string> files;
    const std::string index = (fs::path(path) / kIndexFileName).string();
    if (fs::exists(index)) {
      DCR_RETURN_IF_ERROR(ReadIndex(index, &files, &weight_map));
    } else {
      for (const auto& entry : fs::directory_iterator(path, ec))
        if (entry.is_regular_file() && EndsWith(entry.path().filename().string(), ".safetensors"))
          files.push_back(entry.path().filename().string());
      if (ec) return ErrnoError(ec.value(), "cannot list " + path);
      std::sort(files.begin(), files.end());
      if (files.empty()) return NotFound(fmt::format("{} holds no .safetensors files and no {}", path, kIndexFileName));
    }
    for (const auto& f : files) DCR_RETURN_IF_ERROR(ckpt.AddShard((fs::path(path) / f).string(), mode));
  } else {
    DCR_RETURN_IF_ERROR(ckpt.AddShard(path, mode));
  }
  ckpt.Finalize();

  for (size_t i = 1; i < ckpt.tensors_.size(); ++i)
    if (ckpt.tensors_[i].name == ckpt.tensors_[i - 1].name)
      return InvalidArgument(fmt::format("tensor '{}' is stored twice: in {} and in {}", ckpt.tensors_[i].name,
                                         ckpt.FileOf(i - 1), ckpt.FileOf(i)));
  if (!weight_map.empty() || fs::is_directory(status)) {
    const std::string index = (fs::path(path) / kIndexFileName).string();
    if (!weight_map.empty() || fs::exists(index)) {
      for (size_t i = 0; i < ckpt.tensors_.size(); ++i) {
        const auto& name = ckpt.tensors_[i].name;
        auto it = weight_map.find(name);
        const std::string file = fs::path(ckpt.FileOf(i)).filename().string();
        if (it == weight_map.end())
          return InvalidArgument(
              fmt::format("{}: tensor '{}' in {} is missing from the weight_map", index, name, file));
        if (it->second != file)
          return InvalidArgument(
              fmt::format("{}: weight_map puts '{}' in {} but it is in {}", index, name, it->second, file));
        weight_map.erase(it);
      }
      if (!weight_map.empty())
        return NotFound(fmt::format("{}: tensor '{}' is in the weight_map but not in {}", index,
                                    weight_map.begin()->first, weight_map.begin()->second));
    }
  }
  return ckpt;
}

Result<Checkpoint> Checkpoint::Create(const std::string& path, const std::vector<TensorInfo>& tensors,
                                      const CreateOptions& options) {
  const bool single_file = EndsWith(path, ".safetensors");
  if (single_file && options.max_shard_bytes != 0)
    return InvalidArgument(fmt::format("{}: a .safetensors path is one file; give a directory to shard", path));
  // Plan shards: consecutive runs of tensors.
  std::vector<std::pair<size_t, size_t>> runs;  // [begin, end)
  uint64_t in_shard = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (runs.empty() ||
        (options.max_shard_bytes != 0 && in_shard > 0 && in_shard + tensors[i].nbytes > options.max_shard_bytes)) {
      runs.push_back({i, i});
      in_shard = 0;
    }
    runs.back().second = i + 1;
    in_shard += tensors[i].nbytes;
  }
  if (runs.empty()) runs.push_back({0, 0});

  std::vector<std::string> names;
  std::error_code ec;
  if (single_file) {
    if (fs::exists(path, ec))
      return AlreadyExists(fmt::format("{} exists; remove it first or choose another path", path));
    names.push_back(path);
  } else {
    fs::create_directories(path, ec);
    if (ec) return ErrnoError(ec.value(), "cannot create directory " + path);
    // Never mix with an existing checkpoint: stale shards would be read back.
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      const std::string name = entry.path().filename().string();
      if (EndsWith(name, ".safetensors") || name == kIndexFileName)
        return AlreadyExists(
            fmt::format("{} already holds a checkpoint ({}); remove it first or choose another path", path, name));
    }
    for (size_t s = 0; s < runs.size(); ++s)
      names.push_back(runs.size() == 1 ? "model.safetensors"
                                       : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, runs.size()));
  }

  Checkpoint ckpt;
  ckpt.path_ = path;
  ckpt.mode_ = OpenMode::kReadWrite;
  json weight_map = json::object();
  uint64_t total = 0;
  for (size_t s = 0; s < runs.size(); ++s) {
    const std::string file = single_file ? path : (fs::path(path) / names[s]).string();
    std::span<const TensorInfo> run(tensors.data() + runs[s].first, runs[s].second - runs[s].first);
    const std::string header = EncodeSafetensorsHeader(run, options.metadata);
    uint64_t data = 0;
    for (const auto& t : run) {
      data += t.nbytes;
      weight_map[t.name] = names[s];
    }
    total += data;
    DCR_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Create(file, header.size() + data));
    std::memcpy(mapped.mutable_data().data(), header.data(), header.size());
    auto parsed = ParseSafetensorsHeader(mapped.data(), mapped.size());
    if (!parsed.ok()) return parsed.status().WithContext(file);
    auto shard = std::make_unique<Shard>();
    shard->file = std::move(mapped);
    shard->header = std::move(parsed).value();
    ckpt.shards_.push_back(std::move(shard));
  }
  if (!single_file) {
    const std::string index = (fs::path(path) / kIndexFileName).string();
    if (runs.size() > 1) {
      json doc = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
      std::ofstream out(index, std::ios::binary | std::ios::trunc);
      out << JsonText(doc, 2) << "\n";
      if (!out.flush()) return Unavailable("cannot write " + index);
    }
  }
  ckpt.Finalize();
  for (size_t i = 1; i < ckpt.tensors_.size(); ++i)
    if (ckpt.tensors_[i].name == ckpt.tensors_[i - 1].name)
      return InvalidArgument(fmt::format("{}: tensor '{}' given twice", path, ckpt.tensors_[i].name));
  return ckpt;
}

int64_t Checkpoint::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return TensorNameLess(t.name, n); });
  if (it == tensors_.end() || it->name != name) return -1;
  return it - tensors_.begin();
}

std::span<const uint8_t> Checkpoint::Data(size_t index) const {
  const auto& loc = locations_[index];
  return shards_[loc.shard]->file.data().subspan(loc.offset, tensors_[index].nbytes);
}

std::span<uint8_t> Checkpoint::MutableData(size_t index) {
  const auto& loc = locations_[index];
  return shards_[loc.shard]->file.mutable_data().subspan(loc.offset, tensors_[index].nbytes);
}

const std::string& Checkpoint::FileOf(size_t index) const { return shards_[locations_[index].shard]->file.path(); }

std::vector<std::string> Checkpoint::files() const {
  std::vector<std::string> out;
  for (const auto& s : shards_) out.push_back(s->file.path());
  return out;
}

const Metadata& Checkpoint::metadata() const {
  static const Metadata kEmpty;
  return shards_.empty() ? kEmpty : shards_.front()->header.metadata;
}

Status Checkpoint::Sync() {
  if (mode_ != OpenMode::kReadWrite) return Status::Ok();
  for (auto& s : shards_) DCR_RETURN_IF_ERROR(s->file.Sync().WithContext("sync"));
  return Status::Ok();
}

}  // namespace dcr
