// The bindings' shared pieces (python/src/): the one place a Status becomes
// a Python exception (Raise), conversions, and the objects several API
// areas pass around. Each area binds itself (Bind* below, one file each);
// module.cc calls them.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/map.h>
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
#include "dcr/fp8_engine.h"
#include "dcr/layout.h"
#include "dcr/layout_apply.h"
#include "dcr/mapped_file.h"
#include "dcr/publisher.h"
#include "dcr/receiver.h"
#include "dcr/relay.h"
#include "dcr/shard_publisher.h"
#include "dcr/status.h"
#include "dcr/store.h"

namespace dcr_python {

namespace nb = nanobind;
using namespace nb::literals;

[[noreturn]] void Raise(const dcr::Status& status);
void Check(const dcr::Status& status);
// A digest from its 32-hex-digit form (docs/format.md section 2), or kInvalidArgument naming `what`.
dcr::Digest ParseDigest(const std::string& hex, const std::string& what);
template <typename T>
T Take(dcr::Result<T>&& result) {
  if (!result.ok()) Raise(result.status());
  return std::move(result).value();
}
dcr::DType ParseDTypeOrRaise(const std::string& name);
dcr::DeltaClass ParseMode(const std::string& mode);
dcr::DeltaOptions MakeDeltaOptions(const std::string& mode, uint64_t chunk_elements, uint64_t delta_id);
// A flat, CPU, contiguous uint8 array (numpy or torch through DLPack), as bytes.
std::span<uint8_t> BytesOf(const nb::ndarray<>& a, const std::string& what);
nb::dict ApplyReportDict(const dcr::ApplyReport& r);
nb::tuple TensorTuple(const dcr::TensorInfo& t);
dcr::CompiledLayout CompileJson(const std::string& json, const std::string& where);
std::vector<std::span<uint8_t>> RankBuffers(const dcr::CompiledLayout& layout, const std::vector<nb::ndarray<>>& arrays,
                                            const std::string& who);

struct PyCheckpoint {
  dcr::Checkpoint ckpt;
};

struct PyDelta {
  dcr::DeltaManifest manifest;
  std::shared_ptr<std::string> frames;  // the one frame object (manifest.objects == {"frames.bin"})

  dcr::DeltaReader Reader() const {
    std::vector<std::span<const uint8_t>> objects = {
        {reinterpret_cast<const uint8_t*>(frames->data()), frames->size()}};
    return Take(dcr::DeltaReader::FromObjects(manifest, objects, frames, "in-memory delta"));
  }
};

struct PyStore {
  std::unique_ptr<dcr::Store> store;
};

// An FP8 engine rank's memory (dcr::Fp8EngineMemory: a master of its FP8
// buffers, requantized into the engine's E4M3 bytes and scales at every
// flush), shared by the Receiver's applies and follows. Holds its own
// compiled layout (from the same JSON: the same buffer indices) and the
// arrays it writes.
struct PyFp8Memory {
  dcr::CompiledLayout layout;
  std::vector<nb::ndarray<>> arrays;
  std::unique_ptr<dcr_python::PyBufferMemory> inner;  // the other buffers, where they live (or none: host arrays)
  nb::object on_flush;  // called with the FP8 buffers each flush wrote (or None)
  std::unique_ptr<dcr::Fp8EngineMemory> memory;
};

// A rank's buffers as Python gave them: host arrays (applied in place), an
// object reaching them wherever they live (PyBufferMemory), or an FP8
// engine's memory (PyFp8Memory). The arrays and the memory are kept, so the
// buffers outlive what uses them.
struct PyBuffers {
  std::vector<nb::ndarray<>> arrays;
  nb::object memory_object;
  std::unique_ptr<dcr_python::PyBufferMemory> memory;
  dcr::PlacedRank placed;

  PyBuffers(const dcr::CompiledLayout& layout, std::vector<nb::ndarray<>> a, nb::object mem, const std::string& who)
      : arrays(std::move(a)), memory_object(mem) {
    placed.layout = &layout;
    if (mem.is_none()) {
      placed.buffers = RankBuffers(layout, arrays, who);
      return;
    }
    if (!arrays.empty()) Raise(dcr::InvalidArgument(who + ": buffers given as arrays and as a memory both"));
    if (nb::isinstance<PyFp8Memory>(mem)) {
      PyFp8Memory& fp8 = nb::cast<PyFp8Memory&>(mem);
      if (!(fp8.layout.map() == layout.map()))
        Raise(dcr::InvalidArgument(who + ": the FP8 memory was made for another layout"));
      placed.memory = fp8.memory.get();
    } else {
      memory = std::make_unique<dcr_python::PyBufferMemory>(mem, nb::cast<std::vector<uint64_t>>(mem.attr("sizes")()));
      placed.memory = memory.get();
    }
    Check(dcr::CheckRankBuffers(placed).WithContext(who));
  }
};

// The API areas, each binding itself into the module.
void BindCheckpoints(nb::module_& m);  // checkpoints.cc: Checkpoint
void BindFileDeltas(nb::module_& m);  // checkpoints.cc: delta directories
void BindDeltas(nb::module_& m);  // deltas.cc: in-memory deltas, digests
void BindLayouts(nb::module_& m);  // layouts.cc: layout maps, Sender, Receiver
void BindStores(nb::module_& m);  // stores.cc: Store
void BindStoreFunctions(nb::module_& m);  // stores.cc: open_store, state directories
void BindPublishers(nb::module_& m);  // protocol.cc: Publisher, Follower
void BindRankFollower(nb::module_& m);  // protocol.cc: RankFollower
void BindShardPublisher(nb::module_& m);  // protocol.cc: ShardPublisher
void BindMetrics(nb::module_& m);  // metrics.cc: the metrics text and endpoint

}  // namespace dcr_python
