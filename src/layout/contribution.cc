// Contribution objects: byte layout in docs/format.md section 5.
#include "dcr/contribution.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <tuple>

#include "dcr/hash.h"

namespace dcr {
namespace {

constexpr char kMagic[8] = {'D', 'C', 'R', 'C', 'O', 'N', 'T', 'R'};
constexpr size_t kRecordHeaderBytes = 40;
constexpr size_t kChecksumBytes = 8;

void Put32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void Put64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint32_t ClassCode(DeltaClass c) { return c == DeltaClass::kXorClass ? 1 : 2; }

// The element count of chunk `chunk` of manifest tensor `tensor`, and its
// element bytes; kInvalidArgument when the pair is outside the delta or the
// dtype is narrower than a byte.
Status ChunkShape(const DeltaManifest& m, uint64_t tensor, uint64_t chunk, uint64_t* elements, uint64_t* eb) {
  if (tensor >= m.tensors.size())
    return InvalidArgument(fmt::format("tensor {} is outside the delta's {} tensors", tensor, m.tensors.size()));
  if (chunk >= m.ChunkCount(static_cast<size_t>(tensor)))
    return InvalidArgument(fmt::format("tensor '{}' has {} chunks, not chunk {}", m.tensors[tensor].name,
                                       m.ChunkCount(static_cast<size_t>(tensor)), chunk));
  const DeltaTensor& t = m.tensors[tensor];
  *eb = BitsPerElement(t.dtype) / 8;
  if (*eb == 0 || BitsPerElement(t.dtype) % 8 != 0)
    return InvalidArgument(fmt::format("tensor '{}': sub-byte dtypes are not projected from shards", t.name));
  *elements = std::min<uint64_t>(m.chunk_elements, t.elements - chunk * m.chunk_elements);
  return Status::Ok();
}

// A copy of `c` with covered ranges and positions ascending (bits moved along).
ChunkContribution Canonical(const ChunkContribution& c, uint64_t eb) {
  ChunkContribution out = c;
  std::vector<size_t> order(c.covered.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return c.covered[a].first < c.covered[b].first; });
  if (!std::is_sorted(order.begin(), order.end())) {
    std::vector<uint64_t> at(c.covered.size() + 1, 0);
    for (size_t i = 0; i < c.covered.size(); ++i) at[i + 1] = at[i] + c.covered[i].second;
    out.covered.clear();
    out.covered_bits.clear();
    for (size_t i : order) {
      out.covered.push_back(c.covered[i]);
      if (!c.covered_bits.empty())
        out.covered_bits.insert(out.covered_bits.end(), c.covered_bits.begin() + at[i] * eb,
                                c.covered_bits.begin() + at[i + 1] * eb);
    }
  }
  order.resize(c.positions.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return c.positions[a] < c.positions[b]; });
  if (!std::is_sorted(order.begin(), order.end())) {
    out.positions.clear();
    out.old_bits.clear();
    out.new_bits.clear();
    for (size_t i : order) {
      out.positions.push_back(c.positions[i]);
      out.old_bits.insert(out.old_bits.end(), c.old_bits.begin() + i * eb, c.old_bits.begin() + (i + 1) * eb);
      out.new_bits.insert(out.new_bits.end(), c.new_bits.begin() + i * eb, c.new_bits.begin() + (i + 1) * eb);
    }
  }
  return out;
}

}  // namespace

Result<std::string> WriteContributions(const ContributionHeader& header, const DeltaManifest& manifest,
                                       std::span<const ChunkContribution> records) {
  if (header.delta_class != manifest.delta_class || header.delta_id != manifest.delta_id)
    return InvalidArgument("contribution object: the header's delta id and class must be the manifest's");
  const bool overwrite = manifest.delta_class == DeltaClass::kOverwrite;
  std::vector<const ChunkContribution*> sorted;
  for (const ChunkContribution& c : records) sorted.push_back(&c);
  std::sort(sorted.begin(), sorted.end(), [](const ChunkContribution* a, const ChunkContribution* b) {
    return std::tie(a->tensor, a->chunk, a->from) < std::tie(b->tensor, b->chunk, b->from);
  });
  std::string body;
  for (const ChunkContribution* raw : sorted) {
    if (raw->direct())
      return InvalidArgument(
          fmt::format("tensor {} chunk {}: sender {}'s contribution is direct (spans of its shards), "
                      "which only its own process merges",
                      raw->tensor, raw->chunk, raw->from));
    uint64_t elements = 0, eb = 0;
    DCR_RETURN_IF_ERROR(ChunkShape(manifest, raw->tensor, raw->chunk, &elements, &eb));
    uint64_t covered = 0;
    for (auto [lo, len] : raw->covered) covered += len;
    if (raw->old_bits.size() != raw->positions.size() * eb || raw->new_bits.size() != raw->positions.size() * eb ||
        (overwrite ? raw->covered_bits.size() != covered * eb : !raw->covered_bits.empty()))
      return InvalidArgument(fmt::format("tensor {} chunk {}: sender {}'s record has bit lists of the wrong length",
                                         raw->tensor, raw->chunk, raw->from));
    const ChunkContribution c = Canonical(*raw, eb);
    Put32(body, c.tensor);
    Put32(body, c.chunk);
    Put32(body, c.from);
    Put32(body, static_cast<uint32_t>(c.covered.size()));
    Put32(body, static_cast<uint32_t>(c.positions.size()));
    Put32(body, 0);
    Put64(body, c.base_digest.lane[0]);
    Put64(body, c.base_digest.lane[1]);
    for (auto [lo, len] : c.covered) {
      Put32(body, lo);
      Put32(body, len);
    }
    for (uint32_t p : c.positions) Put32(body, p);
    body.append(reinterpret_cast<const char*>(c.old_bits.data()), c.old_bits.size());
    body.append(reinterpret_cast<const char*>(c.new_bits.data()), c.new_bits.size());
    body.append(reinterpret_cast<const char*>(c.covered_bits.data()), c.covered_bits.size());
  }
  std::string out(kMagic, sizeof kMagic);
  Put32(out, kContributionFormatVersion);
  Put32(out, ClassCode(header.delta_class));
  Put64(out, header.delta_id);
  Put32(out, header.from_process);
  Put32(out, header.to_process);
  Put64(out, sorted.size());
  Put64(out, body.size());
  out += body;
  Put64(out, Xxh3_64(out.data(), out.size()));
  return out;
}

namespace {

// Errors about one contribution object, named by `where`.
struct ObjectError {
  const std::string& where;
  Status operator()(Code code, const std::string& what) const {
    return Status(code, fmt::format("{}: contribution object: {}", where, what));
  }
};

// The object's header, size and checksum checked against `expect`; its
// number of records.
Result<uint64_t> CheckContributionHeader(std::span<const uint8_t> bytes, const ContributionHeader& expect,
                                         const ObjectError& bad) {
  if (bytes.size() < kContributionHeaderBytes + kChecksumBytes)
    return bad(Code::kDataLoss, fmt::format("truncated ({} bytes, the header and checksum need {})", bytes.size(),
                                            kContributionHeaderBytes + kChecksumBytes));
  const uint8_t* p = bytes.data();
  if (std::memcmp(p, kMagic, sizeof kMagic) != 0) return bad(Code::kDataLoss, "bad magic (not a contribution object)");
  if (Get32(p + 8) != kContributionFormatVersion)
    return bad(Code::kInvalidArgument,
               fmt::format("format version {}, this build reads {}", Get32(p + 8), kContributionFormatVersion));
  const uint64_t records = Get64(p + 32), body = Get64(p + 40);
  if (body != bytes.size() - kContributionHeaderBytes - kChecksumBytes)
    return bad(Code::kDataLoss, fmt::format("the header says {} body bytes, the object holds {} (truncated or padded)",
                                            body, bytes.size() - kContributionHeaderBytes - kChecksumBytes));
  const size_t sum_at = bytes.size() - kChecksumBytes;
  if (Xxh3_64(p, sum_at) != Get64(p + sum_at)) return bad(Code::kDataLoss, "checksum mismatch (corrupt object)");
  const uint32_t cls = Get32(p + 12);
  if (cls != 1 && cls != 2) return bad(Code::kInvalidArgument, fmt::format("unknown class {}", cls));
  if (cls != ClassCode(expect.delta_class) || Get64(p + 16) != expect.delta_id)
    return bad(Code::kInvalidArgument, fmt::format("written for delta {:016x} ({}), this attempt is {:016x} ({})",
                                                   Get64(p + 16), cls == 1 ? "xor" : "overwrite", expect.delta_id,
                                                   ClassCode(expect.delta_class) == 1 ? "xor" : "overwrite"));
  if (Get32(p + 24) != expect.from_process || Get32(p + 28) != expect.to_process)
    return bad(Code::kInvalidArgument,
               fmt::format("written by process {} for process {}, expected {} for {}", Get32(p + 24), Get32(p + 28),
                           expect.from_process, expect.to_process));
  if (records > body / kRecordHeaderBytes)
    return bad(Code::kInvalidArgument, fmt::format("{} records cannot fit in {} bytes", records, body));
  return records;
}

// Record `r` of an object whose bytes are `p`, from `*at` (advanced past it)
// to at most `end`; `prev`: the record before it, if any.
Result<ChunkContribution> ParseRecord(const uint8_t* p, uint64_t* at, uint64_t end, uint64_t r,
                                      const ContributionHeader& expect, const DeltaManifest& manifest,
                                      std::span<const uint32_t> from_senders, const ChunkContribution* prev,
                                      const ObjectError& bad) {
  const auto rec_bad = [&](const std::string& what) {
    return bad(Code::kInvalidArgument, fmt::format("record {}: {}", r, what));
  };
  const auto truncated = [&] { return bad(Code::kDataLoss, fmt::format("record {} is truncated", r)); };
  if (end - *at < kRecordHeaderBytes) return truncated();
  const uint8_t* h = p + *at;
  ChunkContribution c;
  c.tensor = Get32(h);
  c.chunk = Get32(h + 4);
  c.from = Get32(h + 8);
  const uint64_t ranges = Get32(h + 12), changes = Get32(h + 16);
  if (Get32(h + 20) != 0) return rec_bad("reserved field is not 0");
  c.base_digest.lane[0] = Get64(h + 24);
  c.base_digest.lane[1] = Get64(h + 32);
  if (c.base_digest.lane[0] >= kDigestPrime || c.base_digest.lane[1] >= kDigestPrime)
    return rec_bad("base digest lane out of range");
  *at += kRecordHeaderBytes;
  uint64_t elements = 0, eb = 0;
  if (Status s = ChunkShape(manifest, c.tensor, c.chunk, &elements, &eb); !s.ok()) return rec_bad(s.message());
  if (std::find(from_senders.begin(), from_senders.end(), c.from) == from_senders.end())
    return rec_bad(fmt::format("sender {} is not one of process {}'s senders", c.from, expect.from_process));
  if (prev && std::tie(c.tensor, c.chunk, c.from) <= std::tie(prev->tensor, prev->chunk, prev->from))
    return rec_bad("records are not in increasing (tensor, chunk, sender) order");
  if (ranges == 0) return rec_bad("covers no elements");
  if (ranges > elements || changes > elements)
    return rec_bad(fmt::format("{} ranges and {} changes in a chunk of {} elements", ranges, changes, elements));
  // Sizes are bounded by the chunk (u32 counts, eb <= 16): no overflow.
  if (end - *at < ranges * 8 + changes * (4 + 2 * eb)) return truncated();
  uint64_t covered = 0, range_end = 0;
  c.covered.reserve(static_cast<size_t>(ranges));
  for (uint64_t i = 0; i < ranges; ++i, *at += 8) {
    const uint64_t lo = Get32(p + *at), len = Get32(p + *at + 4);
    if (len == 0 || lo + len > elements || (i > 0 && lo < range_end))
      return rec_bad(
          fmt::format("covered range [{}, {}) is empty, past the chunk's {} elements, or not after the "
                      "previous range",
                      lo, lo + len, elements));
    range_end = lo + len;
    covered += len;
    c.covered.emplace_back(static_cast<uint32_t>(lo), static_cast<uint32_t>(len));
  }
  c.positions.reserve(static_cast<size_t>(changes));
  size_t range = 0;
  for (uint64_t i = 0; i < changes; ++i, *at += 4) {
    const uint32_t pos = Get32(p + *at);
    if (i > 0 && pos <= c.positions.back()) return rec_bad(fmt::format("changed position {} is not increasing", pos));
    while (range < c.covered.size() && uint64_t{c.covered[range].first} + c.covered[range].second <= pos) ++range;
    if (range == c.covered.size() || pos < c.covered[range].first)
      return rec_bad(fmt::format("changed position {} lies outside the covered ranges", pos));
    c.positions.push_back(pos);
  }
  c.old_bits.assign(p + *at, p + *at + changes * eb);
  *at += changes * eb;
  c.new_bits.assign(p + *at, p + *at + changes * eb);
  *at += changes * eb;
  if (expect.delta_class == DeltaClass::kOverwrite) {
    if (end - *at < covered * eb) return truncated();
    c.covered_bits.assign(p + *at, p + *at + covered * eb);
    *at += covered * eb;
  }
  return c;
}

}  // namespace

Result<std::vector<ChunkContribution>> ParseContributions(std::span<const uint8_t> bytes,
                                                          const ContributionHeader& expect,
                                                          const DeltaManifest& manifest,
                                                          std::span<const uint32_t> from_senders,
                                                          const std::string& where) {
  const ObjectError bad{where};
  DCR_ASSIGN_OR_RETURN(const uint64_t records, CheckContributionHeader(bytes, expect, bad));
  const uint64_t end = bytes.size() - kChecksumBytes;
  std::vector<ChunkContribution> out;
  out.reserve(static_cast<size_t>(records));
  uint64_t at = kContributionHeaderBytes;
  for (uint64_t r = 0; r < records; ++r) {
    DCR_ASSIGN_OR_RETURN(ChunkContribution c, ParseRecord(bytes.data(), &at, end, r, expect, manifest, from_senders,
                                                          out.empty() ? nullptr : &out.back(), bad));
    out.push_back(std::move(c));
  }
  if (at != end) return bad(Code::kInvalidArgument, fmt::format("{} bytes follow the last record", end - at));
  return out;
}

}  // namespace dcr
