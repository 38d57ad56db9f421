// Layout maps: validation, compilation to runs, engine checks.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <unordered_map>

#include "dcr/layout.h"

namespace dcr {
namespace {

std::string Dims(std::span<const uint64_t> v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

std::string CopyName(const LayoutMap& map, size_t i) {
  const BoxCopy& c = map.copies[i];
  return fmt::format("copy #{} (tensor '{}' -> buffer '{}')", i, c.tensor, c.buffer);
}

bool Product(std::span<const uint64_t> shape, uint64_t* out) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d != 0 && n > UINT64_MAX / d) return false;
    n *= d;
  }
  *out = n;
  return true;
}

Status CheckDType(DType dtype, const std::string& what) {
  if (BitsPerElement(dtype) % 8 != 0)
    return InvalidArgument(
        fmt::format("{}: dtype {} is packed below a byte and cannot be copied by boxes; "
                    "declare it as a residual (no copies) instead",
                    what, Name(dtype)));
  return Status::Ok();
}

// A box in some array's coordinates, for overlap checks.
struct Box {
  std::vector<uint64_t> lo, hi;  // [lo, hi) per dimension
  size_t copy;
};

bool Overlap(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.lo.size(); ++d)
    if (a.hi[d] <= b.lo[d] || b.hi[d] <= a.lo[d]) return false;
  return true;
}

// The first overlapping pair among boxes of one array (all of one rank), or
// {-1, -1}. Sorted by the first dimension and swept, so disjoint rows cost
// O(n log n).
std::pair<int64_t, int64_t> FirstOverlap(std::vector<Box>& boxes) {
  if (boxes.empty() || boxes[0].lo.empty()) {
    if (boxes.size() > 1) return {static_cast<int64_t>(boxes[0].copy), static_cast<int64_t>(boxes[1].copy)};
    return {-1, -1};
  }
  std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) { return a.lo[0] < b.lo[0]; });
  for (size_t i = 0; i < boxes.size(); ++i)
    for (size_t j = i + 1; j < boxes.size() && boxes[j].lo[0] < boxes[i].hi[0]; ++j)
      if (Overlap(boxes[i], boxes[j])) {
        auto a = std::min(boxes[i].copy, boxes[j].copy), b = std::max(boxes[i].copy, boxes[j].copy);
        return {static_cast<int64_t>(a), static_cast<int64_t>(b)};
      }
  return {-1, -1};
}

}  // namespace

namespace {

using DeclaredIndex = std::unordered_map<std::string_view, size_t>;

// How a kind of declaration is named in errors: "tensor", its "name",
// and how to fix an empty or repeated one.
struct DeclarationWords {
  const char* kind;
  const char* key;
  const char* empty_fix;
  const char* twice_fix;
};

// Declarations `decls` (tensors or buffers, keyed by `key`): non-empty,
// unique keys, a dtype and a shape whose byte size fits 64 bits. Indexed by key.
template <class Decl>
Status ValidateDeclared(const std::vector<Decl>& decls, std::string Decl::*key, const DeclarationWords& words,
                        DeclaredIndex* index) {
  for (size_t i = 0; i < decls.size(); ++i) {
    const Decl& d = decls[i];
    const std::string& k = d.*key;
    const std::string what = fmt::format("{} #{} '{}'", words.kind, i, k);
    if (k.empty())
      return InvalidArgument(fmt::format("{} #{}: empty {}; {}", words.kind, i, words.key, words.empty_fix));
    if (!index->emplace(k, i).second)
      return InvalidArgument(fmt::format("{}: declared twice; {}", what, words.twice_fix));
    DCR_RETURN_IF_ERROR(CheckDType(d.dtype, what));
    uint64_t n;
    if (!Product(d.shape, &n) || !ByteSize(d.dtype, n))
      return InvalidArgument(fmt::format("{}: shape {} overflows 64 bits", what, Dims(d.shape)));
  }
  return Status::Ok();
}

// The tensors' names and the buffers' ids, validated and indexed.
Status ValidateDeclarations(const LayoutMap& map, DeclaredIndex* tensors, DeclaredIndex* buffers) {
  DCR_RETURN_IF_ERROR(ValidateDeclared(
      map.tensors, &LayoutTensor::name,
      {"tensor", "name", "give every tensor its checkpoint name", "declare each tensor once"}, tensors));
  return ValidateDeclared(map.buffers, &LayoutBuffer::id,
                          {"buffer", "id", "give every buffer a unique id", "buffer ids must be unique"}, buffers);
}

// Copy `i` of the map (tensor `t` into buffer `b`, both declared): same
// dtype, ranks that fit, boxes inside both shapes. Its box in the tensor
// (`canon`) and in the buffer (`dest`).
Status ValidateCopy(const LayoutMap& map, size_t i, const LayoutTensor& t, const LayoutBuffer& b, Box* canon,
                    Box* dest) {
  const BoxCopy& c = map.copies[i];
  const std::string what = CopyName(map, i);
  if (t.dtype != b.dtype)
    return InvalidArgument(
        fmt::format("{}: the tensor is {} but the buffer is {}; a box copy moves bits unchanged, "
                    "so a conversion must be declared as a residual",
                    what, Name(t.dtype), Name(b.dtype)));
  const size_t n = t.shape.size(), m = b.shape.size();
  if (c.offset.size() != n || c.extent.size() != n)
    return InvalidArgument(fmt::format("{}: offset {} and extent {} need {} entries, one per tensor dimension of {}",
                                       what, Dims(c.offset), Dims(c.extent), n, Dims(t.shape)));
  if (c.buffer_offset.size() != m)
    return InvalidArgument(fmt::format("{}: buffer_offset {} needs {} entries, one per dimension of buffer shape {}",
                                       what, Dims(c.buffer_offset), m, Dims(b.shape)));
  if (m < n)
    return InvalidArgument(
        fmt::format("{}: the buffer has {} dimensions, fewer than the tensor's {}; "
                    "reshape the buffer's declaration to at least the tensor's rank",
                    what, m, n));
  *canon = Box{{}, {}, i};
  *dest = Box{{}, {}, i};
  for (size_t d = 0; d < n; ++d) {
    if (c.extent[d] == 0)
      return InvalidArgument(fmt::format("{}: extent {} is empty in dimension {}", what, Dims(c.extent), d));
    if (c.offset[d] > t.shape[d] || c.extent[d] > t.shape[d] - c.offset[d])
      return InvalidArgument(fmt::format("{}: box offset {} extent {} leaves tensor shape {} in dimension {}", what,
                                         Dims(c.offset), Dims(c.extent), Dims(t.shape), d));
    canon->lo.push_back(c.offset[d]);
    canon->hi.push_back(c.offset[d] + c.extent[d]);
  }
  for (size_t d = 0; d < m; ++d) {
    const uint64_t e = d < m - n ? 1 : c.extent[d - (m - n)];
    if (c.buffer_offset[d] > b.shape[d] || e > b.shape[d] - c.buffer_offset[d])
      return InvalidArgument(fmt::format("{}: buffer box at {} of extent {} leaves buffer shape {} in dimension {}",
                                         what, Dims(c.buffer_offset), e, Dims(b.shape), d));
    dest->lo.push_back(c.buffer_offset[d]);
    dest->hi.push_back(c.buffer_offset[d] + e);
  }
  return Status::Ok();
}

}  // namespace

Status ValidateLayoutMap(const LayoutMap& map) {
  DeclaredIndex tensors, buffers;
  DCR_RETURN_IF_ERROR(ValidateDeclarations(map, &tensors, &buffers));
  std::vector<std::vector<Box>> writes(map.buffers.size()), reads(map.tensors.size());
  for (size_t i = 0; i < map.copies.size(); ++i) {
    const BoxCopy& c = map.copies[i];
    auto ti = tensors.find(c.tensor);
    if (ti == tensors.end())
      return InvalidArgument(fmt::format("{}: the tensor is not declared; add it to \"tensors\"", CopyName(map, i)));
    auto bi = buffers.find(c.buffer);
    if (bi == buffers.end())
      return InvalidArgument(fmt::format("{}: the buffer is not declared; add it to \"buffers\"", CopyName(map, i)));
    Box canon, dest;
    DCR_RETURN_IF_ERROR(ValidateCopy(map, i, map.tensors[ti->second], map.buffers[bi->second], &canon, &dest));
    writes[bi->second].push_back(std::move(dest));
    if (c.primary) reads[ti->second].push_back(std::move(canon));
  }
  for (size_t b = 0; b < writes.size(); ++b) {
    auto [x, y] = FirstOverlap(writes[b]);
    if (x >= 0)
      return InvalidArgument(
          fmt::format("{} and {} write the same elements of buffer '{}'; every buffer element "
                      "must have one source",
                      CopyName(map, x), CopyName(map, y), map.buffers[b].id));
  }
  for (size_t t = 0; t < reads.size(); ++t) {
    auto [x, y] = FirstOverlap(reads[t]);
    if (x >= 0)
      return InvalidArgument(
          fmt::format("{} and {} are both primary for the same elements of tensor '{}'; mark all "
                      "but one of them \"primary\": false",
                      CopyName(map, x), CopyName(map, y), map.tensors[t].name));
  }
  return Status::Ok();
}

Result<CompiledLayout> CompiledLayout::Compile(LayoutMap map) {
  DCR_RETURN_IF_ERROR(ValidateLayoutMap(map));
  CompiledLayout out;
  out.map_ = std::move(map);
  const LayoutMap& m = out.map_;
  out.by_tensor_.resize(m.tensors.size());
  out.resolved_.resize(m.copies.size());
  for (size_t i = 0; i < m.copies.size(); ++i) {
    const BoxCopy& c = m.copies[i];
    Resolved& r = out.resolved_[i];
    r.tensor = static_cast<size_t>(out.FindTensor(c.tensor));
    r.buffer = static_cast<size_t>(out.FindBuffer(c.buffer));
    out.by_tensor_[r.tensor].push_back(static_cast<uint32_t>(i));
    const auto& ts = m.tensors[r.tensor].shape;
    const auto& bs = m.buffers[r.buffer].shape;
    const size_t n = ts.size(), lead = bs.size() - n;
    // Strides (elements) on both sides; the buffer's leading extra
    // dimensions only move the origin.
    std::vector<uint64_t> cs(n), bst(bs.size());
    for (size_t d = n, s = 1; d-- > 0;) cs[d] = s, s *= ts[d];
    for (size_t d = bs.size(), s = 1; d-- > 0;) bst[d] = s, s *= bs[d];
    for (size_t d = 0; d < n; ++d) r.canonical_origin += c.offset[d] * cs[d];
    for (size_t d = 0; d < bs.size(); ++d) r.buffer_origin += c.buffer_offset[d] * bst[d];
    if (n == 0) {  // a scalar: one element
      r.extent = {1};
      r.canonical_stride = {1};
      r.buffer_stride = {1};
      continue;
    }
    uint64_t inner = c.extent[n - 1];
    size_t k = n - 1;
    while (k > 0 && cs[k - 1] == inner && bst[lead + k - 1] == inner) inner *= c.extent[--k];
    for (size_t d = 0; d < k; ++d) {
      r.extent.push_back(c.extent[d]);
      r.canonical_stride.push_back(cs[d]);
      r.buffer_stride.push_back(bst[lead + d]);
    }
    r.extent.push_back(inner);
    r.canonical_stride.push_back(1);
    r.buffer_stride.push_back(1);
  }
  return out;
}

int64_t CompiledLayout::FindTensor(std::string_view name) const {
  for (size_t i = 0; i < map_.tensors.size(); ++i)
    if (map_.tensors[i].name == name) return static_cast<int64_t>(i);
  return -1;
}

int64_t CompiledLayout::FindBuffer(std::string_view id) const {
  for (size_t i = 0; i < map_.buffers.size(); ++i)
    if (map_.buffers[i].id == id) return static_cast<int64_t>(i);
  return -1;
}

uint64_t CompiledLayout::ElementBytes(size_t tensor) const { return BitsPerElement(map_.tensors[tensor].dtype) / 8; }

uint64_t CompiledLayout::BufferBytes(size_t buffer) const {
  const LayoutBuffer& b = map_.buffers[buffer];
  uint64_t n = 1;
  for (uint64_t d : b.shape) n *= d;
  return n * (BitsPerElement(b.dtype) / 8);
}

void CompiledLayout::Runs(const Resolved& r, size_t dim, uint64_t canonical, uint64_t buffer, uint64_t first,
                          uint64_t end, std::vector<CopyRun>* out) const {
  const size_t last = r.extent.size() - 1;
  if (dim == last) {
    const uint64_t lo = std::max(canonical, first), hi = std::min(canonical + r.extent[last], end);
    if (lo < hi) out->push_back({lo, buffer + (lo - canonical), hi - lo});
    return;
  }
  const uint64_t cs = r.canonical_stride[dim];
  // Sub-block i spans less than one stride, so blocks before i0 end before `first`.
  uint64_t i = first > canonical ? (first - canonical) / cs : 0;
  for (; i < r.extent[dim]; ++i) {
    const uint64_t c = canonical + i * cs;
    if (c >= end) break;
    Runs(r, dim + 1, c, buffer + i * r.buffer_stride[dim], first, end, out);
  }
}

void CompiledLayout::RunsInRange(size_t copy, uint64_t first, uint64_t count, std::vector<CopyRun>* out) const {
  const Resolved& r = resolved_[copy];
  Runs(r, 0, r.canonical_origin, r.buffer_origin, first, first + count, out);
}

Status ValidateEngine(std::span<const CompiledLayout* const> ranks, std::span<const TensorInfo> tensors,
                      std::vector<std::string>* unmapped) {
  std::map<std::string_view, size_t> index;
  for (size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  std::vector<std::vector<Box>> primaries(tensors.size());
  std::vector<std::vector<size_t>> rank_of(tensors.size());  // per box, which rank
  std::vector<bool> mapped(tensors.size(), false);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const LayoutMap& m = ranks[r]->map();
    for (const LayoutTensor& t : m.tensors) {
      auto it = index.find(t.name);
      if (it == index.end())
        return InvalidArgument(
            fmt::format("rank {}: tensor '{}' is not in the checkpoint; regenerate the map for this "
                        "model",
                        r, t.name));
      const TensorInfo& info = tensors[it->second];
      if (info.dtype != t.dtype || info.shape != t.shape)
        return InvalidArgument(
            fmt::format("rank {}: tensor '{}' is {} {} in the map but {} {} in the checkpoint; "
                        "regenerate the map for this model",
                        r, t.name, Name(t.dtype), Dims(t.shape), Name(info.dtype), Dims(info.shape)));
    }
    for (size_t i = 0; i < m.copies.size(); ++i) {
      const BoxCopy& c = m.copies[i];
      const size_t t = index.at(c.tensor);
      mapped[t] = true;
      if (!c.primary) continue;
      Box b{{}, {}, primaries[t].size()};
      for (size_t d = 0; d < c.offset.size(); ++d)
        b.lo.push_back(c.offset[d]), b.hi.push_back(c.offset[d] + c.extent[d]);
      primaries[t].push_back(std::move(b));
      rank_of[t].push_back(r);
    }
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (!mapped[t]) {
      if (unmapped) unmapped->push_back(tensors[t].name);
      continue;
    }
    std::vector<Box> boxes = primaries[t];
    auto [x, y] = FirstOverlap(boxes);
    if (x >= 0)
      return InvalidArgument(
          fmt::format("tensor '{}': ranks {} and {} both hold primary copies of the same elements; "
                      "exactly one copy per engine may be primary",
                      tensors[t].name, rank_of[t][x], rank_of[t][y]));
    uint64_t covered = 0;
    for (const Box& b : primaries[t]) {
      uint64_t v = 1;
      for (size_t d = 0; d < b.lo.size(); ++d) v *= b.hi[d] - b.lo[d];
      covered += v;
    }
    if (covered != tensors[t].numel)
      return InvalidArgument(
          fmt::format("tensor '{}': the engine's primary copies cover {} of its {} elements; every "
                      "element of a mapped tensor needs exactly one primary copy",
                      tensors[t].name, covered, tensors[t].numel));
  }
  return Status::Ok();
}

}  // namespace dcr
