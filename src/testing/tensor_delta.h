// Test helpers: a delta between two sets of canonical tensors (by name),
// encoded chunk by chunk into frames, and the frames parsed back; the
// tensors as a dense load's source.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <span>
#include <string>
#include <vector>

#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/layout_apply.h"

namespace dcr::testing {

using Tensors = std::map<std::string, std::vector<uint8_t>>;

struct TensorDelta {
  DeltaManifest manifest;
  std::vector<std::string> frames;  // one per changed chunk, in (tensor, chunk) order
};

// The frames moving `base` to `next` (both holding every tensor of `infos`)
// in the options' class and chunking, each chunk encoded canonically.
inline TensorDelta EncodeTensorDelta(std::span<const TensorInfo> infos, const Tensors& base, const Tensors& next,
                                     const DeltaOptions& options) {
  TensorDelta d;
  d.manifest = StartLayoutDelta(std::vector<TensorInfo>(infos.begin(), infos.end()), options);
  ChunkEncoder encoder;
  for (uint32_t t = 0; t < d.manifest.tensors.size(); ++t) {
    const DeltaTensor& tensor = d.manifest.tensors[t];
    const uint32_t wb = WordBytes(tensor.dtype);
    for (uint32_t c = 0; c < d.manifest.ChunkCount(t); ++c) {
      uint64_t first_word, words;
      uint32_t elements;
      d.manifest.ChunkWords(t, c, &first_word, &words, &elements);
      ChunkInput in{tensor.dtype,
                    MakeDigestKey(tensor.name),
                    first_word,
                    elements,
                    {base.at(tensor.name).data() + first_word * wb, words * wb},
                    {next.at(tensor.name).data() + first_word * wb, words * wb}};
      EncodedChunk out;
      auto changed = encoder.Encode(in, options.encode, &out);
      EXPECT_TRUE(changed.ok()) << changed.status().ToString();
      if (!changed.ok() || !*changed) continue;
      out.header.tensor = t;
      out.header.chunk = c;
      d.frames.push_back(EncodeFrame(out.header, out.payload));
    }
  }
  return d;
}

// `tensors` as the source of a dense load (LoadDense); they must outlive it.
inline TensorBytes TensorSource(const Tensors& tensors) {
  return [&tensors](const std::string& name, uint64_t* bytes) -> const uint8_t* {
    auto it = tensors.find(name);
    if (it == tensors.end()) return nullptr;
    *bytes = it->second.size();
    return it->second.data();
  };
}

inline FrameView ParseTestFrame(const std::string& f) {
  auto v = ParseFrame({reinterpret_cast<const uint8_t*>(f.data()), f.size()});
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  return *v;
}

}  // namespace dcr::testing
