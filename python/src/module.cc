// dcr._dcr: nanobind bindings over the public C++ API (include/dcr/).
//
// Thin by rule (DESIGN house rule 9): every function here parses its
// arguments, converts them to the C++ types, calls one C++ entry point with
// the GIL released, and converts the result back. Protocol, delta and layout
// logic stays in C++.
//
// Errors: a non-OK dcr::Status becomes a Python exception in exactly one
// place, Raise() below, which asks dcr.errors for the class of its code.
//
// Memory: checkpoint tensors are returned as numpy arrays over the mapped
// files (no copy; the array keeps the Checkpoint alive). Buffers passed in
// (torch tensors, numpy arrays) are read through DLPack / the buffer protocol
// without copying; they must be CPU, C-contiguous, flat uint8 views (the
// pure-Python layer, dcr._tensors, makes those views and checks dtypes).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <charconv>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "buffer_memory.h"
#include "dcr/checkpoint.h"
#include "dcr/delta.h"
#include "dcr/digest.h"
#include "dcr/layout.h"
#include "dcr/layout_apply.h"
#include "dcr/mapped_file.h"
#include "dcr/protocol.h"
#include "dcr/receiver.h"
#include "dcr/relay.h"
#include "dcr/status.h"
#include "dcr/store.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// ---- Errors: the one place a Status becomes an exception --------------------

[[noreturn]] void Raise(const dcr::Status& status) {
  nb::object errors = nb::module_::import_("dcr.errors");
  nb::object exc = errors.attr("_from_status")(std::string(dcr::CodeName(status.code())), status.message());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw nb::python_error();
}

void Check(const dcr::Status& status) {
  if (!status.ok()) Raise(status);
}

// A digest from its 32-hex-digit form (docs/format.md section 2), or kInvalidArgument naming `what`.
dcr::Digest ParseDigest(const std::string& hex, const std::string& what) {
  dcr::Digest d;
  if (!dcr::Digest::FromHex(hex, &d))
    Raise(dcr::InvalidArgument(what + ": '" + hex +
                               "' is not a digest (32 lowercase hex digits, each lane below 2^61 - 1)"));
  return d;
}

template <typename T>
T Take(dcr::Result<T>&& result) {
  if (!result.ok()) Raise(result.status());
  return std::move(result).value();
}

// ---- Conversions ------------------------------------------------------------

dcr::DType ParseDTypeOrRaise(const std::string& name) {
  auto d = dcr::ParseDType(name);
  if (!d) Raise(dcr::InvalidArgument("unknown dtype '" + name + "' (use safetensors names: BF16, F32, F8_E4M3, ...)"));
  return *d;
}

dcr::DeltaClass ParseMode(const std::string& mode) {
  if (mode == "xor") return dcr::DeltaClass::kXorClass;
  if (mode == "overwrite") return dcr::DeltaClass::kOverwrite;
  Raise(dcr::InvalidArgument("mode '" + mode + "': use 'xor' (needs the base bits) or 'overwrite'"));
}

dcr::DeltaOptions MakeDeltaOptions(const std::string& mode, uint64_t chunk_elements, uint64_t delta_id) {
  dcr::DeltaOptions o;
  o.encode.delta_class = ParseMode(mode);
  if (chunk_elements == 0 || chunk_elements % 8 != 0)
    Raise(dcr::InvalidArgument("chunk_elements " + std::to_string(chunk_elements) + ": use a positive multiple of 8"));
  o.chunk_elements = chunk_elements;
  o.delta_id = delta_id;
  return o;
}

// A flat, CPU, contiguous uint8 array (numpy or torch through DLPack), as bytes.
std::span<uint8_t> BytesOf(const nb::ndarray<>& a, const std::string& what) {
  if (a.device_type() != nb::device::cpu::value)
    Raise(dcr::InvalidArgument(what + ": not a CPU buffer (copy CUDA tensors to the host first)"));
  if (a.dtype() != nb::dtype<uint8_t>() || a.ndim() != 1)
    Raise(dcr::InvalidArgument(what + ": expected a flat uint8 view of the buffer's bytes (dcr._tensors.byte_view)"));
  if (a.shape(0) > 1 && a.stride(0) != 1) Raise(dcr::InvalidArgument(what + ": not contiguous"));
  return {static_cast<uint8_t*>(a.data()), a.shape(0)};
}

nb::dict ApplyReportDict(const dcr::ApplyReport& r) {
  nb::dict d;
  d["frames_applied"] = r.frames_applied;
  d["frames_already_applied"] = r.frames_already_applied;
  d["payload_bytes"] = r.payload_bytes;
  d["changed_words"] = r.changed_words;
  d["scratch_peak_bytes"] = r.scratch_peak_bytes;
  return d;
}

nb::tuple TensorTuple(const dcr::TensorInfo& t) {
  return nb::make_tuple(t.name, std::string(dcr::Name(t.dtype)), t.shape, t.nbytes);
}

// ---- Checkpoint --------------------------------------------------------------

struct PyCheckpoint {
  dcr::Checkpoint ckpt;
};

// The numpy view of a tensor's bytes: native dtypes where numpy has them,
// otherwise unsigned integers of the element's width (BF16 -> uint16, FP8 ->
// uint8) that torch views as the real dtype. Packed sub-byte types: uint8 bytes.
nb::dlpack::dtype ViewDType(dcr::DType d) {
  using dcr::DType;
  switch (d) {
    case DType::kBool: return nb::dtype<bool>();
    case DType::kI8: return nb::dtype<int8_t>();
    case DType::kI16: return nb::dtype<int16_t>();
    case DType::kI32: return nb::dtype<int32_t>();
    case DType::kI64: return nb::dtype<int64_t>();
    case DType::kU16:
    case DType::kBF16: return nb::dtype<uint16_t>();
    case DType::kU32: return nb::dtype<uint32_t>();
    case DType::kU64: return nb::dtype<uint64_t>();
    case DType::kF16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kF32: return nb::dtype<float>();
    case DType::kF64: return nb::dtype<double>();
    case DType::kC64: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Complex), 64, 1};
    default: return nb::dtype<uint8_t>();  // U8, FP8 formats, packed F4/F6
  }
}

nb::object TensorArray(nb::handle self_py, PyCheckpoint& self, const std::string& name) {
  const int64_t i = self.ckpt.Find(name);
  if (i < 0) Raise(dcr::NotFound(self.ckpt.path() + ": no tensor '" + name + "'"));
  const dcr::TensorInfo& t = self.ckpt.tensors()[static_cast<size_t>(i)];
  std::vector<size_t> shape(t.shape.begin(), t.shape.end());
  if (dcr::BitsPerElement(t.dtype) < 8) shape = {static_cast<size_t>(t.nbytes)};
  const bool writable = self.ckpt.mode() == dcr::OpenMode::kReadWrite;
  void* data = writable ? static_cast<void*>(self.ckpt.MutableData(static_cast<size_t>(i)).data())
                        : const_cast<uint8_t*>(self.ckpt.Data(static_cast<size_t>(i)).data());
  const nb::dlpack::dtype dt = ViewDType(t.dtype);
  if (writable) {
    nb::ndarray<nb::numpy> a(data, shape.size(), shape.data(), self_py, nullptr, dt);
    return nb::cast(a, nb::rv_policy::reference);
  }
  nb::ndarray<nb::numpy, nb::ro> a(data, shape.size(), shape.data(), self_py, nullptr, dt);
  return nb::cast(a, nb::rv_policy::reference);
}

// ---- Deltas in memory ----------------------------------------------------------

struct PyDelta {
  dcr::DeltaManifest manifest;
  std::shared_ptr<std::string> frames;  // the one frame object (manifest.objects == {"frames.bin"})

  dcr::DeltaReader Reader() const {
    std::vector<std::span<const uint8_t>> objects = {
        {reinterpret_cast<const uint8_t*>(frames->data()), frames->size()}};
    return Take(dcr::DeltaReader::FromObjects(manifest, objects, frames, "in-memory delta"));
  }
};

PyDelta DeltaFromParts(const std::string& manifest_json, nb::bytes frames) {
  PyDelta d;
  d.manifest = Take(dcr::DeltaManifest::FromJson(manifest_json, "manifest"));
  if (d.manifest.objects.size() != 1)
    Raise(dcr::InvalidArgument("an in-memory delta has one frame object; this manifest names " +
                               std::to_string(d.manifest.objects.size())));
  d.frames = std::make_shared<std::string>(frames.c_str(), frames.size());
  return d;
}

// A delta directory with one frame object, into memory.
PyDelta DeltaFromDir(const std::filesystem::path& path) {
  const std::string dir = path.string();
  PyDelta d;
  dcr::Status s;
  {
    nb::gil_scoped_release release;
    auto reader = dcr::DeltaReader::Open(dir);
    if (!reader.ok()) {
      s = reader.status();
    } else if (reader->manifest().objects.size() != 1) {
      s = dcr::InvalidArgument(dir + ": an in-memory delta has one frame object, this one has " +
                               std::to_string(reader->manifest().objects.size()));
    } else {
      auto bytes = dcr::MappedFile::Open((std::filesystem::path(dir) / reader->manifest().objects[0]).string(), false);
      if (!bytes.ok()) {
        s = bytes.status();
      } else {
        d.manifest = reader->manifest();
        const auto data = bytes->data();
        d.frames = std::make_shared<std::string>(reinterpret_cast<const char*>(data.data()), data.size());
      }
    }
  }
  Check(s);
  return d;
}

void WriteDelta(const PyDelta& d, const std::filesystem::path& path) {
  const std::string dir = path.string();
  dcr::Status s;
  {
    nb::gil_scoped_release release;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      s = dcr::ErrnoError(ec.value(), dir);
    } else if (std::filesystem::exists(std::filesystem::path(dir) / dcr::kManifestFileName)) {
      s = dcr::AlreadyExists(dir + ": holds a delta already");
    } else {
      // Table and frames first, manifest last: a directory with a manifest is complete.
      const std::filesystem::path p(dir);
      s = dcr::WriteFileAtomically((p / dcr::kTableFileName).string(), d.manifest.TableJson());
      if (s.ok()) s = dcr::WriteFileAtomically((p / d.manifest.objects[0]).string(), *d.frames);
      if (s.ok()) s = dcr::WriteFileAtomically((p / dcr::kManifestFileName).string(), d.manifest.Encode());
    }
  }
  Check(s);
}

// ---- Layouts: senders and receivers over live buffers ------------------------

dcr::CompiledLayout CompileJson(const std::string& json, const std::string& where) {
  dcr::LayoutMap map = Take(dcr::LayoutMapFromJson(json, where));
  return Take(dcr::CompiledLayout::Compile(std::move(map)));
}

std::vector<std::span<uint8_t>> RankBuffers(const dcr::CompiledLayout& layout, const std::vector<nb::ndarray<>>& arrays,
                                            const std::string& who) {
  const auto& buffers = layout.map().buffers;
  if (arrays.size() != buffers.size())
    Raise(dcr::InvalidArgument(who + ": " + std::to_string(arrays.size()) + " buffers given, the layout declares " +
                               std::to_string(buffers.size())));
  std::vector<std::span<uint8_t>> spans;
  for (size_t b = 0; b < arrays.size(); ++b)
    spans.push_back(BytesOf(arrays[b], who + ": buffer '" + buffers[b].id + "'"));
  Check(dcr::CheckRankBuffers(dcr::PlacedRank{&layout, spans}));
  return spans;
}

// The trainer side: one sender holding every canonical element its map
// names, its baseline (the committed version) as owned copies of its buffers.
struct PySender {
  dcr::CompiledLayout layout;
  std::vector<dcr::TensorInfo> tensors;
  std::vector<std::vector<uint8_t>> baseline;

  PySender(dcr::CompiledLayout l, const std::vector<nb::ndarray<>>& initial) : layout(std::move(l)) {
    for (const dcr::LayoutTensor& t : layout.map().tensors)
      tensors.push_back(Take(dcr::MakeTensorInfo(t.name, t.dtype, t.shape)));
    std::vector<std::span<uint8_t>> spans = RankBuffers(layout, initial, "Sender");
    for (auto s : spans) baseline.emplace_back(s.begin(), s.end());
  }

  PyDelta MakeDelta(const std::vector<nb::ndarray<>>& current, const std::string& mode, uint64_t chunk_elements,
                    uint64_t delta_id) {
    const dcr::DeltaOptions opt = MakeDeltaOptions(mode, chunk_elements, delta_id);
    std::vector<std::span<uint8_t>> spans = RankBuffers(layout, current, "Sender.make_delta");
    PyDelta out;
    dcr::Status s;
    {
      nb::gil_scoped_release release;
      s = Encode(spans, opt, &out);
    }
    Check(s);
    return out;
  }

  dcr::Status Encode(const std::vector<std::span<uint8_t>>& current, const dcr::DeltaOptions& opt, PyDelta* out) const {
    dcr::SenderRank rank{&layout, {}, {}};
    for (const auto& b : baseline) rank.baseline.emplace_back(b);
    for (const auto& c : current) rank.current.emplace_back(c);
    out->manifest = dcr::StartLayoutDelta(tensors, opt);
    DCR_ASSIGN_OR_RETURN(std::vector<dcr::ChunkContribution> contributions, dcr::ProjectSender(rank, 0, out->manifest));
    DCR_ASSIGN_OR_RETURN(dcr::OwnedFrames owned, dcr::EncodeOwnedChunks(out->manifest, contributions, opt.encode));
    std::vector<dcr::OwnedFrames> owners;
    owners.push_back(std::move(owned));
    DCR_ASSIGN_OR_RETURN(std::string bytes, dcr::AssembleLayoutDelta(out->manifest, owners));
    out->frames = std::make_shared<std::string>(std::move(bytes));
    return dcr::Status::Ok();
  }

  // The delta was committed: the baseline moves to its target, by applying
  // it to the baseline shards (only changed chunks are touched, each verified).
  nb::dict Commit(const PyDelta& delta) {
    dcr::DeltaReader reader = delta.Reader();
    dcr::Result<dcr::ApplyReport> r = dcr::Internal("not run");
    {
      nb::gil_scoped_release release;
      dcr::PlacedRank placed{&layout, {}};
      for (auto& b : baseline) placed.buffers.emplace_back(b);
      dcr::PlacedRank* ranks[] = {&placed};
      r = dcr::ApplyEngineDelta(ranks, reader);
    }
    return ApplyReportDict(Take(std::move(r)));
  }

  std::string BaselineDigest() const {
    dcr::PlacedRank placed{&layout, {}};
    for (const auto& b : baseline) placed.buffers.emplace_back(const_cast<uint8_t*>(b.data()), b.size());
    return Take(dcr::RankDigest(placed)).ToHex();
  }
};

// A rank's buffers as Python gave them: host arrays (applied in place), or
// an object reaching them wherever they live (PyBufferMemory). The arrays
// and the memory are kept, so the buffers outlive what uses them.
struct PyBuffers {
  std::vector<nb::ndarray<>> arrays;
  std::unique_ptr<dcr_python::PyBufferMemory> memory;
  dcr::PlacedRank placed;

  PyBuffers(const dcr::CompiledLayout& layout, std::vector<nb::ndarray<>> a, nb::object mem, const std::string& who)
      : arrays(std::move(a)) {
    placed.layout = &layout;
    if (mem.is_none()) {
      placed.buffers = RankBuffers(layout, arrays, who);
      return;
    }
    if (!arrays.empty()) Raise(dcr::InvalidArgument(who + ": buffers given as arrays and as a memory both"));
    memory = std::make_unique<dcr_python::PyBufferMemory>(mem, nb::cast<std::vector<uint64_t>>(mem.attr("sizes")()));
    placed.memory = memory.get();
    Check(dcr::CheckRankBuffers(placed).WithContext(who));
  }
};

// The receiver side: one rank (or a whole engine in one process) over live
// buffers, applied in place. It tracks the engine's chunk digests (computed
// at the first apply, then updated from the changed words alone).
struct PyReceiver {
  dcr::CompiledLayout layout;
  PyBuffers buffers;
  std::vector<std::string> residuals;
  dcr::ChunkDigestTable tracked;  // of the manifest shape below; empty: computed at the next apply
  std::vector<std::string> tracked_names;
  uint64_t tracked_chunk = 0;

  PyReceiver(dcr::CompiledLayout l, std::vector<nb::ndarray<>> a, std::vector<std::string> r, nb::object mem)
      : layout(std::move(l)), buffers(layout, std::move(a), std::move(mem), "Receiver"), residuals(std::move(r)) {}

  nb::dict Apply(const PyDelta& delta) {
    dcr::DeltaReader reader = delta.Reader();
    dcr::Result<dcr::ApplyReport> r = dcr::Internal("not run");
    {
      nb::gil_scoped_release release;
      const dcr::DeltaManifest& m = reader.manifest();
      std::vector<std::string> names;
      for (const auto& t : m.tensors) names.push_back(t.name);
      if (names != tracked_names || m.chunk_elements != tracked_chunk) tracked.clear();
      dcr::PlacedRank* ranks[] = {&buffers.placed};
      r = dcr::ApplyEngineDelta(ranks, reader, residuals, &tracked);
      tracked_names = std::move(names);
      tracked_chunk = m.chunk_elements;
      if (!r.ok()) tracked.clear();  // after a failure the next apply starts from the bits
    }
    return ApplyReportDict(Take(std::move(r)));
  }

  // The tensors changed outside dcr: the next apply digests them again.
  void Forget() { tracked.clear(); }

  std::string Digest() {
    nb::gil_scoped_release release;
    return Take(dcr::RankDigest(buffers.placed)).ToHex();
  }
};

// ---- Stores and the protocol -------------------------------------------------

struct PyStore {
  std::unique_ptr<dcr::Store> store;
};

nb::dict PublishReportDict(const dcr::PublishReport& r) {
  nb::dict d;
  d["version"] = r.version;
  d["attempt"] = r.attempt;
  d["attempts"] = r.attempts;
  d["frame_bytes"] = r.frame_bytes;
  d["payload_bytes"] = r.payload_bytes;
  d["manifest_bytes"] = r.manifest_bytes;
  d["download_bytes"] = r.download_bytes;
  d["changed_words"] = r.changed_words;
  d["total_bytes"] = r.total_bytes;
  d["acked"] = r.acked;
  d["retired"] = r.retired;
  d["relay_acks"] = r.relay_acks;
  d["relay_acks_unconfirmed"] = r.relay_acks_unconfirmed;
  d["encode_seconds"] = r.encode_seconds;
  d["wait_seconds"] = r.wait_seconds;
  d["total_seconds"] = r.total_seconds;
  d["baseline_seconds"] = r.baseline_seconds;
  d["advance_seconds"] = r.advance_seconds;
  d["staging_seconds"] = r.staging_seconds;
  d["state_dir"] = r.state_dir;
  nb::dict memory;
  memory["baseline_bytes"] = r.memory.baseline_bytes;
  memory["baseline_in_memory"] = r.memory.baseline_in_memory;
  memory["staging_bytes"] = r.memory.staging_bytes;
  memory["frames_in_flight_bytes"] = r.memory.frames_in_flight_bytes;
  memory["digest_bytes"] = r.memory.digest_bytes;
  d["memory"] = memory;
  d["already_committed"] = r.already_committed;
  return d;
}

// Relay client options under `id` from the Python arguments; nullopt
// without addresses (then none of the key arguments may be given).
std::optional<dcr::RelayClientOptions> RelayOptions(const std::string& id, const std::vector<std::string>& addresses,
                                                    const std::string& key, const std::string& pub, bool insecure) {
  if (addresses.empty()) {
    if (!key.empty() || !pub.empty() || insecure)
      Raise(dcr::InvalidArgument("relay_key, relay_pub and relay_insecure need relay addresses"));
    return std::nullopt;
  }
  dcr::RelayClientOptions o;
  o.id = id;
  o.addresses = addresses;
  o.security = Take(dcr::LoadRelaySecurity(key, pub, "", insecure, {"relay_key", "relay_pub", "", "relay_insecure"}));
  return o;
}

// A receiver's relay client (frame objects from the relay tree), started
// under the receiver's id; null without addresses.
std::unique_ptr<dcr::RelayReceiver> StartRelay(const std::string& id, const std::vector<std::string>& addresses,
                                               const std::string& key, const std::string& pub, bool insecure,
                                               bool quiet) {
  auto o = RelayOptions(id, addresses, key, pub, insecure);
  if (!o) return nullptr;
  if (quiet) o->log = [](const std::string&) {};
  return Take(dcr::RelayReceiver::Start(std::move(*o)));
}

// A publisher's relay client (frame objects and fences pushed to the roots
// of the relay tree, acks taken from them), under `id`; null without addresses.
std::unique_ptr<dcr::RelaySender> StartRelaySender(const std::string& id, const std::vector<std::string>& addresses,
                                                   const std::string& key, const std::string& pub, bool insecure) {
  auto o = RelayOptions(id, addresses, key, pub, insecure);
  if (!o) return nullptr;
  o->dead_after = std::chrono::seconds(5);  // a root is written off only when really gone (as `dcr publish`)
  o->log = [](const std::string&) {};
  return Take(dcr::RelaySender::Start(std::move(*o)));
}

// The relay (declared first) outlives the follower that takes from it.
struct PyFollower {
  std::unique_ptr<dcr::RelayReceiver> relay;
  std::unique_ptr<dcr::Follower> follower;
};

// One rank of an engine following the run into live buffers (the arrays are
// kept, and the compiled map has a fixed address, so both outlive the follower).
struct PyRankFollower {
  std::unique_ptr<dcr::CompiledLayout> layout;
  std::unique_ptr<PyBuffers> buffers;
  std::unique_ptr<dcr::RelayReceiver> relay;
  std::unique_ptr<dcr::RankFollower> follower;
};

// Ctrl-C while a publish waits for acks: PublishOptions::cancel takes the
// GIL (every 20 ms) to let Python's signal handlers run; once one raised
// (KeyboardInterrupt), the publish stops (its attempt fenced) and the
// exception is re-raised when it returns.
struct Interruptible {
  std::shared_ptr<bool> raised = std::make_shared<bool>(false);

  std::function<bool()> Hook() const {
    return [raised = raised] {
      if (*raised) return true;  // an exception is pending: no more Python calls
      nb::gil_scoped_acquire acquire;
      return *raised = PyErr_CheckSignals() != 0;
    };
  }
  template <typename F>
  auto Run(F&& publish) {
    *raised = false;
    dcr::Result<dcr::PublishReport> r = dcr::Internal("not run");
    {
      nb::gil_scoped_release release;
      r = publish();
    }
    if (*raised) throw nb::python_error();
    return PublishReportDict(Take(std::move(r)));
  }
};

struct PyPublisher {
  dcr::Publisher publisher;
  Interruptible interrupt;
};

// A trainer's senders publishing live shards: their compiled maps, fixed at
// construction; the buffers are given with each publish. One process of
// several (processes > 1): `layouts` are this process's senders, `all` every
// sender's map (global order) and `procs` the placement.
struct PyShardPublisher {
  std::vector<std::unique_ptr<dcr::CompiledLayout>> layouts, all;
  dcr::ShardProcesses procs;
  std::unique_ptr<dcr::RelaySender> relay;  // declared first: outlives the publisher
  std::unique_ptr<dcr::ShardPublisher> publisher;
  Interruptible interrupt;
};

// The senders' sources for one call: their buffers (checked against the
// maps), and where given, a stage function run on the publisher's copy
// thread (stagers[k](b) fills buffer b's host memory; under the GIL).
std::vector<dcr::ShardSource> ShardSources(PyShardPublisher& p, const std::vector<std::vector<nb::ndarray<>>>& buffers,
                                           const std::vector<nb::object>& stagers, const std::string& who) {
  if (buffers.size() != p.layouts.size() || (!stagers.empty() && stagers.size() != p.layouts.size()))
    Raise(dcr::InvalidArgument(who + ": " + std::to_string(buffers.size()) + " senders' buffers and " +
                               std::to_string(stagers.size()) + " stagers given, it has " +
                               std::to_string(p.layouts.size()) + " senders"));
  std::vector<dcr::ShardSource> sources;
  for (size_t k = 0; k < buffers.size(); ++k) {
    dcr::ShardSource src{p.layouts[k].get(), {}, {}};
    for (auto span : RankBuffers(*p.layouts[k], buffers[k], "ShardPublisher: sender " + std::to_string(k)))
      src.current.emplace_back(span);
    if (!stagers.empty() && !stagers[k].is_none())
      src.stage = [stage = stagers[k]](size_t b) -> dcr::Status {
        nb::gil_scoped_acquire acquire;
        try {
          stage(b);
          return dcr::Status::Ok();
        } catch (nb::python_error& e) {
          return dcr::Aborted(std::string("the stage function raised: ") + e.what());
        }
      };
    sources.push_back(std::move(src));
  }
  return sources;
}

dcr::PublishOptions MakePublishOptions(uint32_t senders, uint32_t max_attempts, double ack_timeout_s,
                                       double heartbeat_timeout_s, uint64_t snapshot_every, uint64_t chunk_elements) {
  dcr::PublishOptions o;
  o.senders = senders;
  o.max_attempts = max_attempts;
  o.ack_timeout = std::chrono::milliseconds(static_cast<int64_t>(ack_timeout_s * 1000));
  o.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(heartbeat_timeout_s * 1000));
  o.snapshot_every = snapshot_every;
  o.delta = MakeDeltaOptions("xor", chunk_elements, 0);
  return o;
}

// Failures injected on purpose (tests of retries): each "point:n" makes the
// n-th time the publisher reaches fault point `point` fail as a transient
// store error would (the attempt is fenced and retried).
std::function<dcr::Status(std::string_view)> InjectedFailures(const std::vector<std::string>& specs) {
  if (specs.empty()) return {};
  auto counts = std::make_shared<std::map<std::string, uint64_t>>();
  std::map<std::string, uint64_t> at;
  for (const std::string& spec : specs) {
    const size_t colon = spec.rfind(':');
    uint64_t n = 0;
    const char* first = colon == std::string::npos ? nullptr : spec.data() + colon + 1;
    const char* last = spec.data() + spec.size();
    if (!first || first == last || std::from_chars(first, last, n).ptr != last || n == 0)
      Raise(dcr::InvalidArgument("inject_failures: '" + spec + "' is not POINT:N (N >= 1)"));
    at[spec.substr(0, colon)] = n;
  }
  return [counts, at](std::string_view point) {
    const std::string p(point);
    auto it = at.find(p);
    if (it != at.end() && ++(*counts)[p] == it->second)
      return dcr::Unavailable("injected failure at " + p + " (inject_failures)");
    return dcr::Status::Ok();
  };
}

dcr::FollowOptions MakeFollowOptions(const std::string& id, double poll_s, double relay_poll_s, bool quiet) {
  if (!(relay_poll_s >= 0.001 && relay_poll_s <= 3600))
    Raise(dcr::InvalidArgument("relay_poll_s must be in [0.001, 3600] seconds, not " + std::to_string(relay_poll_s)));
  dcr::FollowOptions o;
  o.id = id;
  o.poll = std::chrono::milliseconds(static_cast<int64_t>(poll_s * 1000));
  o.relay_poll = std::chrono::milliseconds(static_cast<int64_t>(relay_poll_s * 1000));
  if (quiet) o.log = [](const std::string&) {};
  return o;
}

// Runs a follower (dcr::Follower or dcr::RankFollower) without the GIL.
// The loop polls `stop` after every step (each poll of the store): it takes
// the GIL there to let Python signal handlers run (Ctrl-C raises
// KeyboardInterrupt, which stops the loop cleanly) and to call
// on_version(version) after each version applied (a RankFollower: also after
// the version it joined or reopened). An exception from either stops the loop
// and is re-raised once Run has returned.
template <typename F>
uint64_t RunFollowing(F& follower, const std::string& who, std::optional<uint64_t> until,
                      std::optional<double> timeout_s, nb::object on_version) {
  dcr::Status s;
  bool timed_out = false, py_error = false;
  std::optional<uint64_t> seen;
  // A RankFollower reports the version it joins or reopens, but not again
  // the one a previous call already reported (a call continuing it).
  if constexpr (requires { follower.holds_version(); }) {
    if (follower.holds_version()) seen = follower.version();
  } else {
    seen = follower.version();
  }
  auto poll_python = [&]() -> bool {
    if (py_error) return true;  // an exception is pending: no more Python calls
    nb::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() != 0) return py_error = true;
    if constexpr (requires { follower.holds_version(); })
      if (!follower.holds_version()) return false;
    const uint64_t v = follower.version();
    if (v != seen && !on_version.is_none()) {
      seen = v;
      PyObject* r = PyObject_CallOneArg(on_version.ptr(), nb::int_(v).ptr());
      if (r == nullptr) return py_error = true;
      Py_DECREF(r);
    }
    seen = v;
    return false;
  };
  {
    nb::gil_scoped_release release;
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(timeout_s.value_or(0) * 1000));
    s = follower.Run(until, [&] {
      if (poll_python()) return true;
      if (!timeout_s || std::chrono::steady_clock::now() < deadline) return false;
      timed_out = true;
      return true;
    });
    if (!py_error && s.ok()) poll_python();  // the last version, when `until` ended the loop
  }
  if (py_error) throw nb::python_error();
  if (timed_out)  // the stop callback makes Run return ABORTED; say why instead
    Raise(dcr::DeadlineExceeded(who + ": " + std::to_string(*timeout_s) + " s passed at version " +
                                std::to_string(follower.version())));
  Check(s);
  return follower.version();
}

}  // namespace

NB_MODULE(_dcr, m) {
  m.doc() = "dcr's C++ core (private: use the dcr package)";

  m.def(
      "_raise_status",
      [](const std::string& code, const std::string& message) {
        for (int c = 1; c <= static_cast<int>(dcr::Code::kInternal); ++c)
          if (dcr::CodeName(static_cast<dcr::Code>(c)) == code) Raise(dcr::Status(static_cast<dcr::Code>(c), message));
        Raise(dcr::InvalidArgument("unknown code " + code));
      },
      "code"_a, "message"_a, "Raises the exception a C++ Status of this code becomes (for tests).");

  // Checkpoint
  nb::class_<PyCheckpoint>(m, "Checkpoint")
      .def_static(
          "open",
          [](const std::string& path, bool writable) {
            dcr::Result<dcr::Checkpoint> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = dcr::Checkpoint::Open(path, writable ? dcr::OpenMode::kReadWrite : dcr::OpenMode::kReadOnly);
            }
            return PyCheckpoint{Take(std::move(r))};
          },
          "path"_a, "writable"_a = false)
      .def_static(
          "create",
          [](const std::string& path,
             const std::vector<std::tuple<std::string, std::string, std::vector<uint64_t>>>& specs,
             uint64_t max_shard_bytes) {
            std::vector<dcr::TensorInfo> tensors;
            for (const auto& [name, dtype, shape] : specs)
              tensors.push_back(Take(dcr::MakeTensorInfo(name, ParseDTypeOrRaise(dtype), shape)));
            dcr::CreateOptions o;
            o.max_shard_bytes = max_shard_bytes;
            dcr::Result<dcr::Checkpoint> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = dcr::Checkpoint::Create(path, tensors, o);
            }
            return PyCheckpoint{Take(std::move(r))};
          },
          "path"_a, "tensors"_a, "max_shard_bytes"_a = 0)
      .def_prop_ro("path", [](const PyCheckpoint& c) { return c.ckpt.path(); })
      .def_prop_ro("writable", [](const PyCheckpoint& c) { return c.ckpt.mode() == dcr::OpenMode::kReadWrite; })
      .def_prop_ro("total_bytes", [](const PyCheckpoint& c) { return c.ckpt.total_bytes(); })
      .def_prop_ro("files", [](const PyCheckpoint& c) { return c.ckpt.files(); })
      .def("tensors",
           [](const PyCheckpoint& c) {
             std::vector<nb::tuple> out;
             for (const auto& t : c.ckpt.tensors()) out.push_back(TensorTuple(t));
             return out;
           })
      .def(
          "array",
          [](nb::handle self, const std::string& name) {
            return TensorArray(self, nb::cast<PyCheckpoint&>(self), name);
          },
          "name"_a)
      .def("sync", [](PyCheckpoint& c) {
        dcr::Status s;
        {
          nb::gil_scoped_release release;
          s = c.ckpt.Sync();
        }
        Check(s);
      });

  // File deltas
  m.def(
      "make_delta",
      [](const PyCheckpoint& base, const PyCheckpoint& next, const std::string& out_dir, const std::string& mode,
         uint64_t chunk_elements, uint64_t delta_id) {
        const dcr::DeltaOptions opt = MakeDeltaOptions(mode, chunk_elements, delta_id);
        dcr::Result<dcr::DeltaManifest> r = dcr::Internal("not run");
        {
          nb::gil_scoped_release release;
          r = dcr::MakeDelta(base.ckpt, next.ckpt, opt, out_dir);
        }
        return Take(std::move(r)).ToJson();
      },
      "base"_a, "next"_a, "out_dir"_a, "mode"_a, "chunk_elements"_a, "delta_id"_a);

  m.def(
      "apply_delta",
      [](PyCheckpoint& target, const std::string& delta_dir) {
        if (target.ckpt.mode() != dcr::OpenMode::kReadWrite)
          Raise(dcr::InvalidArgument(target.ckpt.path() + ": opened read-only; open it with writable=True to apply"));
        dcr::Result<dcr::ApplyReport> r = dcr::Internal("not run");
        {
          nb::gil_scoped_release release;
          auto reader = dcr::DeltaReader::Open(delta_dir);
          r = reader.ok() ? dcr::ApplyDelta(target.ckpt, *reader) : dcr::Result<dcr::ApplyReport>(reader.status());
        }
        return ApplyReportDict(Take(std::move(r)));
      },
      "target"_a, "delta_dir"_a);

  m.def(
      "verify_delta",
      [](const PyCheckpoint& ckpt, const std::string& delta_dir, bool against_base) {
        dcr::Result<dcr::VerifyReport> r = dcr::Internal("not run");
        {
          nb::gil_scoped_release release;
          auto reader = dcr::DeltaReader::Open(delta_dir);
          r = reader.ok() ? dcr::VerifyDelta(ckpt.ckpt, *reader, against_base)
                          : dcr::Result<dcr::VerifyReport>(reader.status());
        }
        dcr::VerifyReport v = Take(std::move(r));
        return std::make_pair(v.matches, v.differing);
      },
      "checkpoint"_a, "delta_dir"_a, "against_base"_a = false);

  // The manifest, after checking every frame (checksums, headers): DATA_LOSS otherwise.
  m.def(
      "inspect_delta",
      [](const std::string& delta_dir) {
        dcr::Result<std::string> r = dcr::Internal("not run");
        {
          nb::gil_scoped_release release;
          r = [&]() -> dcr::Result<std::string> {
            DCR_ASSIGN_OR_RETURN(dcr::DeltaReader reader, dcr::DeltaReader::Open(delta_dir));
            for (size_t i = 0; i < reader.manifest().frames.size(); ++i) DCR_RETURN_IF_ERROR(reader.Frame(i));
            return reader.manifest().ToJson();
          }();
        }
        return Take(std::move(r));
      },
      "delta_dir"_a);

  // A stored manifest (manifest.bin) described as JSON, decoded against its
  // tensor table: a delta directory's tensors.json, or a run's run.json.
  m.def(
      "describe_manifest",
      [](nb::bytes manifest, const std::string& table_json) {
        auto table = dcr::DeltaManifest::FromTableJson(table_json, "tensor table");
        if (!table.ok())
          if (auto run = dcr::DeltaManifest::FromTableJson(table_json, "run.json", "dcr-run"); run.ok())
            table = std::move(run);
        const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(manifest.c_str()), manifest.size());
        return Take(dcr::DeltaManifest::Decode(bytes, Take(std::move(table)), "manifest")).ToJson();
      },
      "manifest"_a, "table_json"_a);

  // In-memory deltas
  nb::class_<PyDelta>(m, "Delta")
      .def_static("from_parts", &DeltaFromParts, "manifest_json"_a, "frames"_a)
      .def_static("read", &DeltaFromDir, "dir"_a)
      .def_prop_ro("manifest_json", [](const PyDelta& d) { return d.manifest.ToJson(); })
      .def_prop_ro("frames", [](const PyDelta& d) { return nb::bytes(d.frames->data(), d.frames->size()); })
      .def_prop_ro("frame_count", [](const PyDelta& d) { return d.manifest.frames.size(); })
      .def_prop_ro("frame_bytes", [](const PyDelta& d) { return d.manifest.frame_bytes; })
      .def_prop_ro("changed_words", [](const PyDelta& d) { return d.manifest.changed_words; })
      .def_prop_ro("delta_id", [](const PyDelta& d) { return d.manifest.delta_id; })
      .def_prop_ro("mode",
                   [](const PyDelta& d) {
                     return std::string(d.manifest.delta_class == dcr::DeltaClass::kXorClass ? "xor" : "overwrite");
                   })
      .def_prop_ro("target_digest", [](const PyDelta& d) { return d.manifest.target_digest.ToHex(); })
      .def_prop_ro("base_digest", [](const PyDelta& d) { return d.manifest.base_digest.ToHex(); })
      .def("write", &WriteDelta, "dir"_a);

  m.def(
      "add_digests",
      [](const std::vector<std::string>& digests) {
        dcr::Digest sum;
        for (const auto& hex : digests) sum += ParseDigest(hex, "add_digests");
        return sum.ToHex();
      },
      "digests"_a, "The sum of digests (hex): the digest of the union of the disjoint elements they cover.");

  // Layouts
  m.def(
      "validate_layout",
      [](const std::string& json) { return dcr::LayoutMapToJson(Take(dcr::LayoutMapFromJson(json, "layout"))); },
      "json"_a, "Validates a layout map; returns its canonical JSON.");

  nb::class_<PySender>(m, "Sender")
      .def(
          "__init__",
          [](PySender* self, const std::string& layout_json, const std::vector<nb::ndarray<>>& buffers) {
            new (self) PySender(CompileJson(layout_json, "sender layout"), buffers);
          },
          "layout_json"_a, "buffers"_a)
      .def("make_delta", &PySender::MakeDelta, "buffers"_a, "mode"_a, "chunk_elements"_a, "delta_id"_a)
      .def("commit", &PySender::Commit, "delta"_a)
      .def("baseline_digest", &PySender::BaselineDigest);

  nb::class_<PyReceiver>(m, "Receiver")
      .def(
          "__init__",
          [](PyReceiver* self, const std::string& layout_json, std::vector<nb::ndarray<>> buffers,
             std::vector<std::string> residuals, nb::object memory) {
            new (self) PyReceiver(CompileJson(layout_json, "receiver layout"), std::move(buffers), std::move(residuals),
                                  std::move(memory));
          },
          "layout_json"_a, "buffers"_a, "residuals"_a, "memory"_a = nb::none())
      .def("apply", &PyReceiver::Apply, "delta"_a)
      .def("forget_digests", &PyReceiver::Forget)
      .def("digest", &PyReceiver::Digest);

  // Stores
  nb::class_<PyStore>(m, "Store")
      .def_prop_ro("url", [](const PyStore& s) { return s.store->url(); })
      .def(
          "put",
          [](PyStore& s, const std::string& key, nb::bytes data, bool create_if_absent) {
            dcr::Status st;
            {
              nb::gil_scoped_release release;
              st = s.store->Put(key, std::string_view(data.c_str(), data.size()),
                                create_if_absent ? dcr::WriteMode::kCreateIfAbsent : dcr::WriteMode::kOverwrite);
            }
            Check(st);
          },
          "key"_a, "data"_a, "create_if_absent"_a = false)
      .def(
          "get",
          [](PyStore& s, const std::string& key) {
            dcr::Result<std::string> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = s.store->Get(key);
            }
            std::string v = Take(std::move(r));
            return nb::bytes(v.data(), v.size());
          },
          "key"_a)
      .def(
          "head",
          [](PyStore& s, const std::string& key) {
            dcr::Result<dcr::ObjectInfo> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = s.store->Head(key);
            }
            dcr::ObjectInfo i = Take(std::move(r));
            return nb::make_tuple(i.key, i.size, i.etag);
          },
          "key"_a)
      .def(
          "list",
          [](PyStore& s, const std::string& prefix) {
            dcr::Result<std::vector<dcr::ObjectInfo>> r = dcr::Internal("not run");
            {
              nb::gil_scoped_release release;
              r = s.store->List(prefix);
            }
            std::vector<nb::tuple> out;
            for (const auto& i : Take(std::move(r))) out.push_back(nb::make_tuple(i.key, i.size, i.etag));
            return out;
          },
          "prefix"_a = "")
      .def(
          "delete",
          [](PyStore& s, const std::string& key) {
            dcr::Status st;
            {
              nb::gil_scoped_release release;
              st = s.store->Delete(key);
            }
            Check(st);
          },
          "key"_a);

  m.def(
      "default_publisher_state_dir",
      [](const std::string& store_url) { return Take(dcr::DefaultPublisherStateDir(store_url)); }, "store_url"_a);
  m.def(
      "open_store",
      [](const std::string& url, bool create_root) {
        dcr::OpenStoreOptions o;
        o.create_root = create_root;
        dcr::Result<std::unique_ptr<dcr::Store>> r = dcr::Internal("not run");
        {
          nb::gil_scoped_release release;
          r = dcr::OpenStore(url, o);
        }
        return new PyStore{Take(std::move(r))};
      },
      "url"_a, "create_root"_a = true, nb::rv_policy::take_ownership);

  // The protocol
  nb::class_<PyPublisher>(m, "Publisher")
      .def(
          "__init__",
          [](PyPublisher* self, PyStore& store, const std::string& state_dir, uint32_t senders, uint32_t max_attempts,
             double ack_timeout_s, double heartbeat_timeout_s, uint64_t snapshot_every, uint64_t chunk_elements) {
            Interruptible interrupt;
            dcr::PublishOptions o = MakePublishOptions(senders, max_attempts, ack_timeout_s, heartbeat_timeout_s,
                                                       snapshot_every, chunk_elements);
            o.cancel = interrupt.Hook();
            new (self) PyPublisher{dcr::Publisher(*store.store, state_dir, std::move(o)), interrupt};
          },
          "store"_a, "state_dir"_a, "senders"_a, "max_attempts"_a, "ack_timeout_s"_a, "heartbeat_timeout_s"_a,
          "snapshot_every"_a, "chunk_elements"_a, nb::keep_alive<1, 2>())
      .def(
          "publish",
          [](PyPublisher& p, uint64_t version, const PyCheckpoint& next) {
            return p.interrupt.Run([&] { return p.publisher.Publish(version, next.ckpt); });
          },
          "version"_a, "checkpoint"_a);

  nb::class_<PyFollower>(m, "Follower")
      .def(
          "__init__",
          [](PyFollower* self, PyStore& store, const std::string& target, const std::string& id, double poll_s,
             bool quiet, const std::vector<std::string>& relay, const std::string& relay_key,
             const std::string& relay_pub, bool relay_insecure, double relay_poll_s) {
            dcr::FollowOptions o =
                MakeFollowOptions(id.empty() ? dcr::DefaultReceiverId() : id, poll_s, relay_poll_s, quiet);
            auto relayed = StartRelay(o.id, relay, relay_key, relay_pub, relay_insecure, quiet);
            o.relay = relayed.get();
            auto follower = std::make_unique<dcr::Follower>(*store.store, target, std::move(o));
            new (self) PyFollower{std::move(relayed), std::move(follower)};
          },
          "store"_a, "target"_a, "id"_a, "poll_s"_a, "quiet"_a, "relay"_a, "relay_key"_a, "relay_pub"_a,
          "relay_insecure"_a, "relay_poll_s"_a, nb::keep_alive<1, 2>())
      .def(
          "run",
          [](PyFollower& f, std::optional<uint64_t> until, std::optional<double> timeout_s, nb::object on_version) {
            return RunFollowing(*f.follower, "Follower.run", until, timeout_s, on_version);
          },
          "until"_a = nb::none(), "timeout_s"_a = nb::none(), "on_version"_a = nb::none())
      .def_prop_ro("version", [](const PyFollower& f) { return f.follower->version(); });

  nb::class_<PyRankFollower>(m, "RankFollower")
      .def(
          "__init__",
          [](PyRankFollower* self, PyStore& store, const std::string& layout_json, std::vector<nb::ndarray<>> buffers,
             const std::string& state_dir, const std::string& engine, uint32_t rank, uint32_t ranks,
             const std::string& id, double poll_s, bool quiet, const std::vector<std::string>& relay,
             const std::string& relay_key, const std::string& relay_pub, bool relay_insecure, double relay_poll_s,
             nb::object memory) {
            auto layout = std::make_unique<dcr::CompiledLayout>(CompileJson(layout_json, "receiver layout"));
            auto held = std::make_unique<PyBuffers>(*layout, std::move(buffers), std::move(memory), "Receiver.follow");
            const dcr::PlacedRank placed = held->placed;
            dcr::FollowOptions o =
                MakeFollowOptions(id.empty() ? engine + "-r" + std::to_string(rank) : id, poll_s, relay_poll_s, quiet);
            auto relayed = StartRelay(o.id, relay, relay_key, relay_pub, relay_insecure, quiet);
            o.relay = relayed.get();
            auto follower = std::make_unique<dcr::RankFollower>(*store.store, placed, state_dir,
                                                                dcr::EngineRank{engine, rank, ranks}, std::move(o));
            new (self) PyRankFollower{std::move(layout), std::move(held), std::move(relayed), std::move(follower)};
          },
          "store"_a, "layout"_a, "buffers"_a, "state_dir"_a, "engine"_a, "rank"_a, "ranks"_a, "id"_a, "poll_s"_a,
          "quiet"_a, "relay"_a, "relay_key"_a, "relay_pub"_a, "relay_insecure"_a, "relay_poll_s"_a,
          "memory"_a = nb::none(), nb::keep_alive<1, 2>())
      .def(
          "run",
          [](PyRankFollower& f, std::optional<uint64_t> until, std::optional<double> timeout_s, nb::object on_version) {
            return RunFollowing(*f.follower, "Receiver.follow", until, timeout_s, on_version);
          },
          "until"_a = nb::none(), "timeout_s"_a = nb::none(), "on_version"_a = nb::none())
      .def(
          "adopt",
          [](PyRankFollower& f, uint64_t version, const std::string& engine_digest) {
            const dcr::Digest d = ParseDigest(engine_digest, "Receiver.adopt: engine_digest");
            dcr::Status s;
            {
              nb::gil_scoped_release release;
              s = f.follower->Adopt(version, d);
            }
            Check(s);
          },
          "version"_a, "engine_digest"_a)
      .def_prop_ro("version", [](const PyRankFollower& f) { return f.follower->version(); })
      .def(
          "take_changed", [](PyRankFollower& f) { return f.follower->TakeChangedTensors(); },
          "The map's tensors Run may have written since the last call (from run's on_version, or after run).");

  nb::class_<PyShardPublisher>(m, "ShardPublisher")
      .def(
          "__init__",
          [](PyShardPublisher* self, PyStore& store, const std::string& state_dir,
             const std::vector<std::string>& layouts, uint32_t senders, uint32_t max_attempts, double ack_timeout_s,
             double heartbeat_timeout_s, uint64_t snapshot_every, uint64_t chunk_elements, uint32_t process,
             uint32_t processes, const std::vector<std::string>& all_layouts, const std::vector<uint32_t>& placement,
             double peer_timeout_s, const std::vector<std::string>& inject_failures,
             const std::vector<std::string>& relay, const std::string& relay_key, const std::string& relay_pub,
             bool relay_insecure) {
            std::vector<std::unique_ptr<dcr::CompiledLayout>> compiled, all;
            for (size_t k = 0; k < layouts.size(); ++k)
              compiled.push_back(std::make_unique<dcr::CompiledLayout>(
                  CompileJson(layouts[k], "sender " + std::to_string(k) + "'s layout")));
            for (size_t k = 0; k < all_layouts.size(); ++k)
              all.push_back(std::make_unique<dcr::CompiledLayout>(
                  CompileJson(all_layouts[k], "global sender " + std::to_string(k) + "'s layout")));
            Interruptible interrupt;
            dcr::PublishOptions o = MakePublishOptions(senders, max_attempts, ack_timeout_s, heartbeat_timeout_s,
                                                       snapshot_every, chunk_elements);
            o.peer_timeout = std::chrono::milliseconds(static_cast<int64_t>(peer_timeout_s * 1000));
            o.cancel = interrupt.Hook();
            o.fault = InjectedFailures(inject_failures);
            auto pushed = StartRelaySender("publish-" + dcr::DefaultReceiverId() + "-p" + std::to_string(process),
                                           relay, relay_key, relay_pub, relay_insecure);
            o.relay = pushed.get();
            auto publisher = std::make_unique<dcr::ShardPublisher>(*store.store, state_dir, std::move(o));
            new (self) PyShardPublisher{
                std::move(compiled), std::move(all),       dcr::ShardProcesses{process, processes, placement},
                std::move(pushed),   std::move(publisher), interrupt};
          },
          "store"_a, "state_dir"_a, "layouts"_a, "senders"_a, "max_attempts"_a, "ack_timeout_s"_a,
          "heartbeat_timeout_s"_a, "snapshot_every"_a, "chunk_elements"_a, "process"_a = 0, "processes"_a = 1,
          "all_layouts"_a = std::vector<std::string>{}, "placement"_a = std::vector<uint32_t>{},
          "peer_timeout_s"_a = 60.0, "inject_failures"_a = std::vector<std::string>{},
          "relay"_a = std::vector<std::string>{}, "relay_key"_a = "", "relay_pub"_a = "", "relay_insecure"_a = false,
          nb::keep_alive<1, 2>())
      .def(
          "adopt",
          [](PyShardPublisher& p, uint64_t version, const std::vector<std::vector<nb::ndarray<>>>& buffers,
             const std::vector<nb::object>& stagers) {
            std::vector<dcr::ShardSource> sources = ShardSources(p, buffers, stagers, "ShardPublisher.adopt");
            dcr::Status s;
            {
              nb::gil_scoped_release release;
              s = p.publisher->Adopt(version, sources);
            }
            Check(s);
          },
          "version"_a, "buffers"_a, "stagers"_a = std::vector<nb::object>{})
      .def(
          "publish",
          [](PyShardPublisher& p, uint64_t version, const std::vector<std::vector<nb::ndarray<>>>& buffers,
             const std::vector<nb::object>& stagers) {
            std::vector<dcr::ShardSource> sources = ShardSources(p, buffers, stagers, "ShardPublisher.publish");
            return p.interrupt.Run([&] {
              if (p.all.empty()) return p.publisher->Publish(version, sources);
              std::vector<const dcr::CompiledLayout*> maps;
              for (const auto& l : p.all) maps.push_back(l.get());
              return p.publisher->Publish(version, maps, sources, p.procs);
            });
          },
          "version"_a, "buffers"_a, "stagers"_a = std::vector<nb::object>{});
}
