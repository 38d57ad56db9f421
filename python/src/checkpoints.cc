// dcr._dcr: checkpoints and delta directories.
#include "bindings.h"

namespace dcr_python {
namespace {

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

}  // namespace

// Checkpoint: safetensors files and directories, tensors as numpy views.
void BindCheckpoints(nb::module_& m) {
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
}

// Deltas as directories: make, apply, verify, inspect, describe.
void BindFileDeltas(nb::module_& m) {
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
}

}  // namespace dcr_python
