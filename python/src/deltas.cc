// dcr._dcr: deltas in memory.
#include "bindings.h"

namespace dcr_python {
namespace {

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

}  // namespace

// In-memory deltas (one frame object), and digest sums.
void BindDeltas(nb::module_& m) {
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
}

}  // namespace dcr_python
