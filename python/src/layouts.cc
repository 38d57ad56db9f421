// dcr._dcr: layout maps, and senders and receivers over live buffers.
#include "bindings.h"
#include "dcr/layout_residual.h"

namespace dcr_python {
namespace {

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

  // A dense load of canonical tensors (name -> flat uint8 view) through the
  // map: every buffer the map writes (an FP8 engine's master, requantized).
  void Load(const std::map<std::string, nb::ndarray<>>& tensors) {
    std::map<std::string, std::span<uint8_t>> bytes;
    for (const auto& [name, a] : tensors) bytes[name] = BytesOf(a, "tensor '" + name + "'");
    dcr::Status s;
    {
      nb::gil_scoped_release release;
      s = dcr::LoadDense(
          [&](const std::string& name, uint64_t* n) -> const uint8_t* {
            auto it = bytes.find(name);
            if (it == bytes.end()) return nullptr;
            *n = it->second.size();
            return it->second.data();
          },
          buffers.placed);
      tracked.clear();
    }
    Check(s);
  }

  std::string Digest() {
    nb::gil_scoped_release release;
    return Take(dcr::RankDigest(buffers.placed)).ToHex();
  }
};

}  // namespace

namespace {

// An FP8 engine rank's memory (PyFp8Memory), for Receiver and RankFollower.
void BindFp8Memory(nb::module_& m) {
  nb::class_<PyFp8Memory>(m, "Fp8Memory")
      .def(
          "__init__",
          [](PyFp8Memory* self, const std::string& layout_json,
             std::vector<std::tuple<size_t, nb::ndarray<>, nb::ndarray<>>> fp8, std::map<size_t, nb::ndarray<>> plain,
             nb::object inner, nb::object on_flush) {
            new (self) PyFp8Memory{CompileJson(layout_json, "FP8 receiver layout"), {}, nullptr, on_flush, nullptr};
            std::map<size_t, dcr::Fp8Placement> placements;
            for (auto& [b, bytes, scales] : fp8) {
              placements[b] = {BytesOf(bytes, "FP8 bytes"), BytesOf(scales, "FP8 scales")};
              self->arrays.push_back(bytes);
              self->arrays.push_back(scales);
            }
            std::vector<std::span<uint8_t>> spans(self->layout.map().buffers.size());
            for (auto& [b, array] : plain) {
              if (b >= spans.size()) Raise(dcr::InvalidArgument("FP8 receiver: no buffer " + std::to_string(b)));
              spans[b] = BytesOf(array, "buffer '" + self->layout.map().buffers[b].id + "'");
              self->arrays.push_back(array);
            }
            if (!inner.is_none()) {
              self->inner =
                  std::make_unique<PyBufferMemory>(inner, nb::cast<std::vector<uint64_t>>(inner.attr("sizes")()));
              spans.clear();
            }
            self->memory = Take(
                dcr::Fp8EngineMemory::Create(self->layout, std::move(placements), std::move(spans), self->inner.get()));
            if (!on_flush.is_none())
              self->memory->set_after_flush([self](std::span<const size_t> buffers) {
                return WithGil("the FP8 tensors' copy after requantizing",
                               [&] { self->on_flush(std::vector<size_t>(buffers.begin(), buffers.end())); });
              });
          },
          "layout_json"_a, "fp8"_a, "plain"_a, "inner"_a = nb::none(), "on_flush"_a = nb::none())
      .def_prop_ro("master_bytes", [](const PyFp8Memory& f) { return f.memory->master_bytes(); })
      .def_prop_ro("blocks_requantized", [](const PyFp8Memory& f) { return f.memory->blocks_requantized(); });
}

}  // namespace

// Layout maps, Sender and Receiver.
void BindLayouts(nb::module_& m) {
  m.def(
      "validate_layout",
      [](const std::string& json) { return dcr::LayoutMapToJson(Take(dcr::LayoutMapFromJson(json, "layout"))); },
      "json"_a, "Validates a layout map; returns its canonical JSON.");
  BindFp8Memory(m);
  m.def(
      "quantize_fp8_blocks",
      [](nb::ndarray<> src, const std::string& dtype, uint64_t rows, uint64_t cols, uint64_t block, nb::ndarray<> fp8,
         nb::ndarray<> scales) {
        Check(dcr::QuantizeFp8Blocks(ParseDTypeOrRaise(dtype), BytesOf(src, "src"),
                                     dcr::Fp8BlockShape{rows, cols, block}, BytesOf(fp8, "fp8"),
                                     BytesOf(scales, "scales")));
      },
      "src"_a, "dtype"_a, "rows"_a, "cols"_a, "block"_a, "fp8"_a, "scales"_a,
      "Block FP8 quantization of a [rows, cols] BF16/F32 array (flat uint8 views) into E4M3 bytes and F32 scales.");

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
      .def("load", &PyReceiver::Load, "tensors"_a)
      .def("forget_digests", &PyReceiver::Forget)
      .def("digest", &PyReceiver::Digest);
}

}  // namespace dcr_python
