// One rank's buffers as memory-mapped files (layout_apply.h).
#include <fmt/format.h>

#include <filesystem>

#include "dcr/layout_apply.h"

namespace dcr {

namespace fs = std::filesystem;

namespace {

Result<std::string> BufferPath(const std::string& dir, const LayoutBuffer& b) {
  if (b.id.empty() || b.id.find('/') != std::string::npos || b.id.front() == '.')
    return InvalidArgument(
        fmt::format("buffer '{}' cannot name a file in {} (no '/', not starting with '.')", b.id, dir));
  return (fs::path(dir) / b.id).string();
}

}  // namespace

Result<RankBufferFiles> RankBufferFiles::Open(const CompiledLayout& layout, const std::string& dir) {
  RankBufferFiles out;
  out.layout_ = &layout;
  for (size_t i = 0; i < layout.map().buffers.size(); ++i) {
    DCR_ASSIGN_OR_RETURN(std::string path, BufferPath(dir, layout.map().buffers[i]));
    DCR_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open(path, true));
    if (f.size() != layout.BufferBytes(i))
      return InvalidArgument(
          fmt::format("{} has {} bytes but buffer '{}' of the map has {}; load the rank again "
                      "(dcr layout load)",
                      path, f.size(), layout.map().buffers[i].id, layout.BufferBytes(i)));
    out.files_.push_back(std::move(f));
  }
  return out;
}

Result<RankBufferFiles> RankBufferFiles::Create(const CompiledLayout& layout, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + dir);
  RankBufferFiles out;
  out.layout_ = &layout;
  for (size_t i = 0; i < layout.map().buffers.size(); ++i) {
    DCR_ASSIGN_OR_RETURN(std::string path, BufferPath(dir, layout.map().buffers[i]));
    DCR_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Create(path, layout.BufferBytes(i)));
    out.files_.push_back(std::move(f));
  }
  return out;
}

PlacedRank RankBufferFiles::placed() {
  PlacedRank p;
  p.layout = layout_;
  for (MappedFile& f : files_) p.buffers.push_back(f.mutable_data());
  return p;
}

Status RankBufferFiles::Sync() {
  for (MappedFile& f : files_) DCR_RETURN_IF_ERROR(f.Sync());
  return Status::Ok();
}

}  // namespace dcr
