// The bindings' shared pieces (bindings.h).
#include "bindings.h"

namespace dcr_python {

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

}  // namespace dcr_python
