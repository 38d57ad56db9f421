// Residual tensors: tensors a receiver does not hold as box copies of the
// canonical bits, because it converts them on load in a way dcr does not
// model (block FP8 is modeled: an FP8 engine keeps a master and takes the
// ordinary frames, dcr/fp8_engine.h). Such a receiver cannot use xor/add
// frames for them (it does not hold the old canonical bits).
//
// The rule:
//  - A delta's frames all have its class (docs/format.md), so residual tensors
//    travel in a companion *residual delta* of overwrite class, built from the
//    same sender contributions (ProjectSender on a manifest of the residual
//    tensors only): every chunk of every residual tensor that changed anywhere
//    is sent as a *full-chunk overwrite* (every word of the chunk in the
//    frame), so the receiver gets whole tensors, whichever chunks changed.
//  - Engines that hold the other tensors as copies apply the main delta with
//    the residual tensors declared (ApplyEngineDelta's `residuals`), which
//    skips their frames and leaves them out of the digest check.
// Canonical receivers, and engines holding the tensor as copies, may apply a
// residual delta too (it is an ordinary overwrite delta of those tensors).
//
// Sender-side conversions: a trainer may hold a tensor in a representation
// with arithmetic between it and the checkpoint (a zero-centred norm stored
// as weight - 1, an FP32 master cast to BF16). Such a tensor has no copy in
// the trainer's map; its owner converts its baseline and current buffers to
// canonical bits (ConvertToCanonical, the checkpoint export function) and
// contributes them (ProjectConverted) to the residual delta, so it too goes
// as full-chunk overwrites.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/layout_apply.h"
#include "dcr/status.h"

namespace dcr {

// FP32 -> F8_E4M3 (E4M3FN: bias 7, no infinities, max 448, NaN S.1111.111):
// round to nearest even, subnormals kept, magnitudes above 448 saturate to
// 448, infinities saturate, NaN -> NaN with the sign kept.
uint8_t Fp32ToE4m3(float x);

struct Fp8BlockShape {
  uint64_t rows = 0, cols = 0, block = 128;
  uint64_t scale_rows() const { return (rows + block - 1) / block; }
  uint64_t scale_cols() const { return (cols + block - 1) / block; }
};

// Quantizes a dense row-major 2-D tensor (BF16 or F32 bits in `src`) by
// blocks of block x block (edge blocks smaller): scale = amax / 448 over the
// block's finite magnitudes (1 when amax is 0), stored as F32 in `scales`
// [scale_rows, scale_cols]; each element -> Fp32ToE4m3(x / scale), NaN stays
// NaN, infinities saturate. Errors: kInvalidArgument (sizes, dtype).
Status QuantizeFp8Blocks(DType dtype, std::span<const uint8_t> src, const Fp8BlockShape& shape, std::span<uint8_t> fp8,
                         std::span<uint8_t> scales);
// One block of QuantizeFp8Blocks: block row `br`, block column `bc` of the
// same arrays (sizes checked by the caller).
void QuantizeFp8Block(DType dtype, std::span<const uint8_t> src, const Fp8BlockShape& shape, uint64_t br, uint64_t bc,
                      std::span<uint8_t> fp8, std::span<uint8_t> scales);

enum class ConversionKind {
  kZeroCentred,  // the buffer holds weight - 1: canonical = round(float(b) + 1)
  kCast,  // the buffer holds another float dtype: canonical = round(float(b))
};
// One tensor the sender holds whole in its own representation. Rounding to
// the canonical dtype is to nearest even (BF16) or exact (F32 from BF16).
struct SenderConversion {
  std::string tensor;
  ConversionKind kind = ConversionKind::kZeroCentred;
  DType buffer_dtype = DType::kF32;  // BF16 or F32
};

// Canonical bits (dtype BF16 or F32) of `buffer` (same element count).
// Errors: kInvalidArgument (dtypes, sizes).
Status ConvertToCanonical(const SenderConversion& conversion, DType canonical, std::span<const uint8_t> buffer,
                          std::span<uint8_t> out);

// The contributions of a converted tensor, held whole by sender `index`:
// its baseline and current buffers converted, covered whole, chunk by chunk
// of `manifest` (which must hold the tensor), in the manifest's class.
Result<std::vector<ChunkContribution>> ProjectConverted(const SenderConversion& conversion,
                                                        std::span<const uint8_t> baseline,
                                                        std::span<const uint8_t> current, uint32_t index,
                                                        const DeltaManifest& manifest);

// The sender half: merges whole-tensor contributions (from every sender,
// for the tensors of `manifest`, an overwrite-class manifest of residual
// tensors) into full-chunk overwrite frames of every chunk of each tensor
// that changed anywhere. Digests are the real ones (base and target).
// Errors as EncodeOwnedChunks.
Result<OwnedFrames> EncodeFullChunkOverwrites(const DeltaManifest& manifest,
                                              std::span<const ChunkContribution> contributions,
                                              const EncodeOptions& options);

}  // namespace dcr
